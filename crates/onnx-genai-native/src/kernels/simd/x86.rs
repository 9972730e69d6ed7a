//! The AVX2 (+FMA, F16C) inner loops of [`super`]: dot products, the
//! attention's scores and weighted sums, `axpy`, the vector exponential
//! and the SiLU product, each called only once its features were checked
//! at run time.

use std::arch::x86_64::*;

use super::{Alongside, KvElem};

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// # Safety
/// AVX2 and FMA must be available; `a` and `b` must be valid for `n`
/// reads.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
    let (mut s0, mut s1, mut s2, mut s3) =
        (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 32 <= n {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 8)), _mm256_loadu_ps(b.add(i + 8)), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 16)), _mm256_loadu_ps(b.add(i + 16)), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 24)), _mm256_loadu_ps(b.add(i + 24)), s3);
        i += 32;
    }
    while i + 8 <= n {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), s0);
        i += 8;
    }
    let mut total = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    while i < n {
        total += *a.add(i) * *b.add(i);
        i += 1;
    }
    total
}

/// # Safety
/// AVX2, FMA and F16C must be available; `hd % 8 == 0`; `q` valid for
/// `rows * hd` reads, `k` for `total * hd`, `out` for `total` writes
/// from each `r * ld`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn scores<E: KvElem>(
    q: *const f32,
    rows: usize,
    k: *const E,
    total: usize,
    hd: usize,
    out: *mut f32,
    ld: usize,
    alongside: Alongside,
) {
    // Four keys at a time, for up to three query rows at once: every
    // key load serves each row and every query load each key, and the
    // 12 (row, key) chains overlap (one row at a time, 4 chains, waited
    // on the multiply-add latency). Each (row, key) keeps its own single
    // accumulator, so every score is computed exactly as a key alone
    // would be (same lanes, same order, same reduction).
    let mut t = 0;
    while t + 4 <= total {
        alongside.rows(t..t + 4, total);
        let kt: [*const E; 4] = std::array::from_fn(|i| k.add((t + i) * hd));
        let mut r = 0;
        while r < rows {
            let (qr, o) = (q.add(r * hd), out.add(r * ld + t));
            r += match rows - r {
                1 => scores4::<E, 1>(qr, &kt, hd, o, ld),
                2 => scores4::<E, 2>(qr, &kt, hd, o, ld),
                _ => scores4::<E, 3>(qr, &kt, hd, o, ld),
            };
        }
        t += 4;
    }
    alongside.rows(t..total, total);
    while t < total {
        let kt = k.add(t * hd);
        for r in 0..rows {
            let qr = q.add(r * hd);
            let mut acc = _mm256_setzero_ps();
            let mut c = 0;
            while c < hd {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c)), E::load8(kt.add(c)), acc);
                c += 8;
            }
            // The reduction of four keys at once, on one key: the same
            // additions in the same order, so a key's score does not
            // depend on whether it fell in a group of four.
            let zero = _mm256_setzero_ps();
            *out.add(r * ld + t) = _mm_cvtss_f32(sum4(acc, zero, zero, zero));
        }
        t += 1;
    }
}

/// Scores of `R` query rows (`hd` apart from `q`) against the four keys
/// `k`, written at `out + r * ld + i`; returns `R`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores4<E: KvElem, const R: usize>(
    q: *const f32,
    k: &[*const E; 4],
    hd: usize,
    out: *mut f32,
    ld: usize,
) -> usize {
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut c = 0;
    while c < hd {
        for (r, row) in acc.iter_mut().enumerate() {
            let x = _mm256_loadu_ps(q.add(r * hd + c));
            for (a, key) in row.iter_mut().zip(k) {
                *a = _mm256_fmadd_ps(x, E::load8(key.add(c)), *a);
            }
        }
        c += 8;
    }
    for (r, row) in acc.iter().enumerate() {
        _mm_storeu_ps(out.add(r * ld), sum4(row[0], row[1], row[2], row[3]));
    }
    R
}

/// The lane sums of four vectors, as one vector of four: per vector
/// `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`, by three
/// horizontal adds and one add for all four (a reduction of each apart
/// was 6 instructions per key: 43% of a score's instructions at head
/// dimension 64).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1))
}

/// # Safety
/// AVX2, FMA and F16C must be available; `hd % 8 == 0`; `p` valid for
/// `total` reads from each `r * ld`, `v` for `total * hd`, `out` for
/// `rows * hd` reads and writes.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn weighted_sum<E: KvElem>(
    p: *const f32,
    rows: usize,
    ld: usize,
    v: *const E,
    total: usize,
    hd: usize,
    out: *mut f32,
    alongside: Alongside,
) {
    for r in 0..rows {
        let pr = p.add(r * ld);
        let o = out.add(r * hd);
        // The first row's first pass over the values is the one that
        // reads them from memory: `alongside` goes with it.
        let mut fetch = if r == 0 { alongside } else { Alongside::NONE };
        let mut c = 0;
        // 64 columns at a time (8 independent chains: enough to cover
        // the multiply-add latency, which 4 did not), then 32, then 8.
        while c + 64 <= hd {
            columns::<E, 8>(pr, v.add(c), total, hd, o.add(c), fetch);
            fetch = Alongside::NONE;
            c += 64;
        }
        while c + 32 <= hd {
            columns::<E, 4>(pr, v.add(c), total, hd, o.add(c), fetch);
            fetch = Alongside::NONE;
            c += 32;
        }
        while c < hd {
            columns::<E, 1>(pr, v.add(c), total, hd, o.add(c), fetch);
            fetch = Alongside::NONE;
            c += 8;
        }
    }
}

/// `o[..8N] += Σ_t p[t] · v[t·hd ..][..8N]`, in `N` chains of 8
/// columns. `N` is a constant so the chains stay in registers across
/// `t` (a run-time count kept them in memory behind a branch per
/// multiply-add); each column adds its values in `t` order whatever `N`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `p` valid for `total` reads, `v` for
/// `8N` reads at each `t * hd`, `o` for `8N` reads and writes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn columns<E: KvElem, const N: usize>(
    p: *const f32,
    v: *const E,
    total: usize,
    hd: usize,
    o: *mut f32,
    alongside: Alongside,
) {
    let mut acc: [__m256; N] = std::array::from_fn(|j| _mm256_loadu_ps(o.add(8 * j)));
    for t in 0..total {
        alongside.rows(t..t + 1, total);
        let w = _mm256_set1_ps(*p.add(t));
        let row = v.add(t * hd);
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(w, E::load8(row.add(8 * j)), *a);
        }
    }
    for (j, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(o.add(8 * j), *a);
    }
}

/// # Safety
/// AVX2 and FMA must be available; `y` and `x` valid for `n` elements.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn axpy(y: *mut f32, alpha: f32, x: *const f32, n: usize) {
    let a = _mm256_set1_ps(alpha);
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_fmadd_ps(a, _mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(y.add(i)));
        _mm256_storeu_ps(y.add(i), v);
        i += 8;
    }
    while i < n {
        *y.add(i) += alpha * *x.add(i);
        i += 1;
    }
}

/// `exp(x)` for 8 lanes: Cephes' range reduction and degree-5
/// polynomial (relative error ~1e-7 over the clamped range; inputs below
/// -88.37, including -inf, give ~6e-39, i.e. zero next to the row max).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.376_26)), _mm256_set1_ps(88.376_26));
    let fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), _mm256_set1_ps(0.5)));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let z = _mm256_mul_ps(x, x);
    let mut y = _mm256_set1_ps(1.987_569_2e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0));
    let n = _mm256_cvtps_epi32(fx);
    let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
    _mm256_mul_ps(y, pow2n)
}

/// `out[i] = g · (1 / (1 + exp(-g))) · up[i]` (sigmoid 0 where
/// `exp(-g)` overflows) for whole vectors of 8
/// from the start; returns how many values it wrote (the caller does
/// the rest).
///
/// # Safety
/// AVX2 and FMA must be available; `gate`, `up` valid for `n` reads,
/// `out` for `n` writes.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul(gate: *const f32, up: *const f32, out: *mut f32, n: usize) -> usize {
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i + 8 <= n {
        let g = _mm256_loadu_ps(gate.add(i));
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        // `exp8` clamps at ±88.38 where `expf` overflows to infinity
        // (sigmoid 0): below that gate the clamped value would leave
        // a tiny non-zero sigmoid that a huge gate scales back up.
        let live = _mm256_cmp_ps::<_CMP_GE_OQ>(g, _mm256_set1_ps(-88.376_26));
        let sigmoid = _mm256_and_ps(_mm256_div_ps(one, _mm256_add_ps(one, e)), live);
        _mm256_storeu_ps(out.add(i), _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up.add(i))));
        i += 8;
    }
    i
}

/// Replaces `x[i]` by `exp(x[i] - max)`; returns their sum.
///
/// # Safety
/// AVX2 and FMA must be available; `x` valid for `n` reads and writes.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_shifted(x: *mut f32, n: usize, max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x.add(i)), m));
        _mm256_storeu_ps(x.add(i), e);
        acc = _mm256_add_ps(acc, e);
        i += 8;
    }
    let mut sum = hsum(acc);
    while i < n {
        let e = (*x.add(i) - max).exp();
        *x.add(i) = e;
        sum += e;
        i += 1;
    }
    sum
}
