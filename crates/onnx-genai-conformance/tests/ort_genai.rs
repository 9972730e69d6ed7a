//! ONNX Runtime GenAI runs our contrib exports unchanged (their
//! `genai_config.json` is written by the builder), and its greedy tokens
//! equal ours on ONNX Runtime and on native-cpu for 32 steps. The same
//! holds for the genai exports — packages in the form its own model
//! builder writes (no `position_ids`, rotary inside `GroupQueryAttention`,
//! `past_present_share_buffer: true`), which we load through the
//! `genai_config.json` import. Needs
//! `onnxruntime-genai` in `target/genai` and the real model's GGUF, which
//! `cargo xtask lane ort-genai` installs and fetches.

use std::path::{Path, PathBuf};
use std::process::Command;

use onnx_genai_build::Variant;
use onnx_genai_conformance::real::RealModel;
use onnx_genai_engine::{BackendKind, Engine, FinishReason, Flow, GenerateRequest, Prompt};

const STEPS: usize = 32;
const PROMPT: &str = "The capital of France is";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ort_genai(dir: &Path, ids: &[u32]) -> Vec<u32> {
    let site = root().join("target/genai");
    assert!(site.is_dir(), "{} is missing: run `cargo xtask lane ort-genai`", site.display());
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/ort_genai.py"))
        .args(["generate", &dir.display().to_string(), &ids.join(","), &STEPS.to_string()])
        .env("PYTHONPATH", &site)
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "onnxruntime-genai failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().split(',').map(|t| t.parse().unwrap()).collect()
}

/// Our greedy tokens and whether the run ended on an end-of-sequence token.
fn ours(dir: &Path, backend: BackendKind, ids: &[u32]) -> (Vec<u32>, bool) {
    let mut engine = Engine::open(dir, backend, 1).unwrap();
    let request =
        GenerateRequest { max_new_tokens: Some(STEPS as u32), ..GenerateRequest::new(Prompt::TokenIds(ids.to_vec())) };
    let out = engine.generate(&request, &mut |_| Flow::Continue).unwrap();
    (out.token_ids, out.finish_reason == FinishReason::Eos)
}

fn same_tokens(dir: &Path) {
    let package = onnx_genai_package::Package::open(dir).unwrap();
    let ids = package.tokenizer().encode(PROMPT, false).unwrap().get_ids().to_vec();
    let theirs = ort_genai(dir, &ids);
    assert!(!theirs.is_empty());
    // ONNX Runtime GenAI returns the end-of-sequence token it stopped on;
    // our engine stops before it and says so.
    let eos = &package.manifest.generation.eos_token_ids;
    let (expected, ended) = match theirs.split_last() {
        Some((last, rest)) if eos.contains(last) => (rest.to_vec(), true),
        _ => (theirs.clone(), false),
    };
    assert!(ended || theirs.len() == STEPS, "ONNX Runtime GenAI stopped early without an end token: {theirs:?}");
    assert_eq!(ours(dir, BackendKind::Ort, &ids), (expected.clone(), ended), "ORT backend vs ONNX Runtime GenAI");
    assert_eq!(ours(dir, BackendKind::NativeCpu, &ids), (expected, ended), "native-cpu vs ONNX Runtime GenAI");
}

fn tiny(name: &str, variant: Variant) {
    let (dir, _) = onnx_genai_test_support::build_variant(name, variant);
    assert!(dir.path().join("genai_config.json").is_file());
    same_tokens(dir.path());
}

#[test]
fn tiny_llama_gqa_contrib() {
    tiny("tiny-llama-gqa", Variant::Contrib);
}

#[test]
fn tiny_gpt2_contrib() {
    tiny("tiny-gpt2", Variant::Contrib);
}

#[test]
fn tiny_llama_f16_contrib() {
    tiny("tiny-llama-f16", Variant::Contrib);
}

/// Their builder's defaults: symmetric blocks, `accuracy_level` 4.
#[test]
fn tiny_llama_gqa_genai_layout() {
    tiny("tiny-llama-gqa", Variant::Genai);
}

/// Zero points, `accuracy_level` 0, a shared `GatherBlockQuantized` embedding.
#[test]
fn tiny_llama_f16_genai_layout() {
    tiny("tiny-llama-f16", Variant::Genai);
}

/// SmolLM2-135M's int4 exports, 32 greedy steps each: ours (contrib) and
/// ONNX Runtime GenAI's own form (genai).
#[test]
fn smollm2_int4_contrib_and_genai_layout() {
    let model = RealModel::load_all(&root()).unwrap().into_iter().find(|m| m.name == "smollm2-135m-instruct").unwrap();
    let base = model.load_spec(&root().join("target")).unwrap();
    for variant in [Variant::Contrib, Variant::Genai] {
        let export = model.exports.iter().find(|e| e.variant == variant).unwrap();
        let dir = tempfile::tempdir().unwrap();
        model.build(&base, export, dir.path()).unwrap();
        same_tokens(dir.path());
    }
}
