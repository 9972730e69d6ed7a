//! 4-bit projections at `MatMulNBits` `accuracy_level` 4, computed the way
//! ONNX Runtime's CPU kernel does: each input row is quantized to int8 per
//! weight block (scale `max|x| / 127`, round to nearest even), each block
//! product is an exact integer sum `Σ qx · (qw − zero)`, and only the block
//! results are scaled and added in f32. Computing these in f32 instead
//! would be more exact but not what the reference computes: on a tiny
//! model the two differ by ~1e-2 in the logits, 35x the int4 tier.

use super::linear::{Packed, Weight};
use super::Ctx;
use crate::pool::Disjoint;

/// Below this many multiply-adds a projection runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 15;

/// One input row quantized per block: int8 values and one scale per block.
pub struct QuantizedRow<'a> {
    pub values: &'a [i8],
    pub scales: &'a [f32],
}

/// Quantizes `x` in blocks of `block` (the last may be shorter; it is
/// padded with zeros), appending to `values` and `scales`.
pub fn quantize_row(x: &[f32], block: usize, values: &mut Vec<i8>, scales: &mut Vec<f32>) {
    let start = scales.len();
    for chunk in x.chunks(block) {
        let amax = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inverse = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        values.extend(chunk.iter().map(|v| (v * inverse).round_ties_even() as i8));
        scales.push(scale);
    }
    // Whole blocks, as the weight rows are padded.
    values.resize(scales.len() * block, 0);
    debug_assert!(scales.len() >= start);
}

/// `x . dequant(row r)` with `x` quantized: per block an exact integer sum,
/// scaled once.
fn dot_row(x: &QuantizedRow, values: &[i8], scales: &[f32], block: usize) -> f32 {
    if block == 32 {
        return dot_row32(x, values, scales);
    }
    let mut total = 0.0f32;
    for ((qx, qw), (sx, sw)) in x.values.chunks(block).zip(values.chunks_exact(block)).zip(x.scales.iter().zip(scales))
    {
        // |qx| <= 127 and |qw| <= 15: each product fits an i16, the block
        // sum an i32 (and vectorizes as such).
        let sum: i32 = qx.iter().zip(qw).map(|(a, b)| i32::from(i16::from(*a) * i16::from(*b))).sum();
        total += sum as f32 * (sx * sw);
    }
    total
}

/// [`dot_row`] for blocks of 32 (their builder's size): fixed-length
/// blocks the compiler unrolls and vectorizes.
fn dot_row32(x: &QuantizedRow, values: &[i8], scales: &[f32]) -> f32 {
    let mut total = 0.0f32;
    let blocks = x.values.chunks_exact(32).zip(values.chunks_exact(32));
    for ((qx, qw), (sx, sw)) in blocks.zip(x.scales.iter().zip(scales)) {
        let (Ok(qx), Ok(qw)) = (<&[i8; 32]>::try_from(qx), <&[i8; 32]>::try_from(qw)) else { continue };
        let mut sum = 0i32;
        for j in 0..32 {
            sum += i32::from(i16::from(qx[j]) * i16::from(qw[j]));
        }
        total += sum as f32 * (sx * sw);
    }
    total
}

/// `y[m, n] = quant(x[m, :]) . W[n, :]` for a [`Packed::Q4Int8`] weight.
/// Every input row is quantized once; each weight row is then read once
/// for all of them (prefill streams the weight once, not once per token).
pub fn linear_q4_int8(x: &[f32], m: usize, w: &Weight, y: &mut [f32], ctx: &Ctx) {
    let Packed::Q4Int8 { values, scales, block, blocks } = &w.packed else { return };
    let (n, k, block, blocks) = (w.n, w.k, *block, *blocks);
    let mut staged = ctx.staging();
    let staged = &mut *staged;
    staged.bytes.clear();
    staged.a.clear();
    for xi in x.chunks_exact(k).take(m) {
        quantize_row(xi, block, &mut staged.bytes, &mut staged.a);
    }
    let (qv, qs) = (&staged.bytes, &staged.a);
    let input = |i: usize| QuantizedRow {
        values: &qv[i * blocks * block..(i + 1) * blocks * block],
        scales: &qs[i * blocks..(i + 1) * blocks],
    };
    let weight_row =
        |r: usize| (&values[r * blocks * block..(r + 1) * blocks * block], &scales[r * blocks..(r + 1) * blocks]);
    let out = Disjoint::new(y);
    // Each weight row is read once for every input row.
    let work = |range: std::ops::Range<usize>, _t: usize| {
        for r in range {
            let (v, s) = weight_row(r);
            for i in 0..m {
                // SAFETY: output column `r` belongs to this range only.
                let o = unsafe { out.slice(i * n + r, 1) };
                o[0] = dot_row(&input(i), v, s, block);
            }
        }
    };
    if m * n * k >= PARALLEL_MIN_MACS {
        ctx.pool.for_ranges(n, 16, &work);
    } else {
        work(0..n, 0);
    }
}

/// `x` quantized on its own (tests and reference checks).
#[cfg(test)]
pub(crate) fn quantized(x: &[f32], block: usize) -> (Vec<i8>, Vec<f32>) {
    let (mut v, mut s) = (Vec::new(), Vec::new());
    quantize_row(x, block, &mut v, &mut s);
    (v, s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Runtime;

    fn weight(zeros: Option<Vec<u8>>) -> Weight {
        // 1 output row, K = 4, blocks of 2: nibbles [9, 7 | 15, 0].
        let packed = Packed::Q4 { data: vec![0x79, 0x0f], scales: vec![0.5, 0.25], zeros, block: 2, blocks: 2 };
        Weight { n: 1, k: 4, packed }.into_int8_products()
    }

    /// Scale `max|x| / 127`, ties to even, zero input gives zero scale.
    #[test]
    fn quantizes_per_block() {
        let (values, scales) = quantized(&[1.0, -0.5, 0.0, 0.0, 2.54], 2);
        assert_eq!(values, vec![127, -64, 0, 0, 127, 0]);
        assert_eq!(scales, vec![1.0 / 127.0, 0.0, 2.54 / 127.0]);
        // max 127 gives scale 1: halves round to the even neighbour.
        assert_eq!(quantized(&[127.0, 62.5, -62.5, 63.5], 4).0, vec![127, 62, -62, 64]);
    }

    /// The block sums are exact integers, scaled once per block; with zero
    /// points and with the default 8.
    #[test]
    fn integer_block_products() {
        let x = [1.0f32, -1.0, 0.5, 0.25];
        let (_, qs) = quantized(&x, 2);
        let rt = Runtime::serial();
        let mut y = vec![0.0];
        linear_q4_int8(&x, 1, &weight(None), &mut y, &rt.ctx());
        // Block 0: 127*(9-8) + -127*(7-8) = 254 -> 254 * (1/127) * 0.5 = 1.0.
        // Block 1: qx = [127, 64]; 127*(15-8) + 64*(0-8) = 377 -> 377 * (0.5/127) * 0.25.
        let want = 1.0 + 377.0 * (qs[1] * 0.25);
        assert!((y[0] - want).abs() < 1e-6, "{} vs {want}", y[0]);
        linear_q4_int8(&x, 1, &weight(Some(vec![0x09])), &mut y, &rt.ctx());
        // Zero points 9 and 0: block 0 = 127*0 + -127*-2 = 254; block 1 = 127*15 + 0 = 1905.
        let want = 254.0 * (qs[0] * 0.5) + 1905.0 * (qs[1] * 0.25);
        assert!((y[0] - want).abs() < 1e-6, "{} vs {want}", y[0]);
    }
}

#[cfg(test)]
mod prefill_tests {
    use super::*;
    use crate::kernels::Runtime;

    /// Several input rows (the prefill order: one weight row against all of
    /// them) give each row's single-row result, with and without threads,
    /// and equal the widened product of the dequantized weight with the
    /// dequantized input; K = 72 leaves a partial last block.
    #[test]
    fn prefill_rows_equal_single_rows() {
        let (n, k, blocks) = (40, 72, 3);
        let data: Vec<u8> = (0..n * blocks * 16).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<f32> = (0..n * blocks).map(|i| 0.01 + i as f32 * 1e-3).collect();
        let zeros = Some((0..n * 2).map(|i| (i * 7 % 256) as u8).collect());
        let w = Weight { n, k, packed: Packed::Q4 { data, scales, zeros, block: 32, blocks } }.into_int8_products();
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
