//! The mutation runner measured against a fixture crate whose verdicts are
//! known (INVARIANTS T1, T2): a runner that reported "caught" for a
//! survivor, skipped a drifted `find`, or trusted a drifted filter would
//! make the real batteries measure nothing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use onnx_genai_conformance::mutants::{self, Problem, Runner, Scope, Selection, Verdict};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mutant-crate")
}

/// Copies the fixture into `dir` and makes it a git checkout (the runner
/// copies what git tracks).
fn checkout(dir: &Path) {
    let status = Command::new("cp").arg("-r").arg(fixture()).arg(dir).status().unwrap();
    assert!(status.success());
    let src = dir.join("mutant-crate");
    for args in [&["init", "-q"][..], &["add", "-A"][..]] {
        let status = Command::new("git").args(args).current_dir(&src).status().unwrap();
        assert!(status.success(), "git {args:?}");
    }
}

/// Processes whose command line mentions `needle` (Linux `/proc`).
fn processes_mentioning(needle: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
        .filter(|cmd| cmd.contains(needle))
        .collect()
}

/// One run over the three fixture batteries:
/// - `killed` is caught by its declared test, run alone, and
///   `killed-outside` by its killer in another test target (`--test`);
///   mutants their killers do not kill are judged by the whole battery;
/// - `survivor` (an off-by-one no test reaches) is MISSED and fails the run;
/// - `unviable` (a type error) is unviable, not caught;
/// - `drifted-find` is CATALOG-DRIFT (reported, not skipped);
/// - `wrong-killers` is caught, but by another test than declared, and
///   that is reported as a failure;
/// - `spins` (an endless loop) times out, and the timeout kills the test
///   binary, not only cargo;
/// - `dirties-the-tree` is caught by a test that writes a tracked file
///   (as proptest does) and creates an untracked one, and the runner puts
///   the one back and removes the other;
/// - battery `drifted` is FILTER-DRIFT and battery `baseline-red` is
///   BASELINE-RED, battery `baseline-short` (its one test is ignored) is
///   BASELINE-SHORT, battery `unselected` (its killer is outside its
///   filter) is UNSELECTED-KILLER, battery `alone-red` (its killer passes
///   under cargo but fails run alone, as the fast path runs it) is
///   BASELINE-RED, and none of them judges a mutant;
/// - `killed` names its killer by path (`tests::ok_clamp_caps_at_budget`),
///   the others by name alone: both match;
/// - the scratch tree is byte-identical to the source afterwards, the
///   user's tree is untouched, and both reports are written.
#[test]
fn the_runner_reports_each_known_verdict() {
    let work = tempfile::tempdir().unwrap();
    checkout(work.path());
    let source = work.path().join("mutant-crate");
    let lib_before = std::fs::read(source.join("src/lib.rs")).unwrap();
    let scratch = work.path().join("scratch");
    let mut runner = Runner::new(source.clone(), scratch.clone(), work.path().join("target"));
    runner.prepare().unwrap();
    let catalogs = mutants::load(&source).unwrap();
    assert_eq!(catalogs.len(), 6);
    let selection = Selection { min_limit: Duration::from_secs(20), ..Selection::default() };
    let mut seen = Vec::new();
    let report = mutants::run_all(&runner, &catalogs, &selection, |r| seen.push(r.id.clone())).unwrap();

    let verdict = |id: &str| report.result(id).unwrap_or_else(|| panic!("no result for {id}")).verdict.clone();
    assert_eq!(verdict("killed"), Verdict::Caught { by: vec!["tests::ok_clamp_caps_at_budget".into()] });
    assert!(!report.result("killed").unwrap().is_failure());
    // The declared killers alone decide a kill, each in its own target;
    // whatever they do not kill, the whole battery judges.
    let scope = |id: &str| report.result(id).unwrap().scope;
    assert_eq!(verdict("killed-outside"), Verdict::Caught { by: vec!["ok_countdown_from_outside".into()] });
    for id in ["killed", "killed-outside", "dirties-the-tree", "unviable", "spins"] {
        assert_eq!(scope(id), Scope::Killers, "{id}");
    }
    for id in ["survivor", "wrong-killers"] {
        assert_eq!(scope(id), Scope::Battery, "{id}");
    }
    assert_eq!(verdict("survivor"), Verdict::Missed);
    assert!(matches!(verdict("unviable"), Verdict::Unviable { .. }), "{:?}", verdict("unviable"));
    assert_eq!(verdict("drifted-find"), Verdict::CatalogDrift { occurrences: 0 });
    assert_eq!(scope("drifted-find"), Scope::Nothing, "a mutant that cannot be applied runs nothing");
    let wrong = report.result("wrong-killers").unwrap();
    assert!(matches!(&wrong.verdict, Verdict::Caught { by } if by == &["tests::ok_clamp_caps_at_budget"]));
    assert!(wrong.unexpected && wrong.is_failure());
    assert_eq!(verdict("spins"), Verdict::Timeout);
    let dirty = report.result("dirties-the-tree").unwrap();
    assert!(
        matches!(&dirty.verdict, Verdict::Caught { by } if by.contains(&"tests::ok_fits_leaves_no_trace".to_string()))
    );
    assert!(!dirty.is_failure());
    assert_eq!(dirty.restored, ["left-behind.txt", "state.txt"]);
    assert!(!scratch.join("left-behind.txt").exists());
    assert!(report.results.iter().filter(|r| r.id != "dirties-the-tree").all(|r| r.restored.is_empty()));
    let target = work.path().join("target");
    let left = processes_mentioning(&target.display().to_string());
    assert!(left.is_empty(), "the timed-out test binary is still running: {left:?}");

    assert!(report.problems.contains(&Problem::FilterDrift { battery: "drifted".into(), selected: 1, declared: 2 }));
    assert!(report
        .problems
        .iter()
        .any(|p| matches!(p, Problem::BaselineRed { battery, .. } if battery == "baseline-red")));
    assert!(report.problems.contains(&Problem::BaselineShort {
        battery: "baseline-short".into(),
        passed: 0,
        selected: 1
    }));
    assert!(
        report.problems.iter().any(
            |p| matches!(p, Problem::BaselineRed { battery, detail } if battery == "alone-red" && detail.contains("alone"))
        ),
        "{:?}",
        report.problems
    );
    assert!(report.problems.contains(&Problem::UnselectedKiller {
        battery: "unselected".into(),
        killers: vec!["never-selected: ok_fits_accepts_small_requests".into()]
    }));
    assert!(!report.problems.iter().any(|p| matches!(p, Problem::NotRestored { .. })), "{:?}", report.problems);
    assert!(["never-run", "never-judged", "never-killed", "never-selected", "never-trusted"]
        .iter()
        .all(|id| report.result(id).is_none()));
    assert_eq!(seen.len(), 8);
    assert_eq!(report.failures(), 5);
    assert!(!report.passed());
    assert!(runner.differences().is_empty());
    assert_eq!(std::fs::read(source.join("src/lib.rs")).unwrap(), lib_before);

    let out = work.path().join("report");
    report.write(&out, "0123abc").unwrap();
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["commit"], "0123abc");
    assert_eq!(json["results"].as_array().unwrap().len(), 8);
    assert_eq!(json["problems"].as_array().unwrap().len(), 5);
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("MISSED") && md.contains("CATALOG-DRIFT") && md.contains("FILTER-DRIFT"), "{md}");
}

/// Selecting one mutant and sharding pick exactly the mutants asked for.
#[test]
fn selection_narrows_the_run() {
    let work = tempfile::tempdir().unwrap();
    checkout(work.path());
    let source = work.path().join("mutant-crate");
    let mut runner = Runner::new(source.clone(), work.path().join("scratch"), work.path().join("target"));
    runner.prepare().unwrap();
    let catalogs = mutants::load(&source).unwrap();
    let selection = Selection {
        battery: Some("fixture".into()),
        shard: Some((1, 3)),
        min_limit: Duration::from_secs(20),
        ..Selection::default()
    };
    let report = mutants::run_all(&runner, &catalogs, &selection, |_| {}).unwrap();
    let ids: Vec<&str> = report.results.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["killed", "drifted-find", "dirties-the-tree"]);
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let one = Selection { mutant: Some("killed".into()), ..selection };
    let report = mutants::run_all(&runner, &catalogs, &one, |_| {}).unwrap();
    assert_eq!(report.results.len(), 1);
    assert!(report.passed());
}
