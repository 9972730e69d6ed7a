//! Golden outputs: per package and variant — one record every backend is
//! held to — the greedy token ids, the decoded text and the top-5 logits at
//! chosen steps, rounded (never raw floats). Stored as insta snapshots under
//! `golden/decode/`, recorded from ONNX Runtime.
//!
//! A run passes when its token ids, text and every other line are the
//! record's exactly, and each recorded top-5 logit is matched, by token id,
//! within the check's tolerance tier (plus half a unit of the rounding): so
//! ONNX Runtime and native-cpu must agree on what they generate, and their
//! logits are judged as parity judges them, not by rounded digits that a
//! last-bit difference can flip.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use onnx_genai_backend::Decoder;
use onnx_genai_package::Package;

use crate::cases::{Check, GoldenFile};
use crate::tolerance::Tier;
use crate::HarnessError;

pub const SNAPSHOT_DIR: &str = "golden/decode";

/// The snapshot a golden check is held to: one per package and variant,
/// whatever the backend.
pub fn snapshot_name(check: &Check) -> String {
    format!("{}__{}", check.package, check.variant.name())
}

pub fn snapshot_path(root: &Path, check: &Check) -> PathBuf {
    root.join(SNAPSHOT_DIR).join(format!("{}.snap", snapshot_name(check)))
}

/// One greedy run: the rendered record and the full logits at the steps
/// whose top 5 it keeps (to judge the committed ids by).
pub struct Recording {
    pub text: String,
    logits: Vec<(usize, Vec<f32>)>,
}

fn top5(logits: &[f32], decimals: u32) -> String {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
    idx.iter().take(5).map(|i| format!("[{i}, {}]", rounded(logits[*i], decimals))).collect::<Vec<_>>().join(", ")
}

fn rounded(v: f32, decimals: u32) -> String {
    let p = 10f64.powi(decimals as i32);
    // `+ 0.0` turns a rounded -0 into 0.
    let v = (f64::from(v) * p).round() / p + 0.0;
    format!("{v:.prec$}", prec = decimals as usize)
}

/// Greedy-decodes and renders the golden record of `name` (a package) in
/// `variant` (an export form, or how the user's package is named).
pub fn record(
    name: &str,
    variant: &str,
    package: &Package,
    backend: &mut Decoder,
    prompt: &[u32],
    g: &GoldenFile,
) -> Result<Recording, HarnessError> {
    let run = |e: onnx_genai_backend::BackendError| HarnessError::Backend(e.to_string());
    backend.reset();
    let mut logits = backend.forward(prompt).map_err(run)?;
    let mut tokens = Vec::new();
    let mut top = String::new();
    let mut kept = Vec::new();
    for step in 0..g.max_new_tokens {
        if g.top5_at_steps.contains(&step) {
            let _ = writeln!(top, "  - step: {step}\n    top5: [{}]", top5(&logits, g.decimals));
            kept.push((step, logits.clone()));
        }
        let next = crate::tolerance::top2(&logits).0;
        tokens.push(next);
        if step + 1 < g.max_new_tokens {
            logits = backend.forward(&[next]).map_err(run)?;
        }
    }
    let text = onnx_genai_package::decode(package.tokenizer(), &tokens, false)
        .map_err(|e| HarnessError::Build(format!("tokenizer: {e}")))?;
    let mut out = String::new();
    let _ = writeln!(out, "package: {name}\nvariant: {variant}");
    let _ = writeln!(out, "prompt: {:?}\nprompt_tokens: {prompt:?}", g.prompt);
    let _ = writeln!(out, "token_ids: {tokens:?}\ntext: {text:?}\ntop5_logits:\n{top}");
    Ok(Recording { text: out, logits: kept })
}

#[derive(Debug, PartialEq)]
pub enum Judgement {
    Matches,
    Missing,
    /// A line other than a top-5 line differs (token ids, text, ...).
    Differs {
        line: usize,
        committed: String,
        current: String,
    },
    /// A recorded top-5 logit is outside the tier.
    OutOfTier {
        step: usize,
        token: usize,
        committed: f32,
        current: f32,
        ratio: f32,
    },
    /// The committed snapshot cannot be read as a golden record.
    Malformed {
        line: usize,
        reason: String,
    },
}

impl std::fmt::Display for Judgement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Judgement::Matches => write!(f, "matches the committed snapshot"),
            Judgement::Missing => write!(f, "no committed snapshot"),
            Judgement::Differs { line, committed, current } => {
                write!(f, "differs from the snapshot at line {line}: committed `{committed}`, now `{current}`")
            }
            Judgement::OutOfTier { step, token, committed, current, ratio } => write!(
                f,
                "top-5 logit of token {token} at step {step} is {current}, the snapshot's {committed} ({ratio:.1}x the tolerance)"
            ),
            Judgement::Malformed { line, reason } => write!(f, "the snapshot is malformed at line {line}: {reason}"),
        }
    }
}

/// The snapshot file of a record: insta's metadata header, then the body
/// [`judge`] reads (what `onnx-genai check --golden` writes).
pub fn snapshot_file(source: &str, rec: &Recording) -> String {
    format!("---\nsource: {source}\n---\n{}", rec.text)
}

/// Judges `rec` against the committed insta snapshot at `path` (the body
/// after its metadata header) at `tier`; `decimals` is the rounding of the
/// committed logits.
pub fn judge(path: &Path, rec: &Recording, tier: Tier, decimals: u32) -> Judgement {
    let file = match std::fs::read_to_string(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Judgement::Missing,
        // Not UTF-8, a directory, no permission: a record that is there
        // but cannot be judged, never a mismatch of the model.
        Err(e) => return Judgement::Malformed { line: 0, reason: format!("it cannot be read: {e}") },
    };
    judge_text(file.splitn(3, "---\n").nth(2).unwrap_or(""), rec, tier, decimals)
}

fn judge_text(committed: &str, rec: &Recording, tier: Tier, decimals: u32) -> Judgement {
    let (a, b): (Vec<&str>, Vec<&str>) =
        (committed.trim_end().lines().collect(), rec.text.trim_end().lines().collect());
    let (atol, rtol) = tier.bounds();
    let slack = 0.5 * 10f32.powi(-(decimals as i32));
    let mut step = None;
    for i in 0..a.len().max(b.len()) {
        let (c, n) = (a.get(i).copied().unwrap_or(""), b.get(i).copied().unwrap_or(""));
        let differs = || Judgement::Differs { line: i + 1, committed: c.into(), current: n.into() };
        if let Some(s) = c.trim_start().strip_prefix("- step: ") {
            step = s.trim().parse::<usize>().ok();
        }
        let (Some(pairs), true) = (c.trim_start().strip_prefix("top5: "), n.trim_start().starts_with("top5: ")) else {
            if c != n {
                return differs();
            }
            continue;
        };
        let malformed = |reason: &str| Judgement::Malformed { line: i + 1, reason: reason.into() };
        let Some(logits) = step.and_then(|s| rec.logits.iter().find(|(at, _)| *at == s)).map(|(_, l)| l) else {
            return malformed("a top5 line outside a recorded step");
        };
        let Some(pairs) = parse_pairs(pairs) else { return malformed("top5 is not a list of [token, logit] pairs") };
        for (token, value) in pairs {
            let Some(&current) = logits.get(token) else { return malformed("a token id outside the vocabulary") };
            if current == value {
                // (The same infinity too, whose difference is NaN.)
                continue;
            }
            let ratio = (current - value).abs() / (atol + rtol * value.abs() + slack);
            if ratio.is_nan() || ratio > 1.0 {
                return Judgement::OutOfTier { step: step.unwrap_or(0), token, committed: value, current, ratio };
            }
        }
    }
    Judgement::Matches
}

/// `[[id, logit], [id, logit], ...]`.
fn parse_pairs(s: &str) -> Option<Vec<(usize, f32)>> {
    let inner = s.trim().strip_prefix('[')?.strip_suffix(']')?;
    inner
        .split("],")
        .map(|pair| {
            let pair = pair.trim().trim_start_matches('[').trim_end_matches(']');
            let (id, v) = pair.split_once(',')?;
            Some((id.trim().parse().ok()?, v.trim().parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recording(logits: Vec<f32>) -> Recording {
        let text = format!(
            "package: p\nvariant: v\ntoken_ids: [1, 2]\ntext: \"ab\"\ntop5_logits:\n  - step: 0\n    top5: [{}]\n",
            top5(&logits, 3)
        );
        Recording { text, logits: vec![(0, logits)] }
    }

    /// Pins issue 21's cross-backend goldens: one record for every backend,
    /// tokens and text exact, logits judged at the tier by token id, so a
    /// last-digit rounding flip or a reordering inside the tier passes, and
    /// a logit outside the tier or another token fails.
    #[test]
    fn goldens_hold_tokens_exactly_and_logits_at_the_tier() {
        let reference = recording(vec![2.0, 1.5, 1.4995, 0.25, -1.0, -3.0]);
        let body = reference.text.clone();
        assert_eq!(judge_text(&body, &reference, Tier::F32, 3), Judgement::Matches);
        // 1.4995 and 1.5 swap ranks and 1.5 rounds across a digit: inside
        // f32's tier (1e-4 + 1e-4 * 1.5) both are fine.
        let near = recording(vec![2.0, 1.4999, 1.5001, 0.25, -1.0, -3.0]);
        assert_eq!(judge_text(&body, &near, Tier::F32, 3), Judgement::Matches);
        let off = recording(vec![2.0, 1.5, 1.4995, 0.2515, -1.0, -3.0]);
        assert!(matches!(judge_text(&body, &off, Tier::F32, 3), Judgement::OutOfTier { step: 0, token: 3, .. }));
        assert_eq!(judge_text(&body, &off, Tier::F16, 3), Judgement::Matches);
        let mut other = recording(vec![2.0, 1.5, 1.4995, 0.25, -1.0, -3.0]);
        other.text = other.text.replace("token_ids: [1, 2]", "token_ids: [1, 3]");
        assert!(matches!(judge_text(&body, &other, Tier::F16, 3), Judgement::Differs { line: 3, .. }));
        let garbled = body.replace("top5: [[0,", "top5: [[zero,");
        assert!(matches!(judge_text(&garbled, &reference, Tier::F32, 3), Judgement::Malformed { .. }));
    }

    /// A recorded logit of minus infinity (a masked token) matches the
    /// same now: their difference is NaN, which failed the record against
    /// itself. A record that exists but cannot be read is malformed (the
    /// check could not run), not missing, which `check` counted as a
    /// mismatch of the model.
    #[test]
    fn masked_logits_match_and_unreadable_records_are_malformed() {
        let masked = recording(vec![2.0, 1.5, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, -3.0]);
        assert!(masked.text.contains("-inf"), "{}", masked.text);
        assert_eq!(judge_text(&masked.text.clone(), &masked, Tier::F32, 3), Judgement::Matches);

        let dir = tempfile::tempdir().unwrap();
        assert_eq!(judge(&dir.path().join("none.snap"), &masked, Tier::F32, 3), Judgement::Missing);
        let not_text = dir.path().join("bytes.snap");
        std::fs::write(&not_text, [0xff, 0xfe, 0x00]).unwrap();
        assert!(matches!(judge(&not_text, &masked, Tier::F32, 3), Judgement::Malformed { line: 0, .. }));
        assert!(matches!(judge(dir.path(), &masked, Tier::F32, 3), Judgement::Malformed { line: 0, .. }));
    }
}
