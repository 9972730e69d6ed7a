//! `onnx-genai check` on package directories the tests build: our own
//! layout and ONNX Runtime GenAI's (a genai_config.json package), with the
//! exit codes CI reads (0 pass, 1 mismatch, 2 could not run) and every
//! report format. The mismatch side (exit 1, with both sides' top-k) is in
//! the conformance crate's real_model.rs, on SmolLM2's f16 export held to
//! the f32 tier: the tiny packages sit well inside every tier.

use std::process::{Command, Output};

use serde_json::Value;

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-genai")).args(args).output().unwrap()
}

fn built(name: &str, variant: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let spec = onnx_genai_test_support::spec_path(name);
    let out = cli(&["build", spec.to_str().unwrap(), dir.path().to_str().unwrap(), "--variant", variant]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    })
}

/// Both layouts pass with exit 0: every stage ran and passed, parity of
/// native-cpu on each of the four built-in prompts, speed of both
/// backends, and the tier chosen from the plan (f32 for the decomposed
/// export, int8 activations for the genai one at accuracy_level 4).
#[test]
fn check_passes_on_our_layout_and_on_ort_genais() {
    let ours = built("tiny-llama-gqa", "decomposed");
    let theirs = built("tiny-llama-gqa", "genai");
    assert!(theirs.path().join("genai_config.json").is_file());
    let out = cli(&[
        "check",
        ours.path().to_str().unwrap(),
        theirs.path().to_str().unwrap(),
        "--steps",
        "6",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let report = json_of(&out);
    let packages = report["packages"].as_array().unwrap();
    assert_eq!(packages.len(), 2);
    for (p, tier) in packages.iter().zip(["f32", "int8act"]) {
        assert_eq!(p["verdict"], "pass", "{p}");
        assert_eq!(p["tier"], tier, "{}", p["dir"]);
        let results = p["results"].as_array().unwrap();
        let stages: Vec<&str> = results.iter().map(|r| r["suite"].as_str().unwrap()).collect();
        // Parity and speed of every native backend this machine has
        // (native-cuda too where a GPU is).
        let natives = onnx_genai_conformance::check::native_backends();
        let mut want = vec!["validate", "ort-load", "native-compile"];
        want.extend(std::iter::repeat_n("parity", 4 * natives.len()));
        want.extend(std::iter::repeat_n("speed", 1 + natives.len()));
        assert_eq!(stages, want, "{}", p["dir"]);
        assert!(results.iter().all(|r| r["status"] == "passed"), "{p}");
        for r in results.iter().filter(|r| r["suite"] == "parity") {
            assert!(natives.iter().any(|n| r["backend"] == n.as_str()), "{r}");
            assert_eq!(r["parity"]["steps"], 6, "{r}");
            assert_eq!(r["parity"]["tokens"].as_array().unwrap().len(), 6, "{r}");
        }
        let speed: Vec<&str> = p["speed"].as_array().unwrap().iter().map(|s| s["backend"].as_str().unwrap()).collect();
        assert_eq!(speed[..2], ["ort", "native-cpu"]);
    }

    // The same run as a terminal table, Markdown and JUnit.
    let dir = ours.path().to_str().unwrap();
    let table = cli(&["check", dir, "--steps", "2"]);
    let table_text = String::from_utf8_lossy(&table.stdout);
    assert_eq!(table.status.code(), Some(0));
    assert!(table_text.contains("ok   parity::tiny-llama-gqa::native-cpu::prompt3"), "{table_text}");
    assert!(table_text.contains("| native-cpu |"), "{table_text}");
    let md = cli(&["check", dir, "--steps", "2", "--format", "markdown"]);
    let parity_row = format!("| parity | {} | 0 | 0 |", 4 * onnx_genai_conformance::check::native_backends().len());
    assert!(String::from_utf8_lossy(&md.stdout).contains(&parity_row));
    let junit_path = ours.path().join("junit.xml");
    let junit = cli(&["check", dir, "--steps", "2", "--format", "junit", "--out", junit_path.to_str().unwrap()]);
    assert_eq!(junit.status.code(), Some(0));
    let xml = std::fs::read_to_string(&junit_path).unwrap();
    let suite = format!(
        "<testsuite name=\"parity\" tests=\"{}\" failures=\"0\"",
        4 * onnx_genai_conformance::check::native_backends().len()
    );
    assert!(xml.contains(&suite), "{xml}");
}

/// A prompts file replaces the built-in prompts; one that is not a list of
/// strings, or whose YAML aliases expand past the manifest's bounds, is
/// exit 2 naming the file, as is a directory that is no package
/// (validation's error quoted) and a package whose model is not ONNX.
#[test]
fn check_reads_prompts_and_says_when_it_could_not_run() {
    let ours = built("tiny-llama-gqa", "decomposed");
    let dir = ours.path().to_str().unwrap();
    let prompts = ours.path().join("prompts.yaml");
    std::fs::write(&prompts, "- Hello there\n- 'def main():'\n").unwrap();
    let out = cli(&["check", dir, "--prompts", prompts.to_str().unwrap(), "--steps", "3", "--format", "json"]);
    assert_eq!(out.status.code(), Some(0));
    let parity =
        json_of(&out)["packages"][0]["results"].as_array().unwrap().iter().filter(|r| r["suite"] == "parity").count();
    assert_eq!(parity, 2 * onnx_genai_conformance::check::native_backends().len(), "one parity check per prompt");

    std::fs::write(&prompts, "prompts: [a, b]\n").unwrap();
    let out = cli(&["check", dir, "--prompts", prompts.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("a YAML list of prompt strings"));
    // A 1 MB prompt named by a thousand aliases (1 GB of prompts) is
    // refused as it expands.
    std::fs::write(&prompts, format!("- &p \"{}\"\n{}", "x".repeat(1 << 20), "- *p\n".repeat(1000))).unwrap();
    let out = cli(&["check", dir, "--prompts", prompts.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expand to more than"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Steps past the context could never run: refused before any stage
    // decodes (`--steps 10^12` ran to the context's end for every prompt,
    // backend and stage first). Alternatives past 100 are a usage error.
    let out = cli(&["check", dir, "--steps", "1000000000000"]);
    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("do not fit the context of 256 positions"), "{said}");
    let out = cli(&["check", dir, "--top-k", "1000000000"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("1..=100"), "{}", String::from_utf8_lossy(&out.stderr));

    let empty = tempfile::tempdir().unwrap();
    let out = cli(&["check", empty.path().to_str().unwrap(), "--format", "json"]);
    assert_eq!(out.status.code(), Some(2));
    let p = &json_of(&out)["packages"][0];
    assert_eq!(p["verdict"], "could-not-run");
    assert!(p["results"][0]["summary"].as_str().unwrap().contains("PKG001"), "{p}");

    let broken = built("tiny-llama-gqa", "decomposed");
    std::fs::write(broken.path().join("model.onnx"), b"not an onnx file").unwrap();
    let out = cli(&["check", broken.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("FAIL validate::"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// `--golden DIR`: the first run records each prompt's greedy run from ONNX
/// Runtime (the repository's golden format), the next holds every backend
/// to it and passes; a record whose tokens or logits were changed is a
/// mismatch (exit 1) naming what differs, and one that cannot be read is
/// exit 2.
#[test]
fn check_records_goldens_then_holds_every_backend_to_them() {
    let ours = built("tiny-llama-gqa", "decomposed");
    let dir = ours.path().to_str().unwrap();
    let golden = ours.path().join("golden");
    let golden_arg = golden.to_str().unwrap();
    let prompts = ours.path().join("prompts.yaml");
    std::fs::write(&prompts, "- The capital of France is\n- 'def main():'\n").unwrap();
    let run = || {
        cli(&[
            "check",
            dir,
            "--prompts",
            prompts.to_str().unwrap(),
            "--steps",
            "4",
            "--golden",
            golden_arg,
            "--format",
            "json",
        ])
    };
    let summaries = |out: &Output| -> Vec<String> {
        json_of(out)["packages"][0]["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["suite"] == "golden")
            .map(|r| format!("{} {}", r["status"], r["summary"]))
            .collect()
    };
    let first = run();
    assert_eq!(first.status.code(), Some(0));
    let recorded = summaries(&first);
    let backends = 1 + onnx_genai_conformance::check::native_backends().len();
    assert_eq!(recorded.len(), 2 * backends, "every backend on two prompts: {recorded:?}");
    assert!(recorded[0].contains("recorded") && recorded[1].contains("matches"), "{recorded:?}");
    let snaps: Vec<_> = std::fs::read_dir(&golden).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(snaps.len(), 2, "one record per prompt: {snaps:?}");
    let snap =
        snaps.iter().find(|p| p.file_name().unwrap().to_str().unwrap().ends_with("__prompt0.snap")).unwrap().clone();
    let file = snap.file_name().unwrap().to_str().unwrap().to_string();
    assert!(file.starts_with("tiny-llama-gqa__") && !file.contains(".."), "named by package and directory: {file}");
    let text = std::fs::read_to_string(&snap).unwrap();
    assert!(text.starts_with("---\nsource: onnx-genai check\n---\npackage: tiny-llama-gqa\n"), "{text}");
    assert!(text.contains("top5_logits:\n  - step: 0\n"), "{text}");

    let again = run();
    assert_eq!(again.status.code(), Some(0));
    assert!(
        summaries(&again).iter().all(|s| s.contains("\"passed\"") && s.contains("matches")),
        "{:?}",
        summaries(&again)
    );

    // Another first token in the record: every backend differs from it.
    let token_line = text.lines().find(|l| l.starts_with("token_ids: [")).unwrap();
    let first: u32 = token_line["token_ids: [".len()..].split(',').next().unwrap().parse().unwrap();
    let changed = token_line.replacen(&format!("[{first},"), &format!("[{},", first + 1), 1);
    assert_ne!(changed, token_line);
    std::fs::write(&snap, text.replace(token_line, &changed)).unwrap();
    let out = run();
    assert_eq!(out.status.code(), Some(1));
    assert!(summaries(&out)[0].contains("differs from the snapshot"), "{:?}", summaries(&out));

    // A record of another number of steps is another question, not a
    // mismatch of the model: exit 2, naming the steps it holds (was exit 1,
    // "differs").
    std::fs::write(&snap, text.replace(token_line, &token_line.replacen("[", "[1, ", 1))).unwrap();
    let out = run();
    assert_eq!(out.status.code(), Some(2), "{:?}", summaries(&out));
    assert!(summaries(&out)[0].contains("records 5 steps, this check decodes 4"), "{:?}", summaries(&out));

    // A recorded logit moved by 0.1: outside the f32 tier.
    let top = text.lines().find(|l| l.trim_start().starts_with("top5: [[")).unwrap();
    let value: String = top.split(", ").nth(1).unwrap().trim_end_matches(']').to_string();
    let moved = format!("{:.5}", value.parse::<f32>().unwrap() + 0.1);
    std::fs::write(&snap, text.replacen(top, &top.replacen(&value, &moved, 1), 1)).unwrap();
    let out = run();
    assert_eq!(out.status.code(), Some(1));
    assert!(summaries(&out)[0].contains("the tolerance"), "{:?}", summaries(&out));

    std::fs::write(&snap, text.replacen("top5: [[", "top5: nonsense [[", 1)).unwrap();
    assert_eq!(run().status.code(), Some(2));

    // A record that is there but cannot be read (not UTF-8) could not be
    // judged: exit 2, not a mismatch of the model (exit 1, before).
    std::fs::write(&snap, [0xff, 0xfe, 0xfd]).unwrap();
    let out = run();
    assert_eq!(out.status.code(), Some(2), "{:?}", summaries(&out));
    assert!(summaries(&out)[0].contains("cannot be read"), "{:?}", summaries(&out));
    // No partial file is left beside the records.
    assert!(std::fs::read_dir(&golden).unwrap().all(|e| !e.unwrap().path().to_string_lossy().ends_with(".partial")));
}

/// Golden records are named by manifest name and directory name, so
/// `a/model` and `b/model` of one model would share them: the second is
/// not judged against the first's records (a mismatch of two packages,
/// reported as the model's), its golden stage could not run, naming the
/// first (exit 2). The same directory given twice is one package and is
/// judged against its own records.
#[test]
fn two_packages_never_share_golden_records() {
    let root = tempfile::tempdir().unwrap();
    let spec = onnx_genai_test_support::spec_path("tiny-llama-gqa");
    let (a, b) = (root.path().join("a/model"), root.path().join("b/model"));
    for dir in [&a, &b] {
        let out = cli(&["build", spec.to_str().unwrap(), dir.to_str().unwrap(), "--variant", "decomposed"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let golden = root.path().join("golden");
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let out = cli(&["check", a, b, a, "--steps", "2", "--golden", golden.to_str().unwrap(), "--format", "json"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
    let report = json_of(&out);
    let golden_of = |p: usize| -> Vec<(String, String)> {
        report["packages"][p]["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["suite"] == "golden")
            .map(|r| (r["status"].as_str().unwrap().to_string(), r["summary"].as_str().unwrap().to_string()))
            .collect()
    };
    assert!(golden_of(0).iter().all(|(status, _)| status == "passed"), "{:?}", golden_of(0));
    let second = golden_of(1);
    assert_eq!(second.len(), 1, "{second:?}");
    assert_eq!(second[0].0, "failed");
    assert!(second[0].1.contains("would be named as") && second[0].1.contains("a/model"), "{second:?}");
    let again = golden_of(2);
    assert!(!again.is_empty() && again.iter().all(|(s, m)| s == "passed" && m.contains("matches")), "{again:?}");
    assert_eq!(report["packages"][2]["verdict"], "pass");
}
