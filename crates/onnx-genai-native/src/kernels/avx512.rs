//! AVX-512 tile kernels (and AVX-512 VNNI for int8 inputs). A tile is one
//! 512-bit register of 16 output rows; two tiles are interleaved so their
//! dependency chains overlap, and up to 8 input rows share every weight
//! vector a tile decodes (a prefill or a batch reads each weight once per
//! chunk of rows, from L1).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::ops::Range;

use super::limbs::{BLOCK_BYTES, LIMBS};
use super::tiled::{Ahead, Rows};
use super::weights::{TileData, Tiled, QBLOCK, TILE};
use crate::pool::Disjoint;

/// Runs the kernel for `t`'s storage over `tiles`, every input row.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL/DQ (and AVX-512 VNNI when `vnni`);
/// `rows` must hold `m` rows of `t.kp` values (and their quantization for
/// int8-input weights; for f32-input 4-bit weights the block sums of every
/// row a call of at most 4 rows takes, and with `vnni` the limbs of the
/// rows [`limb_rows`] names, whose block sums only an asymmetric weight
/// needs); `y` must hold `m * t.n` values.
pub unsafe fn tiles(t: &Tiled, rows: &Rows<'_>, tiles: Range<usize>, y: &Disjoint<'_, f32>, vnni: bool) {
    // SAFETY: forwarded contract (VNNI only when the caller says the CPU
    // has it).
    unsafe {
        if vnni {
            tiles_vnni(t, rows, tiles, y)
        } else {
            tiles_plain(t, rows, tiles, y)
        }
    }
}

// Two entry points, one body: `vpdpbusd` only inlines into code compiled
// with `avx512vnni` enabled. Called from a function without it, each
// intrinsic stays an out-of-line call that spills its three vectors
// (measured: the VNNI path ran 7x slower than the plain AVX-512 one). The
// plain entry must not enable VNNI either: LLVM would then fuse
// `vpmaddwd` + `vpaddd` into VNNI instructions a non-VNNI CPU lacks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tiles_plain(t: &Tiled, rows: &Rows<'_>, tiles: Range<usize>, y: &Disjoint<'_, f32>) {
    // SAFETY: forwarded contract.
    unsafe { tiles_body::<false>(t, rows, tiles, y) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512vnni")]
unsafe fn tiles_vnni(t: &Tiled, rows: &Rows<'_>, tiles: Range<usize>, y: &Disjoint<'_, f32>) {
    // SAFETY: forwarded contract.
    unsafe { tiles_body::<true>(t, rows, tiles, y) }
}

/// Inlined into each entry point, so it is compiled with that entry's
/// features.
#[inline(always)]
unsafe fn tiles_body<const VNNI: bool>(t: &Tiled, rows: &Rows<'_>, tiles: Range<usize>, y: &Disjoint<'_, f32>) {
    // Int8 inputs run at most 4 rows a call: 8 rows x 2 tiles keep 16
    // integer sums beside 16 row results, more than the 32 registers, and
    // the spills made 8 rows slower per multiply-add than 4 (criterion
    // `batch_576x3072_1t/q4_int8_inputs/avx512-vnni`, one thread: 90 G/s
    // at 8 rows against 106 at 4 on a Zen 4; run as two calls of 4, 8 rows
    // went from 97 to 124 G/s and 16 from 101 to 134 in adjacent runs).
    // Nor does one tile of 8 rows pay (half the nibble unpacking per
    // multiply-add, but a broadcast load per `vpdpbusd`): 8 and 16 rows ran
    // 22-25% slower than pairs of 4 rows on an Intel Xeon (criterion, same
    // hour, with the low/high nibble sums split or not).
    let eight = !matches!(t.data, TileData::Q4 { int8: true, .. });
    let limbs = VNNI && matches!(t.data, TileData::Q4 { int8: false, per_weight: false, .. });
    let mut tile = tiles.start;
    while tile < tiles.end {
        let pair = tiles.end - tile >= 2;
        let mut r = 0;
        while r < rows.m {
            // SAFETY: forwarded contract; `tile` (and `tile + 1` for a pair)
            // and rows `r..` are in bounds.
            unsafe {
                match (pair, rows_per_call(rows.m - r, eight, limbs)) {
                    (true, 8) => r += dispatch::<2, 8, VNNI>(t, rows, tile, r, y),
                    (true, 4) => r += dispatch::<2, 4, VNNI>(t, rows, tile, r, y),
                    (true, 2) => r += dispatch::<2, 2, VNNI>(t, rows, tile, r, y),
                    (true, _) => r += dispatch::<2, 1, VNNI>(t, rows, tile, r, y),
                    (false, 8) => r += dispatch::<1, 8, VNNI>(t, rows, tile, r, y),
                    (false, 4) => r += dispatch::<1, 4, VNNI>(t, rows, tile, r, y),
                    (false, 2) => r += dispatch::<1, 2, VNNI>(t, rows, tile, r, y),
                    (false, _) => r += dispatch::<1, 1, VNNI>(t, rows, tile, r, y),
                }
            }
        }
        tile += if pair { 2 } else { 1 };
    }
}

/// The rows [`tiles_body`]'s next kernel call takes with `left` rows to go
/// (8 only where `eight`; no 4 where the rows go through [`q4_limbs`],
/// which takes 2: two calls of 2 limb rows ran 4 rows 15% faster than
/// [`q4_blocks`]' one of 4, `batch_576x3072_1t/q4/avx512-vnni`).
/// (Inlined: called, it left `tiles_body`'s match on its result compiled
/// less well — 16 int8-input rows ran 8% slower.)
#[inline(always)]
fn rows_per_call(left: usize, eight: bool, limbs: bool) -> usize {
    match left {
        8.. if eight => 8,
        4.. if !limbs => 4,
        2.. => 2,
        _ => 1,
    }
}

/// The rows of an `m`-row call that [`tiles_body`] computes at most two at
/// a time (those it reaches after its calls of 8): on VNNI, f32-input
/// 4-bit weights take these through [`q4_limbs`], whose inputs `linear`
/// splits first. Walked from [`rows_per_call`], so the two cannot
/// disagree.
pub(crate) fn limb_rows(m: usize) -> Range<usize> {
    let mut r = 0;
    while r < m {
        let call = rows_per_call(m - r, true, true);
        if call <= 2 {
            return r..m;
        }
        r += call;
    }
    m..m
}

/// `T` tiles from `tile`, `R` rows from `r`; returns `R`.
#[inline(always)]
unsafe fn dispatch<const T: usize, const R: usize, const VNNI: bool>(
    t: &Tiled,
    rows: &Rows<'_>,
    tile: usize,
    r: usize,
    y: &Disjoint<'_, f32>,
) -> usize {
    let base = t.as_bytes().as_ptr();
    // A pair's records interleave: both tiles step by the same stride.
    let stride = t.place(tile).1;
    let w: [*const u8; T] = std::array::from_fn(|i| base.add(t.place(tile + i).0));
    let x = rows.x.as_ptr().add(r * rows.kp);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // The first rows of a pair fetch the next pair's records into the cache
    // step by step (pairs are stored one after another, so the next starts
    // where this one ends); the pass of this pair's other rows, or the next
    // call, finds them there. genai-int8 export, `examples/batch_profile`,
    // medians of five alternating runs: a decode step went from 2.72 to
    // 2.34 ms at B = 1, 8.04 to 7.04 at B = 8, 14.99 to 13.75 at B = 16.
    let ahead = (T == 2 && r == 0).then(|| Ahead(w[0].wrapping_add(t.steps() * stride)));
    match t.data {
        TileData::F32 => f32_cols::<T, R>(&w, stride, t.k, x, rows.kp, ahead, &mut acc),
        TileData::F16 => f16_cols::<T, R>(&w, stride, t.k, x, rows.kp, ahead, &mut acc),
        TileData::Q8 { blocks, rounds_to_f16: false } => {
            q8_cols::<T, R, false>(&w, stride, blocks, x, rows.kp, ahead, &mut acc)
        }
        TileData::Q8 { blocks, rounds_to_f16: true } => {
            q8_cols::<T, R, true>(&w, stride, blocks, x, rows.kp, ahead, &mut acc)
        }
        TileData::Q4 { blocks, int8: false, symmetric, half, per_weight: false, .. } if VNNI && R <= 2 => {
            let limbs = &rows.limbs;
            debug_assert_eq!(blocks, rows.kp / QBLOCK, "one record per 32 inputs");
            debug_assert!(
                r >= limbs.first
                    && limbs.scales.len() >= (r - limbs.first + R) * blocks
                    && limbs.digits.len() >= (r - limbs.first + R) * blocks * BLOCK_BYTES
                    && limbs.sums.len() >= (r - limbs.first + R) * blocks * LIMBS
                    && (symmetric || rows.xsum.len() >= (r + R) * blocks),
                "rows {r}..{} were not split into limbs",
                r + R
            );
            let first = (r - limbs.first) * blocks;
            let (digits, scales) = (limbs.digits.as_ptr().add(first * BLOCK_BYTES), limbs.scales.as_ptr().add(first));
            // (A symmetric weight's rows have no block sums: never read.)
            let (sums, xsum) = (limbs.sums.as_ptr().add(first * LIMBS), rows.xsum.as_ptr().wrapping_add(r * blocks));
            q4_limbs::<T, R>(&w, stride, (blocks, symmetric, half), (digits, scales, sums), xsum, ahead, &mut acc)
        }
        // (Per block, `scale · Σ q x + aux · Σ x`: fewer operations, but
        // not the f32 kernels' rounding, which a narrowed f32 weight keeps.)
        TileData::Q4 { blocks, int8: false, symmetric, half, per_weight: false, .. } if R <= 4 => {
            debug_assert!(rows.xsum.len() >= (r + R) * blocks, "block sums of rows {r}..{} were not computed", r + R);
            let xsum = rows.xsum.as_ptr().add(r * blocks);
            q4_blocks::<T, R>(&w, stride, (blocks, symmetric, half), x, xsum, rows.kp, ahead, &mut acc)
        }
        TileData::Q4 { blocks, int8: false, symmetric, half, rounds_to_f16: false, .. } => {
            q4_cols::<T, R, false>(&w, stride, (blocks, symmetric, half), x, rows.kp, ahead, &mut acc)
        }
        TileData::Q4 { blocks, int8: false, symmetric, half, rounds_to_f16: true, .. } => {
            q4_cols::<T, R, true>(&w, stride, (blocks, symmetric, half), x, rows.kp, ahead, &mut acc)
        }
        TileData::Q4 { blocks, int8: true, x_block, symmetric, .. } => {
            let q = rows.q.as_ptr().add(r * rows.kp);
            let s = rows.qscale.as_ptr().add(r * blocks);
            let sums = rows.qsum.as_ptr().add(r * blocks);
            let sub = (x_block / QBLOCK).max(1);
            q4_int8::<T, R, VNNI>(&w, stride, (blocks, sub, symmetric), q, s, sums, rows.kp, ahead, &mut acc)
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            let first = (tile + j) * TILE;
            let width = TILE.min(t.n - first);
            // SAFETY: outputs `first..first + width` of row `r + i` belong to
            // this tile, computed by this thread alone.
            let out = unsafe { y.slice((r + i) * t.n + first, width) };
            _mm512_mask_storeu_ps(out.as_mut_ptr(), ((1u32 << width) - 1) as u16, *v);
        }
    }
    R
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn f32_cols<const T: usize, const R: usize>(
    w: &[*const u8; T],
    stride: usize,
    k: usize,
    x: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m512; T]; R],
) {
    for c in 0..k {
        if let Some(next) = ahead {
            next.fetch(c * stride, stride);
        }
        let wv: [__m512; T] = std::array::from_fn(|j| _mm512_loadu_ps(w[j].add(c * stride).cast()));
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*x.add(r * kp + c));
            for j in 0..T {
                row[j] = _mm512_fmadd_ps(wv[j], xv, row[j]);
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn f16_cols<const T: usize, const R: usize>(
    w: &[*const u8; T],
    stride: usize,
    k: usize,
    x: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m512; T]; R],
) {
    for c in 0..k {
        let at = (c / 2) * stride + (c % 2) * 32;
        if let (Some(next), 0) = (ahead, c % 2) {
            next.fetch(at, stride);
        }
        let wv: [__m512; T] =
            std::array::from_fn(|j| _mm512_cvtph_ps(_mm256_loadu_si256(w[j].add(at).cast::<__m256i>())));
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*x.add(r * kp + c));
            for j in 0..T {
                row[j] = _mm512_fmadd_ps(wv[j], xv, row[j]);
            }
        }
    }
}

/// 8-bit weights (narrowed f32), f32 inputs: each column's 16 bytes
/// sign-extend to f32, are scaled once (`q * scale`, the exact weight) and
/// shared by every row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn q8_cols<const T: usize, const R: usize, const F16: bool>(
    w: &[*const u8; T],
    stride: usize,
    blocks: usize,
    x: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m512; T]; R],
) {
    for b in 0..blocks {
        if let Some(next) = ahead {
            next.fetch(b * stride, stride);
        }
        let rec: [*const u8; T] = std::array::from_fn(|j| w[j].add(b * stride));
        let scale: [__m512; T] = std::array::from_fn(|j| _mm512_loadu_ps(rec[j].add(512).cast()));
        for col in 0..QBLOCK {
            let c = b * QBLOCK + col;
            let wv: [__m512; T] = std::array::from_fn(|j| {
                let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(rec[j].add(16 * col).cast()));
                let wv = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale[j]);
                if F16 {
                    to_f16_and_back(wv)
                } else {
                    wv
                }
            });
            for (r, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add(r * kp + c));
                for j in 0..T {
                    row[j] = _mm512_fmadd_ps(wv[j], xv, row[j]);
                }
            }
        }
    }
}

/// 4-bit weights, f32 inputs, few rows (decode): per block `Σ q · x` in f32
/// (the nibble becomes its float through a 16-entry table lookup on its low
/// four bits, no mask and no conversion), then `scale · Σ q x + aux · Σ x`.
/// One row keeps two accumulator sets (even and odd inputs) so the FMA
/// chains overlap.
#[inline]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn q4_blocks<const T: usize, const R: usize>(
    w: &[*const u8; T],
    stride: usize,
    (blocks, symmetric, half): (usize, bool, bool),
    x: *const f32,
    xsum: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m512; T]; R],
) {
    let lut = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
    let per_row = kp / QBLOCK;
    for b in 0..blocks {
        if let Some(next) = ahead {
            next.fetch(b * stride, stride);
        }
        let rec: [*const u8; T] = std::array::from_fn(|j| w[j].add(b * stride));
        let mut blk = [[[_mm512_setzero_ps(); T]; R]; 2];
        for i in 0..4 {
            let v: [__m512i; T] = std::array::from_fn(|j| _mm512_loadu_si512(rec[j].add(i * 64).cast()));
            macro_rules! column {
                ($shift:literal, $col:expr) => {{
                    let c = b * QBLOCK + 8 * i + $col;
                    let set = if R == 1 { $col % 2 } else { 0 };
                    let wv: [__m512; T] = std::array::from_fn(|j| {
                        let q = if $shift == 0 { v[j] } else { _mm512_srli_epi32::<$shift>(v[j]) };
                        _mm512_permutexvar_ps(q, lut)
                    });
                    for r in 0..R {
                        let xv = _mm512_set1_ps(*x.add(r * kp + c));
                        for j in 0..T {
                            blk[set][r][j] = _mm512_fmadd_ps(wv[j], xv, blk[set][r][j]);
                        }
                    }
                }};
            }
            column!(0, 0);
            column!(8, 1);
            column!(16, 2);
            column!(24, 3);
            column!(4, 4);
            column!(12, 5);
            column!(20, 6);
            column!(28, 7);
        }
        let sides: [(__m512, __m512); T] = std::array::from_fn(|j| scale_aux(rec[j], symmetric, half));
        let (scale, aux): ([__m512; T], [__m512; T]) =
            (std::array::from_fn(|j| sides[j].0), std::array::from_fn(|j| sides[j].1));
        for (r, row) in acc.iter_mut().enumerate() {
            let xs = _mm512_set1_ps(*xsum.add(r * per_row + b));
            for j in 0..T {
                let sum = if R == 1 { _mm512_add_ps(blk[0][r][j], blk[1][r][j]) } else { blk[0][r][j] };
                row[j] = _mm512_fmadd_ps(sum, scale[j], row[j]);
                row[j] = _mm512_fmadd_ps(aux[j], xs, row[j]);
            }
        }
    }
}

/// `v` rounded to f16 (to nearest, ties to even) and widened back: the
/// weight an f16 export stored, for a weight narrowed from it
/// (`TileData::Q4::rounds_to_f16`, `TileData::Q8::rounds_to_f16`).
#[inline(always)]
pub(super) unsafe fn to_f16_and_back(v: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v))
}

/// 4-bit weights, f32 inputs, many rows (prefill, large batches): each
/// weight is decoded once to `q * scale + aux` (its f32 value) and shared by
/// every row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn q4_cols<const T: usize, const R: usize, const F16: bool>(
    w: &[*const u8; T],
    stride: usize,
    (blocks, symmetric, half): (usize, bool, bool),
    x: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m512; T]; R],
) {
    // The nibble's float through a 16-entry table lookup on its low four
    // bits (no mask, no conversion: one uop fewer per weight vector, the
    // same value `cvt(q & 15)` gives).
    let lut = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
    for b in 0..blocks {
        if let Some(next) = ahead {
            next.fetch(b * stride, stride);
        }
        let rec: [*const u8; T] = std::array::from_fn(|j| w[j].add(b * stride));
        let sides: [(__m512, __m512); T] = std::array::from_fn(|j| scale_aux(rec[j], symmetric, half));
        let (scale, aux): ([__m512; T], [__m512; T]) =
            (std::array::from_fn(|j| sides[j].0), std::array::from_fn(|j| sides[j].1));
        for i in 0..4 {
            let v: [__m512i; T] = std::array::from_fn(|j| _mm512_loadu_si512(rec[j].add(i * 64).cast()));
            macro_rules! column {
                ($shift:literal, $col:expr) => {{
                    let c = b * QBLOCK + 8 * i + $col;
                    let wv: [__m512; T] = std::array::from_fn(|j| {
                        let q = if $shift == 0 { v[j] } else { _mm512_srli_epi32::<$shift>(v[j]) };
                        let wv = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, lut), scale[j], aux[j]);
                        if F16 {
                            to_f16_and_back(wv)
                        } else {
                            wv
                        }
                    });
                    for (r, row) in acc.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(*x.add(r * kp + c));
                        for j in 0..T {
                            row[j] = _mm512_fmadd_ps(wv[j], xv, row[j]);
                        }
                    }
                }};
            }
            // Byte t of a lane: input 8i + t low, 8i + 4 + t high.
            column!(0, 0);
            column!(8, 1);
            column!(16, 2);
            column!(24, 3);
            column!(4, 4);
            column!(12, 5);
            column!(20, 6);
            column!(28, 7);
        }
    }
}

/// 4-bit weights, int8 inputs (`accuracy_level` 4): per quantization block
/// (`sub` records of 32) the exact integer sum `Σ q · xq`, minus
/// `zero · Σ xq`, scaled by the weight's and the input's scales — ONNX
/// Runtime's integer path.
///
/// Symmetric and zero-point weights run as two compiled bodies: with the
/// choice a run-time flag, its branch in every group's epilogue and the
/// row results kept behind the caller's reference (stored and reloaded
/// each group) cost 2.5% of 8- and 16-row calls, and summing the
/// group's input sums in a loop where a group is one record (`sub` = 1,
/// SmolLM2's blocks of 32) 3% more, 10% of a one-row call
/// (`examples/cold_probe`, one thread, hot weight, three alternating pairs
/// on a Zen 4: 8 rows 93.0-93.6 → 87.2-87.8 µs, 16 rows 182.7-183.6 →
/// 172.3-174.7, 1 row 19.6-20.4 → 16.7-17.1; the same bits).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_int8<const T: usize, const R: usize, const VNNI: bool>(
    w: &[*const u8; T],
    stride: usize,
    (blocks, sub, symmetric): (usize, usize, bool),
    q: *const i8,
    qscale: *const f32,
    qsum: *const i32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m512; T]; R],
) {
    if symmetric {
        q4_int8_body::<T, R, VNNI, true>(w, stride, (blocks, sub), q, qscale, qsum, kp, ahead, acc)
    } else {
        q4_int8_body::<T, R, VNNI, false>(w, stride, (blocks, sub), q, qscale, qsum, kp, ahead, acc)
    }
}

/// [`q4_int8`] for one kind of weight (`SYMMETRIC`: no zero points).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_int8_body<const T: usize, const R: usize, const VNNI: bool, const SYMMETRIC: bool>(
    w: &[*const u8; T],
    stride: usize,
    (blocks, sub): (usize, usize),
    q: *const i8,
    qscale: *const f32,
    qsum: *const i32,
    kp: usize,
    ahead: Option<Ahead>,
    acc_out: &mut [[__m512; T]; R],
) {
    // (In registers through the groups, written back once.)
    let mut acc = *acc_out;
    let nibble = _mm512_set1_epi8(0x0f);
    let ones = _mm512_set1_epi16(1);
    let per_row = kp / QBLOCK;
    for g in 0..blocks / sub {
        // Fewer than 8 (row, tile) chains: low and high nibbles accumulate
        // apart, two chains each, so enough independent chains hide the
        // latency. Four rows of a pair (8 chains, the most a call takes)
        // run unsplit: criterion `batch_576x3072_1t/q4_int8_inputs/
        // avx512-vnni` at 4, 8 and 16 rows went from 181 to 194-196 G/s on
        // an Intel Xeon with AVX-512 VNNI (the split's extra accumulators
        // and adds cost more than its latency hiding gains there; measured
        // on that CPU only — the split at 8 chains was never measured
        // against unsplit on a Zen 4).
        let split = R * T < 8;
        // The group's quantized-input sum per row: the zero point's share
        // `zero · Σ xq`.
        let totals: [i32; R] = if sub == 1 {
            std::array::from_fn(|r| *qsum.add(r * per_row + g))
        } else {
            std::array::from_fn(|r| (g * sub..(g + 1) * sub).map(|b| *qsum.add(r * per_row + b)).sum())
        };
        // A symmetric weight's zero point is 8 for every output: its share
        // starts the integer sums (exact in i32, so the sum converts to the
        // same f32 the subtraction after conversion gave), which saves a
        // multiply-add per row and tile in every group.
        let mut sums: [[[__m512i; 2]; T]; R] = std::array::from_fn(|r| {
            let start = if SYMMETRIC { _mm512_set1_epi32(-8 * totals[r]) } else { _mm512_setzero_si512() };
            [[start, _mm512_setzero_si512()]; T]
        });
        for b in g * sub..(g + 1) * sub {
            let rec: [*const u8; T] = std::array::from_fn(|j| w[j].add(b * stride));
            if let Some(next) = ahead {
                next.fetch(b * stride, stride);
            }
            for i in 0..4 {
                let v: [__m512i; T] = std::array::from_fn(|j| _mm512_loadu_si512(rec[j].add(i * 64).cast()));
                let lo: [__m512i; T] = std::array::from_fn(|j| _mm512_and_si512(v[j], nibble));
                let hi: [__m512i; T] = std::array::from_fn(|j| _mm512_and_si512(_mm512_srli_epi16::<4>(v[j]), nibble));
                for (r, s) in sums.iter_mut().enumerate() {
                    let at = q.add(r * kp + b * QBLOCK + 8 * i);
                    let xa = _mm512_set1_epi32(at.cast::<i32>().read_unaligned());
                    let xb = _mm512_set1_epi32(at.add(4).cast::<i32>().read_unaligned());
                    for j in 0..T {
                        let h = usize::from(split);
                        if VNNI {
                            s[j][0] = _mm512_dpbusd_epi32(s[j][0], lo[j], xa);
                            s[j][h] = _mm512_dpbusd_epi32(s[j][h], hi[j], xb);
                        } else {
                            let pa = _mm512_madd_epi16(_mm512_maddubs_epi16(lo[j], xa), ones);
                            let pb = _mm512_madd_epi16(_mm512_maddubs_epi16(hi[j], xb), ones);
                            s[j][0] = _mm512_add_epi32(s[j][0], pa);
                            s[j][h] = _mm512_add_epi32(s[j][h], pb);
                        }
                    }
                }
            }
        }
        let rec: [*const u8; T] = std::array::from_fn(|j| w[j].add(g * sub * stride));
        let scale: [__m512; T] = std::array::from_fn(|j| _mm512_loadu_ps(rec[j].add(256).cast()));
        for (r, row) in acc.iter_mut().enumerate() {
            let sx = _mm512_set1_ps(*qscale.add(r * per_row + g * sub));
            let total = _mm512_set1_ps(totals[r] as f32);
            for j in 0..T {
                let int = _mm512_cvtepi32_ps(_mm512_add_epi32(sums[r][j][0], sums[r][j][1]));
                // Exact: integers below 2^24.
                let exact =
                    if SYMMETRIC { int } else { _mm512_fnmadd_ps(_mm512_loadu_ps(rec[j].add(320).cast()), total, int) };
                let product = _mm512_mul_ps(scale[j], sx);
                row[j] = _mm512_fmadd_ps(exact, product, row[j]);
            }
        }
    }
    *acc_out = acc;
}

/// 4-bit weights, f32 inputs split into limbs ([`super::limbs`]), at most
/// 2 rows: per record and limb an exact integer sum over the digits
/// (`vpdpbusd`) — for a symmetric weight `Σ (q − 8) · digit` (its zero
/// point `8 · Σ digit` starts the sums), for an asymmetric one `Σ q ·
/// digit` — the limbs combined with one rounding (each pair of them is
/// below 2^24, exact in f32), times the weight's scale and the block's
/// power-of-two scale; an asymmetric weight's `aux · Σ x` (f32 block sums)
/// is then added as [`q4_blocks`] adds it.
///
/// Each kind of record runs as its own compiled body, the row results in
/// registers, as [`q4_int8`]'s do (`examples/cold_probe 1` with `f32`
/// inputs, symmetric, hot weight, three alternating pairs on a Zen 4: 1 row
/// 39.4-41.4 → 38.3-38.9 µs, 2 rows 74.7-76.7 → 72.3-73.4; the same bits).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_limbs<const T: usize, const R: usize>(
    w: &[*const u8; T],
    stride: usize,
    (blocks, symmetric, half): (usize, bool, bool),
    limbs: (*const i8, *const f32, *const i32),
    xsum: *const f32,
    ahead: Option<Ahead>,
    acc: &mut [[__m512; T]; R],
) {
    // (A symmetric record is never `half`: it stores no `aux`.)
    debug_assert!(!(symmetric && half), "a symmetric 4-bit record has no f16 aux line");
    match (symmetric, half) {
        (true, _) => q4_limbs_body::<T, R, true, false>(w, stride, blocks, limbs, xsum, ahead, acc),
        (false, true) => q4_limbs_body::<T, R, false, true>(w, stride, blocks, limbs, xsum, ahead, acc),
        (false, false) => q4_limbs_body::<T, R, false, false>(w, stride, blocks, limbs, xsum, ahead, acc),
    }
}

/// [`q4_limbs`] for one kind of weight (`SYMMETRIC`: no zero points or
/// offsets; `HALF`: f16 scales and `aux`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_limbs_body<const T: usize, const R: usize, const SYMMETRIC: bool, const HALF: bool>(
    w: &[*const u8; T],
    stride: usize,
    blocks: usize,
    (digits, scales, sums): (*const i8, *const f32, *const i32),
    xsum: *const f32,
    ahead: Option<Ahead>,
    acc_out: &mut [[__m512; T]; R],
) {
    // (In registers through the blocks, written back once.)
    let mut acc = *acc_out;
    let nibble = _mm512_set1_epi8(0x0f);
    for b in 0..blocks {
        if let Some(next) = ahead {
            next.fetch(b * stride, stride);
        }
        let rec: [*const u8; T] = std::array::from_fn(|j| w[j].add(b * stride));
        // Per row, tile and limb.
        let mut int: [[[__m512i; LIMBS]; T]; R] = std::array::from_fn(|r| {
            let start: [__m512i; LIMBS] = std::array::from_fn(|l| {
                if SYMMETRIC {
                    _mm512_set1_epi32(-8 * *sums.add((r * blocks + b) * LIMBS + l))
                } else {
                    _mm512_setzero_si512()
                }
            });
            [start; T]
        });
        for i in 0..4 {
            let v: [__m512i; T] = std::array::from_fn(|j| _mm512_loadu_si512(rec[j].add(i * 64).cast()));
            let lo: [__m512i; T] = std::array::from_fn(|j| _mm512_and_si512(v[j], nibble));
            let hi: [__m512i; T] = std::array::from_fn(|j| _mm512_and_si512(_mm512_srli_epi16::<4>(v[j]), nibble));
            for (r, row) in int.iter_mut().enumerate() {
                // (Indexed by limb inside each tile's sums: laid out
                // limb-innermost, the sums kept 5% more multiply-adds a
                // second than tile-innermost.)
                #[allow(clippy::needless_range_loop)]
                for l in 0..LIMBS {
                    // Byte t of a lane: input 8i + t low, 8i + 4 + t high.
                    let at = digits.add((r * blocks + b) * BLOCK_BYTES + l * QBLOCK + 8 * i);
                    let xa = _mm512_set1_epi32(at.cast::<i32>().read_unaligned());
                    let xb = _mm512_set1_epi32(at.add(4).cast::<i32>().read_unaligned());
                    for j in 0..T {
                        row[j][l] = _mm512_dpbusd_epi32(row[j][l], lo[j], xa);
                        row[j][l] = _mm512_dpbusd_epi32(row[j][l], hi[j], xb);
                    }
                }
            }
        }
        let sides: [(__m512, __m512); T] = std::array::from_fn(|j| scale_aux(rec[j], SYMMETRIC, HALF));
        for (r, row) in acc.iter_mut().enumerate() {
            let block_scale = _mm512_set1_ps(*scales.add(r * blocks + b));
            let xs = if SYMMETRIC { _mm512_setzero_ps() } else { _mm512_set1_ps(*xsum.add(r * blocks + b)) };
            for j in 0..T {
                let [d0, d1, d2, d3] = int[r][j];
                let high = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32::<8>(d3), d2));
                let low = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32::<8>(d1), d0));
                let sum = _mm512_fmadd_ps(high, _mm512_set1_ps(65536.0), low);
                row[j] = _mm512_fmadd_ps(sum, _mm512_mul_ps(sides[j].0, block_scale), row[j]);
                if !SYMMETRIC {
                    row[j] = _mm512_fmadd_ps(sides[j].1, xs, row[j]);
                }
            }
        }
    }
    *acc_out = acc;
}

/// The scales and `aux` line of an f32-input 4-bit record at `rec`: f32
/// lines, or (`half`) one line of f16 scales and f16 `aux` values widened
/// exactly; a symmetric weight's `aux` is `-8 * scale` (it stores none).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn scale_aux(rec: *const u8, symmetric: bool, half: bool) -> (__m512, __m512) {
    if half {
        let widen = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(at).cast::<__m256i>()));
        return (widen(256), widen(288));
    }
    let scale = _mm512_loadu_ps(rec.add(256).cast());
    let aux = if symmetric { _mm512_mul_ps(scale, _mm512_set1_ps(-8.0)) } else { _mm512_loadu_ps(rec.add(320).cast()) };
    (scale, aux)
}

/// Multiply-adds per second of independent 512-bit FMA chains on this
/// thread (a compute roofline for reports).
///
/// # Safety
/// AVX-512 F must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn fma_rate(reps: usize) -> f64 {
    let mut acc = [_mm512_set1_ps(1.0); 16];
    let (b, c) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(1e-7));
    let started = std::time::Instant::now();
    for _ in 0..reps {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
    }
    std::hint::black_box(acc);
    (reps * 16 * 16) as f64 / started.elapsed().as_secs_f64()
}

/// Multiply-adds per second of one thread's `vpdpbusd` (16 independent
/// accumulators, 64 int8 products each): the ceiling of the int8-input
/// 4-bit kernels.
///
/// # Safety
/// AVX-512 F and AVX-512 VNNI must be available.
#[target_feature(enable = "avx512f,avx512vnni")]
pub unsafe fn int8_rate(reps: usize) -> f64 {
    let mut acc = [_mm512_setzero_si512(); 16];
    let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
    let started = std::time::Instant::now();
    for _ in 0..reps {
        for s in acc.iter_mut() {
            *s = _mm512_dpbusd_epi32(*s, a, b);
        }
    }
    std::hint::black_box(acc);
    (reps * 16 * 64) as f64 / started.elapsed().as_secs_f64()
}
