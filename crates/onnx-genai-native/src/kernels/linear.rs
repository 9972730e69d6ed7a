//! Projections by constant weights (`x @ W + b`), the cost centre of
//! decode. Tiled weights ([`super::weights::Tiled`], what the compiler
//! leaves every projection it can repack) run the instruction-set kernels
//! of [`super::tiled`]; weights in row form (4-bit blocks that are not a
//! multiple of 32) run the reference path here, which the kernels are
//! tested against.

use super::math::dot;
use super::weights::{Packed, Weight};
use super::Ctx;
use crate::pool::Disjoint;

pub use super::weights::{Tiled, TILE};

/// Below this many multiply-adds a projection runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 15;

/// `y[m, n] = x[m, :] . W[n, :] + bias[n]` for `m` input rows; large
/// products are split across the context's threads.
pub fn linear(x: &[f32], m: usize, w: &Weight, bias: Option<&[f32]>, y: &mut Vec<f32>, ctx: &Ctx) {
    let n = w.n;
    // Not cleared first: every path writes every output, so `resize` zeroes
    // only values past the old length. Clearing zeroed every projection's
    // whole output on the calling thread while the others waited (16 MB a
    // batched decode step at 16 SmolLM2 sequences, `memset` 2% of a `perf`
    // profile of `examples/batch_profile`).
    y.resize(m * n, 0.0);
    match &w.packed {
        Packed::Tiled(t) => super::tiled::linear(t, x, m, y, ctx, ctx.isa),
        _ => reference(x, m, w, y, ctx),
    }
    if let Some(b) = bias {
        // (A projection to no outputs has no rows to add to:
        // `chunks_exact_mut(0)` panics.)
        for row in y.chunks_exact_mut(n.max(1)) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
}

/// Row-form weights: each output row dequantized and dotted with every
/// input row (int8-input weights in exact integer blocks).
pub fn reference(x: &[f32], m: usize, w: &Weight, y: &mut [f32], ctx: &Ctx) {
    let (n, k) = (w.n, w.k);
    if let Packed::Q4 { int8: true, .. } = &w.packed {
        super::linear_int8::linear_q4_int8(x, m, w, y, ctx);
        return;
    }
    let out = Disjoint::new(y);
    let work = |range: std::ops::Range<usize>, t: usize| {
        let mut scratch = ctx.scratch.take(t);
        for r in range {
            let row = w.row(r, &mut scratch.a);
            for mi in 0..m {
                // SAFETY: output column `r` belongs to this range only.
                let o = unsafe { out.slice(mi * n + r, 1) };
                o[0] = dot(&x[mi * k..(mi + 1) * k], row);
            }
        }
    };
    if m * n * k >= PARALLEL_MIN_MACS {
        ctx.pool.for_ranges(n, TILE, &work);
    } else {
        work(0..n, ctx.pool.inline_index());
    }
}

/// SiLU-gated MLP input stage: `w` stacks the gate rows over the up rows;
/// returns `silu(x Wg) * (x Wu)`. A prefill's rows are gated in parallel
/// (one `exp` per value: serial, it was a tenth of a 128-token prefill's
/// MLP on two threads).
pub fn gated(x: &[f32], m: usize, w: &Weight, scratch: &mut Vec<f32>, y: &mut Vec<f32>, ctx: &Ctx) {
    linear(x, m, w, None, scratch, ctx);
    let inter = w.n / 2;
    // Every value is written below (not cleared first: see `linear`).
    y.resize(m * inter, 0.0);
    let products: &[f32] = scratch;
    let out = Disjoint::new(y);
    let work = |rows: std::ops::Range<usize>, _t: usize| {
        for i in rows {
            let (gate, up) = products[i * w.n..(i + 1) * w.n].split_at(inter);
            // SAFETY: row `i` of the output belongs to this range only.
            let o = unsafe { out.slice(i * inter, inter) };
            super::simd::silu_mul(gate, up, o);
        }
    };
    if m * inter >= PARALLEL_MIN_GATES {
        ctx.pool.for_ranges(m, 1, &work);
    } else {
        work(0..m, 0);
    }
}

/// Members a split projection stacks at most (the compiler makes several
/// stacks of more): its outputs are then held without allocating.
pub const MAX_STACKED: usize = 4;

/// Stacked sibling projections ([`crate::ops::Op::SplitLinear`]): the
/// product over every member's rows into `scratch`, then member `i`'s
/// `widths[i]` columns of each row into `outs[i]` (at most
/// [`MAX_STACKED`]). Each output's values are its member's alone, computed
/// as a projection of that member would.
pub fn split(
    x: &[f32],
    m: usize,
    w: &Weight,
    widths: &[usize],
    scratch: &mut Vec<f32>,
    outs: &mut [Vec<f32>],
    ctx: &Ctx,
) {
    debug_assert_eq!(widths.iter().sum::<usize>(), w.n, "the widths cover the stacked outputs");
    debug_assert!(outs.len() == widths.len() && outs.len() <= MAX_STACKED);
    linear(x, m, w, None, scratch, ctx);
    let products: &[f32] = scratch;
    // Every value is written below (not cleared first: see `linear`).
    for (y, &width) in outs.iter_mut().zip(widths) {
        y.resize(m * width, 0.0);
    }
    let targets: smallvec::SmallVec<[Disjoint<'_, f32>; MAX_STACKED]> =
        outs.iter_mut().map(|y| Disjoint::new(y)).collect();
    let work = |rows: std::ops::Range<usize>, _t: usize| {
        for r in rows {
            let mut first = 0;
            for (y, &width) in targets.iter().zip(widths) {
                // SAFETY: row `r` of each output belongs to this range only.
                let out = unsafe { y.slice(r * width, width) };
                out.copy_from_slice(&products[r * w.n + first..r * w.n + first + width]);
                first += width;
            }
        }
    };
    // A prefill's rows are copied by all the threads (0.5 MB a SmolLM2
    // layer at 128 rows); a decode step's few rows inline.
    if m * w.n >= PARALLEL_MIN_GATES {
        ctx.pool.for_ranges(m, 1, &work);
    } else {
        work(0..m, 0);
    }
}

/// From this many gated values on, rows are gated in parallel (a batch of
/// 8 SmolLM2 rows, 12,288 values, ran serially below 2^14 while the other
/// thread waited: 2% of a batched decode step).
const PARALLEL_MIN_GATES: usize = 1 << 11;

#[cfg(test)]
mod tests {
    use half::f16;

    use super::super::isa::Isa;
    use super::super::weights::TileData;
    use super::super::Runtime;
    use super::*;
    use crate::pool::ThreadPool;
    use std::time::Duration;

    fn naive(x: &[f32], m: usize, w_kn: &[f32], k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|p| x[i * k + p] * w_kn[p * n + j]).sum();
            }
        }
        y
    }

    fn q4(n: usize, k: usize, block: usize, zeros: bool, int8: bool) -> Weight {
        let blocks = k.div_ceil(block);
        let data: Vec<u8> = (0..n * blocks * block / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<f32> = (0..n * blocks).map(|i| 0.01 * (i % 7 + 1) as f32).collect();
        let zeros = zeros.then(|| (0..n * blocks.div_ceil(2)).map(|i| (i * 29 % 256) as u8).collect());
        Weight { n, k, packed: Packed::Q4 { data, scales, zeros, offsets: None, block, blocks, int8 } }
    }

    /// The reference path equals the naive product (one row, a few rows,
    /// threaded or not).
    #[test]
    fn reference_matches_naive() {
        let one = Runtime::serial();
        let two = Runtime::new(2).unwrap();
        for (m, k, n) in [(1, 7, 5), (2, 33, 17), (5, 16, 9), (1, 256, 300), (3, 256, 300)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 * 0.1 - 0.5).collect();
            let w: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 13) as f32 * 0.05 - 0.3).collect();
            let packed = Weight::from_kn_f32(&w, k, n);
            let want = naive(&x, m, &w, k, n);
            for rt in [&one, &two] {
                let mut y = Vec::new();
                linear(&x, m, &packed, None, &mut y, &rt.ctx());
                for (a, b) in y.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-4, "m={m} k={k} n={n}: {a} vs {b}");
                }
            }
        }
    }

    /// Lossless narrowing (issue 15's item 5): an f32 weight whose values
    /// are all f16 (an f16 table widened by constant folding) is stored as
    /// f16, one whose values sit on an 8-bit grid as 8-bit blocks, one of
    /// Q4_1's dequantized values as affine 4-bit blocks (with a partial
    /// last block, blocks of equal values (`d = 0`) and a subnormal `d`),
    /// and each gives back the f32 rows bit for bit and computes bit for
    /// bit what the f32 weight computes, on every instruction-set path, at
    /// every row count the kernels split differently (decode, batches,
    /// prefill); one value off the grid keeps the weight f32.
    #[test]
    fn narrowed_weights_compute_what_f32_computes() {
        // K = 80: two whole blocks of 32 and a partial one of 16.
        let (n, k): (usize, usize) = (40, 80);
        let halves: Vec<f32> =
            (0..n * k).map(|i| f16::from_f32(((i * 37 % 101) as f32 - 50.0) * 0.0123).to_f32()).collect();
        let grid: Vec<f32> =
            (0..n * k).map(|i| if i % k % 32 == 0 { 127.0 } else { (i * 7 % 255) as f32 - 127.0 } * 0.01).collect();
        let affine = q4_1_dequantized(n, k);
        let mut off_grid = affine.clone();
        off_grid[77] = f32::from_bits(off_grid[77].to_bits() + 1);
        // A -0.0 has no 8-bit level (level 0 computes +0.0).
        let mut negative_zero = grid.clone();
        negative_zero[5] = -0.0;
        assert_eq!(Weight { n, k, packed: Packed::F32(negative_zero) }.narrowed().kind(), "f32", "-0.0 stays f32");
        assert_eq!(Weight { n, k, packed: Packed::F32(off_grid) }.narrowed().kind(), "f32", "one value off stays f32");
        for (values, kind) in [(halves, "f16"), (grid, "q8"), (affine, "q4")] {
            let wide = Weight { n, k, packed: Packed::F32(values.clone()) };
            let narrow = wide.clone().narrowed();
            assert_eq!(narrow.kind(), kind, "exact values narrow");
            assert!(narrow.bytes() < wide.bytes());
            let (wide, narrow) = (wide.into_tiled(), narrow.into_tiled());
            let label = if kind == "f16" { "f16".to_string() } else { format!("f32 as {kind}") };
            assert_eq!(narrow.label(), label, "named for what it computes");
            assert_reproduces(&wide, &narrow, &values, kind);
        }
    }

    /// Narrowing proves a weight's rows in parallel ranges, one per thread
    /// of the pool it runs on: on the calling thread alone or pools of 2
    /// and 3 threads (96 rows; and 2 rows and none, fewer than threads),
    /// Q4_1's values (f32 and f16), Q8_0's (f16) and an 8-bit grid of
    /// max/127 steps (f32), a partial last block included,
    /// narrow to the same bytes; and one value off the grid in the last
    /// range keeps the whole weight wide (no range's success covers for
    /// another's failure). Watched red with a range's rows written one
    /// range too far down and with later ranges' results ignored.
    #[test]
    fn narrowing_in_parallel_ranges_is_narrowing_in_one() {
        let (n, k) = (96, 1050);
        let halves = |v: &[f32]| -> Vec<f16> { v.iter().map(|v| f16::from_f32(*v)).collect() };
        let grid: Vec<f32> =
            (0..n * k).map(|i| if i % k % 32 == 0 { 127.0 } else { (i * 17 % 255) as f32 - 127.0 } * 0.0625).collect();
        let (q4_1, q8_0) = (q4_1_dequantized(n, k), q8_0_dequantized(n, k));
        let cases = [
            (Packed::F32(q4_1.clone()), "q4"),
            (Packed::F16(halves(&q4_1)), "q4"),
            (Packed::F16(halves(&q8_0)), "q8"),
            (Packed::F32(grid.clone()), "q8"),
        ];
        let pools: Vec<ThreadPool> =
            [2, 3].into_iter().map(|t| ThreadPool::new(t, Duration::ZERO).expect("test threads")).collect();
        for (packed, kind) in cases {
            let w = Weight { n, k, packed };
            let one = w.narrower_on(&ThreadPool::serial()).map(|p| Weight { n, k, packed: p });
            let one = one.unwrap_or_else(|| panic!("{} {kind} values narrow", w.kind()));
            assert_eq!(one.kind(), kind);
            for pool in &pools {
                let split = w.narrower_on(pool).map(|p| format!("{p:?}"));
                assert_eq!(split, Some(format!("{:?}", one.packed)), "{} {kind} on {pool:?}", w.kind());
            }
        }
        // Fewer rows than threads, and none: a range of one row each, the
        // empty ones skipped.
        for n in [0, 2] {
            let w = Weight { n, k, packed: Packed::F16(halves(&q8_0_dequantized(n, k))) };
            let one = w.narrower_on(&ThreadPool::serial()).map(|p| format!("{p:?}"));
            assert!(one.is_some(), "{n} rows of Q8_0's values narrow");
            for pool in &pools {
                assert_eq!(w.narrower_on(pool).map(|p| format!("{p:?}")), one, "{n} rows on {pool:?}");
            }
        }
        // Off every grid, and not an f16 either (an f32 weight of f16
        // values would narrow to f16).
        for values in [q4_1, grid] {
            let mut off = values;
            off[(n - 1) * k + 5] += 1e-6;
            let off = Weight { n, k, packed: Packed::F32(off) };
            assert!(off.narrower_on(&ThreadPool::serial()).is_none(), "one value off the grid on one thread");
            for pool in &pools {
                assert!(off.narrower_on(pool).is_none(), "one value off the grid on {pool:?}");
            }
        }
    }

    /// GGUF Q4_1 dequantized: per block of 32 of a row, f16 `d` and `m`,
    /// levels 0..=15 (both ends present), `d * q + m` in f32; with blocks
    /// of equal values (`d = 0`), a subnormal `d`, and (K = 80) a partial
    /// last block.
    fn q4_1_dequantized(n: usize, k: usize) -> Vec<f32> {
        let blocks = k.div_ceil(32);
        (0..n * k)
            .map(|i| {
                let (r, c) = (i / k, i % k);
                let (block, j) = (r * blocks + c / 32, c % 32);
                let d = match block % 13 {
                    3 => 0.0,
                    5 => f16::from_bits(0x0011).to_f32(), // subnormal
                    _ => f16::from_f32(0.003 + (block % 7) as f32 * 0.0011).to_f32(),
                };
                let m = f16::from_f32(-0.02 - (block % 5) as f32 * 0.004).to_f32();
                let q = match j {
                    0 => 0,
                    1 => 15,
                    _ => (i * 7 % 16) as u8,
                };
                d * f32::from(q) + m
            })
            .collect()
    }

    /// GGUF Q8_0 dequantized: per block of 32 of a row, an f16 scale `d`
    /// and levels in -127..=127 (the largest magnitude 127, or 126 where
    /// the block's f16 scale was rounded up), `d * q` in f32; a block of
    /// zeros (`d = 0`: Q8_0 then stores levels of 0, so every value is
    /// +0.0) and a subnormal `d` among them.
    fn q8_0_dequantized(n: usize, k: usize) -> Vec<f32> {
        let blocks = k.div_ceil(32);
        (0..n * k)
            .map(|i| {
                let (r, c) = (i / k, i % k);
                let (block, j) = (r * blocks + c / 32, c % 32);
                let d = match block % 11 {
                    4 => 0.0,
                    6 => f16::from_bits(0x0023).to_f32(), // subnormal
                    _ => f16::from_f32(0.0007 + (block % 9) as f32 * 0.00013).to_f32(),
                };
                let top = if block % 3 == 0 { 126 } else { 127 };
                let q = match j {
                    0 => top,
                    1 => -top + 1,
                    _ => (i * 37 % 253) as i32 - 126,
                };
                if d == 0.0 {
                    0.0
                } else {
                    d * q as f32
                }
            })
            .collect()
    }

    /// `values` rounded to f16 and narrowed, which must give `kind`.
    fn f16_narrowed(values: Vec<f32>, n: usize, k: usize, kind: &str) -> Weight {
        let halves = values.iter().map(|v| f16::from_f32(*v)).collect();
        let w = Weight { n, k, packed: Packed::F16(halves) }.narrowed();
        assert_eq!(w.label(), format!("f16 as {kind}"));
        w
    }

    /// Lossless narrowing of an f16 weight (issue 15's item 5): Q4_1's
    /// and Q8_0's dequantized values rounded to f16 (the f16 export's
    /// projections and its tied output projection) are stored as those
    /// blocks, each computed weight rounded to f16, give back the f16 rows
    /// bit for bit and compute bit for bit what the f16 weight computes,
    /// on every instruction-set path and at every row count the kernels
    /// split differently; the same values widened to f32 (as constant
    /// folding widens a tied table) narrow the same way; one value off the
    /// grid keeps the weight f16.
    #[test]
    fn narrowed_f16_weights_compute_what_f16_computes() {
        let (n, k): (usize, usize) = (40, 80);
        for (values, kind) in [(q4_1_dequantized(n, k), "q4"), (q8_0_dequantized(n, k), "q8")] {
            let halves: Vec<f16> = values.iter().map(|v| f16::from_f32(*v)).collect();
            // Rounding must matter, or this would test the f32 case again.
            let rounded = values.iter().zip(&halves).filter(|(v, h)| h.to_f32() != **v).count();
            assert!(rounded > n * k / 4, "{kind}: only {rounded} values changed by rounding to f16");
            let mut off_grid = halves.clone();
            off_grid[77] = f16::from_bits(off_grid[77].to_bits() + 1);
            let off = Weight { n, k, packed: Packed::F16(off_grid) }.narrowed();
            assert_eq!(off.kind(), "f16", "{kind}: one value off stays f16");
            let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
            let from_f32 = Weight { n, k, packed: Packed::F32(widened) }.narrowed();
            assert_eq!(from_f32.kind(), kind, "f16 values widened to f32 narrow alike");
            let wide = Weight { n, k, packed: Packed::F16(halves.clone()) };
            let narrow = wide.clone().narrowed();
            assert_eq!(narrow.kind(), kind, "exact values narrow");
            assert!(narrow.bytes() < wide.bytes());
            let (wide, narrow) = (wide.into_tiled(), narrow.into_tiled());
            // Named for what it computes, so a tier is chosen by the f16.
            assert_eq!(narrow.label(), format!("f16 as {kind}"));
            let rounds = match &narrow.packed {
                Packed::Tiled(t) => matches!(
                    t.data,
                    TileData::Q4 { per_weight: true, rounds_to_f16: true, .. }
                        | TileData::Q8 { rounds_to_f16: true, .. }
                ),
                _ => false,
            };
            assert!(rounds, "{kind}: narrowed from f16, the weight must round to f16");
            let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
            assert_reproduces(&wide, &narrow, &widened, kind);
        }
    }

    /// `narrow` (tiled) holds `values` (the rows of `wide`) bit for bit and
    /// computes bit for bit what `wide` computes, on every instruction-set
    /// path, at every row count the kernels split differently (decode,
    /// batches, prefill).
    fn assert_reproduces(wide: &Weight, narrow: &Weight, values: &[f32], kind: &str) {
        let (n, k) = (wide.n, wide.k);
        let mut row = Vec::new();
        for r in 0..n {
            let back = narrow.row(r, &mut row);
            let same = back.iter().zip(&values[r * k..(r + 1) * k]).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{kind} row {r}: the narrowed weight holds other values");
        }
        for m in [1, 2, 3, 4, 5, 8, 13, 21, 40, 70] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 19) as f32 - 9.0) * 0.11).collect();
            for isa in Isa::all_available() {
                let rt = Runtime::new(2).unwrap();
                let mut ctx = rt.ctx();
                ctx.isa = isa;
                let (mut a, mut b) = (Vec::new(), Vec::new());
                linear(&x, m, wide, None, &mut a, &ctx);
                linear(&x, m, narrow, None, &mut b, &ctx);
                let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "{kind} {isa} m={m}: the narrowed weight computes other values");
            }
        }
    }

    /// A split projection (Q, K and V stacked, `Op::SplitLinear`) gives
    /// each member exactly the bits its own projection gives, on every
    /// instruction-set path, storage (f32, f32 and f16 narrowed to affine
    /// 4-bit blocks, f16, 4-bit with and without zero points, int8 inputs), row
    /// count (decode, batches, AMX-sized and GEMM-sized) and thread count,
    /// with member boundaries inside a tile (40 + 24 + 24 outputs) and on
    /// tile edges (64 + 16 + 16).
    #[test]
    fn split_outputs_are_each_members_own_bits() {
        let k = 96;
        let f32_rows = |n: usize, seed: usize| -> Vec<f32> {
            (0..n * k).map(|i| ((i * 13 + seed * 7) % 29) as f32 * 0.031 - 0.4).collect()
        };
        // Q4_1-style values (`d * q + m` per block of 32): narrow to
        // affine 4-bit blocks.
        let affine = |n: usize, seed: usize| -> Vec<f32> {
            (0..n * k)
                .map(|i| {
                    let block = i / 32 + seed;
                    let d = f16::from_f32(0.002 + (block % 7) as f32 * 0.001).to_f32();
                    let m = f16::from_f32(-0.01 - (block % 5) as f32 * 0.003).to_f32();
                    d * ((i * 7 + seed) % 16) as f32 + m
                })
                .collect()
        };
        type Make<'a> = &'a dyn Fn(usize, usize) -> Weight;
        let storages: [(&str, Make); 8] = [
            ("f32", &|n, s| Weight { n, k, packed: Packed::F32(f32_rows(n, s)) }),
            ("affine", &|n, s| Weight { n, k, packed: Packed::F32(affine(n, s)) }),
            ("affine f16", &|n, s| Weight {
                n,
                k,
                packed: Packed::F16(affine(n, s).iter().map(|v| f16::from_f32(*v)).collect()),
            }),
            ("f16", &|n, s| Weight {
                n,
                k,
                packed: Packed::F16(f32_rows(n, s).iter().map(|v| f16::from_f32(*v)).collect()),
            }),
            ("q4", &|n, _| q4(n, k, 32, false, false)),
            ("q4 zeros", &|n, _| q4(n, k, 32, true, false)),
            ("q4i8", &|n, _| q4(n, k, 32, false, true)),
            ("q4i8 zeros", &|n, _| q4(n, k, 32, true, true)),
        ];
        for (name, make) in storages {
            for widths in [[40, 24, 24], [64, 16, 16]] {
                let members: Vec<Weight> = widths.iter().enumerate().map(|(i, &n)| make(n, i)).collect();
                let stacked =
                    members.iter().skip(1).fold(members[0].clone(), |s, w| Weight::stack(s, w.clone()).unwrap());
                let stacked = stacked.narrowed().into_tiled();
                let members: Vec<Weight> = members.into_iter().map(|w| w.narrowed().into_tiled()).collect();
                assert_eq!(stacked.label(), members[0].label(), "{name}: the stack is stored as its members");
                let narrowed_as = match name {
                    "affine" => "f32 as q4",
                    "affine f16" => "f16 as q4",
                    _ => members[0].kind(),
                };
                assert_eq!(stacked.label(), narrowed_as, "{name}: narrowed as it should be");
                for threads in [1, 2] {
                    let rt = Runtime::new(threads).unwrap();
                    for isa in Isa::all_available() {
                        let mut ctx = rt.ctx();
                        ctx.isa = isa;
                        for m in [1, 2, 4, 5, 8, 9, 16, 70] {
                            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 19) as f32 - 9.0) * 0.11).collect();
                            let mut outs = vec![vec![f32::NAN; 3]; 3];
                            split(&x, m, &stacked, &widths, &mut Vec::new(), &mut outs, &ctx);
                            for (i, (member, got)) in members.iter().zip(&outs).enumerate() {
                                let mut want = Vec::new();
                                linear(&x, m, member, None, &mut want, &ctx);
                                let same = got.len() == want.len()
                                    && got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                                assert!(same, "{name} {widths:?} {isa} {threads}t m={m}: member {i} differs");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every instruction-set path this CPU has computes, on tiled weights
    /// of every storage, what the reference path computes on the row form:
    /// decode (1 row), small batches and prefill-sized row counts (every
    /// row-chunk size of the kernels), partial tiles and blocks, tile pairs
    /// and a single tile, one and two threads; every output written (the
    /// buffers start as NaN). int8-input products are
    /// exact integer block sums, so they must agree to the last bit; f32
    /// inputs to rounding.
    #[test]
    fn every_isa_matches_the_reference_on_every_storage() {
        // 53 outputs are 4 tiles (pairs only); 40 are 3, so a thread's
        // range can end in a single tile, the kernels' one-tile path.
        for (n, k) in [(53, 96), (40, 96)] {
            let wf: Vec<f32> = (0..n * k).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.03).collect();
            let halves: Vec<f16> = wf.iter().map(|v| f16::from_f32(*v)).collect();
            let q8: Vec<f32> = (0..n * 80)
                .map(|i| if i % 80 % 32 == 0 { -127.0 } else { (i * 17 % 255) as f32 - 127.0 } * 0.0625)
                .collect();
            let weights = [
                Weight { n, k: 80, packed: Packed::F32(q8) }.narrowed(),
                // (a narrowed weight must really be 8-bit)
                Weight { n, k, packed: Packed::F32(wf.clone()) },
                Weight { n, k, packed: Packed::F16(halves) },
                q4(n, k, 32, false, false),
                q4(n, k, 32, true, false),
                q4(n, 80, 32, true, false),
                q4(n, 128, 64, false, false),
                q4(n, k, 32, false, true),
                q4(n, 80, 32, true, true),
                q4(n, 128, 64, true, true),
                // Symmetric int8-input blocks of 64: the zero share that
                // starts the integer sums spans two records.
                q4(n, 128, 64, false, true),
                // GGUF Q4_1-like blocks: f16 scales and `aux` (one f16 line).
                crate::kernels::weights::affine_q4(n, k, false, true),
                crate::kernels::weights::affine_q4(n, 80, true, true),
                // Q4_1's and Q8_0's values rounded to f16, narrowed (each
                // computed weight rounded to f16 again).
                f16_narrowed(q4_1_dequantized(n, 80), n, 80, "q4"),
                f16_narrowed(q8_0_dequantized(n, 96), n, 96, "q8"),
            ];
            for w in &weights {
                every_isa_matches_the_reference_on(w);
            }
        }
    }

    /// Pins the accuracy `kernels::limbs` claims for AVX-512 VNNI's
    /// f32-input 4-bit path (decode rows, at most 2 a call): inputs are held
    /// to 2^-30 of their block's largest and each block's integer sum is
    /// exact, so an output is off the exact product (f64) by at most 1e-6
    /// of `Σ |w| · (largest |x| of w's block)` — inputs spanning 40
    /// binades; symmetric, zero-point and f16-`aux` weights; tile pairs and
    /// a single tile. (The bound is the blocks' largest inputs', not the
    /// output's: an input far below its block's largest loses bits.)
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vnni_f32_input_q4_rows_are_within_rounding_of_the_exact_product() {
        if !vnni_here() {
            return;
        }
        let k = 96;
        for n in [53, 40] {
            let weights = [
                q4(n, k, 32, false, false),
                q4(n, k, 32, true, false),
                crate::kernels::weights::affine_q4(n, k, false, true),
            ];
            for w in &weights {
                let tiled = w.clone().into_tiled();
                let mut scratch = Vec::new();
                let rows: Vec<Vec<f32>> = (0..n).map(|r| w.row(r, &mut scratch).to_vec()).collect();
                for m in [1, 2, 3, 5, 7] {
                    let x: Vec<f32> = (0..m * k)
                        .map(|i| {
                            let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                            sign * 2f32.powi((i * 7 % 40) as i32 - 20) * (1.0 + (i % 13) as f32 / 16.0)
                        })
                        .collect();
                    let got = vnni_linear(&x, m, &tiled);
                    for r in super::super::avx512::limb_rows(m) {
                        let x = &x[r * k..(r + 1) * k];
                        let largest: Vec<f64> =
                            x.chunks(32).map(|b| b.iter().fold(0.0f64, |a, v| a.max(f64::from(v.abs())))).collect();
                        for (o, weights) in rows.iter().enumerate() {
                            let exact: f64 = weights.iter().zip(x).map(|(w, x)| f64::from(*w) * f64::from(*x)).sum();
                            let size: f64 =
                                weights.iter().enumerate().map(|(c, w)| f64::from(w.abs()) * largest[c / 32]).sum();
                            let error = (f64::from(got[r * n + o]) - exact).abs();
                            assert!(
                                error <= 1e-6 * size,
                                "{} n={n} m={m} row {r} out {o}: off by {error:e} of {size:e}",
                                w.kind()
                            );
                        }
                    }
                }
            }
        }
    }

    /// The same path on inputs whose exact product is an f32 (multiples of
    /// 2^-19 with one input of 2^10 per block against a zero weight, a
    /// symmetric weight of scale 1/64): every output must be that product
    /// to the last bit, which pins each of the four limbs, the lowest
    /// included (a digit of 2^-19 here), where rounding hides them from the
    /// test above.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vnni_f32_input_q4_rows_are_exact_where_the_product_is_an_f32() {
        if !vnni_here() {
            return;
        }
        let (n, k) = (40, 96);
        let blocks = k / 32;
        // Nibble 8 (weight 0) for each block's first input, else spread.
        let nibble = |o: usize, c: usize| if c.is_multiple_of(32) { 8 } else { ((o * 5 + c * 3) % 16) as u8 };
        let data: Vec<u8> =
            (0..n * k / 2).map(|i| nibble(2 * i / k, 2 * i % k) | (nibble(2 * i / k, 2 * i % k + 1) << 4)).collect();
        let w = Weight {
            n,
            k,
            packed: Packed::Q4 {
                data,
                scales: vec![1.0 / 64.0; n * blocks],
                zeros: None,
                offsets: None,
                block: 32,
                blocks,
                int8: false,
            },
        };
        let tiled = w.clone().into_tiled();
        let mut scratch = Vec::new();
        for m in [1, 2, 3] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| if i.is_multiple_of(32) { 1024.0 } else { ((i * 37 % 2001) as f32 - 1000.0) * 2f32.powi(-19) })
                .collect();
            let got = vnni_linear(&x, m, &tiled);
            for r in 0..m {
                for o in 0..n {
                    let row = w.row(o, &mut scratch);
                    let exact: f64 = row.iter().zip(&x[r * k..]).map(|(w, x)| f64::from(*w) * f64::from(*x)).sum();
                    assert_eq!(f64::from(exact as f32), exact, "the test's product is an f32");
                    assert_eq!(got[r * n + o], exact as f32, "m={m} row {r} out {o}");
                }
            }
        }
    }

    /// Whether this CPU has AVX-512 VNNI (a test without it says so and
    /// passes: the path cannot run here).
    #[cfg(target_arch = "x86_64")]
    fn vnni_here() -> bool {
        let here = Isa::Avx512Vnni.available();
        if !here {
            eprintln!("skipped: this CPU has no AVX-512 VNNI");
        }
        here
    }

    /// `linear` on AVX-512 VNNI, two threads.
    #[cfg(target_arch = "x86_64")]
    fn vnni_linear(x: &[f32], m: usize, tiled: &Weight) -> Vec<f32> {
        let rt = Runtime::new(2).unwrap();
        let mut ctx = rt.ctx();
        ctx.isa = Isa::Avx512Vnni;
        let mut got = Vec::new();
        linear(x, m, tiled, None, &mut got, &ctx);
        got
    }

    /// One weight of the test above: its tiled form on every path, thread
    /// count and row count against the reference on its row form.
    fn every_isa_matches_the_reference_on(w: &Weight) {
        let runtimes = [Runtime::serial(), Runtime::new(2).unwrap()];
        let tiled = w.clone().into_tiled();
        assert!(matches!(tiled.packed, Packed::Tiled(_)), "{} tiles", w.kind());
        if let (Packed::Q4 { offsets: Some(_), .. }, Packed::Tiled(t)) = (&w.packed, &tiled.packed) {
            assert!(matches!(t.data, TileData::Q4 { half: true, .. }), "the f16-record path is the one tested");
        }
        for m in [1, 2, 3, 4, 5, 8, 13, 16, 17, 21, 40, 70] {
            let x: Vec<f32> = (0..m * w.k).map(|i| ((i * 7 % 19) as f32 - 9.0) * 0.11).collect();
            // Outputs start as NaN: no path may leave one unwritten (the
            // output buffer is not cleared before a projection).
            let mut want = vec![f32::NAN; m * w.n];
            reference(&x, m, w, &mut want, &runtimes[0].ctx());
            for (isa, rt) in Isa::all_available().into_iter().flat_map(|isa| runtimes.iter().map(move |rt| (isa, rt))) {
                let mut ctx = rt.ctx();
                ctx.isa = isa;
                let mut got = vec![f32::NAN; m * w.n + 5];
                linear(&x, m, &tiled, None, &mut got, &ctx);
                assert_eq!(got.len(), want.len(), "{} {isa} m={m}: outputs", w.kind());
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    let close = if w.int8_inputs() {
                        a.to_bits() == b.to_bits()
                    } else {
                        (a - b).abs() <= 2e-5 * (1.0 + b.abs())
                    };
                    assert!(close, "{} {isa} m={m} out {i}: {a} vs reference {b}", w.kind());
                }
            }
        }
    }
}
