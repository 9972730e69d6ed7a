//! Kernel benchmarks (criterion): the projections at a real model's shape
//! (SmolLM2-135M: hidden 576, MLP 1536) in each weight storage, and the
//! attention step at context 64 vs 1024. End-to-end decode against ONNX
//! Runtime is `cargo xtask bench`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use onnx_genai_native::kernels::attention::{attention, AttentionInputs, AttentionSpec, Bias, LayerCache, Layout};
use onnx_genai_native::kernels::linear::{linear, Packed, Weight};
use onnx_genai_native::value::Value;

fn weights(k: usize, n: usize) -> Vec<f32> {
    (0..k * n).map(|i| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5).collect()
}

fn projections(c: &mut Criterion) {
    let (k, n) = (576, 1536);
    let w = weights(k, n);
    let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.01).sin()).collect();
    let f32w = Weight::from_kn_f32(&w, k, n);
    let halves: Vec<half::f16> = w.iter().map(|v| half::f16::from_f32(*v)).collect();
    let f16w = Weight::from_kn_f16(&halves, k, n);
    let blocks = k / 32;
    let q4 = Weight {
        n,
        k,
        packed: Packed::Q4 {
            data: (0..n * blocks * 16).map(|i| (i * 31 % 256) as u8).collect(),
            scales: vec![0.01; n * blocks],
            zeros: None,
            block: 32,
            blocks,
        },
    };
    // `accuracy_level` 4: int8 inputs, integer block products.
    let q4i8 = q4.clone().into_int8_products();
    let mut group = c.benchmark_group("linear_576x1536_decode");
    for (name, weight) in [("f32", &f32w), ("f16", &f16w), ("q4", &q4), ("q4_int8_inputs", &q4i8)] {
        let mut y = Vec::new();
        group.bench_function(name, |b| b.iter(|| linear(&x, 1, weight, None, &mut y, None)));
    }
    // The same one-row product through matrixmultiply's sgemm (the crate the
    // prefill path uses), to justify the hand-written decode kernel.
    let mut y = vec![0.0f32; n];
    group.bench_function("f32_matrixmultiply_sgemm", |b| {
        b.iter(|| onnx_genai_native::kernels::math::sgemm(1, k, n, &x, (k, 1), &w, (n, 1), &mut y))
    });
    group.finish();
}

fn attention_step(c: &mut Criterion) {
    // SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64.
    let (heads, kv_heads, hd) = (9, 3, 64);
    let spec = AttentionSpec {
        heads,
        kv_heads,
        head_dim: hd,
        scale: 0.125,
        q_layout: Layout::SeqFirst,
        kv_layout: Layout::SeqFirst,
        out_layout: Layout::SeqFirst,
        bias: Bias::Causal,
    };
    let q = Value::f32(vec![1, 1, heads * hd], vec![0.1; heads * hd]);
    let kv = Value::f32(vec![1, 1, kv_heads * hd], vec![0.2; kv_heads * hd]);
    let mut group = c.benchmark_group("attention_decode_step");
    for context in [64usize, 1024] {
        let mut cache = LayerCache::new(kv_heads, hd, 2048, false);
        let mut out = Value::default();
        group.bench_with_input(BenchmarkId::from_parameter(context), &context, |b, &past| {
            b.iter(|| {
                let inputs = AttentionInputs { q: &q, k: &kv, v: &kv, bias: None, pool: None };
                attention(&spec, &mut cache, past, inputs, &mut out).expect("attention step");
            })
        });
    }
    group.finish();
}

criterion_group!(benches, projections, attention_step);
criterion_main!(benches);
