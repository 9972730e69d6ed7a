//! One sampled token's draw on SmolLM2's vocabulary (49,152 logits, shaped
//! like a model's: a few likely tokens over a long tail), per option set.
//! It runs on the model's driver thread once per sequence a step, while
//! the model's other threads wait: it must stay small beside a decode step.
//! Also a flat distribution, the worst case of a draw that sorts only the
//! likeliest tokens first.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use onnx_genai_engine::sampling::{Sampler, Sampling};

fn logits() -> Vec<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..49_152)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let noise = (s >> 40) as f32 / (1u64 << 24) as f32;
            // A tail of noise around -2, a few tokens well above it.
            if i % 4_096 == 7 {
                12.0 + noise
            } else {
                noise * 8.0 - 6.0
            }
        })
        .collect()
}

fn draws(c: &mut Criterion) {
    let logits = logits();
    let mut group = c.benchmark_group("sample_49152");
    let sets = [
        ("t1", Sampling { temperature: 1.0, ..Sampling::default() }),
        ("t1_top_p0.9", Sampling { temperature: 1.0, top_p: 0.9, ..Sampling::default() }),
        ("t0.7_top_k40", Sampling { temperature: 0.7, top_k: 40, ..Sampling::default() }),
        ("t1_min_p0.05", Sampling { temperature: 1.0, min_p: 0.05, ..Sampling::default() }),
    ];
    for (name, options) in sets {
        let mut sampler = Sampler::new(options);
        group.bench_with_input(BenchmarkId::from_parameter(name), &logits, |b, l| b.iter(|| sampler.pick(l)));
    }
    // The worst case: a flat distribution (every token within a logit of
    // the others), where a draw lands anywhere in the vocabulary.
    let flat: Vec<f32> = logits.iter().map(|l| (l * 0.1).sin()).collect();
    for (name, top_p) in [("flat_t1", 1.0), ("flat_t1_top_p0.9", 0.9)] {
        let mut sampler = Sampler::new(Sampling { temperature: 1.0, top_p, ..Sampling::default() });
        group.bench_with_input(BenchmarkId::from_parameter(name), &flat, |b, l| b.iter(|| sampler.pick(l)));
    }
    group.finish();
}

criterion_group!(benches, draws);
criterion_main!(benches);
