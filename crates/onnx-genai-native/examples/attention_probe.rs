//! A batched decode step's attention alone, SmolLM2-shaped (30 layers, 9
//! query heads over 3 KV heads of 64): B sequences at a context of P
//! positions, every layer in turn and one layer 30 times; best and median
//! of 20 steps (a model's step is a mean, which on a noisy VM is nearer
//! the median than the best). With `evict`, 32 MiB (`evict=MB`: that many
//! MiB) are read between layers on every thread (not timed), as a model's
//! step streams its weights between attentions, so the cache comes from
//! memory as it does there (for the one layer too). (Read by the calling
//! thread alone, the idle workers parked during it, and each layer paid
//! their wake-up: on the Zen 4 of 2026-12-06 that added 0.8-1.0 ms to the
//! 16-sequence step, 3.7-3.9 ms where it now reads 2.9-3.1.) Every cached
//! position is written first (a block never written reads the OS's shared
//! zero page, not memory of its own: before, the probe read 2.1 ms evicted
//! at 16 sequences of 74 positions on a Zen 4 where a real step's attention
//! takes 3.9-4.3). With `rotary`, keys and queries are rotated as
//! SmolLM2's are.
//!
//! `cargo run --release -p onnx-genai-native --example attention_probe -- [THREADS] [B] [P] [f16] [evict[=MB]] [rotary]`

use std::time::Instant;

use onnx_genai_native::kernels::attention::{
    attention, AttentionSpec, Bias, Heads, Layout, RotaryCache, Segment, Step,
};
use onnx_genai_native::kernels::Runtime;
use onnx_genai_native::kv::{KvLayout, KvPool, SeqKv};

const LAYERS: usize = 30;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().map_or(Ok(2), |t| t.parse())?;
    let batch: usize = args.next().map_or(Ok(16), |t| t.parse())?;
    let past: usize = args.next().map_or(Ok(74), |t| t.parse())?;
    let rest: Vec<String> = args.collect();
    let f16 = rest.iter().any(|a| a == "f16");
    // `evict` reads 32 MiB between layers; `evict=MB` that many MiB.
    let evict_mib: usize = match rest.iter().find_map(|a| a.strip_prefix("evict")) {
        None => 0,
        Some("") => 32,
        Some(mb) => mb.trim_start_matches('=').parse()?,
    };
    let evict = evict_mib > 0;
    let rot = rest.iter().any(|a| a == "rotary");
    let (heads, kv_heads, hd) = (9, 3, 64);
    // Rotary tables for positions 0..=past (a rotated half of each head).
    let table = if rot { (past + 1) * hd / 2 } else { 0 };
    let cos: Vec<f32> = (0..table).map(|i| (i as f32 * 0.001).cos()).collect();
    let sin: Vec<f32> = (0..table).map(|i| (i as f32 * 0.001).sin()).collect();
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
    let q: Vec<f32> = (0..batch * heads * hd).map(|i| (i as f32 * 0.37).sin()).collect();
    let kv: Vec<f32> = (0..batch * kv_heads * hd).map(|i| (i as f32 * 0.11).cos()).collect();
    let pool = KvPool::new(KvLayout::new(&[(kv_heads, hd); LAYERS], f16), 0, std::time::Duration::ZERO);
    let mut caches: Vec<SeqKv> = (0..batch)
        .map(|_| {
            let mut c = SeqKv::new(pool.clone(), 4096);
            c.reserve(past + 1);
            // Every position written: blocks never written are the OS's
            // zero page, which stays in the caches however much is read
            // between layers.
            let row: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.07).sin()).collect();
            for l in 0..LAYERS {
                for h in 0..kv_heads {
                    for p in 0..=past {
                        c.write(l, h, p, &row, &row);
                    }
                }
            }
            c.set_len(past);
            c
        })
        .collect();
    let rt = Runtime::new(threads)?;
    let mut out = vec![0.0f32; batch * heads * hd];
    let segments: Vec<Segment> = (0..batch).map(|s| Segment { start: s, len: 1, past }).collect();
    let other: Vec<u64> = vec![1; evict_mib << 17];
    let mut sink = 0u64;
    let mut time_step = |layer_of: &dyn Fn(usize) -> usize| -> Result<f64, String> {
        let mut untimed = 0.0;
        let started = Instant::now();
        for l in 0..LAYERS {
            if evict {
                let reading = Instant::now();
                // Every thread reads its share, as a step's projections
                // stream their weights on every thread: one thread alone
                // left the others idle long enough to park, and each layer
                // then paid their wake-up.
                let threads = rt.pool.threads();
                let share = other.len().div_ceil(threads);
                let total = std::sync::atomic::AtomicU64::new(0);
                rt.pool.run(&|t| {
                    let part = other.chunks(share).nth(t).unwrap_or(&[]);
                    let s = std::hint::black_box(part).iter().sum::<u64>();
                    total.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
                });
                sink = sink.wrapping_add(total.into_inner());
                untimed += reading.elapsed().as_secs_f64() * 1e3;
            }
            let step = Step {
                layer: layer_of(l),
                segments: &segments,
                q: Heads::plain(&q, Layout::SeqFirst, heads, batch, hd),
                k: Heads::plain(&kv, Layout::SeqFirst, kv_heads, batch, hd),
                v: Heads::plain(&kv, Layout::SeqFirst, kv_heads, batch, hd),
                rotary: rot.then(|| RotaryCache { cos: &cos, sin: &sin, half: hd / 2 }),
                bias: None,
            };
            let mut refs: Vec<&mut SeqKv> = caches.iter_mut().collect();
            attention(&spec, &step, &mut refs, &mut out, &rt.ctx())?;
        }
        Ok(started.elapsed().as_secs_f64() * 1e3 - untimed)
    };
    let (mut everys, mut ones) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        everys.push(time_step(&|l| l)?);
        ones.push(time_step(&|_| 0)?);
    }
    everys.sort_by(f64::total_cmp);
    ones.sort_by(f64::total_cmp);
    let (every, one) = (everys[0], ones[0]);
    std::hint::black_box(sink);
    let bytes = (batch * LAYERS * 2 * kv_heads * (past + 1) * hd * if f16 { 2 } else { 4 }) as f64;
    println!(
        "{batch} sequences at {past} positions, {threads} thread(s), {} cache{}: every layer {every:.2} ms a step ({:.1} GB/s of \
         cache; median {:.2}), one layer 30 times {one:.2} ms (median {:.2})",
        if f16 { "f16" } else { "f32" },
        if evict { ", evicted between layers" } else { "" },
        bytes / every / 1e6,
        everys[10],
        ones[10]
    );
    Ok(())
}
