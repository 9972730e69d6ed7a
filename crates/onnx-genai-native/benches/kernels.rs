//! Kernel benchmarks (criterion): the projections at a real model's shape
//! (SmolLM2-135M: hidden 576, MLP 1536) in each weight storage, and the
//! attention step at context 64 vs 1024. End-to-end decode against ONNX
//! Runtime is `cargo xtask bench`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use onnx_genai_native::kernels::attention::{attention, AttentionSpec, Bias, Heads, Layout, Segment, Step};
use onnx_genai_native::kernels::linear::{linear, Packed, Weight};
use onnx_genai_native::kernels::Runtime;
use onnx_genai_native::kv::{KvLayout, KvPool, SeqKv};

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
    let rt = Runtime::serial();
    let mut group = c.benchmark_group("linear_576x1536_decode");
    for (name, weight) in [("f32", &f32w), ("f16", &f16w), ("q4", &q4), ("q4_int8_inputs", &q4i8)] {
        let mut y = Vec::new();
        group.bench_function(name, |b| b.iter(|| linear(&x, 1, weight, None, &mut y, &rt.ctx())));
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
    let q = vec![0.1f32; heads * hd];
    let kv = vec![0.2f32; kv_heads * hd];
    let rt = Runtime::serial();
    let pool = KvPool::new(KvLayout::new(&[(kv_heads, hd)], false), 0);
    let mut group = c.benchmark_group("attention_decode_step");
    for context in [64usize, 1024] {
        let mut cache = SeqKv::new(pool.clone(), 2048);
        cache.reserve(context + 1);
        cache.set_len(context);
        let mut out = vec![0.0f32; heads * hd];
        group.bench_with_input(BenchmarkId::from_parameter(context), &context, |b, &past| {
            b.iter(|| {
                let segments = [Segment { start: 0, len: 1, past }];
                let step = Step {
                    layer: 0,
                    segments: &segments,
                    q: Heads::plain(&q, Layout::SeqFirst, heads, 1, hd),
                    k: Heads::plain(&kv, Layout::SeqFirst, kv_heads, 1, hd),
                    v: Heads::plain(&kv, Layout::SeqFirst, kv_heads, 1, hd),
                    rotary: None,
                    bias: None,
                };
                attention(&spec, &step, &mut [&mut cache], &mut out, &rt.ctx()).expect("attention step");
            })
        });
    }
    group.finish();
}

criterion_group!(benches, projections, attention_step);
criterion_main!(benches);
