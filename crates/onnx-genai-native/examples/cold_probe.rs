//! How much of a weight's memory time a kernel hides behind its
//! arithmetic: one SmolLM2-shaped projection (576 inputs, 3072 outputs,
//! int8-input 4-bit, about 1.1 MB; with `f32`, taking f32 inputs) at 1, 2,
//! 8 and 16 rows on every kernel path
//! this CPU has, its weight hot (the same copy every call, in L2) and cold
//! (64 copies in turn, about 70 MB on huge pages as a model's weights are,
//! streamed from memory); best of 5 passes
//! of 64 calls. A kernel that overlaps fully runs cold in the larger of
//! its hot time and the one-row cold time; one that does not, in their sum.
//!
//! `cargo run --release -p onnx-genai-native --example cold_probe -- [THREADS] [ROWS hot|cold|step] [f32]`
//! (with ROWS and a mode: that case alone, 200 passes on the best path, to
//! profile it; `step`: every projection shape of a SmolLM2 decode step at
//! ROWS rows, hot and cold on the best path, and their sum over the step's
//! 121 projections — the projections' share of a batched step with no
//! attention, norms or server around them).

use std::time::Instant;

use onnx_genai_native::kernels::isa::Isa;
use onnx_genai_native::kernels::linear::linear;
use onnx_genai_native::kernels::weights::{Packed, Tiled, Weight};
use onnx_genai_native::kernels::Runtime;

const K: usize = 576;
const N: usize = 3072;
const COPIES: usize = 64;

/// SmolLM2-135M's projections as (outputs, inputs, count in a decode
/// step): per layer the fused query/key/value, the attention output, the
/// fused gate and up, the down projection; then the logits.
const STEP_SHAPES: [(usize, usize, usize); 5] =
    [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)];

/// Mode `step`'s cold copies of each shape hold about this many bytes.
const STEP_COLD_BYTES: usize = 70_000_000;

enum Mode {
    /// Every path, 1 to 16 rows.
    Table,
    /// One case, long enough to profile.
    One { rows: usize, cold: bool },
    /// The step's shapes at `rows` rows.
    Step { rows: usize },
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (flags, args): (Vec<String>, Vec<String>) = std::env::args().skip(1).partition(|a| a == "f32");
    // `f32`: the same weight taking f32 inputs (`accuracy_level` 0, the
    // genai export's projections) instead of int8 ones.
    let int8 = flags.is_empty();
    let threads: usize = args.first().map_or(Ok(1), |t| t.parse())?;
    let mode = match (args.get(1), args.get(2).map(String::as_str)) {
        (Some(rows), Some(mode @ ("hot" | "cold"))) => Mode::One { rows: rows.parse()?, cold: mode == "cold" },
        (Some(rows), Some("step")) => Mode::Step { rows: rows.parse()? },
        (None, None) => Mode::Table,
        _ => return Err("usage: cold_probe [THREADS] [ROWS hot|cold|step] [f32]".into()),
    };
    if let Mode::One { rows, .. } | Mode::Step { rows } = mode {
        if !(1..=16).contains(&rows) {
            return Err(format!("ROWS must be 1 to 16, not {rows}").into());
        }
    }
    let mut rt = Runtime::new(threads)?;
    if let Mode::Step { rows } = mode {
        return step(&rt, rows, int8);
    }
    let (weights, huge) = copies(N, K, COPIES, int8);
    let x = inputs(16, K);
    if let Mode::One { rows, cold } = mode {
        let each = (0..200).map(|_| pass(&rt, &weights, &x, rows, cold)).sum::<f64>() / 200.0;
        println!("{} {rows} rows, {}: {each:.1} µs a call", rt.isa, if cold { "cold" } else { "hot" });
        return Ok(());
    }
    let kind = if int8 { "int8" } else { "f32" };
    let pages = if huge { "huge pages (advised)" } else { "4 KiB pages (the huge-page hint refused)" };
    println!("{K}x{N} {kind}-input 4-bit, {threads} thread(s), weights on {pages}, µs a call (best of 5 passes of {COPIES} calls)");
    for isa in Isa::all_available() {
        rt.isa = isa;
        for rows in [1usize, 2, 8, 16] {
            let (hot, cold) = best(&rt, &weights, &x, rows, 5);
            println!("{isa:<12} {rows:>2} rows: hot {hot:7.1}  cold {cold:7.1}");
        }
    }
    Ok(())
}

/// Mode `step`: each shape's best hot and cold call, and the step's sum.
fn step(rt: &Runtime, rows: usize, int8: bool) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "SmolLM2-135M decode step's projections at {rows} rows, {} thread(s), {}, µs a call",
        rt.pool.threads(),
        rt.isa
    );
    let (mut hot_sum, mut cold_sum, mut macs) = (0.0, 0.0, 0.0);
    for (n, k, count) in STEP_SHAPES {
        // Enough copies of a small shape too that its cold pass streams
        // past the L3.
        let copies_of = (STEP_COLD_BYTES / (n * k / 2)).max(2);
        let (weights, _) = copies(n, k, copies_of, int8);
        let x = inputs(rows, k);
        // About 2,000 calls of each kind, at least 5 passes.
        let (hot, cold) = best(rt, &weights, &x, rows, (2000 / copies_of).max(5));
        let per_thread = |us: f64| (n * k * rows) as f64 / us / 1e3 / rt.pool.threads() as f64;
        println!(
            "{n:>5}x{k:<4} x{count:<2}  hot {hot:7.1} ({:.0} G multiply-adds/s a thread)  cold {cold:7.1} ({:.0})",
            per_thread(hot),
            per_thread(cold)
        );
        hot_sum += hot * count as f64;
        cold_sum += cold * count as f64;
        macs += (n * k * count) as f64;
    }
    println!(
        "step: hot {:.2} ms, cold {:.2} ms ({:.1} M multiply-adds a row)",
        hot_sum / 1e3,
        cold_sum / 1e3,
        macs / 1e6
    );
    Ok(())
}

/// `count` copies of an `n` x `k` 4-bit weight (symmetric, blocks of 32),
/// gathered into one arena as a compiled model's weights are; whether the
/// arena asked for huge pages.
fn copies(n: usize, k: usize, count: usize, int8: bool) -> (Vec<Weight>, bool) {
    let blocks = k / 32;
    let mut weights: Vec<Weight> = (0..count)
        .map(|c| {
            let data = (0..n * blocks * 16).map(|i| ((i + c) * 31 % 256) as u8).collect();
            let packed = Packed::Q4 {
                data,
                scales: vec![0.01; n * blocks],
                zeros: None,
                offsets: None,
                block: 32,
                blocks,
                int8,
            };
            Weight { n, k, packed }.into_tiled()
        })
        .collect();
    // On huge pages, as a compiled model's weights are (`compile.rs`
    // gathers every tiled projection into one arena): on 4 KiB pages
    // a pair's records cross a page boundary every few kilobytes, TLB
    // misses the model never pays (the probe once read 16 rows cold at
    // hot + one-row cold there: memory time the model's kernels hide).
    let mut tiles: Vec<&mut Tiled> = weights
        .iter_mut()
        .filter_map(|w| match &mut w.packed {
            Packed::Tiled(t) => Some(t),
            _ => None,
        })
        .collect();
    // (The weights hold the arena; this handle only reports on it.)
    let huge = onnx_genai_native::kernels::storage::gather(&mut tiles).is_some_and(|a| a.huge_pages_asked());
    (weights, huge)
}

fn inputs(rows: usize, k: usize) -> Vec<f32> {
    (0..rows * k).map(|i| (i as f32 * 0.01).sin()).collect()
}

/// One pass over `weights` at `rows` rows, each call on a cold copy in turn
/// or on the first (hot) every time: µs a call.
fn pass(rt: &Runtime, weights: &[Weight], x: &[f32], rows: usize, cold: bool) -> f64 {
    let k = weights.first().map_or(0, |w| w.k);
    let mut y = Vec::new();
    let started = Instant::now();
    for w in weights {
        let w = if cold { w } else { &weights[0] };
        linear(&x[..rows * k], rows, w, None, &mut y, &rt.ctx());
    }
    started.elapsed().as_secs_f64() * 1e6 / weights.len() as f64
}

/// The best hot and cold pass of `passes` each, alternating.
fn best(rt: &Runtime, weights: &[Weight], x: &[f32], rows: usize, passes: usize) -> (f64, f64) {
    let (mut hot, mut cold) = (f64::MAX, f64::MAX);
    for _ in 0..passes {
        hot = hot.min(pass(rt, weights, x, rows, false));
        cold = cold.min(pass(rt, weights, x, rows, true));
    }
    (hot, cold)
}
