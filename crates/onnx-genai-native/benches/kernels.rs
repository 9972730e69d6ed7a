//! Kernel benchmarks (criterion), at SmolLM2-135M's shapes: every weight
//! storage (f32, f16, 8-bit, 4-bit with f32 sides, with f16 sides as GGUF
//! Q4_1 gives, narrowed from f32 values and computed weight by weight, and
//! with int8 inputs) on every instruction-set path this CPU has, as a decode
//! projection (one row: the weight streamed once, reported in GB/s of
//! weight bytes read) and as a prefill (128 rows: reported in GFLOP/s);
//! the GEMM microkernel alone; the attention step at context 64 vs
//! 1024; and a parallel region's own cost. End-to-end decode against ONNX Runtime is `cargo xtask bench`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use onnx_genai_native::kernels::attention::{attention, AttentionSpec, Bias, Heads, Layout, Segment, Step};
use onnx_genai_native::kernels::isa::Isa;
use onnx_genai_native::kernels::linear::linear;
use onnx_genai_native::kernels::weights::{Packed, TileData, Tiled, Weight};
use onnx_genai_native::kernels::Runtime;
use onnx_genai_native::kv::{KvLayout, KvPool, SeqKv};

/// SmolLM2-135M's MLP input projection: 576 inputs, 1536 x 2 outputs (gate
/// and up stacked), large enough to leave the L2 cache.
const K: usize = 576;
const N: usize = 3072;

fn storages() -> Vec<(&'static str, Weight)> {
    let w: Vec<f32> = (0..K * N).map(|i| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5).collect();
    let halves: Vec<half::f16> = w.iter().map(|v| half::f16::from_f32(*v)).collect();
    let blocks = K / 32;
    let q4 = |int8| Packed::Q4 {
        data: (0..N * blocks * 16).map(|i| (i * 31 % 256) as u8).collect(),
        scales: vec![0.01; N * blocks],
        zeros: None,
        offsets: None,
        block: 32,
        blocks,
        int8,
    };
    // GGUF Q4_1 blocks (the `int4` export): scales and offsets on a grid
    // of 1/64, so both sides are stored as f16.
    let q4_1_sides = Packed::Q4 {
        data: (0..N * blocks * 16).map(|i| (i * 31 % 256) as u8).collect(),
        scales: (0..N * blocks).map(|i| (i % 5 + 1) as f32 / 64.0).collect(),
        zeros: None,
        offsets: Some((0..N * blocks).map(|i| -((i % 9) as f32) / 64.0).collect()),
        block: 32,
        blocks,
        int8: false,
    };
    // The same blocks dequantized to f32 (the `f32` export): `d * q + m`
    // per block, narrowed back to 4 bits and computed weight by weight.
    let q4_1_values: Vec<f32> = (0..K * N)
        .map(|i| {
            let block = i / 32;
            let d = half::f16::from_f32(0.003 + (block % 7) as f32 * 0.0011).to_f32();
            let m = half::f16::from_f32(-0.02 - (block % 5) as f32 * 0.004).to_f32();
            let q = if i % 32 == 0 { 15 } else { (i * 7 % 16) as u8 };
            d * f32::from(q) + m
        })
        .collect();
    let q4_1_halves: Vec<half::f16> = q4_1_values.iter().map(|v| half::f16::from_f32(*v)).collect();
    let grid: Vec<f32> =
        (0..K * N).map(|i| if i % 32 == 0 { 127.0 } else { (i * 7 % 255) as f32 - 127.0 } * 0.01).collect();
    vec![
        ("f32", Weight::from_kn_f32(&w, K, N)),
        ("f16", Weight::from_kn_f16(&halves, K, N)),
        ("q8", Weight { n: N, k: K, packed: Packed::F32(grid) }.narrowed()),
        ("q4", Weight { n: N, k: K, packed: q4(false) }),
        ("q4_f16_sides", Weight { n: N, k: K, packed: q4_1_sides }),
        ("q4_narrowed_f32", Weight { n: N, k: K, packed: Packed::F32(q4_1_values) }.narrowed()),
        // The same values rounded to f16 (the `f16` export).
        ("q4_narrowed_f16", Weight { n: N, k: K, packed: Packed::F16(q4_1_halves) }.narrowed()),
        ("q4_int8_inputs", Weight { n: N, k: K, packed: q4(true) }),
    ]
    .into_iter()
    .map(|(name, w)| {
        // A storage that does not become what it is named for measures
        // something else.
        let expected = match name {
            "q4_int8_inputs" => "q4i8",
            q4 if q4.starts_with("q4") => "q4",
            other => other,
        };
        assert_eq!(w.kind(), expected, "bench storage {name}");
        let w = w.into_tiled();
        if let Packed::Tiled(Tiled { data: TileData::Q4 { half, per_weight, .. }, .. }) = &w.packed {
            assert_eq!(
                *half,
                name.contains("f16_sides") || name.contains("narrowed"),
                "bench storage {name}: f16 sides"
            );
            assert_eq!(*per_weight, name.starts_with("q4_narrowed"), "bench storage {name}: weight by weight");
        }
        (name, w)
    })
    .collect()
}

fn projections(c: &mut Criterion) {
    let rows = 128;
    let x: Vec<f32> = (0..rows * K).map(|i| (i as f32 * 0.01).sin()).collect();
    for threads in [1, 2] {
        for isa in Isa::all_available() {
            let mut rt = Runtime::new(threads).expect("thread pool");
            rt.isa = isa;
            for (name, weight) in storages() {
                let mut y = Vec::new();
                let mut group = c.benchmark_group(format!("decode_{K}x{N}_{threads}t"));
                group.throughput(Throughput::Bytes(weight.bytes() as u64));
                group.bench_function(format!("{name}/{isa}"), |b| {
                    b.iter(|| linear(&x[..K], 1, &weight, None, &mut y, &rt.ctx()))
                });
                group.finish();
                let mut group = c.benchmark_group(format!("prefill{rows}_{K}x{N}_{threads}t"));
                // Elements = multiply-adds; criterion prints them per second.
                group.throughput(Throughput::Elements((rows * K * N) as u64));
                group.sample_size(10);
                group.bench_function(format!("{name}/{isa}"), |b| {
                    b.iter(|| linear(&x, rows, &weight, None, &mut y, &rt.ctx()))
                });
                group.finish();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn microkernel(c: &mut Criterion) {
    use onnx_genai_native::kernels::avx512_gemm::{gemm_panel, MR};
    if !Isa::Avx512.available() {
        return;
    }
    let mut group = c.benchmark_group("gemm_microkernel_12x32");
    for kp in [64usize, 576, 1536] {
        let a = vec![0.5f32; kp * MR];
        let b = vec![0.25f32; kp * 32];
        let mut out = vec![0f32; MR * 32];
        let base = out.as_mut_ptr();
        // SAFETY: row `r` starts `32 r` values into `out`, which holds `MR * 32`.
        let ptrs: [*mut f32; MR] = std::array::from_fn(|r| unsafe { base.add(r * 32) });
        group.throughput(Throughput::Elements((kp * MR * 32) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(kp), &kp, |bench, &kp| {
            // SAFETY: AVX-512 is available (checked above); `a` holds `kp * MR`
            // values, `b` `kp * 32`, and every row pointer 32 writable values.
            bench.iter(|| unsafe { gemm_panel(a.as_ptr(), b.as_ptr(), kp, MR, &ptrs, 32) })
        });
    }
    group.finish();
}

#[cfg(not(target_arch = "x86_64"))]
fn microkernel(_: &mut Criterion) {}

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
    let mut group = c.benchmark_group("attention_decode_step");
    // An f32 cache and an f16 one (f16 models' caches: widened as read).
    for (cache_type, f16) in [("f32", false), ("f16", true)] {
        let pool = KvPool::new(KvLayout::new(&[(kv_heads, hd)], f16), 0, std::time::Duration::ZERO);
        for context in [64usize, 1024] {
            let mut cache = SeqKv::new(pool.clone(), 2048);
            cache.reserve(context + 1);
            cache.set_len(context);
            let mut out = vec![0.0f32; heads * hd];
            group.bench_with_input(BenchmarkId::new(cache_type, context), &context, |b, &past| {
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
    }
    group.finish();
}

/// A batched decode step: `B` sequences' rows through one projection on
/// one thread, in multiply-adds per second. One row streams the weight
/// (memory-bound); each further row reuses every decoded weight vector, so
/// the rate should grow with `B` until the kernel's arithmetic bounds it.
fn batched_decode(c: &mut Criterion) {
    let rows = 16;
    let x: Vec<f32> = (0..rows * K).map(|i| (i as f32 * 0.01).sin()).collect();
    for isa in Isa::all_available() {
        let mut rt = Runtime::new(1).expect("thread pool");
        rt.isa = isa;
        for (name, weight) in storages() {
            let mut y = Vec::new();
            let mut group = c.benchmark_group(format!("batch_{K}x{N}_1t/{name}/{isa}"));
            group.sample_size(20);
            for b in [1usize, 2, 4, 8, 16] {
                group.throughput(Throughput::Elements((b * K * N) as u64));
                group.bench_with_input(BenchmarkId::from_parameter(b), &b, |bench, &b| {
                    bench.iter(|| linear(&x[..b * K], b, &weight, None, &mut y, &rt.ctx()))
                });
            }
            group.finish();
        }
    }
}

/// A call's int8 input rows quantized (`accuracy_level` 4), as each
/// thread of a projection quantizes all of them for itself: 16 rows of
/// SmolLM2's 576 and 1536 inputs, in values per second. A 16-sequence
/// decode step quantizes about 1.6 M values on every thread.
fn quantize_rows(c: &mut Criterion) {
    use onnx_genai_native::kernels::quantize::quantize;
    let mut group = c.benchmark_group("quantize_16_rows");
    for k in [576usize, 1536] {
        let x: Vec<f32> = (0..16 * k).map(|i| (i as f32 * 0.01).sin()).collect();
        let (mut q, mut scales, mut sums) = (Vec::new(), Vec::new(), Vec::new());
        group.throughput(Throughput::Elements(x.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(k), &k, |b, _| {
            b.iter(|| {
                q.clear();
                scales.clear();
                sums.clear();
                quantize(&x, 32, &mut q, &mut scales, &mut sums);
            })
        });
    }
    group.finish();
}

/// What a parallel region costs beyond its work, on two threads: an empty
/// one (the hand-off and the barrier) and one of SmolLM2's smallest
/// projection's claims (its 576 outputs are 18 tile pairs, claimed 3 at
/// most at a time, as `tiled::linear` splits them). A decode step runs
/// about 180 regions.
fn pool_regions(c: &mut Criterion) {
    use onnx_genai_native::pool::{ThreadPool, DEFAULT_SPIN};
    let pool = ThreadPool::new(2, DEFAULT_SPIN).expect("thread pool");
    let mut group = c.benchmark_group("pool_region_2t");
    group.bench_function("empty", |b| {
        b.iter(|| {
            pool.run(&|t| {
                std::hint::black_box(t);
            })
        })
    });
    group.bench_function("claimed_18_by_3", |b| {
        b.iter(|| {
            pool.for_claimed_ranges(18, 3, &|r, t| {
                std::hint::black_box((r, t));
            })
        })
    });
    group.finish();
}

criterion_group!(benches, projections, batched_decode, microkernel, attention_step, pool_regions, quantize_rows);
criterion_main!(benches);
