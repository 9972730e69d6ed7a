//! Alone in its test binary: it counts the process's threads, which any
//! test running beside it would change.

use onnx_genai_engine::{BackendKind, Engine};

/// The threads this process runs now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |tasks| tasks.count())
}

/// A workflow's components (the vision encoder and the embedding table:
/// ONNX Runtime sessions of their own) run on the thread count the engine
/// was opened with, as its decoder does: opening a vision-language
/// package on one thread starts no more threads than a text-only package
/// does. Before, `--threads 1` started ONNX Runtime's default pool (a
/// thread a core, past the caller) for each component: on this 2-core
/// machine, two threads more. (On a 1-core machine both pools are the
/// caller alone and the counts agree either way.)
#[test]
fn workflow_components_take_the_engines_thread_count() {
    let (_lm_dir, lm) = onnx_genai_test_support::build("tiny-gpt2");
    let (_vlm_dir, vlm) = onnx_genai_test_support::build("tiny-vlm");
    assert!(vlm.manifest.workflow.as_ref().is_some_and(|w| w.steps.len() > 1), "tiny-vlm runs a workflow");
    let started = |dir: &std::path::Path| {
        let before = threads();
        let engine = Engine::open(dir, BackendKind::Ort, 1).expect("the package opens");
        (threads() - before, engine)
    };
    // The first session of a process starts what every later one shares
    // (ONNX Runtime's environment): counted in neither.
    drop(started(&lm.root));
    let (text_only, _lm_engine) = started(&lm.root);
    let (with_components, _vlm_engine) = started(&vlm.root);
    assert_eq!(
        with_components, text_only,
        "the vision-language package started {with_components} threads, the text-only one {text_only}"
    );
}
