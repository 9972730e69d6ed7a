//! The AVX-512 prefill GEMM for f32-input weights: a tile pair decoded
//! once into an f32 panel ([`decode_pair`]), then multiplied by every
//! chunk of [`MR`] packed input rows ([`gemm_panel`]). (The row kernels
//! that decode and prefill rows short of a GEMM use are in `avx512`.)

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::avx512::{scale_aux, to_f16_and_back};
use super::weights::{TileData, Tiled, QBLOCK};

/// Rows of A a GEMM microkernel call covers (24 of the 32 registers hold
/// its 12 x 32 accumulators).
pub const MR: usize = 12;

/// Decodes the tile pair starting at tile `tile` into `panel`: `kp` rows of
/// 32 f32 (columns past the pair's outputs are zero), the weights as f32
/// exactly as the row kernels compute with them.
///
/// # Safety
/// AVX-512 F/BW/VL/DQ must be available; `panel` must hold `32 * t.kp`
/// values; `t` must not take int8 inputs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn decode_pair(t: &Tiled, tile: usize, panel: &mut [f32]) {
    let base = t.as_bytes().as_ptr();
    let (start, stride) = t.place(tile);
    let width = 2.min(t.tiles - tile);
    let p = panel.as_mut_ptr();
    let nibble = _mm512_set1_epi32(0x0f);
    for j in 0..2 {
        if j >= width {
            for c in 0..t.kp {
                _mm512_storeu_ps(p.add(c * 32 + 16), _mm512_setzero_ps());
            }
            continue;
        }
        let w = base.add(start + j * (stride / width));
        match t.data {
            TileData::F32 => {
                for c in 0..t.k {
                    _mm512_storeu_ps(p.add(c * 32 + 16 * j), _mm512_loadu_ps(w.add(c * stride).cast()));
                }
            }
            TileData::F16 => {
                for c in 0..t.k {
                    let at = (c / 2) * stride + (c % 2) * 32;
                    let v = _mm512_cvtph_ps(_mm256_loadu_si256(w.add(at).cast::<__m256i>()));
                    _mm512_storeu_ps(p.add(c * 32 + 16 * j), v);
                }
            }
            TileData::Q8 { blocks, rounds_to_f16 } => {
                for b in 0..blocks {
                    let rec = w.add(b * stride);
                    let scale = _mm512_loadu_ps(rec.add(512).cast());
                    for col in 0..QBLOCK {
                        let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(rec.add(16 * col).cast()));
                        let v = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale);
                        let v = if rounds_to_f16 { to_f16_and_back(v) } else { v };
                        _mm512_storeu_ps(p.add((b * QBLOCK + col) * 32 + 16 * j), v);
                    }
                }
            }
            TileData::Q4 { blocks, symmetric, half, rounds_to_f16, .. } => {
                for b in 0..blocks {
                    let rec = w.add(b * stride);
                    let (scale, aux) = scale_aux(rec, symmetric, half);
                    for i in 0..4 {
                        let v = _mm512_loadu_si512(rec.add(i * 64).cast());
                        for col in 0..8 {
                            let shift = _mm512_set1_epi32(((col % 4) * 8 + (col / 4) * 4) as i32);
                            let q = _mm512_and_si512(_mm512_srlv_epi32(v, shift), nibble);
                            let wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, aux);
                            let wv = if rounds_to_f16 { to_f16_and_back(wv) } else { wv };
                            _mm512_storeu_ps(p.add((b * QBLOCK + 8 * i + col) * 32 + 16 * j), wv);
                        }
                    }
                }
            }
        }
    }
    // Inputs past `k` (padding to whole blocks) multiply zeros in A.
    for c in t.k..t.kp {
        if !matches!(t.data, TileData::Q4 { .. } | TileData::Q8 { .. }) {
            _mm512_storeu_ps(p.add(c * 32), _mm512_setzero_ps());
            _mm512_storeu_ps(p.add(c * 32 + 16), _mm512_setzero_ps());
        }
    }
}

/// `C[r][0..32] = Σ_k A[k][r] · B[k][0..32]` for the `rows` (≤ [`MR`]) rows
/// of a packed A chunk (`kp` x `MR`, rows past `rows` are zero) and a
/// decoded panel B (`kp` x 32); writes `width` (≤ 32) columns of row `r` to
/// `out[r]`.
///
/// # Safety
/// AVX-512 F must be available; `a` must hold `kp * MR` values, `b`
/// `kp * 32`; each `out[r]` for `r < rows` must be valid for `width` writes
/// that no other thread makes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn gemm_panel(a: *const f32, b: *const f32, kp: usize, rows: usize, out: &[*mut f32; MR], width: usize) {
    let mut c = [[_mm512_setzero_ps(); 2]; MR];
    for k in 0..kp {
        let b0 = _mm512_loadu_ps(b.add(k * 32));
        let b1 = _mm512_loadu_ps(b.add(k * 32 + 16));
        let ak = a.add(k * MR);
        for (r, cr) in c.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*ak.add(r));
            cr[0] = _mm512_fmadd_ps(av, b0, cr[0]);
            cr[1] = _mm512_fmadd_ps(av, b1, cr[1]);
        }
    }
    let lo = ((1u32 << width.min(16)) - 1) as u16;
    let hi = ((1u64 << width.saturating_sub(16).min(16)) - 1) as u16;
    for (r, cr) in c.iter().enumerate().take(rows) {
        _mm512_mask_storeu_ps(out[r], lo, cr[0]);
        if hi != 0 {
            _mm512_mask_storeu_ps(out[r].add(16), hi, cr[1]);
        }
    }
}
