//! `cargo xtask mutants`: runs the mutation batteries of
//! `conformance/mutations/` (logic in `onnx-genai-conformance::mutants`) on
//! a scratch copy of the tree and writes `target/mutants/report.md` and
//! `report.json` with the commit.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use onnx_genai_conformance::cases::Filter;
use onnx_genai_conformance::mutants::{self, MutantResult, RunLock, Runner, TestRun, Verdict};

use crate::{ort, pyclient, util};

pub struct Options {
    pub battery: Option<String>,
    pub mutant: Option<String>,
    pub shard: Option<String>,
}

pub fn run(opts: Options) -> Result<()> {
    let lib = ort::provision()?;
    pyclient::provision()?;
    let out = util::target().join("mutants");
    let _lock = RunLock::take(&out).map_err(anyhow::Error::msg)?;
    let root = util::root();
    let mut runner = Runner::new(root.clone(), out.join("scratch"), out.join("target"));
    runner.envs.push(("ORT_DYLIB_PATH".into(), lib.display().to_string()));
    runner.shared_target = vec!["python".into(), "onnxruntime".into()];
    runner.prepare().map_err(anyhow::Error::msg)?;
    let shard = opts.shard.as_deref().map(Filter::parse_shard).transpose().map_err(anyhow::Error::msg)?;
    let mut results: Vec<MutantResult> = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    let started = Instant::now();
    for catalog in mutants::load(&root)? {
        if opts.battery.as_ref().is_some_and(|b| *b != catalog.battery) {
            continue;
        }
        println!(
            "==> battery {}: {} mutants over {}",
            catalog.battery,
            catalog.mutants.len(),
            catalog.packages.join(", ")
        );
        let listed = runner.list(&catalog).map_err(|e| anyhow::anyhow!("listing tests: {e}"))?;
        if listed.len() != catalog.tests {
            problems.push(format!(
                "FILTER-DRIFT {}: the filter selects {} tests, the catalog declares {}",
                catalog.battery,
                listed.len(),
                catalog.tests
            ));
            continue;
        }
        let t = Instant::now();
        match runner.run(&catalog, Duration::from_secs(1800)).map_err(anyhow::Error::msg)? {
            TestRun::Passed { .. } => {}
            other => {
                problems.push(format!("BASELINE-RED {}: {other:?}", catalog.battery));
                continue;
            }
        }
        // The baseline ran after the build; a mutant may rebuild too.
        let limit = Duration::from_secs(120).max(t.elapsed() * 4);
        let selected: Vec<_> = catalog
            .mutants
            .iter()
            .filter(|m| opts.mutant.as_ref().is_none_or(|id| *id == m.id))
            .enumerate()
            .filter(|(i, _)| shard.is_none_or(|(k, n)| i % n == k - 1))
            .map(|(_, m)| m)
            .collect();
        for m in selected {
            let r = runner.mutant(&catalog, m, limit).map_err(anyhow::Error::msg)?;
            let shown = match &r.verdict {
                Verdict::Caught { by } if r.unexpected => {
                    format!("caught by {by:?}, expected {:?}", r.expected_killers)
                }
                Verdict::Caught { by } => format!("caught by {}", by.join(", ")),
                other => format!("{other:?}"),
            };
            println!("  {:<8} {:<32} {:>6.1}s  {shown}", if r.is_failure() { "FAIL" } else { "ok" }, r.id, r.seconds);
            results.push(r);
        }
    }
    let diff = runner.differences();
    if !diff.is_empty() {
        problems.push(format!("the scratch tree differs from the source after restoring: {diff:?}"));
    }
    let commit = util::commit();
    let mut md = format!("# Mutation batteries\n\ncommit `{commit}`, {:.0} s\n\n| battery | mutant | breaks | verdict | seconds |\n|---|---|---|---|---:|\n", started.elapsed().as_secs_f64());
    for r in &results {
        md.push_str(&format!(
            "| {} | {} | {} | {:?}{} | {:.1} |\n",
            r.battery,
            r.id,
            r.breaks.join(" "),
            r.verdict,
            if r.unexpected { " (unexpected killers)" } else { "" },
            r.seconds
        ));
    }
    for p in &problems {
        md.push_str(&format!("\n**{p}**\n"));
    }
    std::fs::write(out.join("report.md"), &md)?;
    let json = serde_json::json!({"commit": commit, "seconds": started.elapsed().as_secs_f64(), "results": results, "problems": problems});
    std::fs::write(out.join("report.json"), serde_json::to_string_pretty(&json)?)?;
    let failures = results.iter().filter(|r| r.is_failure()).count();
    println!(
        "\nmutants: {} run, {failures} failed, {} problems ({:.0} s); report: {}",
        results.len(),
        problems.len(),
        started.elapsed().as_secs_f64(),
        out.join("report.md").display()
    );
    if failures > 0 || !problems.is_empty() {
        for p in &problems {
            eprintln!("{p}");
        }
        bail!("mutation batteries failed");
    }
    Ok(())
}
