//! The conformance suites as named tests (libtest-mimic): every parity case
//! and golden check under `conformance/` is one test, so
//! `cargo test -p onnx-genai-conformance --test conformance -- --list`
//! shows them and filters select them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use libtest_mimic::{Arguments, Failed, Trial};
use onnx_genai_conformance::cases::{discover, Check, Suite, ON_REQUEST, REFERENCE};
use onnx_genai_conformance::golden;
use onnx_genai_conformance::run::{run_check, Context, Status};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Parity: fails with the step, token ids, top-2 gap and max |d| on a
/// divergence. Golden: the run judged its record against `golden/decode/`
/// (tokens and text exact, logits at the tier); on a failure of the
/// reference (ONNX Runtime) the record goes to insta too, so the change shows
/// up in `cargo insta review`.
fn run(check: &Check, ctx: &Context) -> Result<(), Failed> {
    let result = run_check(check, ctx);
    if result.status == Status::Passed {
        return Ok(());
    }
    // Only a pass passes: a check that did not run proves nothing.
    // Goldens are recorded from ONNX Runtime: another backend's failing
    // record must not become a pending snapshot that could replace it.
    if let (Suite::Golden, true, Some(text)) = (check.suite, check.backend == REFERENCE, result.golden_text) {
        let name = golden::snapshot_name(check);
        let dir = root().join(golden::SNAPSHOT_DIR);
        let _pending = std::panic::catch_unwind(|| {
            insta::with_settings!({ snapshot_path => dir, prepend_module_to_snapshot => false, omit_expression => true }, {
                insta::assert_snapshot!(name, text);
            });
        });
    }
    Err(result.summary.into())
}

/// The generated specs every run checks (`cargo xtask conformance --random
/// N --seed S` runs others, and shrinks a failure).
const RANDOM_SEEDS: [u64; 6] = [1, 2, 3, 4, 5, 6];
/// Greedy steps per export of a generated spec.
const RANDOM_STEPS: usize = 16;

/// Issue 21, packages the suite has never seen: the spec drawn from `seed`
/// is built as every export it offers, and each holds parity (native-cpu
/// against ONNX Runtime) at its tier.
fn random_spec(seed: u64) -> Result<(), Failed> {
    use onnx_genai_conformance::random;
    let yaml = random::draw(seed);
    let outcomes = random::check(&yaml, RANDOM_STEPS, 1)?;
    let failed: Vec<String> = outcomes.iter().filter(|o| !o.passed()).map(|o| o.summary()).collect();
    if failed.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{}\nspec:\n{yaml}shrink it with `cargo xtask conformance --random 1 --seed {seed}`",
        failed.join("\n")
    )
    .into())
}

fn main() {
    let args = Arguments::from_args();
    let checks = match discover(&root()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot load the conformance suites: {e}");
            std::process::exit(2);
        }
    };
    // native-cuda's checks run where a GPU is; elsewhere they are ignored
    // (and listed as such), unless the run demands a GPU, when they run and
    // fail with the backend's "unavailable" error.
    let gpu = onnx_genai_engine::BackendKind::NativeCuda.available()
        || std::env::var("ONNX_GENAI_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let packages = Path::new(env!("CARGO_TARGET_TMPDIR")).join("conformance-packages");
    let ctx = Arc::new(Context::new(&root(), &packages, 1));
    let trials = checks
        .into_iter()
        .map(|check| {
            let ctx = ctx.clone();
            let kind = check.suite.name();
            let ignored = !gpu && ON_REQUEST.contains(&check.backend.as_str());
            Trial::test(check.name.clone(), move || run(&check, &ctx)).with_kind(kind).with_ignored_flag(ignored)
        })
        .chain(
            RANDOM_SEEDS
                .map(|seed| Trial::test(format!("random::seed-{seed}"), move || random_spec(seed)).with_kind("random")),
        )
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
