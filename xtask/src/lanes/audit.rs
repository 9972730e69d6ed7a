//! `cargo xtask lanes --audit` (INVARIANTS T3): every test of the workspace,
//! listed from the built binaries under each lane's features (libtest-mimic
//! harnesses included), must be executed by some lane; every rule must
//! select something; every cargo feature must be built by some lane and
//! linted; an accelerator test must not pass silently on a machine without
//! the accelerator (it is `#[ignore]`d there, or its crate honours
//! `ONNX_GENAI_REQUIRE_GPU=1`); every `cargo xtask` command the README
//! documents must be run by some lane or excused (`documented.rs`). Writes
//! `target/conformance/lanes.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Result};

use super::{build_test_binaries, list_tests, LaneFile, TestBinary};
use crate::util;

/// A test, its binary and whether it is `#[ignore]`d.
struct Listed {
    binary: TestBinary,
    name: String,
    ignored: bool,
}

/// Words that mark a test as needing an accelerator.
const ACCELERATOR_WORDS: &[&str] = &["gpu", "cuda"];

/// What the audit found.
#[derive(Default)]
struct Findings {
    /// Test key → the lanes that execute it.
    executed: BTreeMap<String, Vec<String>>,
    total: usize,
    accelerator: usize,
    problems: Vec<String>,
}

/// The checks, over the tests listed under each lane feature set.
fn check(
    file: &LaneFile,
    listings: &[(Vec<String>, Vec<Listed>)],
    declared: &BTreeSet<(String, String)>,
    honours_require_gpu: &dyn Fn(&Path) -> bool,
) -> Findings {
    let mut f = Findings::default();
    let mut all: BTreeMap<String, &Listed> = BTreeMap::new();
    for (features, listed) in listings {
        for lane in file.lanes.iter().filter(|l| sorted(&l.features) == *features) {
            for (i, rule) in lane.select.iter().enumerate() {
                let mut selected = 0;
                // A lane that requires a GPU runs the accelerator tests this
                // machine (without one) lists as ignored.
                let runs =
                    |t: &Listed| !t.ignored || (lane.requires == Some(super::Hardware::Gpu) && is_accelerator(t));
                for t in listed.iter().filter(|t| runs(t) && rule.selects(&t.binary, &t.name)) {
                    selected += 1;
                    f.executed.entry(key(t)).or_default().push(lane.name.clone());
                }
                if selected == 0 {
                    f.problems.push(format!(
                        "lane `{}` rule #{} (package {}, target {:?}) selects no test: it drifted",
                        lane.name,
                        i + 1,
                        rule.package,
                        rule.target
                    ));
                }
            }
        }
        for t in listed {
            all.entry(key(t)).or_insert(t);
        }
    }
    f.total = all.len();
    for k in all.keys().filter(|k| !f.executed.contains_key(*k)) {
        f.problems.push(format!("test `{k}` runs in no lane"));
    }
    let built: BTreeSet<&String> = file.lanes.iter().flat_map(|l| &l.features).collect();
    for (krate, feature) in declared {
        if !built.contains(feature) {
            f.problems.push(format!("feature `{feature}` of {krate} is compiled by no lane"));
        }
    }
    let lint: Vec<String> =
        file.lanes.iter().filter(|l| l.name == "lint").flat_map(|l| l.commands.iter().map(|c| c.join(" "))).collect();
    for (features, _) in listings.iter().filter(|(f, _)| !f.is_empty()) {
        let flag = format!("--features {}", features.join(","));
        if !lint.iter().any(|c| c.contains("clippy") && c.contains(&flag)) {
            f.problems.push(format!("the lint lane runs no clippy with `{flag}`"));
        }
    }
    for t in all.values().filter(|t| is_accelerator(t)) {
        f.accelerator += 1;
        if !t.ignored && !honours_require_gpu(&t.binary.dir) {
            f.problems.push(format!(
                "accelerator test `{}` would pass without a GPU: `#[ignore]` it off-GPU or fail when ONNX_GENAI_REQUIRE_GPU=1",
                key(t)
            ));
        }
    }
    f
}

pub fn run(file: &LaneFile) -> Result<String> {
    let mut feature_sets: BTreeSet<Vec<String>> = file.lanes.iter().map(|l| sorted(&l.features)).collect();
    feature_sets.insert(Vec::new());
    let mut listings = Vec::new();
    for features in &feature_sets {
        let mut listed = Vec::new();
        for b in build_test_binaries(features)? {
            for (name, ignored) in list_tests(&b)? {
                listed.push(Listed { binary: b.clone(), name, ignored });
            }
        }
        listings.push((features.clone(), listed));
    }
    let mut f = check(file, &listings, &declared_features(&util::root())?, &honours_require_gpu);
    let readme = std::fs::read_to_string(util::root().join("README.md"))?;
    let commands = super::documented::documented(&readme).len();
    f.problems.extend(super::documented::problems(&readme, file));
    let mut md = format!("# Lane audit\n\ncommit `{}`\n\n| lane | backend | tests |\n|---|---|---:|\n", util::commit());
    for lane in &file.lanes {
        let n = f.executed.values().filter(|lanes| lanes.contains(&lane.name)).count();
        let _ = writeln!(md, "| {} | {} | {n} |", lane.name, lane.backend);
    }
    let _ = writeln!(
        md,
        "\n{} tests in the workspace, {} executed by some lane, {} accelerator tests, {} feature sets built; {} \
         README commands, each run by a lane or excused under `unlaned`.",
        f.total,
        f.executed.len(),
        f.accelerator,
        feature_sets.len(),
        commands
    );
    for p in &f.problems {
        let _ = writeln!(md, "\n**{p}**");
    }
    let dir = util::target().join("conformance");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("lanes.md"), &md)?;
    println!("{md}");
    if !f.problems.is_empty() {
        bail!("lane audit: {} problems:\n{}", f.problems.len(), f.problems.join("\n"));
    }
    Ok(format!("{} tests, all executed by some lane", f.total))
}

fn key(t: &Listed) -> String {
    format!("{}/{}::{}", t.binary.package, t.binary.target, t.name)
}

fn sorted(v: &[String]) -> Vec<String> {
    let mut v = v.to_vec();
    v.sort();
    v
}

fn is_accelerator(t: &Listed) -> bool {
    let name = format!("{} {}", t.binary.package, t.name).to_lowercase();
    ACCELERATOR_WORDS.iter().any(|w| name.contains(w))
}

/// Whether the crate's sources read `ONNX_GENAI_REQUIRE_GPU` (call
/// `env::var` on it: a comment or a message naming it is not a read).
fn honours_require_gpu(dir: &Path) -> bool {
    walk(dir).iter().any(|f| std::fs::read_to_string(f).is_ok_and(|s| reads_require_gpu(&s)))
}

fn reads_require_gpu(source: &str) -> bool {
    source.contains("env::var(\"ONNX_GENAI_REQUIRE_GPU\")")
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() && !p.ends_with("target") && !p.ends_with("fixtures") {
            out.extend(walk(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// `(crate dir, feature)` for every `[features]` entry of the workspace's
/// manifests and every feature gate (`cfg` on a feature) in their sources.
fn declared_features(root: &Path) -> Result<BTreeSet<(String, String)>> {
    let mut out = BTreeSet::new();
    let mut dirs: Vec<std::path::PathBuf> =
        std::fs::read_dir(root.join("crates"))?.flatten().map(|e| e.path()).collect();
    dirs.push(root.join("xtask"));
    for dir in dirs {
        let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if let Ok(manifest) = std::fs::read_to_string(dir.join("Cargo.toml")) {
            let mut in_features = false;
            for line in manifest.lines().map(str::trim) {
                if line.starts_with('[') {
                    in_features = line == "[features]";
                } else if in_features {
                    if let Some((f, _)) = line.split_once('=') {
                        let f = f.trim();
                        if !f.is_empty() && f != "default" && !f.starts_with('#') {
                            out.insert((name.clone(), f.to_string()));
                        }
                    }
                }
            }
        }
        for file in walk(&dir.join("src")) {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            for part in text.split("feature = \"").skip(1) {
                if let Some((f, _)) = part.split_once('"') {
                    out.insert((name.clone(), f.to_string()));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lanes::{Lane, Rule};

    /// Issue 21: only a read of the variable honours it; the audit's own
    /// text naming it (in a message or a comment) does not.
    #[test]
    fn naming_require_gpu_is_not_reading_it() {
        assert!(reads_require_gpu("let r = std::env::var(\"ONNX_GENAI_REQUIRE_GPU\").is_ok();"));
        assert!(!reads_require_gpu("// fail when ONNX_GENAI_REQUIRE_GPU=1"));
        assert!(!reads_require_gpu("format!(\"ONNX_GENAI_REQUIRE_GPU is set\")"));
    }

    fn binary(package: &str, target: &str) -> TestBinary {
        TestBinary { package: package.into(), target: target.into(), executable: "x".into(), dir: "d".into() }
    }

    fn listed(package: &str, target: &str, name: &str, ignored: bool) -> Listed {
        Listed { binary: binary(package, target), name: name.into(), ignored }
    }

    fn lane(name: &str, select: Vec<Rule>, features: &[&str]) -> Lane {
        Lane {
            name: name.into(),
            backend: "ort".into(),
            needs: Vec::new(),
            features: features.iter().map(|s| s.to_string()).collect(),
            commands: Vec::new(),
            select,
            requires: None,
            empty: None,
        }
    }

    fn rule(package: &str, target: Option<&str>, exclude: &[&str]) -> Rule {
        Rule {
            package: package.into(),
            target: target.map(str::to_string),
            include: Vec::new(),
            exclude: exclude.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// Pins T3: a test no lane executes, an ignored test, a rule that
    /// selects nothing, a feature no lane builds, and an accelerator test
    /// that would pass off-GPU are each reported; a clean setup reports
    /// nothing.
    #[test]
    fn every_hole_is_reported() {
        let tests = vec![
            listed("a", "lib", "covered", false),
            listed("a", "lib", "skipped_by_exclude", false),
            listed("b", "it", "never_ignored", true),
            listed("a", "lib", "cuda_kernel_matches", false),
        ];
        let file = LaneFile {
            unlaned: Default::default(),
            lanes: vec![lane("unit", vec![rule("a", Some("lib"), &["skipped_by_exclude"]), rule("c", None, &[])], &[])],
        };
        let declared = BTreeSet::from([("crate-x".to_string(), "cuda".to_string())]);
        let f = check(&file, &[(Vec::new(), tests)], &declared, &|_| false);
        let text = f.problems.join("\n");
        assert!(text.contains("test `a/lib::skipped_by_exclude` runs in no lane"), "{text}");
        assert!(text.contains("test `b/it::never_ignored` runs in no lane"), "{text}");
        assert!(text.contains("rule #2 (package c"), "{text}");
        assert!(text.contains("feature `cuda` of crate-x is compiled by no lane"), "{text}");
        assert!(text.contains("accelerator test `a/lib::cuda_kernel_matches` would pass without a GPU"), "{text}");
        assert_eq!(f.problems.len(), 5, "{text}");
        assert_eq!((f.total, f.executed.len(), f.accelerator), (4, 2, 1));

        let clean = vec![listed("a", "lib", "covered", false), listed("a", "lib", "gpu_probe", true)];
        let file = LaneFile { lanes: vec![lane("unit", vec![rule("a", None, &[])], &[])], unlaned: Default::default() };
        let f = check(&file, &[(Vec::new(), clean)], &BTreeSet::new(), &|_| false);
        // The ignored GPU test is fine off-GPU; it still runs in no lane.
        assert_eq!(f.problems, ["test `a/lib::gpu_probe` runs in no lane"]);
    }
}
