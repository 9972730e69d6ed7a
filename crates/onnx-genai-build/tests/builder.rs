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

/// Specs the builder cannot build are refused with the reason, before
/// any size in them allocates: sizes beyond what a package may declare (a
/// context of u32::MAX would ask for rotary tables of 512 GiB) or whose
/// products the builder's tables cannot take (rotary tables of 2^24
/// positions of 32; a 4-bit down projection's block sums, quadratic in an
/// intermediate size 78 times the hidden one), a
/// vocabulary without room for the vision placeholder (the tokenizer's
/// merge count would underflow), an image larger than a package may
/// preprocess, or whose tokens fill the context, or not RGB.
#[test]
fn invalid_specs_are_refused_with_the_reason() {
    let read = |name: &str| {
        let path = spec_paths().into_iter().find(|p| p.to_string_lossy().contains(name)).unwrap();
        std::fs::read_to_string(path).unwrap()
    };
    let (text, vlm) = (read("tiny-llama-gqa"), read("tiny-vlm"));
    let cases = [
        (text.replace("max_sequence_length: 256", "max_sequence_length: 4294967295"), "above the 16777216"),
        (text.replace("vocab_size: 384", "vocab_size: 4294967295"), "vocab_size 4294967295 is above"),
        (vlm.replace("vocab_size: 384", "vocab_size: 259"), "below the 260 byte and special tokens"),
        (vlm.replace("image_size: 8", "image_size: 4294967292"), "above the 4096"),
        (
            vlm.replace("patch_size: 4", "patch_size: 1").replace("image_size: 8", "image_size: 16"),
            "does not fit the context",
        ),
        (vlm.replace("channels: 3", "channels: 4294967295"), "channels 4294967295 is not 3"),
        (
            text.replace("max_sequence_length: 256", "max_sequence_length: 16777216")
                .replace("hidden_size: 64", "hidden_size: 128"),
            "above the 268435456 the builder's rotary tables take",
        ),
        (text.replace("intermediate_size: 128", "intermediate_size: 5000"), "intermediate_size 5000 is above the 4096"),
        // 1.8 billion random parameters (was: drawn until memory ran out).
        (
            text.replace("hidden_size: 64", "hidden_size: 8192")
                .replace("intermediate_size: 128", "intermediate_size: 28672"),
            "about 1.8 billion random parameters",
        ),
        (text.replace("num_kv_heads: 2", "num_kv_heads: 3"), "multiple of num_kv_heads"),
        (text.replace("seed: 1", "seed: 1\nsead: 2"), "unknown field `sead`"),
        (text.replace("vocab_size: 384", "vocab_size: 100"), "below the 259"),
        (text.replace("hidden_size: 64", "hidden_size: sixty"), "hidden_size"),
        (format!("{text}genai:\n  accuracy_level: 5\n"), "genai.accuracy_level 5 is not 0–4"),
        (format!("{text}genai:\n  shared_embeddings: true\n"), "needs tie_embeddings: true"),
        (format!("{text}genai:\n  symetric: false\n"), "unknown field `symetric`"),
    ];
    for (spec, want) in cases {
        let err = Spec::parse(&spec, "test").unwrap_err().to_string();
        assert!(err.contains(want), "expected `{want}` in: {err}");
    }
}

/// Issue 21: the builder knows the reference runtime's operator limits. A
/// head size of 12 (hidden 48 over 4 heads) is a fine model, but ONNX
/// Runtime's GroupQueryAttention (the contrib and genai exports' attention)
/// refuses it at the first run: those exports are not offered, and asking
/// for one says why; the plain-ONNX exports are still built.
#[test]
fn exports_the_reference_cannot_run_are_refused_with_the_reason() {
    let gqa = spec_paths().into_iter().find(|p| p.to_string_lossy().contains("tiny-llama-gqa")).unwrap();
    let text = std::fs::read_to_string(gqa).unwrap().replace("hidden_size: 64", "hidden_size: 48");
    let spec = Spec::parse(&text, "head-dim-12").unwrap();
    assert_eq!(spec.head_dim(), 12);
    assert_eq!(spec.variants(), [Variant::Decomposed, Variant::Opset23]);
    let dir = tempfile::tempdir().unwrap();
    for (variant, multiple) in [(Variant::Contrib, 8), (Variant::Genai, 16)] {
        let err = onnx_genai_build::build_variant(&spec, variant, dir.path()).unwrap_err().to_string();
        let want = format!("multiple of {multiple}; head_dim is 12");
        assert!(err.contains("GroupQueryAttention") && err.contains(&want), "{err}");
    }
    onnx_genai_build::build_variant(&spec, Variant::Opset23, dir.path()).unwrap();
    // Head size 8: contrib's GroupQueryAttention takes it, genai's (rotary
    // inside) needs a multiple of 16.
    let eight = Spec::parse(&text.replace("hidden_size: 48", "hidden_size: 32"), "head-dim-8").unwrap();
    assert_eq!(eight.variants(), [Variant::Decomposed, Variant::Opset23, Variant::Contrib]);
    let err = onnx_genai_build::build_variant(&eight, Variant::Genai, dir.path()).unwrap_err().to_string();
    assert!(err.contains("rotating inside) needs a head size that is a multiple of 16; head_dim is 8"), "{err}");
    let sixteen = Spec::parse(&text.replace("hidden_size: 48", "hidden_size: 64"), "head-dim-16").unwrap();
    assert_eq!(sixteen.variants(), Variant::ALL);
    // A shared 4-bit table gathers whole 32-blocks: hidden 48 (3 heads of
    // 16) has no genai export with it (ONNX Runtime refused the padded
    // rows), but has one without.
    let shared = text
        .replace("num_attention_heads: 4", "num_attention_heads: 3")
        .replace("num_kv_heads: 2", "num_kv_heads: 3")
        .replace("tie_embeddings: false", "tie_embeddings: true");
    let unshared = Spec::parse(&shared, "hidden-48").unwrap();
    assert_eq!(unshared.variants(), Variant::ALL);
    let spec = Spec::parse(&format!("{shared}genai:\n  shared_embeddings: true\n"), "hidden-48-shared").unwrap();
    assert_eq!(spec.variants(), [Variant::Decomposed, Variant::Opset23, Variant::Contrib]);
    let err = onnx_genai_build::build_variant(&spec, Variant::Genai, dir.path()).unwrap_err().to_string();
    assert!(err.contains("hidden_size 48 is not a multiple of 32"), "{err}");
}

fn spec_named(name: &str) -> Spec {
    read_spec(&spec_paths().into_iter().find(|p| p.to_string_lossy().contains(name)).unwrap()).unwrap()
}

/// The genai export is what ONNX Runtime GenAI's model builder writes for
/// an int4 CPU llama: its directory layout (no `package.yaml`, weights in
/// `model.onnx.data`, `tokenizer_config.json`), no `position_ids` input,
/// packed QKV into `GroupQueryAttention` with rotary inside, the builder's
/// `accuracy_level`, and `past_present_share_buffer: true`.
#[test]
fn genai_export_is_in_their_layout() {
    let dir = tempfile::tempdir().unwrap();
    build_all_variants(&spec_named("tiny-llama-gqa"), dir.path()).unwrap();
    let genai = dir.path().join("genai");
    let mut files: Vec<String> =
        std::fs::read_dir(&genai).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(
        files,
        ["genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"]
    );
    let size = |f: &str| std::fs::metadata(genai.join(f)).unwrap().len();
    assert!(size("model.onnx.data") > 10 * size("model.onnx"), "the weights live in model.onnx.data");

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(genai.join("genai_config.json")).unwrap()).unwrap();
    assert_eq!(config["search"]["past_present_share_buffer"], true);
    assert!(config["model"]["decoder"]["inputs"].get("position_ids").is_none());

    let model = onnx_genai_onnx::read_model(&genai.join("model.onnx")).unwrap();
    assert!(model.graph.inputs.iter().all(|i| i.name != "position_ids"));
    fn nodes<'m>(
        model: &'m onnx_genai_onnx::ir::Model,
        op: &'m str,
    ) -> impl Iterator<Item = &'m onnx_genai_onnx::ir::Node> {
        model.graph.nodes.iter().filter(move |n| n.op_type == op)
    }
    let int = |n: &onnx_genai_onnx::ir::Node, a: &str| match n.attr(a) {
        Some(onnx_genai_onnx::ir::AttrValue::Int(v)) => *v,
        other => panic!("{}: {a} = {other:?}", n.name),
    };
    assert_eq!(nodes(&model, "GroupQueryAttention").count(), 2);
    for gqa in nodes(&model, "GroupQueryAttention") {
        assert_eq!(int(gqa, "do_rotary"), 1);
        assert!(gqa.inputs[1].is_empty() && gqa.inputs[2].is_empty(), "Q, K and V come packed");
        assert!(!gqa.inputs[7].is_empty() && !gqa.inputs[8].is_empty(), "cos/sin caches");
    }
    for mm in nodes(&model, "MatMulNBits") {
        assert_eq!(int(mm, "accuracy_level"), 4);
        assert_eq!(mm.inputs.len(), 3, "symmetric blocks carry no zero points");
    }
    assert_eq!(nodes(&model, "SkipSimplifiedLayerNormalization").count(), 4);
    assert_eq!(nodes(&model, "Gather").filter(|g| g.inputs[1] == "input_ids").count(), 1, "a plain embedding lookup");
    assert!(dir.path().join("contrib/package.yaml").is_file() && !genai.join("package.yaml").exists());
    let package = onnx_genai_package::Package::open(&genai).unwrap();
    assert_eq!(package.dialect, onnx_genai_package::validate::Dialect::GenaiConfig);
}

/// The builder's other choices (tiny-llama-f16's `genai:` block): zero
/// points, `accuracy_level` 0, and one 4-bit table for the embedding
/// (`GatherBlockQuantized`) and the output projection.
#[test]
fn genai_export_can_share_a_quantized_embedding() {
    let dir = tempfile::tempdir().unwrap();
    onnx_genai_build::build_variant(&spec_named("tiny-llama-f16"), Variant::Genai, dir.path()).unwrap();
    let model = onnx_genai_onnx::read_model(&dir.path().join("model.onnx")).unwrap();
    let gather = model.graph.nodes.iter().find(|n| n.op_type == "GatherBlockQuantized").expect("quantized lookup");
    let head = model.graph.nodes.iter().rfind(|n| n.op_type == "MatMulNBits").unwrap();
    assert_eq!(head.inputs.len(), 4, "zero points");
    let reshaped = model.graph.nodes.iter().find(|n| n.outputs[0] == gather.inputs[0]).expect("a Reshape");
    assert_eq!(reshaped.inputs[0], head.inputs[1], "one table for the embedding and the head");
    assert!(!model
        .graph
        .nodes
        .iter()
        .any(|n| n.op_type == "Gather" && n.inputs.get(1).is_some_and(|i| i == "input_ids")));
}
