//! The package builder: committed digests, deterministic output, tokenizer.

use std::path::{Path, PathBuf};

use onnx_genai_build::digest::{variants_digest, DIGEST_FILE};
use onnx_genai_build::{build_all_variants, build_package, read_spec, tokenizer, Spec, Variant};

fn spec_paths() -> Vec<PathBuf> {
    onnx_genai_build::spec_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packages")).unwrap()
}

/// A generator change that alters a package's bytes (in any export
/// variant) fails here until the digest is deliberately re-blessed
/// (`cargo xtask packages --bless`).
#[test]
fn built_packages_match_their_committed_digests() {
    assert!(spec_paths().len() >= 3);
    for spec_path in spec_paths() {
        let spec = read_spec(&spec_path).unwrap();
        let dir = tempfile::tempdir().unwrap();
        build_all_variants(&spec, dir.path()).unwrap();
        let committed = std::fs::read_to_string(spec_path.with_file_name(DIGEST_FILE)).unwrap();
        assert_eq!(
            variants_digest(dir.path()).unwrap(),
            committed,
            "{} drifted; run `cargo xtask packages --bless` if intended",
            spec.name
        );
        for variant in spec.variants() {
            let vdir = dir.path().join(variant.name());
            let size: u64 = std::fs::read_dir(&vdir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
            assert!(size < 2 * 1024 * 1024, "{} {variant:?} is {size} bytes; tiny packages stay under 2 MB", spec.name);
        }
    }
}

/// The three exports use the ops their names promise (and the decomposed
/// one none of the fused ones).
#[test]
fn variants_use_their_op_sets() {
    let spec =
        read_spec(&spec_paths().into_iter().find(|p| p.to_string_lossy().contains("tiny-llama-gqa")).unwrap()).unwrap();
    let ops = |v: Variant| -> Vec<String> {
        let model = onnx_genai_build::graph::build_decoder(&spec, v).unwrap();
        model.graph.nodes.iter().map(|n| format!("{}:{}", n.domain, n.op_type)).collect()
    };
    let decomposed = ops(Variant::Decomposed);
    for fused in ["RMSNormalization", "RotaryEmbedding", "Attention", "GroupQueryAttention", "MatMulNBits"] {
        assert!(!decomposed.iter().any(|o| o.ends_with(&format!(":{fused}"))), "decomposed uses {fused}");
    }
    let opset23 = ops(Variant::Opset23);
    for op in [":RMSNormalization", ":RotaryEmbedding", ":Attention"] {
        assert!(opset23.iter().any(|o| o == op), "opset23 lacks {op}");
    }
    let contrib = ops(Variant::Contrib);
    for op in [
        ":SimplifiedLayerNormalization",
        "com.microsoft:SkipSimplifiedLayerNormalization",
        "com.microsoft:RotaryEmbedding",
        "com.microsoft:GroupQueryAttention",
        "com.microsoft:MatMulNBits",
    ] {
        assert!(contrib.iter().any(|o| o == op), "contrib lacks {op}");
    }
    assert!(!contrib.iter().any(|o| o == ":MatMul"), "contrib projections are all 4-bit");
}

#[test]
fn a_different_seed_gives_different_weights() {
    let spec = read_spec(&spec_paths()[0]).unwrap();
    let other = Spec { seed: spec.seed + 100, ..spec.clone() };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    build_package(&spec, a.path()).unwrap();
    build_package(&other, b.path()).unwrap();
    let model = |d: &Path| std::fs::read(d.join("model.onnx")).unwrap();
    assert_ne!(model(a.path()), model(b.path()));
}

#[test]
fn tokenizer_round_trips_text_and_keeps_special_tokens_whole() {
    let tok = tokenizer::build(384).unwrap();
    assert_eq!(tok.get_vocab_size(true), 384);
    for text in ["The capital of France is Paris.", "  two  spaces\nand a tab\t", "héllo wörld ✓ 数字 123456", ""]
    {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "round trip of {text:?}");
    }
    let ids = tok.encode("<|im_start|>user", false).unwrap().get_ids().to_vec();
    assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(381));
    // Merges are used: common words are fewer tokens than bytes.
    assert!(tok.encode("the capital", false).unwrap().get_ids().len() < "the capital".len());
}

#[test]
fn invalid_specs_are_refused_with_the_reason() {
    let gqa = spec_paths().into_iter().find(|p| p.to_string_lossy().contains("tiny-llama-gqa")).unwrap();
    let text = std::fs::read_to_string(gqa).unwrap();
    let cases = [
        (text.replace("num_kv_heads: 2", "num_kv_heads: 3"), "multiple of num_kv_heads"),
        (text.replace("seed: 1", "seed: 1\nsead: 2"), "unknown field `sead`"),
        (text.replace("vocab_size: 384", "vocab_size: 100"), "below the 259"),
        (text.replace("hidden_size: 64", "hidden_size: sixty"), "hidden_size"),
    ];
    for (spec, want) in cases {
        let err = Spec::parse(&spec, "test").unwrap_err().to_string();
        assert!(err.contains(want), "expected `{want}` in: {err}");
    }
}
