//! Replays every committed fuzz input — the seed corpora
//! (`fuzz/corpus/<target>/`) and the findings kept as regressions
//! (`fuzz/regressions/<target>/`) — through the same targets the libFuzzer
//! binaries run, so a finding once fixed stays fixed on the stable
//! toolchain in CI (issue 20: "a CI lane replays the corpora").

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use onnx_genai_fuzz::{run, Target};

fn inputs(target: Target) -> Vec<PathBuf> {
    let fuzz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut files = Vec::new();
    for kind in ["corpus", "regressions"] {
        let dir = fuzz.join(kind).join(target.name());
        if let Ok(entries) = std::fs::read_dir(&dir) {
            files.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_file()));
        }
    }
    files.sort();
    files
}

/// Every input of `target` runs without a finding; a corpus that went
/// missing fails too (a replay of nothing proves nothing).
fn replay(target: Target) {
    let files = inputs(target);
    assert!(!files.is_empty(), "no committed inputs for fuzz target `{}`", target.name());
    let mut failed = Vec::new();
    for path in &files {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if catch_unwind(AssertUnwindSafe(|| run(target, &data))).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(failed.is_empty(), "{} of {} inputs failed: {failed:#?}", failed.len(), files.len());
}

#[test]
fn replay_package() {
    replay(Target::Package);
}

#[test]
fn replay_onnx() {
    replay(Target::Onnx);
}

#[test]
fn replay_gguf() {
    replay(Target::Gguf);
}

#[test]
fn replay_chat() {
    replay(Target::Chat);
}

#[test]
fn replay_http() {
    replay(Target::Http);
}
