//! CI lanes (`conformance/lanes.yaml`): `cargo xtask lane NAME` runs one,
//! `cargo xtask ci` runs every lane this machine can with a summary table,
//! `cargo xtask lanes --audit` checks that every test runs somewhere and
//! `--emit-workflow` writes `.github/workflows/ci.yml`. A lane's tests are
//! selected from the workspace's built test binaries, so the audit and the
//! runs use one selection.

pub mod audit;
pub mod documented;
pub mod workflow;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::{ort, pyclient, real, util};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaneFile {
    pub lanes: Vec<Lane>,
    /// README commands no lane runs, each with the reason (the audit
    /// fails on a documented command that is neither run nor excused).
    #[serde(default)]
    pub unlaned: std::collections::BTreeMap<String, String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lane {
    pub name: String,
    pub backend: String,
    #[serde(default)]
    pub needs: Vec<Need>,
    #[serde(default)]
    pub features: Vec<String>,
    #[serde(default)]
    pub commands: Vec<Vec<String>>,
    #[serde(default)]
    pub select: Vec<Rule>,
    #[serde(default)]
    pub requires: Option<Hardware>,
    /// Why a lane selects no tests (its commands are its checks); a lane
    /// that runs no tests without saying why fails.
    #[serde(default)]
    pub empty: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Need {
    Ort,
    PythonClient,
    Schemathesis,
    OrtGenai,
    RealModels,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hardware {
    Gpu,
}

/// Tests of one package's binaries: `target` (`lib`, or an integration
/// test's name; all when absent), names containing an `include` substring
/// (all when empty) and none of the `exclude` ones.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub package: String,
    #[serde(default)]
    pub target: Option<String>,
    #[serde(default)]
    pub include: Vec<String>,
    #[serde(default)]
    pub exclude: Vec<String>,
}

impl Rule {
    pub fn selects_binary(&self, b: &TestBinary) -> bool {
        self.package == b.package && self.target.as_ref().is_none_or(|t| *t == b.target)
    }

    pub fn selects(&self, b: &TestBinary, test: &str) -> bool {
        self.selects_binary(b)
            && (self.include.is_empty() || self.include.iter().any(|i| test.contains(i.as_str())))
            && !self.exclude.iter().any(|x| test.contains(x.as_str()))
    }
}

pub fn load() -> Result<LaneFile> {
    let path = util::root().join("conformance/lanes.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let de = serde_yaml_ng::Deserializer::from_str(&text);
    let file: LaneFile = serde_path_to_error::deserialize(de)
        .map_err(|e| anyhow::anyhow!("{}: {} (at `{}`)", path.display(), e.inner(), e.path()))?;
    for rule in file.lanes.iter().flat_map(|l| &l.select) {
        if rule.include.len() > 1 {
            // libtest-mimic harnesses take one name filter.
            bail!("{}: a rule takes at most one `include` (split it into rules)", path.display());
        }
    }
    Ok(file)
}

/// One built test executable.
#[derive(Clone, Debug)]
pub struct TestBinary {
    pub package: String,
    /// `lib`, or the test/bin target's name.
    pub target: String,
    pub executable: PathBuf,
    /// The package directory (tests run there, as under `cargo test`).
    pub dir: PathBuf,
}

/// Builds the workspace's test binaries with `features` and lists them.
pub fn build_test_binaries(features: &[String]) -> Result<Vec<TestBinary>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(&cargo);
    c.args(["test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"]).current_dir(util::root());
    if !features.is_empty() {
        c.args(["--features", &features.join(",")]);
    }
    let out = c.stderr(std::process::Stdio::inherit()).output().context("cannot run cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the test binaries failed");
    }
    let mut binaries = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else { continue };
        let manifest = PathBuf::from(msg["manifest_path"].as_str().unwrap_or_default());
        let kinds: Vec<&str> =
            msg["target"]["kind"].as_array().into_iter().flatten().filter_map(|k| k.as_str()).collect();
        let target = if kinds.contains(&"lib") {
            "lib".to_string()
        } else {
            msg["target"]["name"].as_str().unwrap_or_default().to_string()
        };
        binaries.push(TestBinary {
            package: package_name(&manifest)?,
            target,
            executable: exe.into(),
            dir: manifest.parent().map(Path::to_path_buf).unwrap_or_default(),
        });
    }
    binaries.sort_by(|a, b| (&a.package, &a.target).cmp(&(&b.package, &b.target)));
    Ok(binaries)
}

fn package_name(manifest: &Path) -> Result<String> {
    let text = std::fs::read_to_string(manifest).with_context(|| manifest.display().to_string())?;
    text.lines()
        .skip_while(|l| l.trim() != "[package]")
        .find_map(|l| l.trim().strip_prefix("name = ").map(|n| n.trim_matches('"').to_string()))
        .with_context(|| format!("{}: no [package] name", manifest.display()))
}

/// The tests a binary holds (`--list`), ignored ones marked.
pub fn list_tests(b: &TestBinary) -> Result<Vec<(String, bool)>> {
    let list = |extra: &[&str]| -> Result<Vec<String>> {
        let out = Command::new(&b.executable)
            .arg("--list")
            .args(extra)
            .current_dir(&b.dir)
            .output()
            .with_context(|| format!("listing {}", b.executable.display()))?;
        if !out.status.success() {
            bail!("{} --list failed: {}", b.executable.display(), String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_suffix(": test"))
            // libtest-mimic prefixes a kind: `[parity] parity::...`.
            .map(|l| l.split_once("] ").filter(|_| l.starts_with('[')).map_or(l, |(_, n)| n).to_string())
            .collect())
    };
    let ignored = list(&["--ignored"])?;
    Ok(list(&[])?.into_iter().map(|t| (t.clone(), ignored.contains(&t))).collect())
}

pub fn has_gpu() -> bool {
    Command::new("nvidia-smi").arg("-L").output().is_ok_and(|o| o.status.success())
}

/// What one lane run did.
pub struct LaneRun {
    pub lane: String,
    pub tests: usize,
    pub seconds: f64,
    pub result: String,
    pub ok: bool,
}

fn provision(lane: &Lane) -> Result<PathBuf> {
    let lib = ort::provision()?;
    if lane.needs.contains(&Need::PythonClient) {
        pyclient::provision()?;
    }
    if lane.needs.contains(&Need::Schemathesis) {
        pyclient::provision_schemathesis()?;
    }
    if lane.needs.contains(&Need::OrtGenai) {
        pyclient::provision_ort_genai()?;
    }
    if lane.needs.contains(&Need::RealModels) {
        for model in real::models()? {
            real::fetch(&model)?;
        }
    }
    Ok(lib)
}

/// Runs one lane: set-up, its commands, then its selected tests.
pub fn run_lane(lane: &Lane) -> Result<LaneRun> {
    let started = Instant::now();
    let done = |tests, result: String, ok| LaneRun {
        lane: lane.name.clone(),
        tests,
        seconds: started.elapsed().as_secs_f64(),
        result,
        ok,
    };
    if lane.requires == Some(Hardware::Gpu) {
        let required = std::env::var("ONNX_GENAI_REQUIRE_GPU").is_ok_and(|v| v == "1");
        if let Some((why, ok)) = without_gpu(has_gpu(), required) {
            return Ok(done(0, why, ok));
        }
    }
    if let Some(why) = undeclared_empty(lane) {
        return Ok(done(0, why, false));
    }
    println!("==> lane {} ({})", lane.name, lane.backend);
    let lib = provision(lane)?;
    for argv in &lane.commands {
        let (program, args) = argv.split_first().context("an empty command")?;
        println!("==> {}", argv.join(" "));
        let command_started = Instant::now();
        let status = Command::new(program)
            .args(args)
            .current_dir(util::root())
            .env("ORT_DYLIB_PATH", &lib)
            .status()
            .with_context(|| format!("cannot start {program}"))?;
        // Each command's time, so a slow lane says where its time went.
        println!("<== {} s: {}", command_started.elapsed().as_secs(), argv.join(" "));
        if !status.success() {
            return Ok(done(0, format!("`{}` failed ({status})", argv.join(" ")), false));
        }
    }
    if let (true, Some(why)) = (lane.select.is_empty(), &lane.empty) {
        return Ok(done(0, format!("passed (no tests: {why})"), true));
    }
    let binaries = build_test_binaries(&lane.features)?;
    let mut total = 0;
    for rule in &lane.select {
        for b in binaries.iter().filter(|b| rule.selects_binary(b)) {
            // What the audit selects from this binary is what must pass: a
            // filter that drifted, a test that stopped running or one run
            // twice shows as a different count.
            let expected = list_tests(b)?.iter().filter(|(t, ignored)| !ignored && rule.selects(b, t)).count();
            let mut c = Command::new(&b.executable);
            c.current_dir(&b.dir).env("ORT_DYLIB_PATH", &lib).arg("--test-threads=2");
            c.args(&rule.include);
            for x in &rule.exclude {
                c.args(["--skip", x]);
            }
            println!("==> {} {} {}", b.package, b.target, rule.include.join(" "));
            let out = c.stderr(std::process::Stdio::inherit()).output()?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            print!("{stdout}");
            let ran = passed(&stdout);
            total += ran;
            if !out.status.success() {
                return Ok(done(total, format!("{} {} failed", b.package, b.target), false));
            }
            if let Some(why) = count_differs(ran, expected) {
                return Ok(done(total, format!("{} {}: {why}", b.package, b.target), false));
            }
        }
    }
    if total == 0 && lane.empty.is_none() {
        return Ok(done(0, "ran no tests and does not say why (`empty: <reason>`)".into(), false));
    }
    Ok(done(total, "passed".into(), true))
}

/// What a gpu lane reports instead of running, when there is no GPU: a
/// skip (green, and it says so), or a failure where a GPU was required
/// (`ONNX_GENAI_REQUIRE_GPU=1`, as the generated workflow's gpu job sets).
fn without_gpu(has_gpu: bool, required: bool) -> Option<(String, bool)> {
    match (has_gpu, required) {
        (true, _) => None,
        (false, true) => Some(("no GPU on this machine, but ONNX_GENAI_REQUIRE_GPU=1".into(), false)),
        (false, false) => Some(("skipped: no GPU on this machine".into(), true)),
    }
}

/// Why a binary's run does not count: it passed a different number of
/// tests than the audit selects from it (a drifted filter, a test that
/// stopped running, or one run twice).
fn count_differs(ran: usize, expected: usize) -> Option<String> {
    (ran != expected).then(|| format!("{ran} tests passed, the lane selects {expected}"))
}

/// Why a lane that selects no tests may not run: it does not say why it
/// has none.
fn undeclared_empty(lane: &Lane) -> Option<String> {
    (lane.select.is_empty() && lane.empty.is_none())
        .then(|| "selects no tests and does not say why (`empty: <reason>`)".to_string())
}

/// Tests passed, from libtest's summary line.
fn passed(stdout: &str) -> usize {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("test result: "))
        .filter_map(|l| l.split(". ").nth(1))
        .filter_map(|l| l.split_whitespace().next()?.parse::<usize>().ok())
        .sum()
}

/// `cargo xtask ci`: the audit, then every lane this machine can run, in
/// order, with a summary table; fails at the end if any failed.
pub fn ci() -> Result<()> {
    let file = load()?;
    let mut runs = Vec::new();
    let t = Instant::now();
    let audit = audit::run(&file);
    runs.push(LaneRun {
        lane: "audit".into(),
        tests: 0,
        seconds: t.elapsed().as_secs_f64(),
        ok: audit.is_ok(),
        result: match &audit {
            Ok(s) => s.clone(),
            Err(e) => format!("{e:#}"),
        },
    });
    for lane in &file.lanes {
        let run = run_lane(lane).unwrap_or_else(|e| LaneRun {
            lane: lane.name.clone(),
            tests: 0,
            seconds: 0.0,
            result: format!("{e:#}"),
            ok: false,
        });
        runs.push(run);
    }
    let mut table = String::from("| lane | tests run | time | result |\n|---|---:|---:|---|\n");
    for r in &runs {
        table.push_str(&format!("| {} | {} | {:.0} s | {} |\n", r.lane, r.tests, r.seconds, r.result));
    }
    println!("\n{table}");
    let dir = util::target().join("conformance");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("ci.md"), format!("# cargo xtask ci\n\ncommit `{}`\n\n{table}", util::commit()))?;
    let failed: Vec<&str> = runs.iter().filter(|r| !r.ok).map(|r| r.lane.as_str()).collect();
    if !failed.is_empty() {
        bail!("lanes failed: {}", failed.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 21: a gpu lane without a GPU is a declared skip, and a
    /// failure when the run requires a GPU; with one it runs.
    #[test]
    fn a_required_gpu_that_is_missing_fails_the_lane() {
        assert_eq!(without_gpu(true, true), None);
        assert_eq!(without_gpu(true, false), None);
        let (why, ok) = without_gpu(false, true).unwrap();
        assert!(!ok && why.contains("ONNX_GENAI_REQUIRE_GPU=1"), "{why}");
        let (why, ok) = without_gpu(false, false).unwrap();
        assert!(ok && why.starts_with("skipped"), "{why}");
    }

    /// Issue 21: a lane passes a binary only when it passed exactly the
    /// tests the audit selects from it.
    #[test]
    fn a_count_other_than_the_audits_fails() {
        assert_eq!(count_differs(12, 12), None);
        assert!(count_differs(11, 12).is_some_and(|w| w.contains("11 tests passed, the lane selects 12")));
        assert!(count_differs(13, 12).is_some(), "a test run twice is a difference too");
    }

    #[test]
    fn passed_counts_sum_over_summaries() {
        let out = "test result: ok. 3 passed; 0 failed; 1 ignored\n\ntest result: ok. 12 passed; 0 failed\n";
        assert_eq!(passed(out), 15);
    }

    /// Issue 21: a lane that runs no tests fails unless it says why.
    #[test]
    fn a_lane_without_tests_must_say_why() {
        let mut lane = Lane {
            name: "commands-only".into(),
            backend: "none".into(),
            needs: Vec::new(),
            features: Vec::new(),
            commands: vec![vec!["true".into()]],
            select: Vec::new(),
            requires: None,
            empty: None,
        };
        // Refused before any set-up runs.
        let silent = run_lane(&lane).unwrap();
        assert!(!silent.ok && silent.result.contains("does not say why"), "{}", silent.result);
        lane.empty = Some("its command is the check".into());
        assert_eq!(undeclared_empty(&lane), None);
        // Every lane of lanes.yaml either selects tests or says why not.
        for lane in load().unwrap().lanes {
            assert_eq!(undeclared_empty(&lane), None, "{}", lane.name);
        }
    }

    /// A rule selects by package, target and name substrings.
    #[test]
    fn rules_select_by_package_target_and_name() {
        let b =
            TestBinary { package: "p".into(), target: "conformance".into(), executable: "x".into(), dir: "d".into() };
        let rule = |target: Option<&str>, include: &[&str], exclude: &[&str]| Rule {
            package: "p".into(),
            target: target.map(str::to_string),
            include: include.iter().map(|s| s.to_string()).collect(),
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
        };
        assert!(rule(None, &[], &[]).selects(&b, "parity::smollm2"));
        assert!(!rule(Some("lib"), &[], &[]).selects(&b, "parity::smollm2"));
        assert!(rule(Some("conformance"), &["smollm2"], &[]).selects(&b, "parity::smollm2"));
        assert!(!rule(Some("conformance"), &["smollm2"], &[]).selects(&b, "parity::tiny"));
        assert!(!rule(None, &[], &["smollm2"]).selects(&b, "parity::smollm2"));
    }
}
