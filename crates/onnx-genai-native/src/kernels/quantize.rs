//! Activations quantized to int8 the way ONNX Runtime's CPU `MatMulNBits`
//! does at `accuracy_level` 4, on every path to the same bits: the
//! portable reference and AVX2 (blocks of 32 eight at a time).

use super::weights::QBLOCK;

/// Quantizes `x` (one row of `kp` values, or several rows whose width is
/// a whole number of blocks: no block then spans two) the way ONNX Runtime's CPU
/// `MatMulNBits` does at `accuracy_level` 4: per block of `x_block` inputs,
/// scale `max|x| / 127` and values rounded to nearest, ties to even. Scales
/// and sums are recorded per 32 inputs (a larger block repeats its scale;
/// a smaller one has its own).
pub fn quantize(x: &[f32], x_block: usize, q: &mut Vec<i8>, scales: &mut Vec<f32>, sums: &mut Vec<i32>) {
    let (at, blocks) = (q.len(), scales.len());
    let entries = quantized_blocks(x.len(), x_block);
    q.resize(at + x.len(), 0);
    scales.resize(blocks + entries, 0.0);
    sums.resize(blocks + entries, 0);
    quantize_into(x, x_block, &mut q[at..], &mut scales[blocks..], &mut sums[blocks..]);
}

/// The scales (and sums) [`quantize`] records for `k` inputs.
pub(super) fn quantized_blocks(k: usize, x_block: usize) -> usize {
    let x_block = x_block.max(1);
    let sub = QBLOCK.min(x_block);
    (k / x_block) * x_block.div_ceil(sub) + (k % x_block).div_ceil(sub)
}

/// [`quantize`] into slices of exactly the right lengths (`x.len()` values,
/// [`quantized_blocks`] scales and sums), so rows can be quantized apart.
pub(super) fn quantize_into(x: &[f32], x_block: usize, q: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 checked.
        unsafe { quantize_avx2(x, x_block, q, scales, sums) };
        return;
    }
    quantize_portable(x, x_block, q, scales, sums);
}

fn quantize_portable(x: &[f32], x_block: usize, q: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    let x_block = x_block.max(1);
    let mut entry = 0;
    for (chunk, out) in x.chunks(x_block).zip(q.chunks_mut(x_block)) {
        entry += quantize_chunk(chunk, out, x_block, &mut scales[entry..], &mut sums[entry..]);
    }
}

/// One block of [`quantize_into`]; returns the scales (and sums) written.
fn quantize_chunk(chunk: &[f32], out: &mut [i8], x_block: usize, scales: &mut [f32], sums: &mut [i32]) -> usize {
    let amax = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inverse = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (o, v) in out.iter_mut().zip(chunk) {
        *o = round_small(v * inverse) as i8;
    }
    let mut entry = 0;
    for sub in out.chunks(QBLOCK.min(x_block)) {
        scales[entry] = scale;
        sums[entry] = sub.iter().map(|v| i32::from(*v)).sum();
        entry += 1;
    }
    entry
}

/// [`quantize_portable`] on AVX2, to the same bits: `max` is exact in any
/// order, the scale and its inverse are the same scalar divisions, the
/// products the same multiplications, and `cvtps2dq` rounds to nearest,
/// ties to even (the default rounding mode), as [`round_small`] does; the
/// sums are exact integers. Blocks of other than whole 32s take the
/// portable path. (It was 5% of a 16-sequence decode step in scalar code.)
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(x: &[f32], x_block: usize, q: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    use std::arch::x86_64::*;
    let x_block = x_block.max(1);
    if !x_block.is_multiple_of(QBLOCK) {
        quantize_portable(x, x_block, q, scales, sums);
        return;
    }
    // Blocks of 32 (ONNX Runtime's usual block), eight at a time first.
    let grouped = if x_block == QBLOCK {
        // SAFETY: AVX2 is available (this function's contract).
        unsafe { quantize_eights(x, q, scales, sums) }
    } else {
        0
    };
    let (x, q) = (&x[grouped * QBLOCK..], &mut q[grouped * QBLOCK..]);
    let (scales, sums) = (&mut scales[grouped..], &mut sums[grouped..]);
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut entry = 0;
    for (chunk, out) in x.chunks(x_block).zip(q.chunks_mut(x_block)) {
        if !chunk.len().is_multiple_of(QBLOCK) {
            entry += quantize_chunk(chunk, out, x_block, &mut scales[entry..], &mut sums[entry..]);
            continue;
        }
        let mut m = _mm256_setzero_ps();
        for v in chunk.chunks_exact(8) {
            // SAFETY: `v` holds 8 values. (|v| first: `maxps` returns its
            // second operand when one is NaN, so a NaN is skipped as
            // `f32::max` skips it.)
            m = _mm256_max_ps(_mm256_and_ps(unsafe { _mm256_loadu_ps(v.as_ptr()) }, magnitude), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
        let scale = amax / 127.0;
        let inverse = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        for (sub, o) in chunk.chunks_exact(QBLOCK).zip(out.chunks_exact_mut(QBLOCK)) {
            // SAFETY: `sub` holds 32 values: four loads of 8.
            let [a, b, c, d]: [__m256i; 4] =
                std::array::from_fn(|i| unsafe { scaled_rounded(sub.as_ptr().add(8 * i), inverse) });
            // SAFETY: `o` holds 32 bytes.
            unsafe { store_bytes(o.as_mut_ptr(), [a, b, c, d]) };
            let s = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1));
            scales[entry] = scale;
            sums[entry] = _mm_cvtsi128_si32(s1);
            entry += 1;
        }
    }
}

/// [`quantize_avx2`]'s blocks of 32 in groups of eight (all the whole
/// groups `x`, `q`, `scales` and `sums` hold); returns the blocks done.
/// Each block alone is a chain of dependent steps (its largest magnitude,
/// two scalar divisions, the products, the packing): one at a time they
/// ran at about 27 cycles a block on a Zen 4, so the threads' own
/// quantization was a tenth of a 576-input projection of 16 rows. Eight
/// blocks' maxima are reduced together, their scales and inverses are one
/// vector division each (correctly rounded, as the scalar ones: the same
/// bits), and their sums are reduced together.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_eights(x: &[f32], q: &mut [i8], scales: &mut [f32], sums: &mut [i32]) -> usize {
    use std::arch::x86_64::*;
    const GROUP: usize = 8;
    let groups =
        (x.len() / (GROUP * QBLOCK)).min(q.len() / (GROUP * QBLOCK)).min(scales.len() / GROUP).min(sums.len() / GROUP);
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let limit = _mm256_set1_ps(127.0);
    for g in 0..groups {
        let block = |b: usize| &x[(g * GROUP + b) * QBLOCK..(g * GROUP + b + 1) * QBLOCK];
        // Each block's largest magnitude lane by lane (|v| first, the
        // running maximum second: `maxps` returns its second operand when
        // one is NaN, so a NaN is skipped as `f32::max` skips it).
        let partial: [__m256; GROUP] = std::array::from_fn(|b| {
            block(b).chunks_exact(8).fold(_mm256_setzero_ps(), |m, v| {
                // SAFETY: `v` holds 8 values.
                _mm256_max_ps(_mm256_and_ps(unsafe { _mm256_loadu_ps(v.as_ptr()) }, magnitude), m)
            })
        });
        let amax = max_across(partial);
        let zero = _mm256_cmp_ps::<_CMP_EQ_OQ>(amax, _mm256_setzero_ps());
        let mut inverse = [0f32; GROUP];
        // SAFETY: `inverse` holds 8 values, `scales` 8 from `g * 8`.
        unsafe {
            _mm256_storeu_ps(inverse.as_mut_ptr(), _mm256_andnot_ps(zero, _mm256_div_ps(limit, amax)));
            _mm256_storeu_ps(scales.as_mut_ptr().add(g * GROUP), _mm256_div_ps(amax, limit));
        }
        let block_sums: [__m256i; GROUP] = std::array::from_fn(|b| {
            let at = (g * GROUP + b) * QBLOCK;
            let scale = _mm256_set1_ps(inverse[b]);
            // SAFETY: `x` and `q` hold 32 values from `at`.
            let [v0, v1, v2, v3]: [__m256i; 4] =
                std::array::from_fn(|i| unsafe { scaled_rounded(x.as_ptr().add(at + 8 * i), scale) });
            // SAFETY: as above.
            unsafe { store_bytes(q.as_mut_ptr().add(at), [v0, v1, v2, v3]) };
            _mm256_add_epi32(_mm256_add_epi32(v0, v1), _mm256_add_epi32(v2, v3))
        });
        // SAFETY: `sums` holds 8 values from `g * 8`.
        unsafe { _mm256_storeu_si256(sums.as_mut_ptr().add(g * GROUP).cast(), add_across(block_sums)) };
    }
    groups * GROUP
}

/// Lane `b` of the result: the largest of vector `b`'s eight lanes (none
/// NaN: the maximum is then exact in any order).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn max_across(p: [std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // Within each 128-bit half: the maxima of lanes (0, 1) and (2, 3) of
    // `a`, then of `b`.
    let pairs =
        |a, b| _mm256_max_ps(_mm256_shuffle_ps::<0b10_00_10_00>(a, b), _mm256_shuffle_ps::<0b11_01_11_01>(a, b));
    let low = pairs(pairs(p[0], p[1]), pairs(p[2], p[3]));
    let high = pairs(pairs(p[4], p[5]), pairs(p[6], p[7]));
    _mm256_max_ps(_mm256_permute2f128_ps::<0x20>(low, high), _mm256_permute2f128_ps::<0x31>(low, high))
}

/// Lane `b` of the result: the sum of vector `b`'s eight lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn add_across(p: [std::arch::x86_64::__m256i; 8]) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let low = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    let high = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(low, high), _mm256_permute2x128_si256::<0x31>(low, high))
}

/// Eight values from `at` times `inverse`, rounded to nearest, ties to
/// even (`cvtps2dq` in the default rounding mode, as [`round_small`]
/// rounds): both AVX2 paths' one rounding.
///
/// # Safety
/// AVX2 must be available and `at` valid for 8 reads.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scaled_rounded(at: *const f32, inverse: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: `at` is valid for 8 reads (the caller's contract).
    let scaled = _mm256_mul_ps(unsafe { _mm256_loadu_ps(at) }, inverse);
    // Where the portable path's saturating cast and `cvtps2dq` (which
    // gives `i32::MIN`: packed to -128, but wrong in the block's sum)
    // part: a NaN product (a NaN input, or an infinite one times its
    // block's zero inverse; also a zero times an infinite inverse) becomes
    // 0, and ±inf (a block whose largest magnitude is below 127 / f32::MAX
    // makes its inverse infinite) 127 and -128.
    let ordered = _mm256_and_ps(scaled, _mm256_cmp_ps::<_CMP_ORD_Q>(scaled, scaled));
    let within = _mm256_max_ps(_mm256_min_ps(ordered, _mm256_set1_ps(127.0)), _mm256_set1_ps(-128.0));
    _mm256_cvtps_epi32(within)
}

/// Stores 32 quantized values (four vectors of 8 rounded `i32`, each
/// within -128..=127) as bytes in order at `o`.
///
/// # Safety
/// AVX2 must be available and `o` valid for 32 bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_bytes(o: *mut i8, [a, b, c, d]: [std::arch::x86_64::__m256i; 4]) {
    use std::arch::x86_64::*;
    let bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    // The packs work within 128-bit lanes: this puts the four 8-value
    // groups back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    // SAFETY: `o` is valid for 32 bytes (the caller's contract).
    unsafe { _mm256_storeu_si256(o.cast(), _mm256_permutevar8x32_epi32(bytes, order)) };
}

/// `v` rounded to nearest, ties to even, for `|v| < 2^22` (quantized
/// activations are within ±127): adding and subtracting 1.5 · 2^23 leaves
/// the rounded value in the default rounding mode. `f32::round_ties_even`
/// is the same, but on the x86-64 baseline (no SSE4.1) it is a call to
/// `rintf` per value, which was 6% of a batched decode step.
#[inline]
fn round_small(v: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (v + SHIFT) - SHIFT
}

#[cfg(test)]
mod tests {
    use super::*;

    type Quantizer = dyn Fn(&[f32], usize, &mut [i8], &mut [f32], &mut [i32]);

    /// The AVX2 quantization gives [`quantize_portable`]'s bits: values,
    /// scales and sums, on rows with zero blocks (the first, or one inside
    /// a group of eight), ties (x.5 after scaling), the block maximum at
    /// either end, negative maxima, blocks of 32, 64 and 128, blocks of 32
    /// in whole groups of eight and with blocks left over (576 inputs:
    /// SmolLM2's width, 18 blocks; 288: 9; 2 rows of 576 as one call, as a
    /// thread quantizes a call's rows), a last block that is not whole
    /// 32s (portable there), blocks holding NaN or infinite inputs, and
    /// blocks so small that their inverse scale is infinite (a broken
    /// model's activations still quantize the same everywhere).
    #[test]
    fn quantization_is_the_same_on_every_path() {
        let mut seed = 0x9e37_79b9u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for (k, x_block) in [(96, 32), (128, 64), (256, 128), (100, 32), (72, 64), (576, 32), (288, 32), (1152, 32)] {
            for case in 0..70 {
                let mut x: Vec<f32> = (0..k).map(|_| (next() % 20001) as f32 / 1000.0 - 10.0).collect();
                match case % 7 {
                    // Zero blocks.
                    0 => x[..k.min(32)].iter_mut().for_each(|v| *v = 0.0),
                    // Ties: max 127 gives scale 1, halves round to even.
                    1 => {
                        x[0] = -127.0;
                        x.iter_mut().skip(1).step_by(3).for_each(|v| *v = (next() % 255) as f32 / 2.0 - 63.5);
                    }
                    // The maximum last in its block.
                    2 => x[k - 1] = 50.0,
                    // A zero block inside a group of eight.
                    3 if k >= 256 => x[160..192].iter_mut().for_each(|v| *v = 0.0),
                    // NaN beside finite values, and an infinite maximum.
                    4 => {
                        x[1] = f32::NAN;
                        x[k / 2] = f32::INFINITY;
                    }
                    5 => x[k - 1] = f32::NEG_INFINITY,
                    // A block of values below 127 / f32::MAX (subnormal)
                    // and zeros, the first (alone, or in a group of eight).
                    6 => x[..k.min(32)].iter_mut().enumerate().for_each(|(i, v)| {
                        *v = [1e-38, -1e-38, 0.0, 3e-39][i % 4];
                    }),
                    _ => {}
                }
                let entries = quantized_blocks(k, x_block);
                let run = |f: &Quantizer| {
                    let (mut q, mut s, mut sums) = (vec![0i8; k], vec![0f32; entries], vec![0i32; entries]);
                    f(&x, x_block, &mut q, &mut s, &mut sums);
                    (q, s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), sums)
                };
                let want = run(&quantize_portable);
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 checked.
                    let got = run(&|x, b, q, s, sums| unsafe { quantize_avx2(x, b, q, s, sums) });
                    assert_eq!(got, want, "k={k} x_block={x_block} case={case}");
                }
                assert_eq!(run(&quantize_into), want);
            }
        }
    }

    /// The activation rounding is ONNX Runtime's (nearest, ties to even) on
    /// every value quantization can produce: every multiple of 1/64 in
    /// ±130 (all the ties among them) and the neighbours of each tie.
    #[test]
    fn small_rounding_is_nearest_ties_to_even() {
        for i in -130 * 64..=130 * 64 {
            let v = i as f32 / 64.0;
            for w in [v, f32::from_bits(v.to_bits() + 1), f32::from_bits(v.to_bits().saturating_sub(1))] {
                // (As quantized: the sign of a zero does not survive.)
                assert_eq!(round_small(w) as i8, w.round_ties_even() as i8, "{w}");
            }
        }
    }
}
