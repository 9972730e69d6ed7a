//! `cargo xtask fuzz`: builds the libFuzzer binaries of `fuzz/` on the
//! nightly toolchain with coverage instrumentation and AddressSanitizer
//! (what cargo-fuzz does, without needing it installed), runs each target
//! for a time under memory and per-input time limits, and reports
//! executions, coverage and findings per target. `--seeds` rewrites the
//! committed seed corpora instead.
//!
//! New inputs the fuzzer finds go to `target/fuzz/corpus/<target>/`; the
//! committed seeds (`fuzz/corpus/`) and regressions (`fuzz/regressions/`)
//! are read, never written. A crashing, hanging or memory-hungry input is
//! saved under `target/fuzz/artifacts/<target>/`; once fixed, copy it to
//! `fuzz/regressions/<target>/`, where the replay test keeps it fixed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use onnx_genai_fuzz::Target;

use crate::util;

pub struct Options {
    pub target: Option<String>,
    /// Seconds each target runs at most.
    pub time: u64,
    /// Executions after which a target stops, if reached before `time`.
    pub runs: Option<u64>,
    /// Memory limit (MiB) of the fuzzing process and of one allocation.
    pub rss_limit_mb: u64,
    /// Seconds one input may take before it counts as a hang.
    pub input_timeout: u64,
    pub seeds: bool,
}

/// ONNX node-test models up to this size become ONNX seeds (the small,
/// single-operator graphs; large ones only slow mutation down).
const NODE_SEED_BYTES: u64 = 2048;

const TRIPLE: &str = "x86_64-unknown-linux-gnu";

struct Outcome {
    target: Target,
    executions: u64,
    seconds: f64,
    coverage: Option<u64>,
    corpus: Option<u64>,
    finding: Option<String>,
}

pub fn run(options: Options) -> Result<()> {
    let root = util::root();
    if options.seeds {
        let nodes = crate::onnx_tests::provision()?;
        for (target, n) in onnx_genai_fuzz::seeds::write(&root.join("fuzz/corpus"), Some(&nodes), NODE_SEED_BYTES)? {
            println!("fuzz/corpus/{}: {n} seeds", target.name());
        }
        return Ok(());
    }
    let targets = match &options.target {
        None => Target::ALL.to_vec(),
        Some(name) => vec![Target::parse(name).with_context(|| {
            let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
            format!("no fuzz target `{name}` (targets: {})", names.join(", "))
        })?],
    };
    let bins = build(&root)?;
    let mut outcomes = Vec::new();
    for target in targets {
        outcomes.push(fuzz_one(&root, &bins, target, &options)?);
    }
    let report = report(&outcomes, &options);
    print!("{report}");
    let out = util::target().join("fuzz/report.md");
    std::fs::write(&out, &report).with_context(|| format!("writing {}", out.display()))?;
    println!("report: {}", out.display());
    let found: Vec<&str> = outcomes.iter().filter(|o| o.finding.is_some()).map(|o| o.target.name()).collect();
    if !found.is_empty() {
        bail!("fuzzing found inputs that fail: {}", found.join(", "));
    }
    Ok(())
}

/// Builds the binaries; returns their directory.
fn build(root: &Path) -> Result<PathBuf> {
    let nightly = Command::new("cargo").args(["+nightly", "--version"]).output();
    if !nightly.map(|o| o.status.success()).unwrap_or(false) {
        bail!("fuzzing needs the nightly toolchain (libFuzzer's coverage flags): `rustup toolchain install nightly`");
    }
    let target_dir = util::target().join("fuzz/build");
    // cargo-fuzz's flags: coverage counters and comparison tracing for
    // libFuzzer, AddressSanitizer, and the checks of a debug build kept in
    // the optimised one. `--target` keeps them off build scripts and
    // procedural macros.
    let flags = [
        "-Cpasses=sancov-module",
        "-Cllvm-args=-sanitizer-coverage-level=4",
        "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
        "-Cllvm-args=-sanitizer-coverage-pc-table",
        "-Cllvm-args=-sanitizer-coverage-trace-compares",
        "--cfg=fuzzing",
        "-Cdebug-assertions",
        "-Coverflow-checks",
        "-Zsanitizer=address",
    ]
    .join(" ");
    let started = Instant::now();
    let status = Command::new("cargo")
        .args(["+nightly", "build", "--release", "--bins", "--target", TRIPLE, "--manifest-path"])
        .arg(root.join("fuzz/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .env("RUSTFLAGS", flags)
        .status()
        .context("running cargo +nightly build")?;
    if !status.success() {
        bail!("building the fuzz targets failed");
    }
    println!("fuzz targets built in {:.0} s", started.elapsed().as_secs_f64());
    Ok(target_dir.join(TRIPLE).join("release"))
}

fn fuzz_one(root: &Path, bins: &Path, target: Target, options: &Options) -> Result<Outcome> {
    let name = target.name();
    let work = util::target().join("fuzz/corpus").join(name);
    let artifacts = util::target().join("fuzz/artifacts").join(name);
    std::fs::create_dir_all(&work)?;
    std::fs::create_dir_all(&artifacts)?;
    let mut cmd = Command::new(bins.join(name));
    cmd.arg(&work);
    for kind in ["corpus", "regressions"] {
        let dir = root.join("fuzz").join(kind).join(name);
        if dir.is_dir() {
            cmd.arg(dir);
        }
    }
    let limit = options.rss_limit_mb;
    cmd.arg(format!("-max_total_time={}", options.time));
    if let Some(runs) = options.runs {
        cmd.arg(format!("-runs={runs}"));
    }
    cmd.arg(format!("-rss_limit_mb={limit}"))
        .arg(format!("-malloc_limit_mb={limit}"))
        .arg(format!("-timeout={}", options.input_timeout))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        // The fixture (a package, a server) lives for the whole process on
        // purpose; growth is caught by the memory limit instead.
        .arg("-detect_leaks=0")
        .arg("-print_final_stats=1");
    match options.runs {
        Some(runs) => println!("fuzzing `{name}` for {runs} executions or {} s, whichever comes first", options.time),
        None => println!("fuzzing `{name}` for {} s", options.time),
    }
    // The fuzzer writes its log straight to the file, so a long run can be
    // watched (`tail -f`) while it goes.
    let log_path = util::target().join("fuzz").join(format!("{name}.log"));
    let log_file = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    println!("log: {}", log_path.display());
    let started = Instant::now();
    let status = cmd
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        .status()
        .with_context(|| format!("running {}", bins.join(name).display()))?;
    let seconds = started.elapsed().as_secs_f64();
    let log = String::from_utf8_lossy(&std::fs::read(&log_path)?).to_string();
    let stat = |key: &str| {
        log.lines()
            .rev()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().trim_start_matches(':').trim().parse().ok()))
    };
    let executions = stat("stat::number_of_executed_units").unwrap_or(0);
    let last_status = log.lines().rev().find(|l| l.contains(" cov: "));
    let field = |key: &str| {
        last_status.and_then(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == key)?;
            // `corp: 342/13165Kb`: the count before the size.
            words.next()?.split('/').next()?.parse().ok()
        })
    };
    let finding = if status.success() {
        None
    } else {
        let artifact = log.lines().find_map(|l| l.split("Test unit written to ").nth(1)).map(str::trim);
        let cause = log
            .lines()
            .find(|l| l.contains("==ERROR:") || l.contains("panicked") || l.contains("out-of-memory"))
            .unwrap_or("the fuzzer exited with an error");
        Some(format!("{} (input: {}; log: {})", cause.trim(), artifact.unwrap_or("none"), log_path.display()))
    };
    Ok(Outcome { target, executions, seconds, coverage: field("cov:"), corpus: field("corp:"), finding })
}

fn report(outcomes: &[Outcome], options: &Options) -> String {
    let mut s = format!(
        "# Fuzzing, {} per target (commit {}; memory limit {} MiB, {} s per input)\n\n\
         | target | executions | seconds | exec/s | coverage | corpus | result |\n|---|---:|---:|---:|---:|---:|---|\n",
        match options.runs {
            Some(runs) => format!("{runs} executions or {} s", options.time),
            None => format!("{} s", options.time),
        },
        util::commit(),
        options.rss_limit_mb,
        options.input_timeout
    );
    for o in outcomes {
        let rate = o.executions as f64 / o.seconds.max(1e-9);
        let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
        s.push_str(&format!(
            "| {} | {} | {:.0} | {rate:.0} | {} | {} | {} |\n",
            o.target.name(),
            o.executions,
            o.seconds,
            opt(o.coverage),
            opt(o.corpus),
            o.finding.as_deref().unwrap_or("no crash, hang or out-of-memory")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(runs: Option<u64>) -> Options {
        Options { target: None, time: 600, runs, rss_limit_mb: 2048, input_timeout: 10, seeds: false }
    }

    /// The report states the stopping rule it ran under (a goal in
    /// executions, or seconds) and each target's own seconds, so an
    /// executions figure can be read against the time it took.
    #[test]
    fn the_report_states_its_stopping_rule_and_each_targets_seconds() {
        let outcome = Outcome {
            target: Target::Chat,
            executions: 1_000_000,
            seconds: 2769.4,
            coverage: Some(9854),
            corpus: Some(3174),
            finding: None,
        };
        let by_runs = report(std::slice::from_ref(&outcome), &options(Some(1_000_000)));
        assert!(by_runs.starts_with("# Fuzzing, 1000000 executions or 600 s per target"), "{by_runs}");
        assert!(by_runs.contains("| chat | 1000000 | 2769 | 361 | 9854 | 3174 | no crash"), "{by_runs}");
        let by_time = report(&[outcome], &options(None));
        assert!(by_time.starts_with("# Fuzzing, 600 s per target"), "{by_time}");
    }
}
