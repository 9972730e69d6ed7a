//! AVX2/FMA/F16C tile kernels (and AVX-VNNI for int8 inputs): a 16-row
//! tile is two 256-bit halves; up to 4 input rows (2 for int8 inputs, which
//! need more registers) share each decoded weight vector.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::ops::Range;

use super::tiled::{Ahead, Rows};
use super::weights::{TileData, Tiled, QBLOCK, TILE};
use crate::pool::Disjoint;

/// Runs the kernel for `t`'s storage over `tiles`, every input row.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (and AVX-VNNI when `vnni`); `rows`
/// must hold `m` rows of `t.kp` values (and their quantization for
/// int8-input weights); `y` must hold `m * t.n` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tiles(t: &Tiled, rows: &Rows<'_>, tiles: Range<usize>, y: &Disjoint<'_, f32>, vnni: bool) {
    for tile in tiles {
        let mut r = 0;
        while r < rows.m {
            let left = rows.m - r;
            let int8 = matches!(t.data, TileData::Q4 { int8: true, .. });
            // SAFETY: forwarded contract; `tile` and rows `r..` are in
            // bounds.
            unsafe {
                r += match (left, int8) {
                    (4.., false) => dispatch::<4>(t, rows, tile, r, y, vnni),
                    (2.., _) => dispatch::<2>(t, rows, tile, r, y, vnni),
                    _ => dispatch::<1>(t, rows, tile, r, y, vnni),
                };
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dispatch<const R: usize>(
    t: &Tiled,
    rows: &Rows<'_>,
    tile: usize,
    r: usize,
    y: &Disjoint<'_, f32>,
    vnni: bool,
) -> usize {
    let (start, stride) = t.place(tile);
    let w = t.as_bytes().as_ptr().add(start);
    let x = rows.x.as_ptr().add(r * rows.kp);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // The first rows of a pair's first tile fetch the next pair's records
    // step by step, as the AVX-512 kernels do (pairs are stored one after
    // another; the pair's second tile then finds nothing left to fetch).
    let first_of_pair = tile.is_multiple_of(2) && tile + 1 < t.tiles;
    let ahead = (first_of_pair && r == 0).then(|| Ahead(w.wrapping_add(t.steps() * stride)));
    match t.data {
        TileData::F32 => f32_cols::<R>(w, stride, t.k, x, rows.kp, ahead, &mut acc),
        TileData::F16 => f16_cols::<R>(w, stride, t.k, x, rows.kp, ahead, &mut acc),
        TileData::Q8 { blocks, rounds_to_f16: false } => {
            q8_cols::<R, false>(w, stride, blocks, x, rows.kp, ahead, &mut acc)
        }
        TileData::Q8 { blocks, rounds_to_f16: true } => {
            q8_cols::<R, true>(w, stride, blocks, x, rows.kp, ahead, &mut acc)
        }
        TileData::Q4 { blocks, int8: false, symmetric, half, rounds_to_f16: false, .. } => {
            q4_cols::<R, false>(w, stride, (blocks, symmetric, half), x, rows.kp, ahead, &mut acc)
        }
        TileData::Q4 { blocks, int8: false, symmetric, half, rounds_to_f16: true, .. } => {
            q4_cols::<R, true>(w, stride, (blocks, symmetric, half), x, rows.kp, ahead, &mut acc)
        }
        TileData::Q4 { blocks, int8: true, x_block, symmetric, .. } => {
            let q = rows.q.as_ptr().add(r * rows.kp);
            let s = rows.qscale.as_ptr().add(r * blocks);
            let sums = rows.qsum.as_ptr().add(r * blocks);
            let sub = (x_block / QBLOCK).max(1);
            if vnni {
                q4_int8_vnni::<R>(w, stride, (blocks, sub, symmetric), q, s, sums, rows.kp, ahead, &mut acc)
            } else {
                q4_int8::<R, false>(w, stride, (blocks, sub, symmetric), q, s, sums, rows.kp, ahead, &mut acc)
            }
        }
    }
    let first = tile * TILE;
    let width = TILE.min(t.n - first);
    for (i, row) in acc.iter().enumerate() {
        let mut lanes = [0f32; TILE];
        _mm256_storeu_ps(lanes.as_mut_ptr(), row[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), row[1]);
        // SAFETY: outputs `first..first + width` of row `r + i` belong to
        // this tile, computed by this thread alone.
        unsafe { y.slice((r + i) * t.n + first, width) }.copy_from_slice(&lanes[..width]);
    }
    R
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_cols<const R: usize>(
    w: *const u8,
    stride: usize,
    k: usize,
    x: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m256; 2]; R],
) {
    for c in 0..k {
        if let Some(next) = ahead {
            next.fetch(c * stride, stride);
        }
        let lo = _mm256_loadu_ps(w.add(c * stride).cast());
        let hi = _mm256_loadu_ps(w.add(c * stride + 32).cast());
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = _mm256_set1_ps(*x.add(r * kp + c));
            row[0] = _mm256_fmadd_ps(lo, xv, row[0]);
            row[1] = _mm256_fmadd_ps(hi, xv, row[1]);
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_cols<const R: usize>(
    w: *const u8,
    stride: usize,
    k: usize,
    x: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m256; 2]; R],
) {
    for c in 0..k {
        if let (Some(next), 0) = (ahead, c % 2) {
            next.fetch((c / 2) * stride, stride);
        }
        let at = w.add((c / 2) * stride + (c % 2) * 32);
        let lo = _mm256_cvtph_ps(_mm_loadu_si128(at.cast()));
        let hi = _mm256_cvtph_ps(_mm_loadu_si128(at.add(16).cast()));
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = _mm256_set1_ps(*x.add(r * kp + c));
            row[0] = _mm256_fmadd_ps(lo, xv, row[0]);
            row[1] = _mm256_fmadd_ps(hi, xv, row[1]);
        }
    }
}

/// `v` rounded to f16 (to nearest, ties to even) and widened back: the
/// weight an f16 export stored, for a weight narrowed from it
/// (`TileData::Q4::rounds_to_f16`, `TileData::Q8::rounds_to_f16`).
#[inline(always)]
unsafe fn to_f16_and_back(v: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_cols<const R: usize, const F16: bool>(
    w: *const u8,
    stride: usize,
    blocks: usize,
    x: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m256; 2]; R],
) {
    for b in 0..blocks {
        if let Some(next) = ahead {
            next.fetch(b * stride, stride);
        }
        let rec = w.add(b * stride);
        let scale = [_mm256_loadu_ps(rec.add(512).cast()), _mm256_loadu_ps(rec.add(544).cast())];
        for col in 0..QBLOCK {
            let c = b * QBLOCK + col;
            let wv: [__m256; 2] = std::array::from_fn(|h| {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(rec.add(16 * col + 8 * h).cast()));
                let wv = _mm256_mul_ps(_mm256_cvtepi32_ps(q), scale[h]);
                if F16 {
                    to_f16_and_back(wv)
                } else {
                    wv
                }
            });
            for (r, row) in acc.iter_mut().enumerate() {
                let xv = _mm256_set1_ps(*x.add(r * kp + c));
                row[0] = _mm256_fmadd_ps(wv[0], xv, row[0]);
                row[1] = _mm256_fmadd_ps(wv[1], xv, row[1]);
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_cols<const R: usize, const F16: bool>(
    w: *const u8,
    stride: usize,
    (blocks, symmetric, half): (usize, bool, bool),
    x: *const f32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m256; 2]; R],
) {
    let nibble = _mm256_set1_epi32(0x0f);
    for b in 0..blocks {
        if let Some(next) = ahead {
            next.fetch(b * stride, stride);
        }
        let rec = w.add(b * stride);
        // A `half` record: 16 f16 scales, then 16 f16 `aux`, widened exactly.
        let widen = |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(rec.add(at).cast::<__m128i>()));
        let scale = if half {
            [widen(256), widen(272)]
        } else {
            [_mm256_loadu_ps(rec.add(256).cast()), _mm256_loadu_ps(rec.add(288).cast())]
        };
        let aux = if half {
            [widen(288), widen(304)]
        } else if symmetric {
            let m8 = _mm256_set1_ps(-8.0);
            [_mm256_mul_ps(scale[0], m8), _mm256_mul_ps(scale[1], m8)]
        } else {
            [_mm256_loadu_ps(rec.add(320).cast()), _mm256_loadu_ps(rec.add(352).cast())]
        };
        for i in 0..4 {
            let v = [_mm256_loadu_si256(rec.add(i * 64).cast()), _mm256_loadu_si256(rec.add(i * 64 + 32).cast())];
            macro_rules! column {
                ($shift:literal, $col:expr) => {{
                    let c = b * QBLOCK + 8 * i + $col;
                    let wv: [__m256; 2] = std::array::from_fn(|h| {
                        let q = _mm256_and_si256(_mm256_srli_epi32::<$shift>(v[h]), nibble);
                        let wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale[h], aux[h]);
                        if F16 {
                            to_f16_and_back(wv)
                        } else {
                            wv
                        }
                    });
                    for (r, row) in acc.iter_mut().enumerate() {
                        let xv = _mm256_set1_ps(*x.add(r * kp + c));
                        row[0] = _mm256_fmadd_ps(wv[0], xv, row[0]);
                        row[1] = _mm256_fmadd_ps(wv[1], xv, row[1]);
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
    }
}

/// AVX-VNNI dot products: the same kernel with `vpdpbusd`.
#[inline]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q4_int8_vnni<const R: usize>(
    w: *const u8,
    stride: usize,
    shape: (usize, usize, bool),
    q: *const i8,
    qscale: *const f32,
    qsum: *const i32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m256; 2]; R],
) {
    q4_int8::<R, true>(w, stride, shape, q, qscale, qsum, kp, ahead, acc)
}

/// Per quantization block (`sub` records of 32) the exact integer sum,
/// minus `zero · Σ xq`, scaled once (ONNX Runtime's integer path).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_int8<const R: usize, const VNNI: bool>(
    w: *const u8,
    stride: usize,
    (blocks, sub, symmetric): (usize, usize, bool),
    q: *const i8,
    qscale: *const f32,
    qsum: *const i32,
    kp: usize,
    ahead: Option<Ahead>,
    acc: &mut [[__m256; 2]; R],
) {
    let nibble = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let per_row = kp / QBLOCK;
    for g in 0..blocks / sub {
        let totals: [i32; R] =
            std::array::from_fn(|r| (g * sub..(g + 1) * sub).map(|b| *qsum.add(r * per_row + b)).sum());
        // Per row and half: low and high nibble quads apart. A symmetric
        // weight's zero share `8 · Σ xq` starts the integer sums (exact,
        // as in the AVX-512 kernel).
        let mut sums: [[[__m256i; 2]; 2]; R] = std::array::from_fn(|r| {
            let start = if symmetric { _mm256_set1_epi32(-8 * totals[r]) } else { _mm256_setzero_si256() };
            [[start, _mm256_setzero_si256()]; 2]
        });
        for b in g * sub..(g + 1) * sub {
            if let Some(next) = ahead {
                next.fetch(b * stride, stride);
            }
            let rec = w.add(b * stride);
            for i in 0..4 {
                let v = [_mm256_loadu_si256(rec.add(i * 64).cast()), _mm256_loadu_si256(rec.add(i * 64 + 32).cast())];
                let lo: [__m256i; 2] = std::array::from_fn(|h| _mm256_and_si256(v[h], nibble));
                let hi: [__m256i; 2] = std::array::from_fn(|h| _mm256_and_si256(_mm256_srli_epi16::<4>(v[h]), nibble));
                for (r, s) in sums.iter_mut().enumerate() {
                    let at = q.add(r * kp + b * QBLOCK + 8 * i);
                    let xa = _mm256_set1_epi32(at.cast::<i32>().read_unaligned());
                    let xb = _mm256_set1_epi32(at.add(4).cast::<i32>().read_unaligned());
                    for h in 0..2 {
                        if VNNI {
                            s[h][0] = _mm256_dpbusd_avx_epi32(s[h][0], lo[h], xa);
                            s[h][1] = _mm256_dpbusd_avx_epi32(s[h][1], hi[h], xb);
                        } else {
                            let pa = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[h], xa), ones);
                            let pb = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[h], xb), ones);
                            s[h][0] = _mm256_add_epi32(s[h][0], pa);
                            s[h][1] = _mm256_add_epi32(s[h][1], pb);
                        }
                    }
                }
            }
        }
        let rec = w.add(g * sub * stride);
        let scale = [_mm256_loadu_ps(rec.add(256).cast()), _mm256_loadu_ps(rec.add(288).cast())];
        for (r, row) in acc.iter_mut().enumerate() {
            let sx = _mm256_set1_ps(*qscale.add(r * per_row + g * sub));
            let total = _mm256_set1_ps(totals[r] as f32);
            for h in 0..2 {
                let int = _mm256_cvtepi32_ps(_mm256_add_epi32(sums[r][h][0], sums[r][h][1]));
                // Exact: integers below 2^24.
                let exact = if symmetric {
                    int
                } else {
                    _mm256_fnmadd_ps(_mm256_loadu_ps(rec.add(320 + 32 * h).cast()), total, int)
                };
                let product = _mm256_mul_ps(scale[h], sx);
                row[h] = _mm256_fmadd_ps(exact, product, row[h]);
            }
        }
    }
}

/// Multiply-adds per second of independent 256-bit FMA chains on this
/// thread (a compute roofline for reports).
///
/// # Safety
/// AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn fma_rate(reps: usize) -> f64 {
    let mut acc = [_mm256_set1_ps(1.0); 12];
    let (b, c) = (_mm256_set1_ps(1.000_000_1), _mm256_set1_ps(1e-7));
    let started = std::time::Instant::now();
    for _ in 0..reps {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, b, c);
        }
    }
    std::hint::black_box(acc);
    (reps * 12 * 8) as f64 / started.elapsed().as_secs_f64()
}
