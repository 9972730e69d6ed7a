//! Running checks: packages are built once per process, backends are
//! opened per check, and every check ends in a [`CheckResult`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use onnx_genai_backend::{BackendError, DecodeBackend};
use onnx_genai_build::Variant;
use onnx_genai_package::Package;
use serde::Serialize;

use crate::cases::{Check, CheckKind, GoldenFile, PromptDef, Suite};
use crate::parity::{self, Divergence};
use crate::tolerance::Tier;
use crate::HarnessError;

type Built = Arc<OnceLock<Result<PathBuf, String>>>;

/// Where packages are built and how many threads backends use.
pub struct Context {
    pub root: PathBuf,
    pub packages_dir: PathBuf,
    pub threads: usize,
    built: Mutex<HashMap<(String, Variant), Built>>,
}

impl Context {
    pub fn new(root: &Path, packages_dir: &Path, threads: usize) -> Self {
        Self { root: root.into(), packages_dir: packages_dir.into(), threads, built: Mutex::new(HashMap::new()) }
    }

    /// Builds (once per process) and opens `package` in `variant`.
    pub fn package(&self, package: &str, variant: Variant) -> Result<Package, HarnessError> {
        let cell = {
            let mut map = self.built.lock().unwrap_or_else(|p| p.into_inner());
            map.entry((package.to_string(), variant)).or_default().clone()
        };
        let dir = cell
            .get_or_init(|| {
                let spec = onnx_genai_build::read_spec(&self.root.join("packages").join(package).join("spec.yaml"))
                    .map_err(|e| e.to_string())?;
                let dir = self.packages_dir.join(package).join(variant.name());
                onnx_genai_build::build_variant(&spec, variant, &dir).map_err(|e| e.to_string())?;
                Ok(dir)
            })
            .clone()
            .map_err(HarnessError::Build)?;
        Package::open(&dir).map_err(|e| HarnessError::Build(e.to_string()))
    }
}

/// Opens `backend` on `package`.
pub fn open_backend(backend: &str, package: &Package, threads: usize) -> Result<Box<dyn DecodeBackend>, BackendError> {
    match backend {
        "ort" => Ok(Box::new(onnx_genai_ort::OrtDecoder::load(package, threads)?)),
        "native-cpu" => Ok(Box::new(onnx_genai_native::NativeDecoder::load(package, threads)?)),
        other => Err(BackendError::Load {
            backend: "harness",
            what: other.into(),
            reason: "unknown backend (ort, native-cpu)".into(),
        }),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Passed,
    Failed,
}

#[derive(Clone, Debug, Serialize)]
pub struct CheckResult {
    pub name: String,
    pub suite: &'static str,
    pub package: String,
    pub variant: &'static str,
    pub backend: String,
    pub status: Status,
    /// One line: what was measured, or where and how it failed.
    pub summary: String,
    pub seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parity: Option<parity::ParityOutcome>,
    /// Golden checks: the text to snapshot.
    #[serde(skip)]
    pub golden_text: Option<String>,
}

/// Runs one check. Never panics on a failing backend: failures are results.
pub fn run_check(check: &Check, ctx: &Context) -> CheckResult {
    let started = Instant::now();
    let mut result = CheckResult {
        name: check.name.clone(),
        suite: check.suite.name(),
        package: check.package.clone(),
        variant: check.variant.name(),
        backend: check.backend.clone(),
        status: Status::Failed,
        summary: String::new(),
        seconds: 0.0,
        parity: None,
        golden_text: None,
    };
    let outcome = match &check.kind {
        CheckKind::Parity { prompt, steps, tier } => run_parity(check, ctx, prompt, *steps, *tier, &mut result),
        CheckKind::Golden(g) => run_golden(check, ctx, g, &mut result),
    };
    if let Err(e) = outcome {
        result.status = Status::Failed;
        result.summary = e.to_string();
    }
    result.seconds = started.elapsed().as_secs_f64();
    result
}

fn encode(package: &Package, text: &str) -> Result<Vec<u32>, HarnessError> {
    let enc = package.tokenizer().encode(text, false).map_err(|e| HarnessError::Build(format!("tokenizer: {e}")))?;
    Ok(enc.get_ids().to_vec())
}

fn run_parity(
    check: &Check,
    ctx: &Context,
    prompt: &PromptDef,
    steps: usize,
    tier: Tier,
    result: &mut CheckResult,
) -> Result<(), HarnessError> {
    let package = ctx.package(&check.package, check.variant)?;
    let tokens = encode(&package, &prompt.text)?;
    let mut reference = open_backend(crate::cases::REFERENCE, &package, ctx.threads)?;
    let mut candidate = open_backend(&check.backend, &package, ctx.threads)?;
    let out = parity::run(reference.as_mut(), candidate.as_mut(), &tokens, steps, tier);
    result.summary = match &out.divergence {
        None => {
            result.status = Status::Passed;
            format!(
                "{} steps, tier {}: max |d| {:.2e} ({:.1}% of tolerance), greedy tokens identical, min top-2 gap {:.2e}",
                out.steps,
                tier.name(),
                out.worst.max_abs,
                100.0 * out.worst.worst_ratio,
                out.min_top2_gap
            )
        }
        Some(Divergence::Logits { step, deviation }) => format!(
            "logits out of tier {} at step {step}: max |d| {:.3e} at token {} ({:.1}x the tolerance)",
            tier.name(),
            deviation.max_abs,
            deviation.worst_index,
            deviation.worst_ratio
        ),
        Some(Divergence::Token { step, reference, candidate, top2_gap, max_abs, near_tie }) => format!(
            "{}greedy token differs at step {step}: ort {reference}, {} {candidate}; reference top-2 gap {top2_gap:.3e}, max |d| {max_abs:.3e}",
            if *near_tie { "NEAR-TIE: " } else { "" },
            check.backend
        ),
        Some(Divergence::Error { step, backend, message }) => format!("{backend} failed at step {step}: {message}"),
    };
    result.parity = Some(out);
    Ok(())
}

fn run_golden(check: &Check, ctx: &Context, g: &GoldenFile, result: &mut CheckResult) -> Result<(), HarnessError> {
    let package = ctx.package(&check.package, check.variant)?;
    let tokens = encode(&package, &g.prompt)?;
    let mut backend = open_backend(&check.backend, &package, ctx.threads)?;
    let text = crate::golden::record(check, &package, backend.as_mut(), &tokens, g)?;
    result.status = Status::Passed;
    result.summary = "recorded; compared with the committed snapshot".into();
    result.golden_text = Some(text);
    Ok(())
}

impl Suite {
    /// Checks of this suite run in this order within a conformance run.
    pub fn order(self) -> u8 {
        match self {
            Suite::Parity => 0,
            Suite::Golden => 1,
        }
    }
}
