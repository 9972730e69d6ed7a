//! Running checks: packages are built once per process, backends are
//! opened per check, and every check ends in a [`CheckResult`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use onnx_genai_backend::{BackendError, Decoder};
use onnx_genai_build::{Spec, Variant};
use onnx_genai_engine::BackendKind;
use onnx_genai_package::{ElementType, Package};
use serde::Serialize;

use crate::batch;
use crate::cases::{Check, CheckKind, GoldenFile, PromptDef, Suite};
use crate::golden::Judgement;
use crate::parity::{self, Divergence};
use crate::real::RealModel;
use crate::tolerance::Tier;
use crate::HarnessError;

type Built = Arc<OnceLock<Result<PathBuf, String>>>;
type RealSpec = Arc<OnceLock<Result<Spec, String>>>;

/// Where packages are built and how many threads backends use.
pub struct Context {
    pub root: PathBuf,
    pub packages_dir: PathBuf,
    pub threads: usize,
    built: Mutex<HashMap<(String, Variant), Built>>,
    real: Vec<RealModel>,
    /// Real models' weights, read once per process (by model name).
    real_specs: Mutex<HashMap<String, RealSpec>>,
}

impl Context {
    pub fn new(root: &Path, packages_dir: &Path, threads: usize) -> Self {
        Self {
            root: root.into(),
            packages_dir: packages_dir.into(),
            threads,
            built: Mutex::new(HashMap::new()),
            real: RealModel::load_all(root).unwrap_or_default(),
            real_specs: Mutex::new(HashMap::new()),
        }
    }

    /// For a real model's reduced-precision export, the f32 decomposed
    /// export of the same model (the arbiter of near-ties).
    pub fn f32_sibling(&self, package: &str) -> Option<(String, Variant)> {
        let model = self.real.iter().find(|m| m.export_for(package).is_some())?;
        let export = model.export_for(package)?;
        let f32 = model.exports.iter().find(|e| e.dtype == ElementType::F32 && e.variant == Variant::Decomposed)?;
        (export.name != f32.name).then(|| (model.package(f32), f32.variant))
    }

    pub fn is_real(&self, package: &str) -> bool {
        self.real.iter().any(|m| m.export_for(package).is_some())
    }

    /// Builds `package` (a shipped spec, or an export of a real model) in
    /// `variant` into `dir`.
    fn build(&self, package: &str, variant: Variant, dir: &Path) -> Result<(), String> {
        let spec_path = self.root.join("packages").join(package).join("spec.yaml");
        if spec_path.is_file() {
            let spec = onnx_genai_build::read_spec(&spec_path).map_err(|e| e.to_string())?;
            return onnx_genai_build::build_variant(&spec, variant, dir).map_err(|e| e.to_string());
        }
        let (model, export) = self
            .real
            .iter()
            .find_map(|m| m.export_for(package).map(|e| (m, e)))
            .filter(|(_, e)| e.variant == variant)
            .ok_or_else(|| {
                format!("no package `{package}` ({}) under packages/ or conformance/real/", variant.name())
            })?;
        let cell = {
            let mut map = self.real_specs.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(model.name.clone()).or_default().clone()
        };
        let base = cell.get_or_init(|| model.load_spec(&self.root.join("target")).map_err(|e| e.to_string()));
        let base = base.as_ref().map_err(Clone::clone)?;
        model.build(base, export, dir).map_err(|e| e.to_string())
    }

    /// Builds (once per process) and opens `package` in `variant`.
    pub fn package(&self, package: &str, variant: Variant) -> Result<Package, HarnessError> {
        let dir = self.package_dir(package, variant)?;
        Package::open(&dir).map_err(|e| HarnessError::Build(e.to_string()))
    }

    /// Builds (once per process) `package` in `variant`; its directory.
    pub fn package_dir(&self, package: &str, variant: Variant) -> Result<PathBuf, HarnessError> {
        let cell = {
            let mut map = self.built.lock().unwrap_or_else(|p| p.into_inner());
            map.entry((package.to_string(), variant)).or_default().clone()
        };
        let dir = cell
            .get_or_init(|| {
                // A real model's export is one package of one variant.
                let dir = if self.is_real(package) {
                    self.packages_dir.join(package)
                } else {
                    self.packages_dir.join(package).join(variant.name())
                };
                self.build(package, variant, &dir)?;
                Ok(dir)
            })
            .clone()
            .map_err(HarnessError::Build)?;
        Ok(dir)
    }
}

/// Opens `backend` (a name [`BackendKind`] knows) on `package`: one
/// sequence on a freshly loaded model.
pub fn open_backend(backend: &str, package: &Package, threads: usize) -> Result<Decoder, BackendError> {
    let kind: BackendKind = backend.parse().map_err(|reason: String| BackendError::Load {
        backend: "harness",
        what: backend.into(),
        reason,
    })?;
    kind.decoder(package, threads)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Passed,
    Failed,
    /// Not run, and the report says why (a real model whose wheel could not
    /// be fetched).
    Skipped,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<batch::BatchOutcome>,
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
        batch: None,
        golden_text: None,
    };
    let outcome = match &check.kind {
        CheckKind::Parity { prompt, steps, tier } => run_parity(check, ctx, prompt, *steps, *tier, &mut result),
        CheckKind::Batch { prompts, steps, tier } => run_batch(check, ctx, prompts, *steps, *tier, &mut result),
        CheckKind::Golden { file, tier } => run_golden(check, ctx, file, *tier, &mut result),
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
    let mut out = parity::run(&mut reference, &mut candidate, &tokens, steps, tier);
    if let (Some(Divergence::Token { reference: r, candidate: c, near_tie: true, .. }), Some((f32_package, variant))) =
        (&out.divergence, ctx.f32_sibling(&check.package))
    {
        let f32_package = ctx.package(&f32_package, variant)?;
        let mut f32_backend = open_backend(crate::cases::REFERENCE, &f32_package, ctx.threads)?;
        out.arbitration = Some(parity::arbitrate(&mut f32_backend, &tokens, &out.tokens, *r, *c)?);
    }
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
        Some(d) => format!(
            "{}{}",
            parity::describe(d, tier, "ort", &check.backend),
            match &out.arbitration {
                Some(a) => format!(
                    "; the f32 export decides: it picks {} (sides with {}; f32 margin {:.3e})",
                    a.choice,
                    if a.sides_with == "reference" {
                        "ort"
                    } else if a.sides_with == "candidate" {
                        check.backend.as_str()
                    } else {
                        "neither"
                    },
                    a.margin
                ),
                None => String::new(),
            }
        ),
    };
    result.parity = Some(out);
    Ok(())
}

fn run_batch(
    check: &Check,
    ctx: &Context,
    prompts: &[PromptDef],
    steps: usize,
    tier: Tier,
    result: &mut CheckResult,
) -> Result<(), HarnessError> {
    let package = ctx.package(&check.package, check.variant)?;
    let tokens: Vec<Vec<u32>> = prompts.iter().map(|p| encode(&package, &p.text)).collect::<Result<_, _>>()?;
    let prompts = batch::mixed_lengths(&tokens);
    let mut alone = open_backend(&check.backend, &package, ctx.threads)?;
    let kind: BackendKind = check.backend.parse().map_err(HarnessError::Backend)?;
    let model = kind.load(&package, ctx.threads)?;
    let out = batch::run(&mut alone, &model, &prompts, steps, tier);
    let chunked = batch::chunked(&mut alone, tokens.first().map_or(&[][..], |t| &t[..]), tier);
    let lengths: Vec<String> = prompts.iter().map(|p| p.len().to_string()).collect();
    let chunks: Vec<String> = batch::CHUNKS.iter().map(|c| c.to_string()).collect();
    result.summary = match (&out.divergence, &chunked.divergence) {
        (None, _) if out.widest < 2 => format!("the batch never held two sequences ({} model steps)", out.model_steps),
        (None, None) => {
            result.status = Status::Passed;
            format!(
                "{} sequences (prompt tokens {}), joining every {} steps, {} model steps, widest {}: greedy tokens as each alone, logits within tier {}: max |d| {:.2e} ({:.1}% of tolerance); a prompt in chunks of {} tokens as one-shot prefills of the same prefixes: max |d| {:.2e} ({:.1}%)",
                out.sequences,
                lengths.join("/"),
                batch::JOIN_EVERY,
                out.model_steps,
                out.widest,
                tier.name(),
                out.worst.max_abs,
                100.0 * out.worst.worst_ratio,
                chunks.join("/"),
                chunked.worst.max_abs,
                100.0 * chunked.worst.worst_ratio
            )
        }
        (Some((i, d)), _) => {
            format!(
                "sequence {i} ({} prompt tokens): {}",
                prompts[*i].len(),
                parity::describe(d, tier, "alone", &format!("batched on {}", check.backend))
            )
        }
        (None, Some(d)) => format!(
            "a prompt in chunks of {} tokens against one-shot prefills of the same prefixes (step = chunk): {}",
            chunks.join("/"),
            parity::describe(d, tier, "one-shot", &format!("chunked on {}", check.backend))
        ),
    };
    result.batch = Some(out);
    Ok(())
}

fn run_golden(
    check: &Check,
    ctx: &Context,
    g: &GoldenFile,
    tier: Tier,
    result: &mut CheckResult,
) -> Result<(), HarnessError> {
    let package = ctx.package(&check.package, check.variant)?;
    let tokens = encode(&package, &g.prompt)?;
    let mut backend = open_backend(&check.backend, &package, ctx.threads)?;
    let recording = crate::golden::record(&check.package, check.variant.name(), &package, &mut backend, &tokens, g)?;
    let path = crate::golden::snapshot_path(&ctx.root, check);
    let judgement = crate::golden::judge(&path, &recording, tier, g.decimals);
    result.status = if judgement == Judgement::Matches { Status::Passed } else { Status::Failed };
    result.summary = match judgement {
        Judgement::Matches => format!("matches {} (logits at tier {})", path.display(), tier.name()),
        Judgement::Missing => format!(
            "no snapshot at {}; record it from ONNX Runtime with `cargo test -p onnx-genai-conformance --test conformance -- golden::{}::{}::ort` then `cargo insta review`",
            path.display(),
            check.package,
            check.variant.name()
        ),
        other => format!(
            "{other} ({}); review with `cargo test -p onnx-genai-conformance --test conformance` + `cargo insta review`",
            path.display()
        ),
    };
    result.golden_text = Some(recording.text);
    Ok(())
}

impl Suite {
    /// Checks of this suite run in this order within a conformance run.
    pub fn order(self) -> u8 {
        match self {
            Suite::Parity => 0,
            Suite::Batch => 1,
            Suite::Golden => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Near-ties in a real model's f16 or int4 export are arbitrated by its
    /// f32 export; the f32 export itself and tiny packages have no arbiter.
    #[test]
    fn reduced_precision_real_exports_have_an_f32_arbiter() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let ctx = Context::new(&root, Path::new("unused"), 1);
        let f32 = Some(("smollm2-135m-instruct-f32".to_string(), Variant::Decomposed));
        assert_eq!(ctx.f32_sibling("smollm2-135m-instruct-int4"), f32);
        assert_eq!(ctx.f32_sibling("smollm2-135m-instruct-f16"), f32);
        assert_eq!(ctx.f32_sibling("smollm2-135m-instruct-f32"), None);
        assert_eq!(ctx.f32_sibling("tiny-llama-gqa"), None);
        assert!(ctx.is_real("smollm2-135m-instruct-int4") && !ctx.is_real("tiny-llama-gqa"));
    }
}
