//! Lossless narrowing: a projection weight stored in a narrower form
//! only where a round trip proves every value exact, so the kernels
//! compute the same values (and, in the wide form's order, the same
//! results bit for bit) from fewer bytes.

use std::sync::atomic::{AtomicBool, Ordering};

use half::f16;

use super::weights::{f16_exact, q4_weight, q8_weight, Packed, TileData, Tiled, Weight, QBLOCK};
use crate::pool::{Disjoint, ThreadPool};

impl Weight {
    /// An f32 weight stored narrower when a round trip proves it exact:
    /// as 8-bit blocks of 32 with an f32 scale when every block's values
    /// are integer multiples of `max|w| / 127` (what an 8-bit export such
    /// as GGUF's Q8_0 dequantizes to) and reproduce bit for bit; else as
    /// affine 4-bit blocks of 32 when every block's values are `d * q + m`
    /// for f16 `d` and `m` and `q` in 0..=15, computed in f32 (GGUF's Q4_1
    /// dequantized: the f32 export's projections), tiled and computed
    /// weight by weight; else as f16 when every value is an f16 (an f16
    /// table that constant folding widened: the f16 export's tied output
    /// projection). The kernels compute with the same f32s, in the f32
    /// kernels' order. (One corner no real weight meets: a partial last
    /// block's padding adds `m · 0` or `0 · 0`, which turns an accumulated
    /// -0.0 into +0.0 — only when every product of the row underflowed;
    /// the same holds for the f16 forms below.)
    /// An f16 weight (or an f32 one whose values are all f16) is stored as
    /// 8-bit blocks when every block's values are `d * q` computed in f32
    /// and rounded to f16 (GGUF's Q8_0 dequantized, then stored as f16:
    /// the f16 export's tied output projection), else as affine 4-bit
    /// blocks when they are `d * q + m` so rounded (Q4_1: its other
    /// projections); the kernels compute each weight so, round it to f16
    /// and multiply in the f16 kernels' order (which is the f32 kernels'),
    /// so the results are the f16 weight's bit for bit — from 1.125 or
    /// 0.625 bytes a weight instead of 2.
    /// Anything else stays as it is.
    pub fn narrowed(self) -> Self {
        self.narrowed_on(&ThreadPool::serial())
    }

    /// [`Weight::narrowed`], proved on `pool`'s threads.
    pub(crate) fn narrowed_on(self, pool: &ThreadPool) -> Self {
        match self.narrower_on(pool) {
            Some(packed) => Self { packed, ..self },
            None => self,
        }
    }

    /// What [`Weight::narrowed`] stores this weight as, where that is
    /// narrower, proved on `pool`'s threads (one row range each) and read
    /// in place: a compile that only asks which form a weight narrows to,
    /// or that holds it shared, copies nothing.
    pub(crate) fn narrower_on(&self, pool: &ThreadPool) -> Option<Packed> {
        let (n, k) = (self.n, self.k);
        match &self.packed {
            Packed::F16(halves) => {
                let values = Values::F16(halves);
                narrowed_q8(values, n, k, true, pool).or_else(|| narrowed_affine_q4(values, n, k, true, pool))
            }
            Packed::F32(rows) => {
                let values = Values::F32(rows);
                narrowed_q8(values, n, k, false, pool)
                    .or_else(|| narrowed_affine_q4(values, n, k, false, pool))
                    .or_else(|| {
                        rows.iter().all(|v| f16_exact(*v)).then(|| {
                            narrowed_q8(values, n, k, true, pool)
                                .or_else(|| narrowed_affine_q4(values, n, k, true, pool))
                                .unwrap_or_else(|| Packed::F16(rows.iter().map(|v| f16::from_f32(*v)).collect()))
                        })
                    })
            }
            _ => None,
        }
    }
}

/// A weight's values as stored, read a row at a time in f32.
#[derive(Clone, Copy)]
enum Values<'a> {
    F32(&'a [f32]),
    /// Widened a row at a time (a whole widened copy of the f16 export's
    /// weights was 540 MB of a load).
    F16(&'a [f16]),
}

impl<'a> Values<'a> {
    /// Row `r` of `k` values, widened into `wide` where stored as f16.
    fn row<'s>(self, r: usize, k: usize, wide: &'s mut Vec<f32>) -> &'s [f32]
    where
        'a: 's,
    {
        match self {
            Values::F32(v) => &v[r * k..(r + 1) * k],
            Values::F16(v) => {
                wide.clear();
                wide.extend(v[r * k..(r + 1) * k].iter().map(|h| h.to_f32()));
                wide
            }
        }
    }
}

/// The 8-bit form of [`Weight::narrowed`] of the `n x k` values `rows`,
/// if exact: per block of 32 a scale and levels in -127..=127 with
/// `level * scale` the value — with `to_f16`, that product rounded to f16
/// (GGUF's Q8_0 dequantized, then stored as f16), for an f16 `scale` a few
/// f16 steps from the largest magnitude over 127 (or 126, 125: a block
/// whose f16 scale was rounded up has no level of 127).
fn narrowed_q8(rows: Values<'_>, n: usize, k: usize, to_f16: bool, pool: &ThreadPool) -> Option<Packed> {
    if k == 0 {
        // No values: the empty 8-bit form.
        return Some(Packed::Q8 { values: Vec::new(), scales: Vec::new(), blocks: 0, rounds_to_f16: to_f16 });
    }
    let blocks = k.div_ceil(QBLOCK);
    let mut values = vec![0i8; n * k];
    let mut scales = vec![0f32; n * blocks];
    let fits = |block: &[f32], scale: f32, q: &mut [i8]| -> bool {
        for (w, qj) in block.iter().zip(q.iter_mut()) {
            let level = if scale > 0.0 { (w / scale).round() } else { 0.0 };
            if !w.is_finite() || level.abs() > 127.0 {
                return false;
            }
            // The stored level through the kernels' own formula, compared
            // by bits: a -0.0 (stored as level 0, computed as +0.0) fails.
            *qj = level as i8;
            if q8_weight(*qj, scale, to_f16).to_bits() != w.to_bits() {
                return false;
            }
        }
        true
    };
    // Rows `first..` of the weight into their own part of the outputs.
    let fill = |first: usize, values: &mut [i8], scales: &mut [f32]| -> Option<()> {
        let mut wide = Vec::new();
        for (i, (q_row, scale_row)) in values.chunks_exact_mut(k).zip(scales.chunks_exact_mut(blocks)).enumerate() {
            let row = rows.row(first + i, k, &mut wide);
            for ((block, q), scale_at) in row.chunks(QBLOCK).zip(q_row.chunks_mut(QBLOCK)).zip(scale_row) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                *scale_at = if to_f16 {
                    let candidates = [127.0f32, 126.0, 125.0].into_iter().flat_map(|top| {
                        let near = f16::from_f32(amax / top).to_bits();
                        [0i16, 1, -1, 2, -2, 3, -3].map(|step| f16::from_bits(near.wrapping_add_signed(step)).to_f32())
                    });
                    candidates.filter(|d| d.is_finite() && *d >= 0.0).find(|d| fits(block, *d, q))?
                } else {
                    let scale = amax / 127.0;
                    fits(block, scale, q).then_some(scale)?
                };
            }
        }
        Some(())
    };
    in_row_ranges(pool, n, (&mut values, k), (&mut scales, blocks), fill)?;
    Some(Packed::Q8 { values, scales, blocks, rounds_to_f16: to_f16 })
}

/// The affine 4-bit form of [`Weight::narrowed`] of the `n x k` values
/// `rows` (already tiled), if exact; `to_f16`: the values are f16, each
/// `d * q + m` rounded.
fn narrowed_affine_q4(rows: Values<'_>, n: usize, k: usize, to_f16: bool, pool: &ThreadPool) -> Option<Packed> {
    if k == 0 {
        return None;
    }
    let blocks = k.div_ceil(QBLOCK);
    let mut data = vec![0u8; n * blocks * QBLOCK / 2];
    let (mut scales, mut offsets) = (vec![0f32; n * blocks], vec![0f32; n * blocks]);
    // A row's nibbles take whole bytes (blocks of 32 levels).
    let row_bytes = blocks * QBLOCK / 2;
    let fill = |first: usize, data: &mut [u8], params: &mut [(f32, f32)]| -> Option<()> {
        let (mut q, mut wide) = ([0u8; QBLOCK], Vec::new());
        for (i, (bytes, param_row)) in data.chunks_exact_mut(row_bytes).zip(params.chunks_exact_mut(blocks)).enumerate()
        {
            let row = rows.row(first + i, k, &mut wide);
            for ((block, packed), param) in row.chunks(QBLOCK).zip(bytes.chunks_exact_mut(QBLOCK / 2)).zip(param_row) {
                *param = affine_block(block, &mut q[..block.len()], to_f16)?;
                // Level j in the low nibble of byte j/2 for even j, the
                // high for odd; a partial block's padding stays level 0.
                for (j, v) in q[..block.len()].iter().enumerate() {
                    packed[j / 2] |= if j % 2 == 0 { *v } else { *v << 4 };
                }
            }
        }
        Some(())
    };
    let mut params = vec![(0f32, 0f32); n * blocks];
    in_row_ranges(pool, n, (&mut data, row_bytes), (&mut params, blocks), fill)?;
    for ((d, m), (scale, offset)) in params.into_iter().zip(scales.iter_mut().zip(offsets.iter_mut())) {
        (*scale, *offset) = (d, m);
    }
    // Zero points of 0: `aux = -0 * d + m = m`, each weight `d * q + m`.
    let zeros = Some(vec![0u8; n * blocks.div_ceil(2)]);
    let q4 = Packed::Q4 { data, scales, zeros, offsets: Some(offsets), block: QBLOCK, blocks, int8: false };
    let mut tiled = Tiled::from_rows(&Weight { n, k, packed: q4 })?;
    if let TileData::Q4 { per_weight, rounds_to_f16, .. } = &mut tiled.data {
        (*per_weight, *rounds_to_f16) = (true, to_f16);
    }
    Some(Packed::Tiled(tiled))
}

/// Runs `fill(first_row, rows' part of a, rows' part of b)` over the `n`
/// rows in one range per thread of `pool`, each with its own disjoint
/// parts of the outputs `a` and `b` (`a_row` and `b_row` elements a row);
/// `None` if any range is. (Narrowing a SmolLM2 export's weights took a
/// second of its load on one core.)
fn in_row_ranges<A: Send, B: Send>(
    pool: &ThreadPool,
    n: usize,
    (a, a_row): (&mut [A], usize),
    (b, b_row): (&mut [B], usize),
    fill: impl Fn(usize, &mut [A], &mut [B]) -> Option<()> + Sync,
) -> Option<()> {
    let (a, b) = (Disjoint::new(a), Disjoint::new(b));
    let failed = AtomicBool::new(false);
    pool.for_ranges(n, 1, &|rows, _| {
        if failed.load(Ordering::Relaxed) {
            return;
        }
        // SAFETY: `for_ranges` hands each thread its own rows, so the
        // parts of `a` and `b` they cover are disjoint.
        let (a, b) = unsafe {
            (a.slice(rows.start * a_row, rows.len() * a_row), b.slice(rows.start * b_row, rows.len() * b_row))
        };
        if fill(rows.start, a, b).is_none() {
            failed.store(true, Ordering::Relaxed);
        }
    });
    (!failed.into_inner()).then_some(())
}

/// `(d, m)` with `block[j] == d * q[j] + m` bit for bit in f32 for every
/// `j`, `d` and `m` f16 values, `q[j]` in 0..=15 (written to `q`), if the
/// block has that form. A Q4_1 block's smallest value is its `m` (q = 0)
/// and its largest `15 d + m`, so `d` is the f16 nearest `(max - m) / 15`
/// or a neighbour; `d * q` is exact in f32 (11 + 4 significant bits), so
/// one rounding makes each value, as in a fused multiply-add. With
/// `to_f16` each value is `d * q + m` rounded again, to f16: the largest
/// then sits up to half an f16 step off `15 d + m`, so `d` is searched a
/// few f16 steps either side.
fn affine_block(block: &[f32], q: &mut [u8], to_f16: bool) -> Option<(f32, f32)> {
    if block.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let m = block.iter().copied().fold(f32::INFINITY, f32::min);
    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !f16_exact(m) {
        return None;
    }
    let near = f16::from_f32((max - m) / 15.0).to_bits();
    let steps: &[i16] = if to_f16 { &[0, 1, -1, 2, -2, 3, -3, 4, -4] } else { &[0, 1, -1] };
    'next: for step in steps {
        let d = f16::from_bits(near.wrapping_add_signed(*step)).to_f32();
        if !(d.is_finite() && d >= 0.0) {
            continue;
        }
        for (v, qj) in block.iter().zip(q.iter_mut()) {
            let level = if d > 0.0 { ((v - m) / d).round() } else { 0.0 };
            if !(0.0..=15.0).contains(&level) || q4_weight(level, d, m, to_f16).to_bits() != v.to_bits() {
                continue 'next;
            }
            *qj = level as u8;
        }
        return Some((d, m));
    }
    None
}
