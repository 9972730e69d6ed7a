//! `cargo xtask conformance`: build every package in every export variant,
//! validate it, load it in ONNX Runtime, compile it natively, run the parity
//! and golden suites; print a summary, write `target/conformance/report.md`,
//! `report.json` and `junit.xml` (each stamped with the commit); exit
//! non-zero on any failure.

use std::time::Instant;

use anyhow::{bail, Result};
use onnx_genai_build::Variant;
use onnx_genai_conformance::cases::{discover, Filter, Suite};
use onnx_genai_conformance::check;
use onnx_genai_conformance::report::Report;
use onnx_genai_conformance::run::{run_check, CheckResult, Context, Status};
use onnx_genai_engine::BackendKind;

use crate::{ort, packages, util};

pub struct Options {
    pub package: Option<String>,
    pub backend: Option<String>,
    pub suite: Option<String>,
    pub shard: Option<String>,
    pub threads: usize,
    /// Skip the real models (conformance/real/).
    pub no_real: bool,
}

fn stage(
    name: &str,
    package: &str,
    variant: Variant,
    backend: &str,
    started: Instant,
    outcome: Result<String>,
) -> CheckResult {
    let (status, summary) = match outcome {
        Ok(s) => (Status::Passed, s),
        Err(e) => (Status::Failed, format!("{e:#}")),
    };
    CheckResult {
        name: format!("{name}::{package}::{}", variant.name()),
        suite: match name {
            "validate" => "validate",
            "ort-load" => "ort-load",
            _ => "native-compile",
        },
        package: package.into(),
        variant: variant.name(),
        backend: backend.into(),
        status,
        summary,
        seconds: started.elapsed().as_secs_f64(),
        parity: None,
        batch: None,
        golden_text: None,
    }
}

/// A shared stage's result under this report's names (`stage::package::variant`).
fn named(mut r: CheckResult, package: &str, variant: Variant) -> CheckResult {
    r.name = format!("{}::{package}::{}", r.suite, variant.name());
    r.variant = variant.name();
    r
}

fn print_result(i: usize, n: usize, r: &CheckResult) {
    let mark = if r.status == Status::Passed { "ok  " } else { "FAIL" };
    println!("[{i:>3}/{n}] {mark} {:<60} {:>6.2}s  {}", r.name, r.seconds, r.summary);
}

pub fn run(opts: Options) -> Result<()> {
    let lib = ort::provision()?;
    // Read by the in-process reference backend; set before any thread starts.
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    let suite = match opts.suite.as_deref() {
        None => None,
        Some(s) => Some(Suite::parse(s).ok_or_else(|| anyhow::anyhow!("unknown suite `{s}` (parity, batch, golden)"))?),
    };
    if let Some(b) = &opts.backend {
        if BackendKind::parse(b).is_none() {
            bail!("unknown backend `{b}` (known: {})", BackendKind::names());
        }
    }
    let shard = opts.shard.as_deref().map(Filter::parse_shard).transpose().map_err(anyhow::Error::msg)?;
    let mut filter =
        Filter { package: opts.package.clone(), backend: opts.backend.clone(), suite, no_real: opts.no_real, shard };
    let root = util::root();
    let ctx = Context::new(&root, &util::target().join("packages"), opts.threads);
    let mut real_exports = Vec::new();
    let mut skipped = Vec::new();
    if !opts.no_real {
        for model in crate::real::models()? {
            // On by default when the wheel is reachable; a fetch failure
            // skips the lane loudly rather than failing the run.
            match crate::real::fetch(&model) {
                Ok(()) => real_exports.extend(
                    model
                        .exports
                        .iter()
                        .map(|e| (model.package(e), e.variant))
                        .filter(|(p, _)| opts.package.as_ref().is_none_or(|want| want == p)),
                ),
                Err(e) => {
                    println!("==> real-model lane SKIPPED ({}): {e:#}", model.name);
                    filter.no_real = true;
                    // The reports say so too: a skipped model is not a pass.
                    skipped.push(CheckResult {
                        name: format!("real::{}::fetch", model.name),
                        suite: "real",
                        package: model.name.clone(),
                        variant: "-",
                        backend: "-".into(),
                        status: Status::Skipped,
                        summary: format!("not fetched, so not checked: {e:#}"),
                        seconds: 0.0,
                        parity: None,
                        batch: None,
                        golden_text: None,
                    });
                }
            }
        }
    }

    println!("==> build packages (every variant; digests checked)");
    let built = packages::build_all(false)?;
    let selected: Vec<_> = built.iter().filter(|b| opts.package.as_ref().is_none_or(|p| *p == b.name)).collect();
    if selected.is_empty() && real_exports.is_empty() {
        bail!("no package matched {:?}", opts.package);
    }
    let mut results: Vec<CheckResult> = skipped;
    let stages: usize = selected.iter().map(|b| b.spec.variants().len() * 3).sum::<usize>() + real_exports.len() * 3;
    println!("==> validate, ONNX Runtime load, native compile ({stages} stages)");
    for b in &selected {
        for variant in b.spec.variants() {
            let dir = b.dir.join(variant.name());
            let r = named(check::validate_stage(&dir, &b.name).0, &b.name, variant);
            print_result(results.len() + 1, stages, &r);
            results.push(r);
            let r = named(check::ort_load_stage(&dir, &b.name, opts.threads), &b.name, variant);
            print_result(results.len() + 1, stages, &r);
            results.push(r);
            let t = Instant::now();
            let r = if b.spec.vision.is_some() {
                // Workflow packages run interpreted on ONNX Runtime; native
                // compiles decode cores (a decoder reading token ids).
                let interpreted =
                    "workflow package: interpreted on ONNX Runtime (native-cpu compiles decode cores only)";
                stage("native-compile", &b.name, variant, "native-cpu", t, Ok(interpreted.into()))
            } else {
                named(check::native_compile_stage(&dir, &b.name).0, &b.name, variant)
            };
            print_result(results.len() + 1, stages, &r);
            results.push(r);
        }
    }
    for (package, variant) in &real_exports {
        let t = Instant::now();
        let dir = ctx.package_dir(package, *variant);
        let dir = match dir {
            Ok(dir) => dir,
            Err(e) => {
                let r = stage("validate", package, *variant, "-", t, Err(anyhow::anyhow!("{e}")));
                print_result(results.len() + 1, stages, &r);
                results.push(r);
                continue;
            }
        };
        let r = named(check::validate_stage(&dir, package).0, package, *variant);
        print_result(results.len() + 1, stages, &r);
        results.push(r);
        let r = named(check::ort_load_stage(&dir, package, opts.threads), package, *variant);
        print_result(results.len() + 1, stages, &r);
        results.push(r);
        let r = named(check::native_compile_stage(&dir, package).0, package, *variant);
        print_result(results.len() + 1, stages, &r);
        results.push(r);
    }
    let mut checks = filter.select(discover(&root)?).map_err(anyhow::Error::msg)?;
    checks.sort_by_key(|c| (c.suite.order(), c.name.clone()));
    println!("==> {} checks (parity, then goldens)", checks.len());
    let n = checks.len();
    for (i, check) in checks.iter().enumerate() {
        let r = run_check(check, &ctx);
        print_result(i + 1, n, &r);
        results.push(r);
    }
    let report = Report { commit: util::commit(), results };
    let dir = util::target().join("conformance");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("report.md"), report.markdown())?;
    std::fs::write(dir.join("report.json"), report.json())?;
    std::fs::write(dir.join("junit.xml"), report.junit())?;
    println!("\n| suite | passed | failed | skipped |\n|---|---:|---:|---:|");
    for (suite, (p, f, k)) in report.by_suite() {
        println!("| {suite:<14} | {p:>6} | {f:>6} | {k:>7} |");
    }
    println!("\nreports: {0}/report.md, {0}/report.json, {0}/junit.xml (commit {1})", dir.display(), report.commit);
    let failed = report.failures();
    if failed > 0 {
        for r in report.results.iter().filter(|r| r.status == Status::Failed) {
            eprintln!("FAILED {}: {}", r.name, r.summary);
        }
        bail!("conformance: {failed} of {} failed", report.results.len());
    }
    println!("conformance: all {} passed", report.results.len());
    Ok(())
}

/// `--package-dir`: the `onnx-genai check` stages on each directory, the
/// reports written beside the suites' (`target/conformance/check.md`,
/// `check.json`, `check.junit.xml`); fails unless every package passed
/// (near-ties are reported, not failed).
pub fn run_dirs(dirs: &[std::path::PathBuf], threads: usize) -> Result<()> {
    let lib = ort::provision()?;
    // Read by the in-process reference backend; set before any thread starts.
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    let opts = check::CheckOptions { threads: threads.max(1), ..Default::default() };
    let checks = check::check_dirs(dirs, &opts);
    print!("{}", check::table(&checks));
    let out = util::target().join("conformance");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("check.md"), check::markdown(&checks))?;
    std::fs::write(out.join("check.json"), check::json(&checks))?;
    std::fs::write(out.join("check.junit.xml"), check::report(&checks).junit())?;
    println!("reports: {}/check.{{md,json,junit.xml}}", out.display());
    match check::exit_code(&checks) {
        0 => Ok(()),
        1 => bail!("a native backend does not match ONNX Runtime on a package"),
        _ => bail!("a package could not be checked"),
    }
}
