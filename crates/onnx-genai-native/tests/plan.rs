//! What the compiler makes of the shipped exports: the fusions fire, no
//! generic matrix product or KV concatenation survives, buffers are shared,
//! and the KV cache is preallocated once.

use std::path::Path;

use onnx_genai_backend::DecodeBackend;
use onnx_genai_build::{build_variant, read_spec, Variant};
use onnx_genai_native::{compile_package, NativeDecoder};

fn package(name: &str, variant: Variant) -> (tempfile::TempDir, onnx_genai_package::Package) {
    let spec =
        read_spec(&Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../packages/{name}/spec.yaml"))).unwrap();
    let dir = tempfile::tempdir().unwrap();
    build_variant(&spec, variant, dir.path()).unwrap();
    let package = onnx_genai_package::Package::open(dir.path()).unwrap();
    (dir, package)
}

/// Fusion coverage per export: a matcher that silently stops firing fails
/// here even though the generic kernels would still compute the right
/// logits (decomposed attention cannot fall back: it must fuse).
#[test]
fn fusions_fire_on_every_export() {
    let layers = 2;
    type Expected = (&'static str, Variant, Vec<(&'static str, usize)>);
    let expect: Vec<Expected> = vec![
        (
            "tiny-llama-gqa",
            Variant::Decomposed,
            vec![
                ("causal_mask", 1),
                ("linear", 15),
                ("rms_norm", 2 * layers + 1),
                ("gated_mlp", layers),
                ("rotary", 2 * layers),
                ("attention", layers),
                ("head_layout", layers),
            ],
        ),
        (
            "tiny-llama-gqa",
            Variant::Opset23,
            vec![("causal_mask", 1), ("linear", 15), ("gated_mlp", layers), ("head_layout", layers)],
        ),
        ("tiny-llama-gqa", Variant::Contrib, vec![("matmul_nbits", 15), ("gated_mlp", layers)]),
        // One packed QKV projection per layer: 5 per layer plus the head.
        ("tiny-llama-gqa", Variant::Genai, vec![("matmul_nbits", 5 * layers + 1), ("gated_mlp", layers)]),
        ("tiny-llama-f16", Variant::Genai, vec![("matmul_nbits", 5 * layers + 1), ("gated_mlp", layers)]),
        ("tiny-gpt2", Variant::Contrib, vec![("matmul_nbits", 13), ("linear_bias", 12), ("gelu_tanh", layers)]),
        (
            "tiny-gpt2",
            Variant::Decomposed,
            vec![
                ("causal_mask", 1),
                ("linear", 13),
                ("linear_bias", 12),
                ("layer_norm", 2 * layers + 1),
                ("gelu_tanh", layers),
                ("attention", layers),
                ("head_layout", layers),
            ],
        ),
        (
            "tiny-llama-f16",
            Variant::Decomposed,
            vec![("linear", 15), ("rms_norm", 5), ("gated_mlp", layers), ("rotary", 4), ("attention", layers)],
        ),
    ];
    for (name, variant, fusions) in expect {
        let (_dir, package) = package(name, variant);
        let plan = compile_package(&package).unwrap();
        for (kind, n) in fusions {
            assert_eq!(plan.stats.fused(kind), n, "{name} {variant:?} {kind}: {:?}", plan.stats.fusions);
        }
        let ops = plan.step_ops();
        for generic in ["MatMul", "Concat", "Softmax", "MatMulNBits", "Tile", "Tanh"] {
            assert!(!ops.iter().any(|o| o == generic), "{name} {variant:?} still runs a generic {generic}: {ops:?}");
        }
        assert_eq!(ops.iter().filter(|o| *o == "Attention").count(), layers, "{name} {variant:?}");
        assert!(
            plan.slots() * 3 < plan.values,
            "{name} {variant:?}: {} slots for {} values",
            plan.slots(),
            plan.values
        );
    }
}

/// f16 weights stay f16 in the packed projections (not widened at compile
/// time), and 4-bit ones stay 4-bit.
#[test]
fn compressed_weights_stay_compressed() {
    let (_d, f16) = package("tiny-llama-f16", Variant::Decomposed);
    assert!(compile_package(&f16).unwrap().step_ops().iter().any(|o| o == "Linear[f16]"));
    let (_d, q4) = package("tiny-llama-gqa", Variant::Contrib);
    let ops = compile_package(&q4).unwrap().step_ops();
    assert!(ops.iter().filter(|o| o.starts_with("Linear")).all(|o| o == "Linear[q4]"), "{ops:?}");
}

/// In-place KV: the cache is allocated once at its full capacity and never
/// grows; decoding writes into it and `kv_len` advances one per step.
#[test]
fn kv_cache_is_preallocated_and_fixed() {
    let (_d, package) = package("tiny-llama-gqa", Variant::Decomposed);
    let mut b = NativeDecoder::load(&package, 1).unwrap();
    let bytes = b.kv_bytes();
    let geometry = package.kv_geometry().unwrap();
    assert_eq!(bytes as u64, geometry.bytes_per_token() * u64::from(package.manifest.architecture.max_sequence_length));
    b.forward(&[1, 2, 3]).unwrap();
    for t in 0..20 {
        b.forward(&[t]).unwrap();
    }
    assert_eq!(b.kv_len(), 23);
    assert_eq!(b.kv_bytes(), bytes);
    // Past capacity is a typed capacity error, and the state is unchanged.
    let err = b.forward(&vec![5; 256]).unwrap_err();
    assert!(matches!(err, onnx_genai_backend::BackendError::Capacity { have: 23, .. }), "{err}");
    assert_eq!(b.kv_len(), 23);
}

/// Threads change where large kernels run, not what they compute: a long
/// prefill and decode (parallel projections and attention past their size
/// thresholds) on two threads give the one-thread logits bit for bit.
#[test]
fn threaded_kernels_compute_the_same_logits() {
    let (_d, package) = package("tiny-llama-gqa", Variant::Decomposed);
    let prompt: Vec<u32> = (0..200).map(|i| (i * 37 + 11) % 380).collect();
    let run = |threads| {
        let mut b = NativeDecoder::load(&package, threads).unwrap();
        let mut all = b.forward(&prompt).unwrap();
        for t in 0..8 {
            all.extend(b.forward(&[t * 13]).unwrap());
        }
        all
    };
    assert_eq!(run(1), run(2));
}
