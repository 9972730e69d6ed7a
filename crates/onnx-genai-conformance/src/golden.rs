//! Golden outputs: per package, variant and backend, the greedy token ids,
//! the decoded text and rounded top-5 logits at chosen steps — never raw
//! floats. Stored as insta snapshots under `golden/decode/`; the test
//! harness asserts them with insta (so `cargo insta review` works) and
//! `cargo xtask conformance` compares them with [`compare`].

use std::fmt::Write;
use std::path::{Path, PathBuf};

use onnx_genai_backend::Decoder;
use onnx_genai_package::Package;

use crate::cases::{Check, GoldenFile};
use crate::HarnessError;

pub const SNAPSHOT_DIR: &str = "golden/decode";

/// The snapshot name of a golden check.
/// The backend whose snapshot a check is held to: native-cuda runs
/// native-cpu's plan, so it must reproduce native-cpu's goldens.
fn snapshot_backend(check: &Check) -> &str {
    if check.backend == "native-cuda" {
        "native-cpu"
    } else {
        check.backend.as_str()
    }
}

pub fn snapshot_name(check: &Check) -> String {
    format!("{}__{}__{}", check.package, check.variant.name(), snapshot_backend(check))
}

pub fn snapshot_path(root: &Path, check: &Check) -> PathBuf {
    root.join(SNAPSHOT_DIR).join(format!("{}.snap", snapshot_name(check)))
}

fn top5(logits: &[f32], decimals: u32) -> String {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
    let p = 10f32.powi(decimals as i32);
    idx.iter()
        .take(5)
        .map(|i| {
            // `+ 0.0` turns a rounded -0 into 0.
            let v = (logits[*i] * p).round() / p + 0.0;
            format!("[{i}, {v:.prec$}]", prec = decimals as usize)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Greedy-decodes and renders the golden record.
pub fn record(
    check: &Check,
    package: &Package,
    backend: &mut Decoder,
    prompt: &[u32],
    g: &GoldenFile,
) -> Result<String, HarnessError> {
    let run = |e: onnx_genai_backend::BackendError| HarnessError::Backend(e.to_string());
    backend.reset();
    let mut logits = backend.forward(prompt).map_err(run)?;
    let mut tokens = Vec::new();
    let mut top = String::new();
    for step in 0..g.max_new_tokens {
        if g.top5_at_steps.contains(&step) {
            let _ = writeln!(top, "  - step: {step}\n    top5: [{}]", top5(&logits, g.decimals));
        }
        let next = crate::tolerance::top2(&logits).0;
        tokens.push(next);
        if step + 1 < g.max_new_tokens {
            logits = backend.forward(&[next]).map_err(run)?;
        }
    }
    let text =
        package.tokenizer().decode(&tokens, false).map_err(|e| HarnessError::Build(format!("tokenizer: {e}")))?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "package: {}\nvariant: {}\nbackend: {}",
        check.package,
        check.variant.name(),
        snapshot_backend(check)
    );
    let _ = writeln!(out, "prompt: {:?}\nprompt_tokens: {prompt:?}", g.prompt);
    let _ = writeln!(out, "token_ids: {tokens:?}\ntext: {text:?}\ntop5_logits:\n{top}");
    Ok(out)
}

#[derive(Debug, PartialEq, Eq)]
pub enum Comparison {
    Matches,
    Missing,
    Differs { first_line: usize, committed: String, current: String },
}

/// Compares `text` with the committed insta snapshot at `path` (the body
/// after its metadata header).
pub fn compare(path: &Path, text: &str) -> Comparison {
    let Ok(file) = std::fs::read_to_string(path) else { return Comparison::Missing };
    let body = file.splitn(3, "---\n").nth(2).unwrap_or("");
    let (committed, current) = (body.trim_end(), text.trim_end());
    if committed == current {
        return Comparison::Matches;
    }
    let (a, b): (Vec<&str>, Vec<&str>) = (committed.lines().collect(), current.lines().collect());
    let first = (0..a.len().max(b.len())).find(|i| a.get(*i) != b.get(*i)).unwrap_or(0);
    Comparison::Differs {
        first_line: first + 1,
        committed: a.get(first).unwrap_or(&"").to_string(),
        current: b.get(first).unwrap_or(&"").to_string(),
    }
}
