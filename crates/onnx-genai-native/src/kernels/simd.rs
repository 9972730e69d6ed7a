//! Vector inner loops with run-time CPU dispatch: AVX2+FMA where the CPU has
//! it (checked once), portable code elsewhere. Both paths are tested
//! against each other.

use std::sync::OnceLock;

fn has_f16c() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            has_avx2_fma() && std::arch::is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

fn has_avx2_fma() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Dot product of two equal-length slices (the shorter length is used).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above); the
        // function reads exactly `n` elements of each slice, both of which
        // hold at least `n`.
        return unsafe { x86::dot(a.as_ptr(), b.as_ptr(), n) };
    }
    dot_portable(&a[..n], &b[..n])
}

/// `y += alpha * x` (the shorter length is used).
#[inline]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2/FMA checked; reads `n` of `x`, writes `n` of `y`;
        // `y` is borrowed mutably so it cannot alias `x`.
        unsafe { x86::axpy(y.as_mut_ptr(), alpha, x.as_ptr(), n) };
        return;
    }
    y[..n].iter_mut().zip(&x[..n]).for_each(|(y, x)| *y += alpha * x);
}

/// `sum_j q_j * x_j` over one 4-bit block of 32 (16 bytes, low nibble
/// first); `x` holds the block's 32 inputs.
#[inline]
pub fn q4_block32(bytes: &[u8], x: &[f32]) -> f32 {
    debug_assert!(bytes.len() >= 16 && x.len() >= 32);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && bytes.len() >= 16 && x.len() >= 32 {
        // SAFETY: AVX2/FMA checked; reads 16 bytes and 32 floats, which the
        // condition guarantees exist.
        return unsafe { x86::q4_block32(bytes.as_ptr(), x.as_ptr()) };
    }
    q4_block32_portable(bytes, x)
}

/// `out[r * total + t] = q_r . k_t` for `rows` query rows of `hd` and
/// `total` key rows of `hd` (both row-major).
pub fn scores(q: &[f32], rows: usize, keys: &[f32], hd: usize, out: &mut [f32]) {
    let total = keys.len().checked_div(hd).unwrap_or(0);
    assert!(q.len() >= rows * hd && out.len() >= rows * total, "attention score buffers are too small");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && hd.is_multiple_of(8) {
        // SAFETY: AVX2/FMA checked; the assertion above bounds every read of
        // `q` (rows * hd), `keys` (total * hd) and write of `out`.
        unsafe { x86::scores(q.as_ptr(), rows, keys.as_ptr(), total, hd, out.as_mut_ptr()) };
        return;
    }
    for t in 0..total {
        for r in 0..rows {
            out[r * total + t] = dot_portable(&q[r * hd..(r + 1) * hd], &keys[t * hd..(t + 1) * hd]);
        }
    }
}

/// `out_r = sum_t p[r * total + t] * v_t` for `rows` rows.
pub fn weighted_sum(p: &[f32], rows: usize, values: &[f32], hd: usize, out: &mut [f32]) {
    let total = values.len().checked_div(hd).unwrap_or(0);
    assert!(p.len() >= rows * total && out.len() >= rows * hd, "attention output buffers are too small");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && hd.is_multiple_of(8) {
        // SAFETY: AVX2/FMA checked; the assertion above bounds every read of
        // `p` (rows * total), `values` (total * hd) and write of `out`.
        unsafe { x86::weighted_sum(p.as_ptr(), rows, values.as_ptr(), total, hd, out.as_mut_ptr()) };
        return;
    }
    out[..rows * hd].iter_mut().for_each(|o| *o = 0.0);
    for t in 0..total {
        let v = &values[t * hd..(t + 1) * hd];
        for r in 0..rows {
            axpy(&mut out[r * hd..(r + 1) * hd], p[r * total + t], v);
        }
    }
}

/// `y[r] = x . w[r]` for the rows of a row-major `[y.len(), x.len()]`
/// weight.
pub fn matvec(x: &[f32], w: &[f32], y: &mut [f32]) {
    let k = x.len();
    assert!(w.len() >= y.len() * k, "matvec weight is smaller than its rows");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2/FMA checked; reads `k` of `x` and `y.len() * k` of
        // `w` (asserted), writes `y.len()` of `y`.
        unsafe { x86::matvec(x.as_ptr(), k, w.as_ptr(), y.as_mut_ptr(), y.len()) };
        return;
    }
    for (r, o) in y.iter_mut().enumerate() {
        *o = dot_portable(x, &w[r * k..(r + 1) * k]);
    }
}

/// [`q4_row32`] for consecutive rows: `y[r]` from `bytes[r * 16 * blocks..]`
/// and `scales[r * blocks..]`.
pub fn q4_matvec32(x: &[f32], xsum: &[f32], bytes: &[u8], scales: &[f32], blocks: usize, y: &mut [f32]) {
    let n = y.len();
    assert!(
        x.len() >= 32 * blocks && xsum.len() >= blocks && bytes.len() >= n * 16 * blocks && scales.len() >= n * blocks,
        "q4 matvec buffers are too small"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        for (r, o) in y.iter_mut().enumerate() {
            // SAFETY: AVX2/FMA checked; row `r < n` lies inside the buffers
            // asserted above.
            *o = unsafe {
                x86::q4_row32(
                    x.as_ptr(),
                    xsum.as_ptr(),
                    bytes.as_ptr().add(r * 16 * blocks),
                    scales.as_ptr().add(r * blocks),
                    blocks,
                )
            };
        }
        return;
    }
    for (r, o) in y.iter_mut().enumerate() {
        *o = q4_row32(x, xsum, &bytes[r * 16 * blocks..(r + 1) * 16 * blocks], &scales[r * blocks..(r + 1) * blocks]);
    }
}

/// One 4-bit row with blocks of 32, no zero points (8), `k = 32 * blocks`:
/// `sum_b scale_b * (sum_j q_j x_j - 8 * xsum_b)`.
pub fn q4_row32(x: &[f32], xsum: &[f32], bytes: &[u8], scales: &[f32]) -> f32 {
    let blocks = scales.len();
    assert!(
        x.len() >= 32 * blocks && xsum.len() >= blocks && bytes.len() >= 16 * blocks,
        "q4 row buffers are too small"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2/FMA checked; reads bounded by the assertion above.
        return unsafe { x86::q4_row32(x.as_ptr(), xsum.as_ptr(), bytes.as_ptr(), scales.as_ptr(), blocks) };
    }
    (0..blocks).map(|b| scales[b] * (q4_block32_portable(&bytes[16 * b..], &x[32 * b..]) - 8.0 * xsum[b])).sum()
}

/// [`matvec`] over f16 weight rows, widened as they are read.
pub fn matvec_f16(x: &[f32], w: &[half::f16], y: &mut [f32]) {
    let k = x.len();
    assert!(w.len() >= y.len() * k, "matvec weight is smaller than its rows");
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: AVX2/FMA/F16C checked; reads `k` of `x` and `y.len() * k`
        // halves of `w` (asserted; f16 is two bytes), writes `y.len()`.
        unsafe { x86::matvec_f16(x.as_ptr(), k, w.as_ptr() as *const u16, y.as_mut_ptr(), y.len()) };
        return;
    }
    let mut row = vec![0.0f32; k];
    for (r, o) in y.iter_mut().enumerate() {
        for (d, h) in row.iter_mut().zip(&w[r * k..(r + 1) * k]) {
            *d = h.to_f32();
        }
        *o = dot_portable(x, &row);
    }
}

/// Numerically stable softmax of one row, in place.
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2/FMA checked; the function stays within `row`.
        let sum = unsafe { x86::exp_shifted(row.as_mut_ptr(), row.len(), max) };
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|v| *v *= inv);
        return;
    }
    softmax_portable(row, max);
}

pub fn softmax_portable(row: &mut [f32], max: f32) {
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

pub fn q4_block32_portable(bytes: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0;
    for (j, b) in bytes.iter().take(16).enumerate() {
        acc += f32::from(b & 0x0f) * x[2 * j] + f32::from(b >> 4) * x[2 * j + 1];
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

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
    /// AVX2 and FMA must be available; `hd % 8 == 0`; `q` valid for
    /// `rows * hd` reads, `k` for `total * hd`, `out` for `rows * total`
    /// writes.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(q: *const f32, rows: usize, k: *const f32, total: usize, hd: usize, out: *mut f32) {
        for t in 0..total {
            let kt = k.add(t * hd);
            for r in 0..rows {
                let qr = q.add(r * hd);
                let mut acc = _mm256_setzero_ps();
                let mut c = 0;
                while c < hd {
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr.add(c)), _mm256_loadu_ps(kt.add(c)), acc);
                    c += 8;
                }
                *out.add(r * total + t) = hsum(acc);
            }
        }
    }

    /// # Safety
    /// AVX2 and FMA must be available; `hd % 8 == 0`; `p` valid for
    /// `rows * total` reads, `v` for `total * hd`, `out` for `rows * hd`
    /// writes.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum(p: *const f32, rows: usize, v: *const f32, total: usize, hd: usize, out: *mut f32) {
        for r in 0..rows {
            let pr = p.add(r * total);
            let mut c = 0;
            // Four column chunks at a time stay in registers across t.
            while c < hd {
                let width = ((hd - c) / 8).min(4);
                let mut acc = [_mm256_setzero_ps(); 4];
                for t in 0..total {
                    let w = _mm256_set1_ps(*pr.add(t));
                    let row = v.add(t * hd + c);
                    for (j, a) in acc.iter_mut().enumerate().take(width) {
                        *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(8 * j)), *a);
                    }
                }
                for (j, a) in acc.iter().enumerate().take(width) {
                    _mm256_storeu_ps(out.add(r * hd + c + 8 * j), *a);
                }
                c += 8 * width;
            }
        }
    }

    /// Four weight rows at a time share each load of `x`.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `x` valid for `k` reads, `w` for
    /// `n * k`, `y` for `n` writes.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn matvec(x: *const f32, k: usize, w: *const f32, y: *mut f32, n: usize) {
        let mut r = 0;
        while r + 4 <= n {
            let rows = [w.add(r * k), w.add((r + 1) * k), w.add((r + 2) * k), w.add((r + 3) * k)];
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c + 8 <= k {
                let xv = _mm256_loadu_ps(x.add(c));
                for j in 0..4 {
                    acc[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows[j].add(c)), acc[j]);
                }
                c += 8;
            }
            for j in 0..4 {
                let mut v = hsum(acc[j]);
                for t in c..k {
                    v += *x.add(t) * *rows[j].add(t);
                }
                *y.add(r + j) = v;
            }
            r += 4;
        }
        while r < n {
            *y.add(r) = dot(x, w.add(r * k), k);
            r += 1;
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available; `x` valid for `k` reads, `w`
    /// for `n * k` halves, `y` for `n` writes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn matvec_f16(x: *const f32, k: usize, w: *const u16, y: *mut f32, n: usize) {
        for r in 0..n {
            let row = w.add(r * k);
            let mut acc = [_mm256_setzero_ps(); 2];
            let mut c = 0;
            while c + 16 <= k {
                let w0 = _mm256_cvtph_ps(_mm_loadu_si128(row.add(c) as *const __m128i));
                let w1 = _mm256_cvtph_ps(_mm_loadu_si128(row.add(c + 8) as *const __m128i));
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(c)), w0, acc[0]);
                acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(c + 8)), w1, acc[1]);
                c += 16;
            }
            let mut v = hsum(_mm256_add_ps(acc[0], acc[1]));
            while c < k {
                v += *x.add(c) * half::f16::from_bits(*row.add(c)).to_f32();
                c += 1;
            }
            *y.add(r) = v;
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

    /// # Safety
    /// AVX2 and FMA must be available; `x` valid for `32 * blocks` reads,
    /// `xsum` and `scales` for `blocks`, `q` for `16 * blocks`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q4_row32(x: *const f32, xsum: *const f32, q: *const u8, scales: *const f32, blocks: usize) -> f32 {
        // Scales are applied to the block's lane sums, so one horizontal sum
        // ends the row; the zero-point term is a scalar sum.
        let mut acc = _mm256_setzero_ps();
        let mut zero_term = 0.0;
        for b in 0..blocks {
            let scale = *scales.add(b);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), q4_lanes32(q.add(16 * b), x.add(32 * b)), acc);
            zero_term += scale * 8.0 * *xsum.add(b);
        }
        hsum(acc) - zero_term
    }

    /// Lane sums of `q_j * x_j` over one block of 32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4_lanes32(q: *const u8, x: *const f32) -> __m256 {
        let raw = _mm_loadu_si128(q as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        let first = _mm_unpacklo_epi8(lo, hi);
        let second = _mm_unpackhi_epi8(lo, hi);
        let widen = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        let mut acc = _mm256_mul_ps(widen(first), _mm256_loadu_ps(x));
        acc = _mm256_fmadd_ps(widen(_mm_srli_si128(first, 8)), _mm256_loadu_ps(x.add(8)), acc);
        acc = _mm256_fmadd_ps(widen(second), _mm256_loadu_ps(x.add(16)), acc);
        _mm256_fmadd_ps(widen(_mm_srli_si128(second, 8)), _mm256_loadu_ps(x.add(24)), acc)
    }

    /// # Safety
    /// AVX2 and FMA must be available; `q` valid for 16 reads, `x` for 32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q4_block32(q: *const u8, x: *const f32) -> f32 {
        hsum(q4_lanes32(q, x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched (AVX2 where present) and portable paths agree, over
    /// lengths that exercise every loop tail.
    #[test]
    fn dispatched_paths_match_portable() {
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            assert!((dot(&a, &b) - dot_portable(&a, &b)).abs() < 1e-4, "dot n={n}");
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            axpy(&mut y1, 0.5, &a);
            y2.iter_mut().zip(&a).for_each(|(y, x)| *y += 0.5 * x);
            assert!(y1.iter().zip(&y2).all(|(p, q)| (p - q).abs() < 1e-6), "axpy n={n}");
        }
        // Attention inner products against their plain definitions.
        for hd in [8, 16, 40, 64] {
            let (rows, total) = (3, 11);
            let q: Vec<f32> = (0..rows * hd).map(|i| (i as f32 * 0.13).cos()).collect();
            let kv: Vec<f32> = (0..total * hd).map(|i| (i as f32 * 0.07).sin()).collect();
            let mut sc = vec![0.0; rows * total];
            scores(&q, rows, &kv, hd, &mut sc);
            let mut o = vec![0.0; rows * hd];
            weighted_sum(&sc, rows, &kv, hd, &mut o);
            for r in 0..rows {
                for t in 0..total {
                    let want = dot_portable(&q[r * hd..(r + 1) * hd], &kv[t * hd..(t + 1) * hd]);
                    assert!((sc[r * total + t] - want).abs() < 1e-4, "scores hd={hd}");
                }
                for c in 0..hd {
                    let want: f32 = (0..total).map(|t| sc[r * total + t] * kv[t * hd + c]).sum();
                    assert!((o[r * hd + c] - want).abs() < 1e-3, "weighted_sum hd={hd}");
                }
            }
        }
        for (k, n) in [(7, 5), (64, 64), (67, 9), (16, 3)] {
            let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.21).sin()).collect();
            let w: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.05).cos()).collect();
            let mut y = vec![0.0; n];
            matvec(&x, &w, &mut y);
            let halves: Vec<half::f16> = w.iter().map(|v| half::f16::from_f32(*v)).collect();
            let mut yh = vec![0.0; n];
            matvec_f16(&x, &halves, &mut yh);
            for r in 0..n {
                assert!((y[r] - dot_portable(&x, &w[r * k..(r + 1) * k])).abs() < 1e-4, "matvec k={k} n={n}");
                let widened: Vec<f32> = halves[r * k..(r + 1) * k].iter().map(|h| h.to_f32()).collect();
                assert!((yh[r] - dot_portable(&x, &widened)).abs() < 1e-4, "matvec_f16 k={k} n={n}");
            }
        }
        for n in [1, 5, 8, 13, 64, 1000] {
            let row: Vec<f32> =
                (0..n).map(|i| (i as f32 * 0.731).sin() * 30.0 - if i % 7 == 3 { 1e9 } else { 0.0 }).collect();
            let (mut fast, mut slow) = (row.clone(), row.clone());
            softmax(&mut fast);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            softmax_portable(&mut slow, max);
            for (a, b) in fast.iter().zip(&slow) {
                assert!((a - b).abs() <= 1e-6 + 1e-5 * b.abs(), "softmax n={n}: {a} vs {b}");
            }
        }
        let bytes: Vec<u8> = (0..48).map(|i| (i * 53 % 256) as u8).collect();
        let x96: Vec<f32> = (0..96).map(|i| (i as f32 * 0.3).sin()).collect();
        let xsum: Vec<f32> = x96.chunks(32).map(|c| c.iter().sum()).collect();
        let scales = [0.5, 0.25, 2.0];
        let want: f32 =
            (0..3).map(|b| scales[b] * (q4_block32_portable(&bytes[16 * b..], &x96[32 * b..]) - 8.0 * xsum[b])).sum();
        assert!((q4_row32(&x96, &xsum, &bytes, &scales) - want).abs() < 1e-3);
        let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.3).sin()).collect();
        assert!((q4_block32(&bytes, &x) - q4_block32_portable(&bytes, &x)).abs() < 1e-4);
    }
}
