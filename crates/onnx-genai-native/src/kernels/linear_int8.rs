//! 4-bit projections at `MatMulNBits` `accuracy_level` 4, computed the way
//! ONNX Runtime's CPU kernel does: each input row is quantized to int8 per
//! weight block (scale `max|x| / 127`, round to nearest even), each block
//! product is an exact integer sum `Σ qx · (qw − zero)`, and only the block
//! results are scaled and added in f32. Computing these in f32 instead
//! would be more exact but not what the reference computes: on a tiny
//! model the two differ by ~1e-2 in the logits, 35x the int4 tier.

use rayon::prelude::*;

use super::linear::{Packed, Pool, Weight};

/// Below this many multiply-adds a projection runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 15;

/// One input row quantized per block: int8 values and one scale per block.
pub struct QuantizedRow {
    pub values: Vec<i8>,
    pub scales: Vec<f32>,
}

/// Quantizes `x` in blocks of `block` (the last may be shorter).
pub fn quantize_row(x: &[f32], block: usize) -> QuantizedRow {
    let mut values = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len().div_ceil(block));
    for chunk in x.chunks(block) {
        let amax = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inverse = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        values.extend(chunk.iter().map(|v| (v * inverse).round_ties_even() as i8));
        scales.push(scale);
    }
    QuantizedRow { values, scales }
}

/// `x . dequant(row r)` with `x` quantized.
fn dot_row(x: &QuantizedRow, w: &Weight, r: usize) -> f32 {
    let Packed::Q4 { data, scales, zeros, block, blocks, .. } = &w.packed else { return 0.0 };
    let (block, blocks, half) = (*block, *blocks, *block / 2);
    let row = &data[r * blocks * half..(r + 1) * blocks * half];
    let zero_stride = blocks.div_ceil(2);
    let mut total = 0.0f32;
    for (b, (qx, qw)) in x.values.chunks(block).zip(row.chunks_exact(half)).enumerate() {
        let zero = match zeros {
            Some(z) => i32::from((z[r * zero_stride + b / 2] >> (4 * (b % 2))) & 0x0f),
            None => 8,
        };
        let mut sum = 0i32;
        for (pair, byte) in qx.chunks(2).zip(qw) {
            sum += i32::from(pair[0]) * (i32::from(byte & 0x0f) - zero);
            if let Some(odd) = pair.get(1) {
                sum += i32::from(*odd) * (i32::from(byte >> 4) - zero);
            }
        }
        total += sum as f32 * (x.scales[b] * scales[r * blocks + b]);
    }
    total
}

/// `y[m, n] = quant(x[m, :]) . W[n, :]` for a 4-bit weight.
pub fn linear_q4_int8(x: &[f32], m: usize, w: &Weight, y: &mut [f32], pool: Pool) {
    let Packed::Q4 { block, .. } = &w.packed else { return };
    let (n, k) = (w.n, w.k);
    for (xi, out) in x.chunks_exact(k).zip(y.chunks_exact_mut(n)).take(m) {
        let q = quantize_row(xi, *block);
        match pool {
            Some(p) if n * k >= PARALLEL_MIN_MACS => {
                p.install(|| out.par_iter_mut().enumerate().for_each(|(r, o)| *o = dot_row(&q, w, r)))
            }
            _ => out.iter_mut().enumerate().for_each(|(r, o)| *o = dot_row(&q, w, r)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(zeros: Option<Vec<u8>>) -> Weight {
        // 1 output row, K = 4, blocks of 2: nibbles [9, 7 | 15, 0].
        let packed = Packed::Q4 {
            data: vec![0x79, 0x0f],
            scales: vec![0.5, 0.25],
            zeros,
            block: 2,
            blocks: 2,
            int8_input: true,
        };
        Weight { n: 1, k: 4, packed }
    }

    /// Scale `max|x| / 127`, ties to even, zero input gives zero scale.
    #[test]
    fn quantizes_per_block() {
        let q = quantize_row(&[1.0, -0.5, 0.0, 0.0, 2.54], 2);
        assert_eq!(q.values, vec![127, -64, 0, 0, 127]);
        assert_eq!(q.scales, vec![1.0 / 127.0, 0.0, 2.54 / 127.0]);
        // max 127 gives scale 1: halves round to the even neighbour.
        assert_eq!(quantize_row(&[127.0, 62.5, -62.5, 63.5], 4).values, vec![127, 62, -62, 64]);
    }

    /// The block sums are exact integers, scaled once per block; with zero
    /// points and with the default 8.
    #[test]
    fn integer_block_products() {
        let x = [1.0f32, -1.0, 0.5, 0.25];
        let q = quantize_row(&x, 2);
        let mut y = vec![0.0];
        linear_q4_int8(&x, 1, &weight(None), &mut y, None);
        // Block 0: 127*(9-8) + -127*(7-8) = 254 -> 254 * (1/127) * 0.5 = 1.0.
        // Block 1: qx = [127, 64]; 127*(15-8) + 64*(0-8) = 377 -> 377 * (0.5/127) * 0.25.
        let want = 1.0 + 377.0 * (q.scales[1] * 0.25);
        assert!((y[0] - want).abs() < 1e-6, "{} vs {want}", y[0]);
        linear_q4_int8(&x, 1, &weight(Some(vec![0x09])), &mut y, None);
        // Zero points 9 and 0: block 0 = 127*0 + -127*-2 = 254; block 1 = 127*15 + 0 = 1905.
        let want = 254.0 * (q.scales[0] * 0.5) + 1905.0 * (q.scales[1] * 0.25);
        assert!((y[0] - want).abs() < 1e-6, "{} vs {want}", y[0]);
    }
}
