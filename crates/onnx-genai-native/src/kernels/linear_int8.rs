//! The reference for 4-bit projections at `MatMulNBits` `accuracy_level` 4,
//! computed the way ONNX Runtime's CPU kernel does: each input row is
//! quantized to int8 per weight block (scale `max|x| / 127`, round to
//! nearest even: [`super::quantize::quantize`]), each block product is an
//! exact integer sum `Σ qx · (qw − zero)`, and only the block results are
//! scaled and added in f32, each with one fused multiply-add
//! `total + sum · (sw · sx)` as MLAS's kernels do (a multiply and then an
//! add put one of 12 tiny-model prompts 1.2e-2 away from ONNX Runtime
//! through an int8 rounding tie a layer later; fused, within 8.4e-7). Computing these in f32 instead would be more
//! exact but not what the reference runtime computes: on a tiny model the
//! two differ by ~1e-2 in the logits, 35x the int4 tier. The tiled kernels
//! compute the same integers and must agree with this to the last bit.

use super::quantize::quantize;
use super::weights::{zero_point, Packed, Weight, QBLOCK};
use super::Ctx;
use crate::pool::Disjoint;

/// Below this many multiply-adds a projection runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 15;

/// One row of a row-form 4-bit weight against one quantized input row:
/// per block `Σ qx · (q − zero)` in integers, scaled once.
#[allow(clippy::too_many_arguments)]
fn dot_row(
    xq: &[i8],
    xscale: &[f32],
    data: &[u8],
    scales: &[f32],
    zeros: Option<&[u8]>,
    r: usize,
    block: usize,
    blocks: usize,
) -> f32 {
    let half = block / 2;
    let row = &data[r * blocks * half..(r + 1) * blocks * half];
    let per = (block / QBLOCK).max(1);
    let mut total = 0.0f32;
    for b in 0..blocks {
        let zero = i32::from(zero_point(zeros, r, blocks, b));
        // Scales are recorded per 32 inputs; a block repeats its own.
        let sx = xscale[b * per];
        let mut sum = 0i32;
        for (j, qx) in xq[b * block..(b + 1) * block].iter().enumerate() {
            let byte = row[b * half + j / 2];
            let q = i32::from(if j % 2 == 0 { byte & 0x0f } else { byte >> 4 });
            sum += i32::from(*qx) * (q - zero);
        }
        total = (sum as f32).mul_add(scales[r * blocks + b] * sx, total);
    }
    total
}

/// `y[m, n] = quant(x[m, :]) . W[n, :]` for a row-form int8-input 4-bit
/// weight (blocks a multiple of 32).
pub fn linear_q4_int8(x: &[f32], m: usize, w: &Weight, y: &mut [f32], ctx: &Ctx) {
    let Packed::Q4 { data, scales, zeros, block, blocks, int8: true, .. } = &w.packed else { return };
    let (n, k, block, blocks) = (w.n, w.k, *block, *blocks);
    let padded = blocks * block;
    let mut staged = ctx.staging();
    let s = &mut *staged;
    s.a.clear();
    s.bytes.clear();
    s.b.clear();
    s.ints.clear();
    for xi in x.chunks_exact(k.max(1)).take(m) {
        let start = s.a.len();
        s.a.extend_from_slice(xi);
        s.a.resize(start + padded, 0.0);
        quantize(&s.a[start..], block, &mut s.bytes, &mut s.b, &mut s.ints);
    }
    let (qv, qs) = (&s.bytes, &s.b);
    let per_row_scales = padded / QBLOCK.min(block).max(1);
    let out = Disjoint::new(y);
    let work = |range: std::ops::Range<usize>, _t: usize| {
        for r in range {
            for i in 0..m {
                let xq = &qv[i * padded..(i + 1) * padded];
                let xs = &qs[i * per_row_scales..(i + 1) * per_row_scales];
                // SAFETY: output column `r` belongs to this range only.
                let o = unsafe { out.slice(i * n + r, 1) };
                o[0] = dot_row(xq, xs, data, scales, zeros.as_deref(), r, block, blocks);
            }
        }
    };
    if m * n * k >= PARALLEL_MIN_MACS {
        ctx.pool.for_ranges(n, 16, &work);
    } else {
        work(0..n, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Runtime;

    /// `x` quantized on its own, per block of `block` (tests).
    fn quantized(x: &[f32], block: usize) -> (Vec<i8>, Vec<f32>) {
        let (mut v, mut s, mut sums) = (Vec::new(), Vec::new(), Vec::new());
        let padded = x.len().div_ceil(block) * block;
        let mut xs = x.to_vec();
        xs.resize(padded, 0.0);
        quantize(&xs, block, &mut v, &mut s, &mut sums);
        (v, s)
    }

    /// Scale `max|x| / 127`, ties to even, zero input gives zero scale.
    #[test]
    fn quantizes_per_block() {
        let (values, scales) = quantized(&[1.0, -0.5, 0.0, 0.0, 2.54], 32);
        assert_eq!(&values[..5], &[50, -25, 0, 0, 127]);
        assert_eq!(scales, vec![2.54 / 127.0]);
        let mut x = vec![0.0f32; 64];
        x[..4].copy_from_slice(&[127.0, 62.5, -62.5, 63.5]);
        let (values, scales) = quantized(&x, 32);
        // max 127 gives scale 1: halves round to the even neighbour.
        assert_eq!(&values[..4], &[127, 62, -62, 64]);
        assert_eq!(scales, vec![1.0, 0.0], "an all-zero block has scale 0");
    }

    fn weight(zeros: Option<Vec<u8>>) -> Weight {
        // 1 output row, K = 64, blocks of 32: nibbles 9 (first 32 inputs),
        // then 15 and 0 alternating.
        let mut data = vec![0x99u8; 16];
        data.extend(std::iter::repeat_n(0x0fu8, 16));
        let packed =
            Packed::Q4 { data, scales: vec![0.5, 0.25], zeros, offsets: None, block: 32, blocks: 2, int8: true };
        Weight { n: 1, k: 64, packed }
    }

    /// The block sums are exact integers, scaled once per block; with zero
    /// points and with the default 8.
    #[test]
    fn integer_block_products() {
        let mut x = vec![0.0f32; 64];
        x[0] = 1.0;
        x[1] = -1.0;
        x[32] = 0.5;
        x[33] = 0.25;
        let (_, qs) = quantized(&x, 32);
        let rt = Runtime::serial();
        let mut y = vec![0.0];
        linear_q4_int8(&x, 1, &weight(None), &mut y, &rt.ctx());
        // Block 0: 127*(9-8) + -127*(9-8) = 0. Block 1: qx = [127, 64];
        // 127*(15-8) + 64*(0-8) = 377.
        let want = 377.0 * (0.25 * qs[1]);
        assert!((y[0] - want).abs() < 1e-6, "{} vs {want}", y[0]);
        linear_q4_int8(&x, 1, &weight(Some(vec![0x09])), &mut y, &rt.ctx());
        // Zero points 9 and 0: block 0 = 127*0 + -127*0 = 0; block 1 = 127*15 + 0 = 1905.
        let want = 1905.0 * (0.25 * qs[1]);
        assert!((y[0] - want).abs() < 1e-6, "{} vs {want}", y[0]);
    }

    /// Several input rows give each row's single-row result, with and
    /// without threads, and equal the widened product of the dequantized
    /// weight with the dequantized input; K = 72 leaves a partial last
    /// block.
    #[test]
    fn prefill_rows_equal_single_rows() {
        let (n, k, blocks) = (40, 72, 3);
        let data: Vec<u8> = (0..n * blocks * 16).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<f32> = (0..n * blocks).map(|i| 0.01 + i as f32 * 1e-3).collect();
        let zeros = Some((0..n * 2).map(|i| (i * 7 % 256) as u8).collect());
        let w =
            Weight { n, k, packed: Packed::Q4 { data, scales, zeros, offsets: None, block: 32, blocks, int8: true } };
        let m = 5;
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1).collect();
        for rt in [Runtime::serial(), Runtime::new(2).unwrap()] {
            let mut all = vec![0.0; m * n];
            linear_q4_int8(&x, m, &w, &mut all, &rt.ctx());
            for i in 0..m {
                let mut one = vec![0.0; n];
                linear_q4_int8(&x[i * k..(i + 1) * k], 1, &w, &mut one, &rt.ctx());
                assert_eq!(&all[i * n..(i + 1) * n], &one[..], "row {i}");
                let (qv, qs) = quantized(&x[i * k..(i + 1) * k], 32);
                let xq: Vec<f32> = (0..k).map(|j| f32::from(qv[j]) * qs[j / 32]).collect();
                let mut scratch = Vec::new();
                for (r, got) in one.iter().enumerate() {
                    let want: f32 = w.row(r, &mut scratch).iter().zip(&xq).map(|(a, b)| a * b).sum();
                    assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {i} out {r}: {got} vs {want}");
                }
            }
        }
    }
}
