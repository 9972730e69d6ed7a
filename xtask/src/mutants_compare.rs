//! `cargo xtask mutants --compare`: runs cargo-mutants (installed with
//! `cargo install`, the version pinned in
//! `conformance/cargo-mutants.yaml`) time-boxed on that file's targets
//! (the scheduler crate, the server's lease module, and its routes and
//! model driver together), optionally one shard of each, and reports its caught /
//! missed / unviable / timeout counts beside the batteries' last report.
//! Each miss is either listed as equivalent (with the reason) in that file
//! or reported as a GAP, which fails the command.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::{ort, util};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    version: String,
    targets: Vec<Target>,
    equivalent: Vec<Equivalent>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Target {
    name: String,
    args: Vec<String>,
    #[serde(default)]
    skip_tests: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Equivalent {
    mutant: String,
    /// Text of the mutated source line, when the description alone names
    /// several mutants (two `!` deletions in one function): only the one
    /// on a line holding this text is the equivalent one.
    #[serde(default)]
    at: Option<String>,
    why: String,
}

/// The source line a `file:line:col: ...` mutant name points at (in the
/// unmutated tree), trimmed; empty when it cannot be read.
fn source_line(root: &Path, name: &str) -> String {
    let mut parts = name.splitn(3, ':');
    let (Some(file), Some(line)) = (parts.next(), parts.next().and_then(|l| l.parse::<usize>().ok())) else {
        return String::new();
    };
    let text = std::fs::read_to_string(root.join(file)).unwrap_or_default();
    text.lines().nth(line.saturating_sub(1)).unwrap_or("").trim().to_string()
}

/// Whether `equivalent` covers the missed mutant `name` (whose source line
/// is `line`).
fn covers(equivalent: &Equivalent, name: &str, line: &str) -> bool {
    equivalent.mutant == without_position(name) && equivalent.at.as_deref().is_none_or(|at| line.contains(at))
}

/// `file:line:col: description` → `file: description` (stable when lines
/// move).
fn without_position(name: &str) -> String {
    let mut parts = name.splitn(4, ':');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(file), Some(_line), Some(_col), Some(rest)) => format!("{file}:{rest}"),
        _ => name.to_string(),
    }
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_string).collect()
}

/// Installs the pinned cargo-mutants under `target/tools` unless present.
fn install(version: &str) -> Result<std::path::PathBuf> {
    let root = util::target().join("tools");
    let bin = root.join("bin/cargo-mutants");
    let installed = Command::new(&bin).args(["mutants", "--version"]).output().ok().filter(|o| o.status.success());
    if installed.is_some_and(|o| String::from_utf8_lossy(&o.stdout).trim() == format!("cargo-mutants {version}")) {
        return Ok(bin);
    }
    println!("==> cargo install cargo-mutants {version} (--locked --debug) into {}", root.display());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // `--debug`: the optimised build took most of this lane's set-up on a
    // CI machine, and what the tool does itself (copy a tree, parse a few
    // files, start cargo) does not need it.
    let status = Command::new(cargo)
        .args(["install", "cargo-mutants", "--locked", "--debug", "--force", "--version", version, "--root"])
        .arg(&root)
        .status()
        .context("cannot run cargo install")?;
    if !status.success() {
        bail!("cargo install cargo-mutants {version} failed");
    }
    Ok(bin)
}

/// How many mutants cargo-mutants lists for target `t` unsharded (a
/// listing only: nothing is built or run).
fn listed(bin: &Path, t: &Target, root: &Path, lib: &Path) -> Result<usize> {
    let out = Command::new(bin)
        .arg("mutants")
        .args(&t.args)
        .arg("--list")
        .current_dir(root)
        .env("ORT_DYLIB_PATH", lib)
        .output()
        .with_context(|| format!("cannot run cargo-mutants --list on {}", t.name))?;
    if !out.status.success() {
        bail!("cargo-mutants --list on {} failed: {}", t.name, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(count_listed(&String::from_utf8_lossy(&out.stdout)))
}

/// Mutant names in a `--list` output: one per non-empty line.
fn count_listed(text: &str) -> usize {
    text.lines().filter(|l| !l.trim().is_empty()).count()
}

#[derive(Debug, PartialEq)]
enum Outcome {
    /// Mutants were tested (all of them, or until the time box).
    Measured,
    /// The shard held none of the target's mutants; the target has some.
    EmptyShard,
    /// A red baseline, a crash, or a target whose filter matches nothing.
    Nothing,
}

/// What one cargo-mutants run measured, from its exit `code` (None: the
/// time box stopped it), the mutants it `tested`, whether it was
/// `sharded`, and — asked only for an empty sharded run — how many
/// mutants the whole target lists.
fn outcome(
    code: Option<i32>,
    tested: usize,
    sharded: bool,
    target_mutants: impl FnOnce() -> Result<usize>,
) -> Result<Outcome> {
    // cargo-mutants exits 0 (all caught), 2 (missed), 3 (timeouts);
    // anything else — 4 is a red baseline — means it measured nothing.
    Ok(match code {
        Some(0 | 2 | 3) | None if tested > 0 => Outcome::Measured,
        Some(0) if sharded && target_mutants()? > 0 => Outcome::EmptyShard,
        _ => Outcome::Nothing,
    })
}

pub struct Options {
    pub minutes_per_target: u64,
    /// Only these targets (all when empty).
    pub targets: Vec<String>,
    /// `k/n`, or `auto/n` (k from the history's length).
    pub shard: Option<String>,
}

/// `k/n` as cargo-mutants' `--shard` value; `auto/n` takes k from the
/// number of commits in the history (`commits`), so successive commits
/// test successive slices.
fn shard_arg(shard: &str, commits: impl FnOnce() -> Result<u64>) -> Result<String> {
    let (k, n) = shard.split_once('/').context("--shard is k/n or auto/n")?;
    let n: u64 = n.parse().ok().filter(|n| *n > 0).context("--shard k/n: n must be a positive integer")?;
    let k: u64 = if k == "auto" {
        commits()? % n
    } else {
        k.parse().ok().filter(|k| *k < n).with_context(|| format!("--shard k/n: k must be below {n}"))?
    };
    Ok(format!("{k}/{n}"))
}

pub fn run(opts: Options) -> Result<()> {
    let minutes_per_target = opts.minutes_per_target;
    let root = util::root();
    let text = std::fs::read_to_string(root.join("conformance/cargo-mutants.yaml"))?;
    let config: Config = serde_yaml_ng::from_str(&text).context("conformance/cargo-mutants.yaml")?;
    if let Some(unknown) = opts.targets.iter().find(|t| !config.targets.iter().any(|c| &&c.name == t)) {
        bail!(
            "no cargo-mutants target `{unknown}` in conformance/cargo-mutants.yaml (there are: {})",
            config.targets.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    let targets: Vec<&Target> =
        config.targets.iter().filter(|t| opts.targets.is_empty() || opts.targets.contains(&t.name)).collect();
    let commit = util::commit();
    let commits = || -> Result<u64> {
        let out = Command::new("git").args(["rev-list", "--count", "HEAD"]).current_dir(&root).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim()
            .parse()
            .with_context(|| format!("--shard auto/N: `git rev-list --count HEAD` gave `{}`", text.trim()))
    };
    let shard = opts.shard.as_deref().map(|s| shard_arg(s, commits)).transpose()?;
    let lib = ort::provision()?;
    let bin = install(&config.version)?;
    let out = util::target().join("mutants/compare");
    let mut md = format!(
        "# cargo-mutants {} beside the batteries\n\ncommit `{}`; each target time-boxed to {minutes_per_target} min{}.\n\n\
         | tool | target | mutants | caught | missed | unviable | timeout | complete |\n|---|---|---:|---:|---:|---:|---:|---|\n",
        config.version,
        commit,
        shard.as_ref().map(|s| format!(", shard {s} of each")).unwrap_or_default()
    );
    let mut gaps = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    let mut misses_md = String::new();
    let mut shard_notes = String::new();
    for t in targets {
        let dir = out.join(&t.name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut c = Command::new(&bin);
        c.arg("mutants")
            .args(&t.args)
            .args(["--no-shuffle", "--minimum-test-timeout", "60"])
            .args(shard.iter().flat_map(|s| ["--shard", s.as_str()]))
            .arg("--output")
            .arg(&dir)
            .current_dir(&root)
            .env("ORT_DYLIB_PATH", &lib)
            // The batteries' build directory: dependencies are already built.
            .env("CARGO_TARGET_DIR", util::target().join("mutants/target"));
        if !t.skip_tests.is_empty() {
            c.args(["--", "--"]);
            for s in &t.skip_tests {
                c.args(["--skip", s]);
            }
        }
        println!("==> cargo-mutants on {} (at most {minutes_per_target} min)", t.name);
        let finished = onnx_genai_conformance::mutants::run_limited(c, Duration::from_secs(minutes_per_target * 60))
            .map_err(anyhow::Error::msg)?;
        let result = |f: &str| lines(&dir.join("mutants.out").join(f));
        let (caught, missed, unviable, timeout) =
            (result("caught.txt"), result("missed.txt"), result("unviable.txt"), result("timeout.txt"));
        let total = caught.len() + missed.len() + unviable.len() + timeout.len();
        // A shard may hold no mutant of a small target (7 mutants cut in 8
        // shards leave one empty): that is measured, as long as the target
        // as a whole has mutants — a filter that matches nothing is not.
        let code = finished.and_then(|s| s.code());
        match outcome(code, total, shard.is_some(), || listed(&bin, t, &root, &lib))? {
            Outcome::Measured => {}
            Outcome::EmptyShard => {
                let _ = writeln!(shard_notes, "- {}: this shard holds none of its mutants", t.name);
            }
            Outcome::Nothing => problems.push(format!(
                "cargo-mutants on {} tested {total} mutants and exited {code:?} (4 = the unmutated tests failed); see {}",
                t.name,
                dir.join("mutants.out/log/baseline.log").display()
            )),
        }
        let _ = writeln!(
            md,
            "| cargo-mutants | {} | {total} | {} | {} | {} | {} | {} |",
            t.name,
            caught.len(),
            missed.len(),
            unviable.len(),
            timeout.len(),
            if finished.is_some() { "yes" } else { "time box reached" }
        );
        for m in &missed {
            let line = source_line(&root, m);
            match config.equivalent.iter().find(|e| covers(e, m, &line)) {
                Some(e) => {
                    let _ = writeln!(misses_md, "- equivalent: `{m}` — {}", e.why);
                }
                None => {
                    let _ = writeln!(misses_md, "- **GAP**: `{m}`");
                    gaps.push(m.clone());
                }
            }
        }
    }
    match std::fs::read_to_string(util::target().join("mutants/report.json")) {
        Ok(text) => {
            let report: serde_json::Value = serde_json::from_str(&text)?;
            let results = report["results"].as_array().cloned().unwrap_or_default();
            for battery in ["admission", "lease"] {
                let of = |verdict: &str| {
                    results.iter().filter(|r| r["battery"] == battery && r["verdict"]["verdict"] == verdict).count()
                };
                let total = results.iter().filter(|r| r["battery"] == battery).count();
                let _ = writeln!(
                    md,
                    "| batteries (commit {}) | {battery} | {total} | {} | {} | {} | {} | yes |",
                    report["commit"].as_str().unwrap_or("?").chars().take(10).collect::<String>(),
                    of("caught"),
                    of("missed"),
                    of("unviable"),
                    of("timeout")
                );
            }
        }
        Err(_) => md.push_str("\n(no battery report yet: run `cargo xtask mutants` for the batteries' row)\n"),
    }
    if !shard_notes.is_empty() {
        let _ = write!(md, "\n## Empty shards\n\n{shard_notes}");
    }
    let _ = write!(md, "\n## cargo-mutants misses\n\n{}", if misses_md.is_empty() { "none\n" } else { &misses_md });
    for p in &problems {
        let _ = write!(md, "\n**{p}**\n");
    }
    std::fs::write(out.join("report.md"), &md)?;
    println!("\n{md}\nreport: {}", out.join("report.md").display());
    for p in &problems {
        eprintln!("{p}");
    }
    if !problems.is_empty() {
        bail!("the comparison measured nothing for some targets");
    }
    if !gaps.is_empty() {
        bail!(
            "{} missed mutants are neither killed nor listed as equivalent in conformance/cargo-mutants.yaml",
            gaps.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{count_listed, outcome, shard_arg, without_position, Outcome};

    /// A shard that holds none of a small target's mutants (the CI failure
    /// of 3292d3f: routes, shard 7/8, "Found 0 mutants") is measured; an
    /// empty unsharded run, an empty target, a red baseline or a crash is
    /// not, and a run that tested mutants never asks for the listing.
    #[test]
    fn an_empty_shard_of_a_target_with_mutants_is_measured() {
        let never = || -> anyhow::Result<usize> { panic!("listing asked for") };
        assert_eq!(outcome(Some(0), 3, true, never).unwrap(), Outcome::Measured);
        assert_eq!(outcome(Some(2), 1, false, never).unwrap(), Outcome::Measured);
        assert_eq!(outcome(None, 2, true, never).unwrap(), Outcome::Measured);
        assert_eq!(outcome(Some(0), 0, true, || Ok(7)).unwrap(), Outcome::EmptyShard);
        assert_eq!(outcome(Some(0), 0, true, || Ok(0)).unwrap(), Outcome::Nothing);
        assert_eq!(outcome(Some(0), 0, false, never).unwrap(), Outcome::Nothing);
        assert_eq!(outcome(Some(4), 0, true, never).unwrap(), Outcome::Nothing);
        assert_eq!(outcome(None, 0, true, never).unwrap(), Outcome::Nothing);
        assert!(outcome(Some(0), 0, true, || anyhow::bail!("no cargo-mutants")).is_err());
        assert_eq!(count_listed("a.rs:1:2: x\n\nb.rs:3:4: y\n"), 2);
    }

    /// `--shard auto/n` walks the shards with the history's length; an
    /// explicit shard out of range, a malformed one, or `auto` without a
    /// history is refused (a shard that selects nothing would pass
    /// vacuously).
    #[test]
    fn shards_are_checked_and_auto_follows_the_history() {
        assert_eq!(shard_arg("2/5", || Ok(0)).unwrap(), "2/5");
        assert_eq!(shard_arg("auto/4", || Ok(10)).unwrap(), "2/4");
        assert_eq!(shard_arg("auto/4", || Ok(11)).unwrap(), "3/4");
        assert!(shard_arg("auto/4", || anyhow::bail!("no git")).is_err());
        for bad in ["5/5", "1/0", "auto", "x/3"] {
            assert!(shard_arg(bad, || Ok(0)).is_err(), "{bad}");
        }
    }

    /// An equivalent entry with `at` covers only the mutant on a line
    /// holding that text: another `!` deletion in the same function stays a
    /// gap.
    #[test]
    fn an_equivalent_with_at_covers_only_its_line() {
        let e = super::Equivalent {
            mutant: "src/a.rs: delete ! in f".into(),
            at: Some("!r.flush()".into()),
            why: String::new(),
        };
        assert!(super::covers(&e, "src/a.rs:7:9: delete ! in f", "if !r.flush() && r.gone {"));
        assert!(!super::covers(&e, "src/a.rs:3:9: delete ! in f", "if !r.gone {"));
        assert!(!super::covers(&e, "src/b.rs:7:9: delete ! in f", "if !r.flush() && r.gone {"));
    }

    #[test]
    fn positions_are_dropped_from_names() {
        assert_eq!(
            without_position("crates/a/src/lib.rs:127:23: replace > with >= in f"),
            "crates/a/src/lib.rs: replace > with >= in f"
        );
        assert_eq!(without_position("odd"), "odd");
    }
}
