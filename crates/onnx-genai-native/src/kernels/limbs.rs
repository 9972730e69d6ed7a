//! f32 activations as integers, so a 4-bit weight's dot product at
//! `accuracy_level` 0 runs on integer dot products (`vpdpbusd`) without
//! giving up f32 inputs.
//!
//! Each block of 32 inputs is scaled by a power of two that puts its
//! largest magnitude in `[2^29, 2^30)` and rounded to integers, which are
//! then written as four signed base-256 digits ("limbs", each in
//! `-128..=127`; the top one within ±64). Scaling by a power of two is
//! exact, so every input within 2^6 of its block's largest keeps all 24
//! bits of its significand; a smaller one is held to 2^-30 of that largest
//! magnitude — 64 times finer than f32's own rounding of the largest
//! input's product with a weight. The kernel's sum over the block is then
//! an exact integer per limb, combined with one rounding.
//!
//! Why: the f32-input 4-bit kernel turns each weight into an f32 (a shift
//! and a table lookup per 16 weights) before its multiply-add, and on a
//! Zen 4 those two operations share a port: one thread computed 28 G
//! multiply-adds a second with the weights in cache, against 50 G for the
//! same block sums as four `vpdpbusd` digits (a standalone loop over one
//! tile pair, 2026-12-05) — a decode step of SmolLM2's 4-bit exports was
//! bound by that arithmetic, not by memory.

use super::weights::QBLOCK;

/// Limbs per input.
pub const LIMBS: usize = 4;

/// Bytes one block of 32 inputs takes as limbs: limb `l` of input `i` at
/// `l * 32 + i`.
pub const BLOCK_BYTES: usize = LIMBS * QBLOCK;

/// The block exponent floor: a block whose largest magnitude is below
/// 2^-96 is scaled as if it were 2^-96 (its scale and inverse stay normal
/// f32; what it loses is below 2^-126).
const MIN_EXPONENT: i32 = -96;

/// Splits one row of `x.len()` inputs (whole blocks of 32) into limbs:
/// per block its 32 x 4 digits (`limbs`, [`BLOCK_BYTES`] each), its scale
/// (`scales`, a power of two: input ≈ scale · Σ digit_l · 256^l), and each
/// limb's digit sum (`sums`, [`LIMBS`] per block: a symmetric weight's
/// zero point `8 · Σ digit` comes off the integer sums). A block holding a
/// NaN or an infinity gets a NaN scale and zero digits: its outputs are
/// NaN.
pub fn split(x: &[f32], limbs: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    debug_assert!(x.len().is_multiple_of(QBLOCK));
    #[cfg(target_arch = "x86_64")]
    if super::isa::Isa::Avx512.available() {
        // SAFETY: AVX-512 F/BW/VL/DQ checked; `split_avx512` writes the
        // same slots `split_portable` does, bounds-checked.
        unsafe { split_avx512(x, limbs, scales, sums) };
        return;
    }
    split_portable(x, limbs, scales, sums);
}

/// The power-of-two scale of a block whose largest magnitude is `max`
/// (finite), and its inverse.
fn block_scale(max: f32) -> (f32, f32) {
    let exponent = (((max.to_bits() >> 23) & 0xff) as i32 - 127).max(MIN_EXPONENT);
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    (pow2(exponent - 29), pow2(29 - exponent))
}

/// The four digits of `n` (|n| ≤ 2^30), lowest first.
fn digits(mut n: i32) -> [i32; LIMBS] {
    let mut d = [0; LIMBS];
    for digit in d.iter_mut().take(LIMBS - 1) {
        *digit = ((n + 128) & 255) - 128;
        n = (n - *digit) >> 8;
    }
    d[LIMBS - 1] = n;
    d
}

fn split_portable(x: &[f32], limbs: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    for (b, block) in x.chunks_exact(QBLOCK).enumerate() {
        let out = &mut limbs[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
        let sum = &mut sums[b * LIMBS..(b + 1) * LIMBS];
        sum.fill(0);
        if block.iter().any(|v| !v.is_finite()) {
            out.fill(0);
            scales[b] = f32::NAN;
            continue;
        }
        let (scale, inverse) = block_scale(block.iter().fold(0.0f32, |m, v| m.max(v.abs())));
        scales[b] = scale;
        for (i, v) in block.iter().enumerate() {
            // Exact product (a power of two), below 2^30 in magnitude.
            let d = digits((v * inverse).round_ties_even() as i32);
            for (l, digit) in d.iter().enumerate() {
                out[l * QBLOCK + i] = *digit as i8;
                sum[l] += digit;
            }
        }
    }
}

/// [`split_portable`] on AVX-512, to the same bits: the maximum is exact
/// in any order, the scale the same bit construction, the products exact,
/// `cvtps2dq` rounds to nearest, ties to even (the default mode), and the
/// digits and sums are integer operations.
///
/// # Safety
/// AVX-512 F/BW/VL/DQ must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn split_avx512(x: &[f32], limbs: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    use std::arch::x86_64::*;
    let exponent_bits = _mm512_set1_epi32(0x7f80_0000);
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    let (half, low) = (_mm512_set1_epi32(128), _mm512_set1_epi32(255));
    for (b, block) in x.chunks_exact(QBLOCK).enumerate() {
        let out = &mut limbs[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
        let sum = &mut sums[b * LIMBS..(b + 1) * LIMBS];
        // SAFETY: `block` holds 32 values: two loads of 16.
        let v = [0, 16].map(|at| unsafe { _mm512_loadu_si512(block.as_ptr().add(at).cast()) });
        let non_finite =
            v.iter().any(|v| _mm512_cmpeq_epi32_mask(_mm512_and_si512(*v, exponent_bits), exponent_bits) != 0);
        if non_finite {
            out.fill(0);
            sum.fill(0);
            scales[b] = f32::NAN;
            continue;
        }
        let max = _mm512_reduce_max_ps(_mm512_max_ps(
            _mm512_castsi512_ps(_mm512_and_si512(v[0], magnitude)),
            _mm512_castsi512_ps(_mm512_and_si512(v[1], magnitude)),
        ));
        let (scale, inverse) = block_scale(max);
        scales[b] = scale;
        let mut n = v.map(|v| _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(v), _mm512_set1_ps(inverse))));
        for (l, total) in sum.iter_mut().enumerate() {
            let d = if l + 1 < LIMBS {
                n.map(|n| _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(n, half), low), half))
            } else {
                n
            };
            for (half_block, d) in d.iter().enumerate() {
                // SAFETY: 16 bytes at `l * 32 + 16 * half_block`, within
                // the block's 128.
                unsafe {
                    _mm_storeu_si128(
                        out.as_mut_ptr().add(l * QBLOCK + 16 * half_block).cast(),
                        _mm512_cvtepi32_epi8(*d),
                    )
                };
            }
            *total = _mm512_reduce_add_epi32(_mm512_add_epi32(d[0], d[1]));
            n = [0, 1].map(|i| _mm512_srai_epi32::<8>(_mm512_sub_epi32(n[i], d[i])));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_with(vector: bool, x: &[f32]) -> (Vec<i8>, Vec<f32>, Vec<i32>) {
        let blocks = x.len() / QBLOCK;
        let (mut limbs, mut scales, mut sums) =
            (vec![99; blocks * BLOCK_BYTES], vec![7.0; blocks], vec![5; blocks * LIMBS]);
        if vector {
            split(x, &mut limbs, &mut scales, &mut sums);
        } else {
            split_portable(x, &mut limbs, &mut scales, &mut sums);
        }
        (limbs, scales, sums)
    }

    /// A row of blocks that covers the cases: ordinary values with a
    /// largest just below 2 (its top digit reaches 64), a block whose
    /// values span 40 binades, zeros, values at the exponent floor (2^-96)
    /// and below it (2^-106), a huge block, a subnormal, and NaN /
    /// infinite inputs.
    fn awkward_row() -> Vec<f32> {
        let mut x: Vec<f32> = (0..9 * QBLOCK).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.0173).collect();
        x[5] = 1.999_999_9;
        for (i, v) in x[QBLOCK..2 * QBLOCK].iter_mut().enumerate() {
            *v = (if i % 2 == 0 { 1.0 } else { -1.0 }) * 2f32.powi(i as i32 - 20) * (1.0 + i as f32 / 64.0);
        }
        x[2 * QBLOCK..3 * QBLOCK].fill(0.0);
        for (i, v) in x[3 * QBLOCK..4 * QBLOCK].iter_mut().enumerate() {
            *v = 2f32.powi(-100) * (i as f32 - 16.0);
        }
        for (i, v) in x[4 * QBLOCK..5 * QBLOCK].iter_mut().enumerate() {
            *v = 3.0e37 * (i as f32 - 15.5) / 16.0;
        }
        x[5 * QBLOCK + 3] = f32::from_bits(1);
        x[6 * QBLOCK + 9] = f32::NAN;
        x[7 * QBLOCK + 31] = f32::NEG_INFINITY;
        for (i, v) in x[8 * QBLOCK..9 * QBLOCK].iter_mut().enumerate() {
            *v = 2f32.powi(-110) * (i as f32 - 15.0);
        }
        x
    }

    /// Pins the claim the kernel rests on: each input is `scale · Σ
    /// digit_l · 256^l` exactly when it lies within 2^6 of its block's
    /// largest magnitude, and within 2^-30 of that magnitude otherwise
    /// (of 2^-96 below the exponent floor); every digit is a signed byte
    /// (the top one, which is not reduced, within ±64, and ±64 reached);
    /// the sums are the digits' sums; a non-finite block has a NaN scale
    /// and zero digits.
    #[test]
    fn limbs_hold_each_input_to_the_block_claim() {
        let x = awkward_row();
        let (limbs, scales, sums) = split_with(false, &x);
        let mut widest_top = 0;
        for (b, block) in x.chunks_exact(QBLOCK).enumerate() {
            let digits = |i: usize| -> [i32; LIMBS] {
                std::array::from_fn(|l| i32::from(limbs[b * BLOCK_BYTES + l * QBLOCK + i]))
            };
            if block.iter().any(|v| !v.is_finite()) {
                assert!(scales[b].is_nan(), "block {b}: non-finite input, NaN scale");
                assert!((0..QBLOCK).all(|i| digits(i) == [0; LIMBS]), "block {b}: zero digits");
                continue;
            }
            let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(scales[b].to_bits() & 0x807f_ffff, 0, "block {b}: scale {} is a power of two", scales[b]);
            for (i, v) in block.iter().enumerate() {
                let d = digits(i);
                assert!(d[LIMBS - 1].abs() <= 64, "block {b} input {i}: top digit {}", d[LIMBS - 1]);
                widest_top = widest_top.max(d[LIMBS - 1].abs());
                let n = d.iter().rev().fold(0i64, |n, d| n * 256 + i64::from(*d));
                let back = n as f64 * f64::from(scales[b]);
                let error = (back - f64::from(*v)).abs();
                if max >= 2f32.powi(-96) && v.abs() * 64.0 >= max {
                    assert_eq!(error, 0.0, "block {b} input {i}: {v} is not held exactly ({back})");
                } else {
                    assert!(
                        error <= f64::from(max.max(2f32.powi(-96))) * 2f64.powi(-30),
                        "block {b} input {i}: {v} vs {back}"
                    );
                }
            }
            for l in 0..LIMBS {
                let want: i32 = (0..QBLOCK).map(|i| digits(i)[l]).sum();
                assert_eq!(sums[b * LIMBS + l], want, "block {b} limb {l} sum");
            }
        }
        assert_eq!(widest_top, 64, "the row reaches the top digit's bound");
    }

    /// The vector split is the portable one, bit for bit (the test runs
    /// the vector path only where the CPU has AVX-512).
    #[test]
    fn vector_split_is_the_portable_split() {
        let x = awkward_row();
        let (a, b) = (split_with(true, &x), split_with(false, &x));
        assert_eq!(a.0, b.0, "digits");
        assert_eq!(
            a.1.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
            b.1.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(a.2, b.2, "sums");
    }
}
