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
//! `cargo run --release -p onnx-genai-native --example cold_probe -- [THREADS] [ROWS hot|cold] [f32]`
//! (with ROWS and a mode: that case alone, 200 passes on the best path, to
//! profile it).

use std::time::Instant;

use onnx_genai_native::kernels::isa::Isa;
use onnx_genai_native::kernels::linear::linear;
use onnx_genai_native::kernels::weights::{Packed, Tiled, Weight};
use onnx_genai_native::kernels::Runtime;

const K: usize = 576;
const N: usize = 3072;
const COPIES: usize = 64;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (flags, args): (Vec<String>, Vec<String>) = std::env::args().skip(1).partition(|a| a == "f32");
    // `f32`: the same weight taking f32 inputs (`accuracy_level` 0, the
    // genai export's projections) instead of int8 ones.
    let int8 = flags.is_empty();
    let threads: usize = args.first().map_or(Ok(1), |t| t.parse())?;
    let only: Option<(usize, bool)> = match (args.get(1), args.get(2).map(String::as_str)) {
        (Some(rows), Some(mode @ ("hot" | "cold"))) => Some((rows.parse()?, mode == "cold")),
        (None, None) => None,
        _ => return Err("usage: cold_probe [THREADS] [ROWS hot|cold] [f32]".into()),
    };
    let blocks = K / 32;
    let mut weights: Vec<Weight> = (0..COPIES)
        .map(|c| {
            let data = (0..N * blocks * 16).map(|i| ((i + c) * 31 % 256) as u8).collect();
            let packed = Packed::Q4 {
                data,
                scales: vec![0.01; N * blocks],
                zeros: None,
                offsets: None,
                block: 32,
                blocks,
                int8,
            };
            Weight { n: N, k: K, packed }.into_tiled()
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
    let x: Vec<f32> = (0..16 * K).map(|i| (i as f32 * 0.01).sin()).collect();
    let mut rt = Runtime::new(threads)?;
    // One pass of COPIES calls at `rows` rows, weight cold or hot: µs a call.
    let pass = |rt: &Runtime, rows: usize, cold: bool| {
        let mut y = Vec::new();
        let started = Instant::now();
        for w in &weights {
            let w = if cold { w } else { &weights[0] };
            linear(&x[..rows * K], rows, w, None, &mut y, &rt.ctx());
        }
        started.elapsed().as_secs_f64() * 1e6 / COPIES as f64
    };
    if let Some((rows, cold)) = only {
        if !(1..=16).contains(&rows) {
            return Err(format!("ROWS must be 1 to 16, not {rows}").into());
        }
        let each = (0..200).map(|_| pass(&rt, rows, cold)).sum::<f64>() / 200.0;
        println!("{} {rows} rows, {}: {each:.1} µs a call", rt.isa, if cold { "cold" } else { "hot" });
        return Ok(());
    }
    let inputs = if int8 { "int8" } else { "f32" };
    let pages = if huge { "huge pages (advised)" } else { "4 KiB pages (the huge-page hint refused)" };
    println!("{K}x{N} {inputs}-input 4-bit, {threads} thread(s), weights on {pages}, µs a call (best of 5 passes of {COPIES} calls)");
    for isa in Isa::all_available() {
        rt.isa = isa;
        for rows in [1usize, 2, 8, 16] {
            let (mut hot, mut cold) = (f64::MAX, f64::MAX);
            for _ in 0..5 {
                hot = hot.min(pass(&rt, rows, false));
                cold = cold.min(pass(&rt, rows, true));
            }
            println!("{isa:<12} {rows:>2} rows: hot {hot:7.1}  cold {cold:7.1}");
        }
    }
    Ok(())
}
