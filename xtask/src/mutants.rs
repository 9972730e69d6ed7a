//! `cargo xtask mutants`: runs the mutation batteries of
//! `conformance/mutations/` (logic in `onnx-genai-conformance::mutants`) on
//! a scratch copy of the tree and writes `target/mutants/report.md` and
//! `report.json` with the commit.

use anyhow::{bail, Result};
use onnx_genai_conformance::cases::Filter;
use onnx_genai_conformance::mutants::{self, RunLock, Runner, Selection};

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
    let selection = Selection {
        battery: opts.battery,
        mutant: opts.mutant,
        shard: opts.shard.as_deref().map(Filter::parse_shard).transpose().map_err(anyhow::Error::msg)?,
        ..Selection::default()
    };
    let catalogs = mutants::load(&root)?;
    // Before the scratch copy and any build: a misspelled name fails at once.
    mutants::check_selection(&catalogs, &selection).map_err(anyhow::Error::msg)?;
    let mut runner = Runner::new(root.clone(), out.join("scratch"), out.join("target"));
    runner.envs.push(("ORT_DYLIB_PATH".into(), lib.display().to_string()));
    runner.shared_target = vec!["python".into(), "onnxruntime".into()];
    runner.seed_from = Some(util::target());
    // The dev profile builds the native kernels at opt-level 3 (43 s a
    // build here, 16 s at 1): the scratch build is rebuilt for every
    // mutant of the native crate and its dependents, and its tests run
    // tiny models, so it trades run time for build time. Rust keeps float
    // semantics at every opt-level, so parity is unchanged.
    runner.cargo_config = vec!["profile.dev.package.onnx-genai-native.opt-level=1".into()];
    runner.prepare().map_err(anyhow::Error::msg)?;
    for c in catalogs.iter().filter(|c| selection.battery.as_ref().is_none_or(|b| *b == c.battery)) {
        println!("==> battery {}: {} mutants over {}", c.battery, c.mutants.len(), c.packages.join(", "));
    }
    let report = mutants::run_all(&runner, &catalogs, &selection, |r| {
        let mark = if r.is_failure() { "FAIL" } else { "ok" };
        println!("  {mark:<8} {:<10} {:<32} {:>6.1}s  {}", r.battery, r.id, r.seconds, r.describe());
    })
    .map_err(anyhow::Error::msg)?;
    report.write(&out, &util::commit())?;
    for p in &report.preparations {
        println!("before the mutants of {p}");
    }
    println!(
        "\nmutants: {} run, {} failed, {} problems ({:.0} s); report: {}",
        report.results.len(),
        report.failures(),
        report.problems.len(),
        report.seconds,
        out.join("report.md").display()
    );
    if !report.passed() {
        for p in &report.problems {
            eprintln!("{p}");
        }
        bail!("mutation batteries failed");
    }
    Ok(())
}
