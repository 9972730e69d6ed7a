//! Vector inner loops with run-time CPU dispatch: AVX2+FMA where the CPU has
//! it (checked once), portable code elsewhere. Each public function is its
//! `*_on(vector, ..)` twin with `vector = true`; the tests run both paths
//! (the vector one where the CPU has it) against plain definitions, so the
//! portable path is tested on AVX2 machines too.

use std::sync::OnceLock;

use half::f16;

/// AVX2, FMA and F16C (every AVX2 CPU has F16C; the attention loops widen
/// f16 caches with it).
fn has_avx2_fma_f16c() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// An element a KV cache stores: f32, or f16 widened (exactly) to f32
/// inside the attention loops as it is read. Widening a block into a
/// buffer first, then reading that, cost more than the halved bytes saved
/// (SmolLM2 genai-int8 with its cache forced to f16, 16 sequences:
/// attention 3.8-3.9 ms a step against 3.2-3.3 in f32).
///
/// # Safety
/// [`scores`] and [`weighted_sum`], safe functions, trust `load8` to read
/// exactly the 8 elements at `p` (their bounds checks count elements of
/// `Self`): an implementation must read nothing else.
pub unsafe trait KvElem: Copy + Send + Sync + 'static {
    fn widen(self) -> f32;

    /// Eight elements from `p`, widened.
    ///
    /// # Safety
    /// The caller must run with AVX2 and F16C enabled; `p` must be valid
    /// for 8 reads.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

// SAFETY: `load8` reads the 8 f32 at `p`, nothing else.
unsafe impl KvElem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: forwarded contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

// SAFETY: `load8` reads the 8 halves (16 bytes) at `p`, nothing else.
unsafe impl KvElem for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: forwarded contract (8 halves are the 16 bytes read).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
    }
}

/// Dot product of two equal-length slices (the shorter length is used).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_on(true, a, b)
}

/// [`dot`], on the vector path only when `vector` and the CPU allow it.
#[inline]
fn dot_on(vector: bool, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    if vector && has_avx2_fma_f16c() {
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
    axpy_on(true, y, alpha, x)
}

#[inline]
fn axpy_on(vector: bool, y: &mut [f32], alpha: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    #[cfg(target_arch = "x86_64")]
    if vector && has_avx2_fma_f16c() {
        // SAFETY: AVX2, FMA and F16C checked; reads `n` of `x`, writes `n` of `y`;
        // `y` is borrowed mutably so it cannot alias `x`.
        unsafe { x86::axpy(y.as_mut_ptr(), alpha, x.as_ptr(), n) };
        return;
    }
    axpy_portable(&mut y[..n], alpha, &x[..n]);
}

/// `out[r * ld + t] = q_r . k_t` for `rows` query rows of `hd` and
/// `total` key rows of `hd` (both row-major; `ld >= total` is the row
/// stride of `out`, so a caller can fill a wide score row in chunks).
/// `alongside` (the block's values, read after the softmax) is fetched in
/// step with the keys (on the portable path, all at once before them).
pub fn scores<E: KvElem>(
    q: &[f32],
    rows: usize,
    keys: &[E],
    hd: usize,
    out: &mut [f32],
    ld: usize,
    alongside: Alongside,
) {
    scores_on(true, q, rows, keys, hd, out, ld, alongside)
}

/// Whether `len` values hold `rows` rows `ld` apart, the last `width`
/// long (checked: a wrapped product passed the bound before).
fn holds(len: usize, rows: usize, ld: usize, width: usize) -> bool {
    rows == 0 || (rows - 1).checked_mul(ld).and_then(|at| at.checked_add(width)).is_some_and(|end| len >= end)
}

#[allow(clippy::too_many_arguments)]
fn scores_on<E: KvElem>(
    vector: bool,
    q: &[f32],
    rows: usize,
    keys: &[E],
    hd: usize,
    out: &mut [f32],
    ld: usize,
    alongside: Alongside,
) {
    let total = keys.len().checked_div(hd).unwrap_or(0);
    assert!(
        holds(q.len(), rows, hd, hd) && ld >= total && holds(out.len(), rows, ld, total),
        "attention score buffers are too small"
    );
    #[cfg(target_arch = "x86_64")]
    if vector && has_avx2_fma_f16c() && hd.is_multiple_of(8) {
        // SAFETY: AVX2, FMA and F16C checked; the assertion above bounds every read of
        // `q` (rows * hd), `keys` (total * hd) and write of `out` (row r
        // at r * ld, total values).
        unsafe { x86::scores(q.as_ptr(), rows, keys.as_ptr(), total, hd, out.as_mut_ptr(), ld, alongside) };
        return;
    }
    alongside.rows(0..total, total);
    for t in 0..total {
        for r in 0..rows {
            out[r * ld + t] = dot_portable(&q[r * hd..(r + 1) * hd], &keys[t * hd..(t + 1) * hd]);
        }
    }
}

/// `out_r += sum_t p[r * ld + t] * v_t` for `rows` rows, in `t` order (the
/// same operations, in the same order, as one `axpy` per value row, so a
/// caller may split the values into chunks).
/// `alongside` (what the caller reads next) is fetched in step with the
/// values as the first row's first 64 columns are summed (on the portable
/// path, all at once before the sum).
pub fn weighted_sum<E: KvElem>(
    p: &[f32],
    rows: usize,
    ld: usize,
    values: &[E],
    hd: usize,
    out: &mut [f32],
    alongside: Alongside,
) {
    weighted_sum_on(true, p, rows, ld, values, hd, out, alongside)
}

#[allow(clippy::too_many_arguments)]
fn weighted_sum_on<E: KvElem>(
    vector: bool,
    p: &[f32],
    rows: usize,
    ld: usize,
    values: &[E],
    hd: usize,
    out: &mut [f32],
    alongside: Alongside,
) {
    let total = values.len().checked_div(hd).unwrap_or(0);
    assert!(
        ld >= total && holds(p.len(), rows, ld, total) && holds(out.len(), rows, hd, hd),
        "attention output buffers are too small"
    );
    #[cfg(target_arch = "x86_64")]
    if vector && has_avx2_fma_f16c() && hd.is_multiple_of(8) {
        // SAFETY: AVX2, FMA and F16C checked; the assertion above bounds every read of
        // `p` (row r at r * ld, total values), `values` (total * hd) and
        // read/write of `out` (rows * hd).
        unsafe { x86::weighted_sum(p.as_ptr(), rows, ld, values.as_ptr(), total, hd, out.as_mut_ptr(), alongside) };
        return;
    }
    alongside.rows(0..total, total);
    for t in 0..total {
        let v = &values[t * hd..(t + 1) * hd];
        for r in 0..rows {
            axpy_portable(&mut out[r * hd..(r + 1) * hd], p[r * ld + t], v);
        }
    }
}

fn axpy_portable<E: KvElem>(y: &mut [f32], alpha: f32, x: &[E]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += alpha * x.widen());
}

/// Asks the CPU to bring `data` into its L2 cache ahead of use: a hint, with
/// no effect on any result (nothing at all off x86-64).
pub fn prefetch<T>(data: &[T]) {
    prefetch_bytes(data.as_ptr().cast(), std::mem::size_of_val(data));
}

/// Asks the CPU to bring the `bytes` bytes at `start` into its L2 cache,
/// one 64-byte line at a time. Any address is allowed, even past an
/// allocation's end: a prefetch never faults and reads nothing the
/// program sees, so at worst it fetches for nothing.
///
/// L2, not L1 (`T1`, which Intel cores and, since Zen 4, AMD cores fill
/// into L2 only): what callers fetch ahead (the next tile pair's weights,
/// the next block's keys and this block's values) is as large as the L1
/// itself, and fetched into L1 it evicted the rows a kernel was still
/// reading; from L2 the core's own L1 prefetcher brings it in as it is
/// read. genai-int8 export, `examples/batch_profile` at 16 sequences on
/// a 2-core Zen 4, medians of 8 alternating runs: projections 8.17 to
/// 6.92 ms a step, gated MLPs 5.02 to 4.34, attention 4.40 to 4.02.
#[inline(always)]
pub(crate) fn prefetch_bytes(start: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes).step_by(64) {
        // SAFETY: SSE is part of the x86-64 baseline, and a prefetch of
        // any address is defined (it is a hint: no fault, no read).
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(start.wrapping_add(line).cast())
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, bytes);
}

/// Memory a loop over `total` rows fetches into L2 as it goes, in step
/// with its own reads: row `t` fetches the `t`-th share of the lines, so
/// the requests interleave with the loop's arithmetic instead of queueing,
/// all at once, ahead of its own loads. A hint like [`prefetch`]: any
/// address is allowed and no result changes. (An address, not a pointer:
/// nothing is ever read through it, and as a number it goes to the
/// threads of a parallel region as it is.)
#[derive(Clone, Copy, Debug)]
pub struct Alongside {
    address: usize,
    lines: usize,
}

impl Alongside {
    /// Nothing to fetch.
    pub const NONE: Alongside = Alongside { address: 0, lines: 0 };

    /// The lines of `data`.
    pub fn of<T>(data: &[T]) -> Self {
        Self { address: data.as_ptr() as usize, lines: std::mem::size_of_val(data).div_ceil(64) }
    }

    /// The lines rows `rows` of `total` fetch: `ceil(lines / total)` a
    /// row, so a walk over every row fetches every line once, in order.
    fn share(&self, rows: std::ops::Range<usize>, total: usize) -> std::ops::Range<usize> {
        if self.lines == 0 || total == 0 {
            return 0..0;
        }
        let per_row = self.lines.div_ceil(total);
        let first = rows.start.saturating_mul(per_row).min(self.lines);
        first..rows.end.saturating_mul(per_row).min(self.lines).max(first)
    }

    /// Fetches the share of rows `rows` (of `total`).
    #[inline(always)]
    fn rows(&self, rows: std::ops::Range<usize>, total: usize) {
        let lines = self.share(rows, total);
        let start = std::ptr::without_provenance::<u8>(self.address.wrapping_add(lines.start * 64));
        prefetch_bytes(start, lines.len() * 64);
    }
}

/// Numerically stable softmax of one row, in place; returns the row's
/// maximum and the sum of `exp(v - max)` it divided by (what merging the
/// softmaxes of a row's parts needs).
pub fn softmax(row: &mut [f32]) -> (f32, f32) {
    softmax_on(true, row)
}

fn softmax_on(vector: bool, row: &mut [f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    #[cfg(target_arch = "x86_64")]
    if vector && has_avx2_fma_f16c() {
        // SAFETY: AVX2, FMA and F16C checked; the function stays within `row`.
        let sum = unsafe { x86::exp_shifted(row.as_mut_ptr(), row.len(), max) };
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|v| *v *= inv);
        return (max, sum);
    }
    softmax_portable(row, max)
}

fn softmax_portable(row: &mut [f32], max: f32) -> (f32, f32) {
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
    (max, sum)
}

/// `out[i] = gate[i] · sigmoid(gate[i]) · up[i]`: the gated MLP's SiLU
/// gate. A batch of 16 SmolLM2 rows gates 737,000 values a step; one libm
/// `expf` each was 1 ms of a 20 ms step. The vector path's exponential is
/// the softmax's (Cephes' polynomial, within 2 ulp of `expf`); the rest is
/// the same operations in the same order as the portable path.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_on(true, gate, up, out)
}

fn silu_mul_on(vector: bool, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if vector && has_avx2_fma_f16c() {
        // SAFETY: AVX2, FMA and F16C checked; `n` bounds every read of `gate`, `up`
        // and write of `out`.
        done = unsafe { x86::silu_mul(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), n) };
    }
    for i in done..n {
        out[i] = gate[i] * super::elementwise::sigmoid(gate[i]) * up[i];
    }
}

fn dot_portable<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].widen();
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y.widen();
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;

    /// Row bounds are checked without wrapping: 3 rows 2^63 apart do not
    /// fit any slice (unchecked, `(rows - 1) * ld` wrapped to 0 and passed).
    #[test]
    fn row_bounds_do_not_wrap() {
        assert!(holds(10, 2, 4, 4) && holds(8, 2, 4, 4) && !holds(7, 2, 4, 4) && holds(0, 0, 4, 4));
        assert!(!holds(4, 3, 1 << 63, 4));
        assert!(!holds(usize::MAX, 2, usize::MAX, 2));
    }

    /// The paths this machine can run: portable always, AVX2+FMA where
    /// the CPU has it.
    fn paths() -> Vec<bool> {
        if has_avx2_fma_f16c() {
            vec![false, true]
        } else {
            vec![false]
        }
    }

    fn plain_dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Walking a loop's rows one at a time, or in steps of four with a
    /// tail, fetches every line of the companion span exactly once and in
    /// order, whether it has more lines than the loop has rows or fewer;
    /// and an empty span or loop fetches nothing.
    #[test]
    fn alongside_shares_cover_every_line_once() {
        for lines in [0usize, 1, 5, 40, 256, 300] {
            let data = vec![0u8; lines * 64];
            let span = Alongside::of(&data);
            for total in [0usize, 1, 3, 9, 64, 74] {
                for step in [1, 4] {
                    let mut next = 0;
                    let mut t = 0;
                    while t < total {
                        let end = (t + step).min(total);
                        let got = span.share(t..end, total);
                        assert_eq!(got.start, next, "{lines} lines, {total} rows: rows {t}..{end} start at {got:?}");
                        next = got.end;
                        t = end;
                    }
                    let want = if total == 0 { 0 } else { lines };
                    assert_eq!(next, want, "{lines} lines over {total} rows in steps of {step}");
                }
            }
        }
        assert_eq!(Alongside::NONE.share(0..10, 10), 0..0);
    }

    /// Every path (portable, and AVX2 where present: each forced in turn)
    /// agrees with the plain definitions, over lengths that exercise every
    /// loop tail; the public functions take the vector path.
    #[test]
    fn every_path_matches_the_plain_definitions() {
        for vector in paths() {
            let path = if vector { "avx2" } else { "portable" };
            for n in [0, 1, 7, 8, 9, 31, 32, 33, 64, 100] {
                let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
                let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
                assert!((dot_on(vector, &a, &b) - plain_dot(&a, &b)).abs() < 1e-4, "{path} dot n={n}");
                let mut y1 = b.clone();
                let mut y2 = b.clone();
                axpy_on(vector, &mut y1, 0.5, &a);
                y2.iter_mut().zip(&a).for_each(|(y, x)| *y += 0.5 * x);
                assert!(y1.iter().zip(&y2).all(|(p, q)| (p - q).abs() < 1e-6), "{path} axpy n={n}");
            }
            // Attention inner products against their plain definitions.
            for hd in [8, 12, 16, 40, 64] {
                let (rows, total) = (3, 11);
                let q: Vec<f32> = (0..rows * hd).map(|i| (i as f32 * 0.13).cos()).collect();
                let kv: Vec<f32> = (0..total * hd).map(|i| (i as f32 * 0.07).sin()).collect();
                // Scores land in rows of a wider buffer (stride 13), in two
                // chunks of keys; the weighted sum accumulates over both
                // chunks onto what `o` held.
                let ld = 13;
                let mut sc = vec![f32::NAN; rows * ld];
                let split = 5;
                scores_on(vector, &q, rows, &kv[..split * hd], hd, &mut sc, ld, Alongside::NONE);
                scores_on(vector, &q, rows, &kv[split * hd..], hd, &mut sc[split..], ld, Alongside::NONE);
                let mut o = vec![1.0; rows * hd];
                weighted_sum_on(vector, &sc, rows, ld, &kv[..split * hd], hd, &mut o, Alongside::NONE);
                weighted_sum_on(vector, &sc[split..], rows, ld, &kv[split * hd..], hd, &mut o, Alongside::NONE);
                for r in 0..rows {
                    for t in 0..total {
                        let want = plain_dot(&q[r * hd..(r + 1) * hd], &kv[t * hd..(t + 1) * hd]);
                        assert!((sc[r * ld + t] - want).abs() < 1e-4, "{path} scores hd={hd}");
                    }
                    for c in 0..hd {
                        let want: f32 = 1.0 + (0..total).map(|t| sc[r * ld + t] * kv[t * hd + c]).sum::<f32>();
                        assert!((o[r * hd + c] - want).abs() < 1e-3, "{path} weighted_sum hd={hd}");
                    }
                }
            }
            // Batch invariance (B1's arithmetic): a score is the same bits
            // however many rows and keys share the call, and a weighted sum
            // the same bits as one `axpy` per value row in order.
            for hd in [8, 24, 40, 64, 72, 136] {
                for rows in 1..=5 {
                    let total = 9;
                    let q: Vec<f32> = (0..rows * hd).map(|i| (i as f32 * 0.29).sin()).collect();
                    let kv: Vec<f32> = (0..total * hd).map(|i| (i as f32 * 0.17).cos()).collect();
                    let mut together = vec![0.0; rows * total];
                    scores_on(vector, &q, rows, &kv, hd, &mut together, total, Alongside::of(&kv));
                    for r in 0..rows {
                        for t in 0..total {
                            let mut alone = [0.0];
                            let (qr, kt) = (&q[r * hd..(r + 1) * hd], &kv[t * hd..(t + 1) * hd]);
                            scores_on(vector, qr, 1, kt, hd, &mut alone, 1, Alongside::NONE);
                            let got = together[r * total + t];
                            assert_eq!(
                                got.to_bits(),
                                alone[0].to_bits(),
                                "{path} hd={hd} rows={rows} score ({r}, {t})"
                            );
                        }
                    }
                    let mut summed = vec![0.5; rows * hd];
                    weighted_sum_on(vector, &together, rows, total, &kv, hd, &mut summed, Alongside::of(&q));
                    for r in 0..rows {
                        let mut each = vec![0.5; hd];
                        for t in 0..total {
                            axpy_on(vector, &mut each, together[r * total + t], &kv[t * hd..(t + 1) * hd]);
                        }
                        let same =
                            summed[r * hd..(r + 1) * hd].iter().zip(&each).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{path} hd={hd} rows={rows}: weighted sum of row {r} differs from one axpy per value"
                        );
                    }
                }
            }
            // An f16 cache: every path reads f16 keys and values as the
            // same bits as their exact f32 widening (the attention of an
            // f16 model does not depend on where the widening happens).
            for hd in [8, 16, 24, 64, 72] {
                for rows in [1, 3, 4] {
                    let total = 11;
                    let q: Vec<f32> = (0..rows * hd).map(|i| (i as f32 * 0.23).sin()).collect();
                    let half: Vec<f16> = (0..total * hd).map(|i| f16::from_f32((i as f32 * 0.19).cos())).collect();
                    let wide: Vec<f32> = half.iter().map(|h| h.to_f32()).collect();
                    let (mut s16, mut s32) = (vec![0.0; rows * total], vec![0.0; rows * total]);
                    scores_on(vector, &q, rows, &half, hd, &mut s16, total, Alongside::NONE);
                    scores_on(vector, &q, rows, &wide, hd, &mut s32, total, Alongside::NONE);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&s16), bits(&s32), "{path} f16 scores hd={hd} rows={rows}");
                    let (mut o16, mut o32) = (vec![0.25; rows * hd], vec![0.25; rows * hd]);
                    weighted_sum_on(vector, &s32, rows, total, &half, hd, &mut o16, Alongside::NONE);
                    weighted_sum_on(vector, &s32, rows, total, &wide, hd, &mut o32, Alongside::NONE);
                    assert_eq!(bits(&o16), bits(&o32), "{path} f16 weighted sum hd={hd} rows={rows}");
                    let want = plain_dot(&q[..hd], &wide[..hd]);
                    assert!((s16[0] - want).abs() < 1e-4, "{path} f16 score hd={hd}: {} vs {want}", s16[0]);
                }
            }
            // The SiLU gate against the f64 definition, over every tail
            // length and the saturated ends (exp over- and underflow).
            for n in [0, 1, 7, 8, 9, 17, 100] {
                let gate: Vec<f32> = (0..n).map(|i| (i as f32 * 0.913).sin() * 12.0).collect();
                let up: Vec<f32> = (0..n).map(|i| (i as f32 * 0.41).cos()).collect();
                let mut out = vec![f32::NAN; n];
                silu_mul_on(vector, &gate, &up, &mut out);
                for i in 0..n {
                    let g = f64::from(gate[i]);
                    let want = (g / (1.0 + (-g).exp()) * f64::from(up[i])) as f32;
                    assert!((out[i] - want).abs() <= 4e-7 * want.abs() + 1e-30, "{path} silu n={n} i={i}");
                }
            }
            let extremes = [-1e30f32, -200.0, -88.5, -87.0, -20.0, -0.0, 0.0, 1e-8, 20.0, 88.5, 200.0, 1e30];
            let mut out = [f32::NAN; 12];
            silu_mul_on(vector, &extremes, &[2.0; 12], &mut out);
            for (g, o) in extremes.iter().zip(out) {
                let want = if *g > 50.0 {
                    2.0 * g
                } else if *g < -150.0 {
                    0.0
                } else {
                    2.0 * g / (1.0 + (-g).exp())
                };
                assert!((o - want).abs() <= 1e-6 * want.abs() + 1e-30, "{path} silu({g}) = {o}, want {want}");
            }
            for n in [1, 5, 8, 13, 64, 1000] {
                let row: Vec<f32> =
                    (0..n).map(|i| (i as f32 * 0.731).sin() * 30.0 - if i % 7 == 3 { 1e9 } else { 0.0 }).collect();
                let mut got = row.clone();
                let (got_max, got_sum) = softmax_on(vector, &mut got);
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f64> = row.iter().map(|v| f64::from(v - max).exp()).collect();
                let sum: f64 = exps.iter().sum();
                assert_eq!(got_max, max, "{path} softmax n={n}: the maximum it reports");
                assert!((f64::from(got_sum) - sum).abs() <= 1e-5 * sum, "{path} softmax n={n}: sum {got_sum} vs {sum}");
                for (a, e) in got.iter().zip(&exps) {
                    let want = (e / sum) as f32;
                    assert!((a - want).abs() <= 1e-6 + 1e-5 * want.abs(), "{path} softmax n={n}: {a} vs {want}");
                }
            }
        }
    }
}
