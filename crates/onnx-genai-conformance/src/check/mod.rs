//! `onnx-genai check DIR...`: the harness's question asked of any package
//! directory, ours or ONNX Runtime GenAI's — does native decode match the
//! reference on it, and where exactly do they part? Stages, in order, each
//! a [`CheckResult`]: validate, load in ONNX Runtime (greedy twice, the
//! same tokens), compile natively (the tier comes from what the compiled
//! plan computes in, unless given), parity of every native backend here
//! against ONNX Runtime on every prompt, then speed side by side. A
//! divergence carries both sides' top-k and margins; one where the
//! reference's own top-2 margin is inside the tier is a near-tie, reported
//! and not failed. The same stages back `cargo xtask conformance`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use onnx_genai_backend::Decoder;
use onnx_genai_engine::{BackendKind, Engine, Flow, GenerateRequest};
use onnx_genai_package::{ElementType, Package};
use serde::Serialize;

use crate::cases::REFERENCE;
use crate::parity::{self, Divergence};
use crate::report::Report;
use crate::run::{open_backend, CheckResult, Status};
use crate::tolerance::Tier;

mod records;

pub use records::write_whole;
use records::{golden_stage, golden_stem};

/// The prompts a check runs when none are given: prose, code, a list and
/// a fact, so a divergence is not one prompt's accident.
pub const DEFAULT_PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Three things to pack for a week of hiking:\n1.",
    "Once upon a time, in a village by the sea, there lived",
];

#[derive(Clone, Debug)]
pub struct CheckOptions {
    pub prompts: Vec<String>,
    /// Greedy decode steps compared after each prompt's prefill.
    pub steps: usize,
    /// The tolerance tier; `None`: from what the compiled plan computes in.
    pub tier: Option<Tier>,
    pub threads: usize,
    /// Alternatives shown on each side of a divergence.
    pub top_k: usize,
    /// Golden records: each prompt's greedy run from ONNX Runtime, recorded
    /// here when missing, and every backend held to it when present.
    pub golden: Option<PathBuf>,
}

impl Default for CheckOptions {
    fn default() -> Self {
        Self {
            prompts: DEFAULT_PROMPTS.map(String::from).to_vec(),
            steps: 16,
            tier: None,
            threads: 2,
            top_k: 5,
            golden: None,
        }
    }
}

/// What a check of one package concluded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Pass,
    /// Greedy tokens parted where the reference itself could not tell the
    /// two apart within the tier: reported, not failed.
    NearTie,
    Mismatch,
    /// A stage before parity failed (validation, loading, compiling) or a
    /// backend errored.
    CouldNotRun,
}

impl Verdict {
    /// The process exit code for CI: 0 pass (near-ties included), 1
    /// mismatch, 2 could not run.
    pub fn exit_code(self) -> i32 {
        match self {
            Verdict::Pass | Verdict::NearTie => 0,
            Verdict::Mismatch => 1,
            Verdict::CouldNotRun => 2,
        }
    }
}

/// One side's likeliest tokens at a divergence: (token, logit, text).
pub type Top = Vec<(u32, f32, String)>;

/// Where a native backend parted from the reference, with what both saw.
#[derive(Clone, Debug, Serialize)]
pub struct Parting {
    pub backend: String,
    pub prompt: usize,
    /// 0 is the prefill's logits, k the k-th decode step's.
    pub step: usize,
    pub near_tie: bool,
    pub reference_top: Top,
    pub candidate_top: Top,
    /// Each side's top-1 minus top-2 logit.
    pub reference_margin: f32,
    pub candidate_margin: f32,
}

/// Speed of one backend on the first prompt.
#[derive(Clone, Debug, Serialize)]
pub struct Speed {
    pub backend: String,
    pub prefill_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens: usize,
    pub decode_tokens_per_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PackageCheck {
    pub dir: PathBuf,
    pub name: String,
    pub tier: Option<Tier>,
    pub verdict: Verdict,
    pub results: Vec<CheckResult>,
    pub partings: Vec<Parting>,
    pub speed: Vec<Speed>,
}

fn result(stage: &'static str, package: &str, backend: &str, started: Instant) -> CheckResult {
    CheckResult {
        name: format!("{stage}::{package}::{backend}"),
        suite: stage,
        package: package.into(),
        variant: "package",
        backend: backend.into(),
        status: Status::Failed,
        summary: String::new(),
        seconds: started.elapsed().as_secs_f64(),
        parity: None,
        batch: None,
        golden_text: None,
    }
}

fn finish(mut r: CheckResult, outcome: Result<String, String>, started: Instant) -> CheckResult {
    (r.status, r.summary) = match outcome {
        Ok(s) => (Status::Passed, s),
        Err(e) => (Status::Failed, e),
    };
    r.seconds = started.elapsed().as_secs_f64();
    r
}

/// Validation of `dir`: passes with its warnings counted, fails on errors
/// (the first three quoted). Also the package's name, when its manifest
/// reads.
pub fn validate_stage(dir: &Path, name: &str) -> (CheckResult, Option<String>) {
    let started = Instant::now();
    let (report, checked) = onnx_genai_package::validate(dir);
    let name = checked.manifest.map_or_else(|| name.to_string(), |m| m.name);
    let warnings = report.diagnostics.len() - report.errors().count();
    let outcome = if report.has_errors() {
        let first: Vec<String> =
            report.errors().take(3).map(|d| format!("{} {}: {}", d.code, d.file, d.message)).collect();
        Err(format!("{} errors ({warnings} warnings): {}", report.errors().count(), first.join("; ")))
    } else {
        Ok(format!("valid ({warnings} warnings)"))
    };
    (finish(result("validate", &name, "-", started), outcome, started), Some(name))
}

/// ONNX Runtime loads the package and greedy decoding through the engine
/// gives the same tokens twice on fresh state.
pub fn ort_load_stage(dir: &Path, name: &str, threads: usize) -> CheckResult {
    let started = Instant::now();
    let outcome = (|| {
        let mut engine = Engine::open(dir, BackendKind::Ort, threads).map_err(|e| e.to_string())?;
        let request = GenerateRequest { max_new_tokens: Some(8), ..GenerateRequest::text("The capital of France is") };
        let mut run = || engine.generate(&request, &mut |_| Flow::Continue).map_err(|e| e.to_string());
        let (first, second) = (run()?, run()?);
        if first.token_ids != second.token_ids {
            return Err(format!(
                "greedy decoding is not deterministic: {:?} then {:?}",
                first.token_ids, second.token_ids
            ));
        }
        if first.token_ids.is_empty() {
            return Err(format!("generated no tokens (finish: {:?})", first.finish_reason));
        }
        Ok(format!("loaded; greedy deterministic: {:?}", first.token_ids))
    })();
    finish(result("ort-load", name, REFERENCE, started), outcome, started)
}

/// The native compiler's plan of the package at `dir`, summarized; and the
/// tier its arithmetic calls for.
pub fn native_compile_stage(dir: &Path, name: &str) -> (CheckResult, Option<Tier>) {
    let started = Instant::now();
    let compiled = Package::open(dir)
        .map_err(|e| e.to_string())
        .and_then(|p| onnx_genai_native::compile_package(&p).map(|plan| (plan, p)).map_err(|e| e.to_string()));
    let (outcome, tier) = match compiled {
        Ok((plan, package)) => {
            let s = &plan.stats;
            let fused: Vec<String> = s.fusions.iter().map(|(k, n)| format!("{k} x{n}")).collect();
            let tier = tier_of(&plan.step_ops(), &package);
            let summary = format!(
                "{} nodes -> {} steps; fused {}; {} values in {} slots",
                s.imported_nodes,
                s.planned_steps,
                fused.join(", "),
                plan.values,
                plan.slots()
            );
            (Ok(summary), Some(tier))
        }
        Err(e) => (Err(e), None),
    };
    (finish(result("native-compile", name, BackendKind::NativeCpu.name(), started), outcome, started), tier)
}

/// The tier a package's arithmetic calls for: int8 activations (4-bit
/// weights at `accuracy_level` 4), 4-bit or 8-bit weights, f16 KV (deep
/// models drift further), else f32. A weight narrowed losslessly (a step
/// named `Linear[f16 as q4]`) counts as what it reproduces, the f16.
pub fn tier_of(step_ops: &[String], package: &Package) -> Tier {
    let any = |kind: &str| step_ops.iter().any(|op| op.contains(&format!("[{kind}")));
    let layers = package.manifest.architecture.num_layers;
    let f16_kv = package.kv_geometry().is_some_and(|g| g.dtype == ElementType::F16);
    if any("q4i8") {
        Tier::Int8Act
    } else if any("q4") || any("q8") {
        Tier::Int4
    } else if f16_kv || any("f16") {
        if layers > 8 {
            Tier::F16Deep
        } else {
            Tier::F16
        }
    } else {
        Tier::F32
    }
}

fn top(logits: &[f32], k: usize, package: &Package) -> Top {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    let k = k.min(order.len());
    if k == 0 {
        return Vec::new();
    }
    order.select_nth_unstable_by(k - 1, |a, b| logits[*b].total_cmp(&logits[*a]));
    order.truncate(k);
    order.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]));
    order
        .into_iter()
        .map(|i| {
            let text = onnx_genai_package::decode(package.tokenizer(), &[i as u32], false).unwrap_or_default();
            (i as u32, logits[i], text)
        })
        .collect()
}

fn margin(top: &Top) -> f32 {
    match top.as_slice() {
        [a, b, ..] => a.1 - b.1,
        _ => f32::INFINITY,
    }
}

/// Both sides' logits at the step a parity run parted: the prompt and the
/// tokens they agreed on, run fresh.
fn parting(
    reference: &mut Decoder,
    candidate: &mut Decoder,
    prompt: &[u32],
    agreed: &[u32],
    k: usize,
    package: &Package,
) -> Result<(Top, Top), String> {
    let input: Vec<u32> = prompt.iter().chain(agreed).copied().collect();
    let side = |d: &mut Decoder| {
        d.reset();
        d.forward(&input).map(|l| top(&l, k, package)).map_err(|e| e.to_string())
    };
    Ok((side(reference)?, side(candidate)?))
}

/// What one parity run concluded. A flip where the reference itself could
/// not tell the two tokens apart is a near-tie only while the logits
/// stayed in the tier: wrong logits that happen to flip a close call are a
/// mismatch.
fn verdict_of(run: &parity::ParityOutcome) -> Verdict {
    match &run.divergence {
        None => Verdict::Pass,
        Some(Divergence::Token { near_tie: true, .. }) if run.worst.worst_ratio <= 1.0 => Verdict::NearTie,
        Some(Divergence::Error { .. }) => Verdict::CouldNotRun,
        Some(_) => Verdict::Mismatch,
    }
}

/// Parity of `backend` against ONNX Runtime on every prompt.
fn parity_stage(
    package: &Package,
    name: &str,
    backend: &str,
    prompts: &[Vec<u32>],
    opts: &CheckOptions,
    tier: Tier,
    partings: &mut Vec<Parting>,
) -> Vec<(CheckResult, Verdict)> {
    let mut out = Vec::new();
    let opened = open_backend(REFERENCE, package, opts.threads)
        .and_then(|r| Ok((r, open_backend(backend, package, opts.threads)?)));
    let (mut reference, mut candidate) = match opened {
        Ok(pair) => pair,
        Err(e) => {
            let started = Instant::now();
            let r = finish(result("parity", name, backend, started), Err(e.to_string()), started);
            return vec![(r, Verdict::CouldNotRun)];
        }
    };
    for (i, tokens) in prompts.iter().enumerate() {
        let started = Instant::now();
        let mut r = result("parity", name, backend, started);
        r.name = format!("parity::{name}::{backend}::prompt{i}");
        let run = parity::run(&mut reference, &mut candidate, tokens, opts.steps, tier);
        let verdict = verdict_of(&run);
        let summary = match &run.divergence {
            None => format!(
                "{} steps, tier {}: max |d| {:.2e} ({:.1}% of tolerance), greedy tokens identical, min top-2 gap {:.2e}",
                run.steps,
                tier.name(),
                run.worst.max_abs,
                100.0 * run.worst.worst_ratio,
                run.min_top2_gap
            ),
            Some(d) => {
                let step = match d {
                    Divergence::Logits { step, .. } | Divergence::Token { step, .. } | Divergence::Error { step, .. } => {
                        *step
                    }
                };
                if !matches!(d, Divergence::Error { .. }) {
                    match parting(&mut reference, &mut candidate, tokens, &run.tokens, opts.top_k, package) {
                        Ok((reference_top, candidate_top)) => partings.push(Parting {
                            backend: backend.into(),
                            prompt: i,
                            step,
                            near_tie: verdict == Verdict::NearTie,
                            reference_margin: margin(&reference_top),
                            candidate_margin: margin(&candidate_top),
                            reference_top,
                            candidate_top,
                        }),
                        Err(e) => eprintln!("{name} prompt {i}: the top-k rerun failed: {e}"),
                    }
                }
                let verdict_text = if verdict == Verdict::NearTie { "near-tie (not a failure): " } else { "" };
                format!("{verdict_text}{}", parity::describe(d, tier, REFERENCE, backend))
            }
        };
        r.status = if verdict <= Verdict::NearTie { Status::Passed } else { Status::Failed };
        r.summary = summary;
        r.parity = Some(run);
        r.seconds = started.elapsed().as_secs_f64();
        out.push((r, verdict));
    }
    out
}

/// Prefill and greedy decode speed of `backend` on `prompt` (one warm-up
/// run first).
fn speed(package: &Package, backend: &str, prompt: &[u32], steps: usize, threads: usize) -> Result<Speed, String> {
    let mut d = open_backend(backend, package, threads).map_err(|e| e.to_string())?;
    let mut timed = || -> Result<(f64, f64), String> {
        d.reset();
        let started = Instant::now();
        let mut logits = d.forward(prompt).map_err(|e| e.to_string())?;
        let prefill = started.elapsed().as_secs_f64();
        let started = Instant::now();
        for _ in 0..steps {
            let (next, _) = crate::tolerance::top2(&logits);
            logits = d.forward(&[next]).map_err(|e| e.to_string())?;
        }
        Ok((prefill, started.elapsed().as_secs_f64()))
    };
    timed()?;
    let (prefill, decode) = timed()?;
    Ok(Speed {
        backend: backend.into(),
        prefill_tokens: prompt.len(),
        prefill_tokens_per_s: prompt.len() as f64 / prefill.max(1e-9),
        decode_tokens: steps,
        decode_tokens_per_s: steps as f64 / decode.max(1e-9),
    })
}

/// The native backends this machine can run (native-cuda only with a GPU).
pub fn native_backends() -> Vec<String> {
    BackendKind::available_here().into_iter().filter(|k| *k != BackendKind::Ort).map(|k| k.name().to_string()).collect()
}

/// Every stage on the package at `dir`; stops after the first stage that
/// could not run.
pub fn check_dir(dir: &Path, opts: &CheckOptions) -> PackageCheck {
    check_claiming(dir, opts, &mut Vec::new())
}

/// [`check_dir`] on each of `dirs` in turn. Two packages whose golden
/// records would share names (`a/model` and `b/model` of one manifest
/// name) cannot both be held to records in one `--golden` directory: the
/// later one's golden stage could not run, naming the earlier one (it was
/// judged against the earlier one's records: a mismatch of two models).
pub fn check_dirs(dirs: &[PathBuf], opts: &CheckOptions) -> Vec<PackageCheck> {
    let mut claimed = Vec::new();
    dirs.iter().map(|d| check_claiming(d, opts, &mut claimed)).collect()
}

/// [`check_dir`], with the golden record stems earlier packages of the
/// run claimed (and the package directory each belongs to).
fn check_claiming(dir: &Path, opts: &CheckOptions, claimed: &mut Vec<(String, PathBuf)>) -> PackageCheck {
    let dir_path = dir;
    let dir_name = dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    let (validated, name) = validate_stage(dir, &dir_name);
    let name = name.unwrap_or(dir_name);
    let mut check = PackageCheck {
        dir: dir.into(),
        name: name.clone(),
        tier: opts.tier,
        verdict: Verdict::CouldNotRun,
        results: Vec::new(),
        partings: Vec::new(),
        speed: Vec::new(),
    };
    let valid = validated.status == Status::Passed;
    check.results.push(validated);
    if !valid {
        return check;
    }
    let package = match Package::open(dir) {
        Ok(p) => p,
        Err(e) => {
            let started = Instant::now();
            check.results.push(finish(result("validate", &name, "open", started), Err(e.to_string()), started));
            return check;
        }
    };
    let loaded = ort_load_stage(dir, &name, opts.threads);
    let ort_ok = loaded.status == Status::Passed;
    check.results.push(loaded);
    let (compiled, planned_tier) = native_compile_stage(dir, &name);
    let compiled_ok = compiled.status == Status::Passed;
    check.results.push(compiled);
    if !ort_ok || !compiled_ok {
        return check;
    }
    let tier = opts.tier.or(planned_tier).unwrap_or(Tier::F32);
    check.tier = Some(tier);
    let prompts: Result<Vec<Vec<u32>>, String> = opts
        .prompts
        .iter()
        .map(|p| package.tokenizer().encode(p.as_str(), false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string()))
        .collect();
    // Every prompt and its compared steps must fit the context: the
    // backends refuse what does not, after running every step before it
    // (`--steps 10^12` decoded to the context's end for every prompt,
    // backend and stage, then could not run).
    let context = package.manifest.architecture.max_sequence_length as usize;
    let longest = prompts.as_ref().map_or(0, |p| p.iter().map(Vec::len).max().unwrap_or(0));
    // (The stages decode at least one step: `--steps 0` compares the
    // prefill and still runs one.)
    if longest.saturating_add(opts.steps.max(1)) > context {
        let started = Instant::now();
        let why = format!(
            "the longest prompt ({longest} tokens) and {} steps do not fit the context of {context} positions: \
             give fewer --steps or shorter prompts",
            opts.steps
        );
        check.results.push(finish(result("parity", &name, "-", started), Err(why), started));
        return check;
    }
    let prompts = match prompts {
        Ok(p) if !p.is_empty() && p.iter().all(|t| !t.is_empty()) => p,
        Ok(_) => {
            let started = Instant::now();
            let why = "no prompts, or a prompt that encodes to no tokens".to_string();
            let r = finish(result("parity", &name, "-", started), Err(why), started);
            check.results.push(r);
            return check;
        }
        Err(e) => {
            let started = Instant::now();
            check.results.push(finish(result("parity", &name, "-", started), Err(format!("tokenizer: {e}")), started));
            return check;
        }
    };
    let mut verdict = Verdict::Pass;
    let mut near_ties = Vec::new();
    for backend in native_backends() {
        let results = parity_stage(&package, &name, &backend, &prompts, opts, tier, &mut check.partings);
        for (i, (r, v)) in results.into_iter().enumerate() {
            if v == Verdict::NearTie {
                near_ties.push((backend.clone(), i));
            }
            verdict = verdict.max(v);
            check.results.push(r);
        }
    }
    if let Some(dir) = &opts.golden {
        let stem = golden_stem(&name, dir_path);
        let here = dir_path.canonicalize().unwrap_or_else(|_| dir_path.to_path_buf());
        match claimed.iter().find(|(s, _)| *s == stem) {
            Some((_, other)) if *other != here => {
                let started = Instant::now();
                let why = format!(
                    "its golden records would be named as {}'s ({stem}__prompt*.snap): check them with \
                     separate --golden directories",
                    other.display()
                );
                check.results.push(finish(result("golden", &name, REFERENCE, started), Err(why), started));
                verdict = verdict.max(Verdict::CouldNotRun);
            }
            _ => {
                claimed.push((stem, here));
                let texts: Vec<(String, Vec<u32>)> =
                    opts.prompts.iter().cloned().zip(prompts.iter().cloned()).collect();
                for (r, v) in golden_stage(&package, (&name, dir_path), dir, &texts, opts, tier, &near_ties) {
                    verdict = verdict.max(v);
                    check.results.push(r);
                }
            }
        }
    }
    for backend in std::iter::once(REFERENCE.to_string()).chain(native_backends()) {
        let started = Instant::now();
        let outcome = speed(&package, &backend, &prompts[0], opts.steps.max(1), opts.threads);
        let summary = outcome.map(|s| {
            let line = format!(
                "prefill {:.1} tok/s ({} tokens), decode {:.1} tok/s ({} tokens)",
                s.prefill_tokens_per_s, s.prefill_tokens, s.decode_tokens_per_s, s.decode_tokens
            );
            check.speed.push(s);
            line
        });
        let r = finish(result("speed", &name, &backend, started), summary, started);
        if r.status == Status::Failed {
            verdict = verdict.max(Verdict::CouldNotRun);
        }
        check.results.push(r);
    }
    check.verdict = verdict;
    check
}

/// The checks of several packages as one report (Markdown, JSON, JUnit).
pub fn report(checks: &[PackageCheck]) -> Report {
    Report {
        commit: format!("onnx-genai {}", env!("CARGO_PKG_VERSION")),
        results: checks.iter().flat_map(|c| c.results.clone()).collect(),
    }
}

/// The worst verdict's exit code.
pub fn exit_code(checks: &[PackageCheck]) -> i32 {
    checks.iter().map(|c| c.verdict.exit_code()).max().unwrap_or(2)
}

fn partings_text(c: &PackageCheck, md: bool) -> String {
    let mut s = String::new();
    for p in &c.partings {
        let what = if p.near_tie { "near-tie" } else { "divergence" };
        let _ = writeln!(
            s,
            "{}{what}: {} prompt {} step {} (reference margin {:.3e}, {} margin {:.3e})",
            if md { "- " } else { "  " },
            p.backend,
            p.prompt,
            p.step,
            p.reference_margin,
            p.backend,
            p.candidate_margin
        );
        for (side, top) in [(REFERENCE, &p.reference_top), (p.backend.as_str(), &p.candidate_top)] {
            let items: Vec<String> = top.iter().map(|(t, l, text)| format!("{t} {text:?} {l:.4}")).collect();
            let _ = writeln!(s, "{}{side:>10}: {}", if md { "  - " } else { "    " }, items.join(" | "));
        }
    }
    s
}

fn speed_text(c: &PackageCheck) -> String {
    let mut s = String::from("| backend | prefill tok/s | decode tok/s |\n|---|---:|---:|\n");
    for sp in &c.speed {
        let _ = writeln!(s, "| {} | {:.1} | {:.1} |", sp.backend, sp.prefill_tokens_per_s, sp.decode_tokens_per_s);
    }
    s
}

/// For a terminal: every stage's line, where the sides parted, speed.
pub fn table(checks: &[PackageCheck]) -> String {
    let mut s = String::new();
    for c in checks {
        let tier = c.tier.map_or("-", Tier::name);
        let _ = writeln!(s, "== {} ({}) tier {tier}: {:?}", c.name, c.dir.display(), c.verdict);
        for r in &c.results {
            let mark = if r.status == Status::Passed { "ok  " } else { "FAIL" };
            let _ = writeln!(s, "{mark} {:<48} {:>7.2}s  {}", r.name, r.seconds, r.summary);
        }
        s.push_str(&partings_text(c, false));
        if !c.speed.is_empty() {
            s.push('\n');
            s.push_str(&speed_text(c));
        }
    }
    s
}

/// The report's Markdown with each package's partings and speed after it.
pub fn markdown(checks: &[PackageCheck]) -> String {
    let mut s = report(checks).markdown();
    for c in checks {
        let tier = c.tier.map_or("-", Tier::name);
        let _ = writeln!(s, "\n## {} — {:?} (tier {tier})\n", c.name, c.verdict);
        s.push_str(&partings_text(c, true));
        if !c.speed.is_empty() {
            s.push('\n');
            s.push_str(&speed_text(c));
        }
    }
    s
}

/// Every package's stages, partings, speed and verdict as JSON.
pub fn json(checks: &[PackageCheck]) -> String {
    serde_json::to_string_pretty(&serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "exit_code": exit_code(checks),
        "packages": checks,
    }))
    .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tolerance::Deviation;

    fn run(divergence: Option<Divergence>, worst_ratio: f32) -> parity::ParityOutcome {
        parity::ParityOutcome {
            steps: 3,
            worst: Deviation { max_abs: 0.0, worst_index: 0, worst_ratio },
            min_top2_gap: 0.0,
            tokens: vec![1, 2],
            divergence,
            arbitration: None,
        }
    }

    /// The verdicts behind the exit codes: a near-tie passes only with the
    /// logits inside the tier; a flip outside it, logits out of tier and a
    /// backend error do not.
    #[test]
    fn a_near_tie_passes_only_with_logits_inside_the_tier() {
        let flip = |near_tie| Divergence::Token {
            step: 2,
            reference: 5,
            candidate: 6,
            top2_gap: 1e-5,
            max_abs: 0.0,
            near_tie,
        };
        assert_eq!(verdict_of(&run(None, 0.5)), Verdict::Pass);
        assert_eq!(verdict_of(&run(Some(flip(true)), 0.9)), Verdict::NearTie);
        assert_eq!(verdict_of(&run(Some(flip(true)), 3.0)), Verdict::Mismatch);
        assert_eq!(verdict_of(&run(Some(flip(false)), 0.1)), Verdict::Mismatch);
        let error = Divergence::Error { step: 0, backend: "native-cpu".into(), message: "x".into() };
        assert_eq!(verdict_of(&run(Some(error), 0.0)), Verdict::CouldNotRun);
        assert_eq!(
            [Verdict::Pass, Verdict::NearTie, Verdict::Mismatch, Verdict::CouldNotRun].map(Verdict::exit_code),
            [0, 0, 1, 2]
        );
    }
}
