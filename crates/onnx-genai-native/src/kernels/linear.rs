//! Projections by constant weights (`x @ W + b`), the cost centre of decode.
//! Weights are packed once at compile time as output rows (`[N, K]`), so a
//! decode step (one input row) is N contiguous dot products split across
//! threads; f16 and 4-bit weights stay compressed and are widened a row at a
//! time.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::math::{dot, sgemm};
use super::Ctx;
use crate::pool::Disjoint;

/// Below this many multiply-adds a projection runs on the calling thread:
/// handing tiny work to the pool costs more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 15;

/// Output rows handed to one thread are a multiple of this (a cache line of
/// f32 outputs).
const ROW_ALIGN: usize = 16;

#[derive(Clone, Debug)]
pub enum Packed {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// `MatMulNBits` with 4 bits: per row, `blocks` blocks of `block`
    /// elements, two per byte (low nibble first), one scale per block and an
    /// optional packed 4-bit zero point per block (8 when absent).
    Q4 {
        data: Vec<u8>,
        scales: Vec<f32>,
        zeros: Option<Vec<u8>>,
        block: usize,
        blocks: usize,
    },
    /// `MatMulNBits` at `accuracy_level` 4, multiplied with int8 inputs in
    /// integers as ONNX Runtime computes it ([`super::linear_int8`]): the
    /// 4-bit values unpacked to `q - zero` (−15..=15), one per byte, each
    /// row padded to whole blocks, and one scale per block.
    Q4Int8 {
        values: Vec<i8>,
        scales: Vec<f32>,
        block: usize,
        blocks: usize,
    },
}

/// A `[N, K]` weight: row `n` holds the K input weights of output `n`.
#[derive(Clone, Debug)]
pub struct Weight {
    pub n: usize,
    pub k: usize,
    pub packed: Packed,
}

impl Weight {
    /// Packs an ONNX MatMul weight given as `[K, N]`.
    pub fn from_kn_f32(w: &[f32], k: usize, n: usize) -> Self {
        let mut t = vec![0.0; k * n];
        for (ki, row) in w.chunks_exact(n).enumerate() {
            for (ni, v) in row.iter().enumerate() {
                t[ni * k + ki] = *v;
            }
        }
        Self { n, k, packed: Packed::F32(t) }
    }

    pub fn from_kn_f16(w: &[f16], k: usize, n: usize) -> Self {
        let mut t = vec![f16::ZERO; k * n];
        for (ki, row) in w.chunks_exact(n).enumerate() {
            for (ni, v) in row.iter().enumerate() {
                t[ni * k + ki] = *v;
            }
        }
        Self { n, k, packed: Packed::F16(t) }
    }

    /// Stacks weights with the same K: outputs of `a` come first.
    pub fn stack(a: Weight, b: Weight) -> Result<Self, String> {
        if a.k != b.k {
            return Err(format!("cannot stack weights with K {} and {}", a.k, b.k));
        }
        let packed = match (a.packed, b.packed) {
            (Packed::F32(mut x), Packed::F32(y)) => {
                x.extend(y);
                Packed::F32(x)
            }
            (Packed::F16(mut x), Packed::F16(y)) => {
                x.extend(y);
                Packed::F16(x)
            }
            (
                Packed::Q4 { data: mut d1, scales: mut s1, zeros: z1, block, blocks },
                Packed::Q4 { data: d2, scales: s2, zeros: z2, block: block2, blocks: blocks2 },
            ) if block == block2 && blocks == blocks2 && z1.is_some() == z2.is_some() => {
                d1.extend(d2);
                s1.extend(s2);
                let zeros = z1.zip(z2).map(|(mut a, b)| {
                    a.extend(b);
                    a
                });
                Packed::Q4 { data: d1, scales: s1, zeros, block, blocks }
            }
            (
                Packed::Q4Int8 { values: mut v1, scales: mut s1, block, blocks },
                Packed::Q4Int8 { values: v2, scales: s2, block: block2, blocks: blocks2 },
            ) if block == block2 && blocks == blocks2 => {
                v1.extend(v2);
                s1.extend(s2);
                Packed::Q4Int8 { values: v1, scales: s1, block, blocks }
            }
            _ => return Err("cannot stack weights of different storage".into()),
        };
        Ok(Self { n: a.n + b.n, k: a.k, packed })
    }

    /// Row `r` as f32: borrowed when stored as f32, widened into `scratch`
    /// otherwise.
    pub(crate) fn row<'a>(&'a self, r: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        let k = self.k;
        match &self.packed {
            Packed::F32(w) => &w[r * k..(r + 1) * k],
            Packed::F16(w) => {
                scratch.resize(k, 0.0);
                w[r * k..(r + 1) * k].convert_to_f32_slice(scratch);
                scratch
            }
            Packed::Q4Int8 { values, scales, block, blocks } => {
                scratch.resize(k, 0.0);
                let row = &values[r * blocks * block..];
                for (j, v) in scratch.iter_mut().enumerate() {
                    *v = f32::from(row[j]) * scales[r * blocks + j / block];
                }
                scratch
            }
            Packed::Q4 { data, scales, zeros, block, blocks } => {
                scratch.resize(k, 0.0);
                let bytes_per_block = block / 2;
                let row = &data[r * blocks * bytes_per_block..(r + 1) * blocks * bytes_per_block];
                for b in 0..*blocks {
                    let scale = scales[r * blocks + b];
                    let zero = f32::from(zero_point(zeros.as_deref(), r, *blocks, b));
                    let start = b * block;
                    for j in 0..(*block).min(k.saturating_sub(start)) {
                        let byte = row[b * bytes_per_block + j / 2];
                        let q = if j % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                        scratch[start + j] = (f32::from(q) - zero) * scale;
                    }
                }
                scratch
            }
        }
    }

    /// Bytes the packed weight occupies.
    pub fn bytes(&self) -> usize {
        match &self.packed {
            Packed::F32(w) => w.len() * 4,
            Packed::F16(w) => w.len() * 2,
            Packed::Q4 { data, scales, zeros, .. } => {
                data.len() + scales.len() * 4 + zeros.as_ref().map_or(0, Vec::len)
            }
            Packed::Q4Int8 { values, scales, .. } => values.len() + scales.len() * 4,
        }
    }

    /// A 4-bit weight for `accuracy_level` 4: the same blocks unpacked to
    /// `q - zero` for integer products with int8 inputs.
    pub fn into_int8_products(self) -> Self {
        let Packed::Q4 { data, scales, zeros, block, blocks } = self.packed else { return self };
        let half = block / 2;
        let mut values = Vec::with_capacity(self.n * blocks * block);
        for r in 0..self.n {
            for b in 0..blocks {
                let zero = zero_point(zeros.as_deref(), r, blocks, b);
                for byte in &data[(r * blocks + b) * half..(r * blocks + b + 1) * half] {
                    for q in [byte & 0x0f, byte >> 4] {
                        values.push(q as i8 - zero as i8);
                    }
                }
            }
        }
        Self { packed: Packed::Q4Int8 { values, scales, block, blocks }, ..self }
    }
}

/// `y[m, n] = x[m, :] . W[n, :] + bias[n]` for `m` input rows; large
/// products are split across the context's threads.
pub fn linear(x: &[f32], m: usize, w: &Weight, bias: Option<&[f32]>, y: &mut Vec<f32>, ctx: &Ctx) {
    let (n, k) = (w.n, w.k);
    y.clear();
    y.resize(m * n, 0.0);
    if let Packed::Q4Int8 { .. } = &w.packed {
        super::linear_int8::linear_q4_int8(x, m, w, y, ctx);
    } else if let (Packed::F32(wt), true) = (&w.packed, m >= 4) {
        sgemm(m, k, n, x, (k, 1), wt, (1, k), y);
    } else if m >= 4 {
        widened_panels(x, m, w, y, ctx);
    } else if m == 1 {
        rows_dot(x, w, y, ctx);
    } else {
        // Few rows: each weight row once against every input row.
        let out = Disjoint::new(y);
        let work = |range: std::ops::Range<usize>, t: usize| {
            // SAFETY: thread `t` is the only user of its scratch here.
            let scratch = unsafe { ctx.scratch.get(t) };
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
            ctx.pool.for_ranges(n, ROW_ALIGN, &work);
        } else {
            work(0..n, 0);
        }
    }
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(n) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
}

/// Several input rows against an f16 or 4-bit weight: widens `PANEL` weight
/// rows at a time to f32 and multiplies them with the blocked sgemm, so a
/// weight row is converted once per call rather than once per input row
/// (prefill), and the product runs register-blocked.
fn widened_panels(x: &[f32], m: usize, w: &Weight, y: &mut [f32], ctx: &Ctx) {
    const PANEL: usize = 64;
    let (n, k) = (w.n, w.k);
    let panel = |p: usize| -> Vec<f32> {
        let (r0, rows) = (p * PANEL, PANEL.min(n - p * PANEL));
        let (mut wide, mut scratch) = (vec![0.0; rows * k], Vec::new());
        for (i, dst) in wide.chunks_exact_mut(k).enumerate() {
            dst.copy_from_slice(w.row(r0 + i, &mut scratch));
        }
        let mut out = vec![0.0; m * rows];
        sgemm(m, k, rows, x, (k, 1), &wide, (1, k), &mut out);
        out
    };
    let panels = n.div_ceil(PANEL);
    let target = Disjoint::new(y);
    let work = |range: std::ops::Range<usize>, _t: usize| {
        for p in range {
            let out = panel(p);
            let (r0, rows) = (p * PANEL, PANEL.min(n - p * PANEL));
            for (mi, src) in out.chunks_exact(rows).enumerate() {
                // SAFETY: columns r0..r0+rows of every row belong to panel p.
                unsafe { target.slice(mi * n + r0, rows) }.copy_from_slice(src);
            }
        }
    };
    if m * n * k >= PARALLEL_MIN_MACS {
        ctx.pool.for_ranges(panels, 1, &work);
    } else {
        work(0..panels, 0);
    }
}

/// The 4-bit zero point of block `b` of `row`: packed two per byte, low
/// nibble first, `ceil(blocks / 2)` bytes per row (`MatMulNBits` and
/// `GatherBlockQuantized` alike); 8 when the weight has none.
pub(crate) fn zero_point(zeros: Option<&[u8]>, row: usize, blocks: usize, b: usize) -> u8 {
    match zeros {
        Some(z) => (z[row * blocks.div_ceil(2) + b / 2] >> (4 * (b % 2))) & 0x0f,
        None => 8,
    }
}

/// `x . dequant(row)` for one 4-bit row without widening it:
/// per block, `scale * (sum(q * x) - zero * sum(x))`, with the block sums of
/// `x` computed once per input row (`xsum`).
fn dot_q4(x: &[f32], xsum: &[f32], w: &Weight, r: usize) -> f32 {
    let Packed::Q4 { data, scales, zeros, block, blocks } = &w.packed else { return 0.0 };
    let (block, blocks) = (*block, *blocks);
    let half = block / 2;
    let row = &data[r * blocks * half..(r + 1) * blocks * half];
    if block == 32 && zeros.is_none() && x.len() == 32 * blocks {
        return super::simd::q4_row32(x, xsum, row, &scales[r * blocks..(r + 1) * blocks]);
    }
    let mut total = 0.0;
    for b in 0..blocks {
        let zero = f32::from(zero_point(zeros.as_deref(), r, blocks, b));
        let start = b * block;
        let xb = &x[start..(start + block).min(x.len())];
        let qb = &row[b * half..(b + 1) * half];
        if xb.len() == 32 && block == 32 {
            total += scales[r * blocks + b] * (super::simd::q4_block32(qb, xb) - zero * xsum[b]);
            continue;
        }
        let (mut lo, mut hi) = ([0f32; 4], [0f32; 4]);
        let pairs = xb.len() / 2;
        let (xc, qc) = (xb[..pairs * 2].chunks_exact(8), qb[..pairs].chunks_exact(4));
        let (xr, qr) = (xc.remainder(), qc.remainder());
        for (xs, qs) in xc.zip(qc) {
            for j in 0..4 {
                lo[j] += f32::from(qs[j] & 0x0f) * xs[2 * j];
                hi[j] += f32::from(qs[j] >> 4) * xs[2 * j + 1];
            }
        }
        let mut acc = (lo[0] + lo[1]) + (lo[2] + lo[3]) + (hi[0] + hi[1]) + (hi[2] + hi[3]);
        for (j, q) in qr.iter().enumerate() {
            acc += f32::from(q & 0x0f) * xr[2 * j] + f32::from(q >> 4) * xr[2 * j + 1];
        }
        if xb.len() % 2 == 1 {
            acc += f32::from(qb[pairs] & 0x0f) * xb[xb.len() - 1];
        }
        total += scales[r * blocks + b] * (acc - zero * xsum[b]);
    }
    total
}

/// Per-block sums of `x` for a 4-bit weight's zero-point term, in `stack`
/// when they fit (a decode step allocates nothing), else on the heap.
fn block_sums<'a>(x: &[f32], w: &Weight, stack: &'a mut [f32], heap: &'a mut Vec<f32>) -> &'a [f32] {
    let Packed::Q4 { block, .. } = &w.packed else { return &[] };
    let blocks = x.len().div_ceil(*block);
    let sums: &mut [f32] = if blocks <= stack.len() {
        &mut stack[..blocks]
    } else {
        heap.resize(blocks, 0.0);
        heap
    };
    for (s, c) in sums.iter_mut().zip(x.chunks(*block)) {
        *s = c.iter().sum();
    }
    sums
}

/// One input row against every weight row, split across threads.
fn rows_dot(x: &[f32], w: &Weight, y: &mut [f32], ctx: &Ctx) {
    let (mut stack, mut heap) = ([0f32; 1024], Vec::new());
    let xsum = block_sums(x, w, &mut stack, &mut heap);
    let target = Disjoint::new(y);
    let chunk = |range: std::ops::Range<usize>, t: usize| {
        let first = range.start;
        // SAFETY: rows `range` belong to this thread alone.
        let out = unsafe { target.slice(first, range.len()) };
        match &w.packed {
            Packed::F32(data) => super::simd::matvec(x, &data[first * w.k..(first + out.len()) * w.k], out),
            Packed::Q4 { data, scales, zeros: None, block: 32, blocks } if x.len() == 32 * blocks => {
                let (b, rows) = (*blocks, out.len());
                let (bytes, sc) =
                    (&data[first * 16 * b..(first + rows) * 16 * b], &scales[first * b..(first + rows) * b]);
                super::simd::q4_matvec32(x, xsum, bytes, sc, b, out)
            }
            Packed::Q4 { .. } => out.iter_mut().enumerate().for_each(|(i, o)| *o = dot_q4(x, xsum, w, first + i)),
            // `linear` sends these to the integer kernel; widening is the
            // exact fallback.
            Packed::Q4Int8 { .. } => {
                // SAFETY: thread `t` is the only user of its scratch here.
                let scratch = unsafe { ctx.scratch.get(t) };
                out.iter_mut().enumerate().for_each(|(i, o)| *o = dot(x, w.row(first + i, &mut scratch.a)))
            }
            Packed::F16(data) => super::simd::matvec_f16(x, &data[first * w.k..(first + out.len()) * w.k], out),
        }
    };
    if w.n * w.k >= PARALLEL_MIN_MACS {
        ctx.pool.for_ranges(w.n, ROW_ALIGN, &chunk);
    } else {
        chunk(0..w.n, 0);
    }
}

/// SiLU-gated MLP input stage: `w` stacks the gate rows over the up rows;
/// returns `silu(x Wg) * (x Wu)`.
pub fn gated(x: &[f32], m: usize, w: &Weight, scratch: &mut Vec<f32>, y: &mut Vec<f32>, ctx: &Ctx) {
    linear(x, m, w, None, scratch, ctx);
    let inter = w.n / 2;
    y.clear();
    y.resize(m * inter, 0.0);
    for (row, out) in scratch.chunks_exact(w.n).zip(y.chunks_exact_mut(inter)) {
        let (gate, up) = row.split_at(inter);
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = g * super::elementwise::sigmoid(*g) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, w_kn: &[f32], k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|p| x[i * k + p] * w_kn[p * n + j]).sum();
            }
        }
        y
    }

    /// Every path (matvec, small-m transposed, sgemm, threaded) equals the
    /// naive product.
    #[test]
    fn linear_paths_match_naive() {
        for (m, k, n) in [(1, 7, 5), (2, 33, 17), (5, 16, 9), (1, 256, 300), (3, 256, 300)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 * 0.1 - 0.5).collect();
            let w: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 13) as f32 * 0.05 - 0.3).collect();
            let packed = Weight::from_kn_f32(&w, k, n);
            let mut y = Vec::new();
            let rt = super::super::Runtime::new(2).unwrap();
            linear(&x, m, &packed, None, &mut y, &rt.ctx());
            let want = naive(&x, m, &w, k, n);
            for (a, b) in y.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "m={m} k={k} n={n}: {a} vs {b}");
            }
        }
    }

    /// f16 and 4-bit weights give the product with their widened rows on
    /// every path: one row, a few rows, and the widened panels of prefill
    /// (more rows than a panel has columns, threaded or not).
    #[test]
    fn f16_and_q4_paths_match_the_widened_product() {
        let (k, n) = (64, 150);
        let halves: Vec<f16> = (0..n * k).map(|i| f16::from_f32(((i * 5) % 13) as f32 * 0.05 - 0.3)).collect();
        let f16w = Weight { n, k, packed: Packed::F16(halves) };
        let data: Vec<u8> = (0..n * 2 * 16).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<f32> = (0..n * 2).map(|i| 0.01 * (i % 7 + 1) as f32).collect();
        let zeros = Some((0..n).map(|i| (i * 29 % 256) as u8).collect::<Vec<_>>());
        let q4w = Weight { n, k, packed: Packed::Q4 { data, scales, zeros, block: 32, blocks: 2 } };
        let (one, two) = (super::super::Runtime::new(1).unwrap(), super::super::Runtime::new(2).unwrap());
        for w in [&f16w, &q4w] {
            let mut scratch = Vec::new();
            let widened: Vec<f32> = (0..n).flat_map(|r| w.row(r, &mut scratch).to_vec()).collect();
            for m in [1, 2, 5, 70] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 * 0.1 - 0.5).collect();
                for rt in [&one, &two] {
                    let mut y = Vec::new();
                    linear(&x, m, w, None, &mut y, &rt.ctx());
                    for mi in 0..m {
                        for r in 0..n {
                            let want = dot(&x[mi * k..(mi + 1) * k], &widened[r * k..(r + 1) * k]);
                            let got = y[mi * n + r];
                            assert!((got - want).abs() < 1e-3 * (1.0 + want.abs()), "m={m} r={r}: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }

    /// The fused 4-bit dot equals the dot with the dequantized row (odd K,
    /// a partial last block, explicit zero points).
    #[test]
    fn q4_dot_matches_dequantized_dot() {
        let (k, n, block): (usize, usize, usize) = (37, 3, 16);
        let blocks = k.div_ceil(block);
        let data: Vec<u8> = (0..n * blocks * block / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<f32> = (0..n * blocks).map(|i| 0.01 * (i + 1) as f32).collect();
        for zeros in [None, Some((0..n * blocks.div_ceil(2)).map(|i| (i * 29 % 256) as u8).collect::<Vec<_>>())] {
            let w = Weight {
                n,
                k,
                packed: Packed::Q4 { data: data.clone(), scales: scales.clone(), zeros, block, blocks },
            };
            let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
            let (mut stack, mut heap) = ([0f32; 4], Vec::new());
            let xsum = block_sums(&x, &w, &mut stack, &mut heap);
            let mut s = Vec::new();
            for r in 0..n {
                let want = dot(&x, w.row(r, &mut s));
                let got = dot_q4(&x, xsum, &w, r);
                assert!((want - got).abs() < 1e-4, "row {r}: {got} vs {want}");
            }
        }
    }

    /// 4-bit rows decode as `(q - zero) * scale`, low nibble first.
    #[test]
    fn q4_rows_dequantize_low_nibble_first() {
        let w = Weight {
            n: 1,
            k: 4,
            packed: Packed::Q4 { data: vec![0x21, 0xf0], scales: vec![0.5], zeros: None, block: 4, blocks: 1 },
        };
        let mut s = Vec::new();
        assert_eq!(w.row(0, &mut s), &[(1.0 - 8.0) * 0.5, (2.0 - 8.0) * 0.5, -4.0, (15.0 - 8.0) * 0.5]);
    }
}
