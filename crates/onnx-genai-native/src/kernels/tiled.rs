//! Projections on [`Tiled`] weights: the inputs are staged once per call
//! (padded to whole blocks), the output tiles are split across the pool's
//! threads in contiguous ranges, and each thread runs the kernel of the
//! chosen instruction set over its tiles for every input row — rows it
//! quantized to int8 (`accuracy_level` 4) or split into limbs for itself
//! as its region started.

use super::isa::Isa;
use super::weights::{TileData, Tiled, QBLOCK, TILE};
use super::{Ctx, Scratch};
use crate::pool::Disjoint;

/// The inputs as the kernels read them: `m` rows of `kp` values
/// (zero-padded past `k`) with the sum of each block of 32 (`xsum`, for
/// 4-bit weights; not of a symmetric weight's `limbs` rows), and for int8-input weights the same rows quantized per
/// block (`q`), each block's scale and the sum of its quantized values,
/// and for f32-input 4-bit weights on AVX-512 VNNI the rows its integer
/// kernel takes split into limbs (`limbs`).
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub m: usize,
    pub kp: usize,
    pub x: &'a [f32],
    pub xsum: &'a [f32],
    pub q: &'a [i8],
    pub qscale: &'a [f32],
    pub qsum: &'a [i32],
    pub limbs: LimbRows<'a>,
}

/// Rows `first..` of a call as [`super::limbs::split`] leaves them: per
/// row, `kp / 32` blocks of digits, scales and digit sums.
#[derive(Clone, Copy, Default)]
pub struct LimbRows<'a> {
    pub first: usize,
    pub digits: &'a [i8],
    pub scales: &'a [f32],
    pub sums: &'a [i32],
}

/// The little-endian f32 at byte `at` of `b`.
#[inline]
pub fn lane_f32(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Below this many multiply-adds a projection runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 15;

/// Quantizes `x` (one row, `kp` values) the way ONNX Runtime's CPU
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
fn quantized_blocks(k: usize, x_block: usize) -> usize {
    let x_block = x_block.max(1);
    let sub = QBLOCK.min(x_block);
    (k / x_block) * x_block.div_ceil(sub) + (k % x_block).div_ceil(sub)
}

/// [`quantize`] into slices of exactly the right lengths (`x.len()` values,
/// [`quantized_blocks`] scales and sums), so rows can be quantized apart.
fn quantize_into(x: &[f32], x_block: usize, q: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
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
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // packs work within 128-bit lanes: this puts the four 8-value groups
    // back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
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
            let [a, b, c, d]: [__m256i; 4] = std::array::from_fn(|i| {
                _mm256_cvtps_epi32(_mm256_mul_ps(unsafe { _mm256_loadu_ps(sub.as_ptr().add(8 * i)) }, inverse))
            });
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
            // SAFETY: `o` holds 32 bytes.
            unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), _mm256_permutevar8x32_epi32(bytes, order)) };
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

#[cfg(target_arch = "x86_64")]
/// Where the next tile pair's records start: a kernel fetches the bytes of
/// its step `s` there (`stride` of them) while it computes its own step
/// `s`. The address may lie past the weight's end (a last pair, or the
/// weight's end): a prefetch never faults, it only fetches for nothing.
#[derive(Clone, Copy)]
pub(crate) struct Ahead(pub(crate) *const u8);

#[cfg(target_arch = "x86_64")]
impl Ahead {
    #[inline(always)]
    pub(crate) fn fetch(self, offset: usize, bytes: usize) {
        super::simd::prefetch_bytes(self.0.wrapping_add(offset), bytes);
    }
}

/// Quantizes `m` rows of `kp` inputs (`a`) into this thread's own buffers,
/// laid out as [`own_int8_layout`] says.
fn quantize_own(s: &mut Scratch, a: &[f32], m: usize, kp: usize, x_block: usize) {
    if kp == 0 {
        return;
    }
    let per_row = quantized_blocks(kp, x_block);
    super::grow_to(&mut s.own_rows, m * kp + 64);
    super::grow_to(&mut s.own_scales, m * per_row);
    super::grow_to(&mut s.own_sums, m * per_row);
    let (values, blocks) = own_int8_layout(&s.own_rows, m, kp, x_block);
    let outputs = s.own_rows[values]
        .chunks_exact_mut(kp)
        .zip(s.own_scales[..blocks].chunks_exact_mut(per_row).zip(s.own_sums[..blocks].chunks_exact_mut(per_row)));
    for (row, (q, (scales, sums))) in a.chunks_exact(kp).zip(outputs) {
        quantize_into(row, x_block, q, scales, sums);
    }
}

/// Where a call's `m` int8 rows of `kp` lie in a thread's own buffers, the
/// one layout [`quantize_own`] writes and every range of the region reads:
/// the values (returned) from the first cache-line boundary of `own_rows`,
/// as the AMX kernel loads them, and the first `m` rows' worth of scales
/// and sums (the count returned), [`quantized_blocks`] a row.
fn own_int8_layout(own_rows: &[i8], m: usize, kp: usize, x_block: usize) -> (std::ops::Range<usize>, usize) {
    // (Clamped for a buffer never grown — no inputs, `kp` 0 — whose
    // dangling pointer is not on a line boundary.)
    let at = super::line_offset(own_rows.as_ptr()).min(own_rows.len());
    (at..at + m * kp, m * quantized_blocks(kp, x_block))
}

/// Splits rows of `kp` f32 inputs (`a`, a call's rows from its first limb
/// row on) into limbs in this thread's own buffers.
fn split_own(s: &mut Scratch, a: &[f32], kp: usize) {
    use super::limbs::{split, BLOCK_BYTES, LIMBS};
    if kp == 0 {
        return;
    }
    let blocks = kp / QBLOCK;
    let rows = a.len() / kp;
    super::grow_to(&mut s.own_rows, rows * blocks * BLOCK_BYTES);
    super::grow_to(&mut s.own_scales, rows * blocks);
    super::grow_to(&mut s.own_sums, rows * blocks * LIMBS);
    for (r, row) in a.chunks_exact(kp).enumerate() {
        split(
            row,
            &mut s.own_rows[r * blocks * BLOCK_BYTES..(r + 1) * blocks * BLOCK_BYTES],
            &mut s.own_scales[r * blocks..(r + 1) * blocks],
            &mut s.own_sums[r * blocks * LIMBS..(r + 1) * blocks * LIMBS],
        );
    }
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

/// `y[m, n] = x[m, :] . W[n, :]` for a tiled weight on `isa` (which must be
/// available on this CPU).
pub fn linear(t: &Tiled, x: &[f32], m: usize, y: &mut [f32], ctx: &Ctx, isa: Isa) {
    let mut staged = ctx.staging();
    let s = &mut *staged;
    #[cfg(target_arch = "x86_64")]
    if m >= GEMM_MIN_ROWS && isa.wide() && isa.available() && !matches!(t.data, TileData::Q4 { int8: true, .. }) {
        gemm(t, &mut s.d, x, m, y, ctx);
        return;
    }
    let kp = t.kp;
    // The kernels read rows `kp` apart: only a width off the 32-grid is
    // copied to pad it (copying every row was 0.8% of a batched decode).
    let a: &[f32] = match x.get(..m * kp) {
        Some(a) if kp == t.k => a,
        _ => {
            s.a.clear();
            for row in x.chunks_exact(t.k.max(1)).take(m) {
                s.a.extend_from_slice(row);
                s.a.resize(s.a.len() + (kp - t.k), 0.0);
            }
            &s.a
        }
    };
    s.c.clear();
    // f32 inputs on VNNI: the first row the limb kernel takes.
    let mut limb_rows: Option<usize> = None;
    // Int8 inputs: each thread quantizes every row for itself as the
    // region starts (`quantize_own`), so no thread reads rows another
    // wrote. Quantized by rows across the threads before the region (each
    // thread then read the other's half from the other core's cache), a
    // 576 x 576 projection of 8 rows spent a quarter of its time on two
    // threads quantizing and waiting, and took 14.3-15.0 µs a call
    // against 16.9 on one; each thread quantizing for itself, 12.3.
    let int8_block = match t.data {
        TileData::Q4 { int8: true, x_block, .. } => Some(x_block),
        _ => None,
    };
    match t.data {
        // Only the AVX-512 per-block kernel reads the block sums (any row
        // of a call left with at most 4 rows to go may reach it); on VNNI
        // the integer kernel takes those rows instead, and needs the sums
        // only for an asymmetric weight (they run serially on the calling
        // thread while the others wait; groups of 8 rows never read them).
        TileData::Q4 { int8: false, per_weight: false, symmetric, .. } if isa.wide() => {
            #[cfg(target_arch = "x86_64")]
            let limb_first = if isa.vnni() { super::avx512::limb_rows(m).start } else { m };
            #[cfg(not(target_arch = "x86_64"))]
            let limb_first = m;
            let summed = if isa.vnni() { !symmetric && limb_first < m } else { true };
            if summed {
                s.c.extend(a.chunks_exact(QBLOCK).map(|b| b.iter().sum::<f32>()));
            }
            // The rows VNNI's integer kernel takes, split into limbs by
            // each thread for itself (`split_own`), as int8 rows are
            // quantized.
            if limb_first < m {
                limb_rows = Some(limb_first);
            }
        }
        _ => {}
    }
    let shared = Rows { m, kp, x: a, xsum: &s.c, q: &[], qscale: &[], qsum: &[], limbs: LimbRows::default() };
    let out = Disjoint::new(y);
    let amx = isa == Isa::Avx512Amx && m >= AMX_MIN_ROWS && int8_block.is_some() && isa.available();
    let prepare = |th: usize| {
        // SAFETY: thread `th` is the only user of its scratch in this
        // region.
        let scratch = unsafe { ctx.scratch.get(th) };
        if let Some(x_block) = int8_block {
            quantize_own(scratch, a, m, kp, x_block);
        } else if let Some(first) = limb_rows {
            split_own(scratch, &a[first * kp..m * kp], kp);
        }
    };
    let work = |range: std::ops::Range<usize>, th: usize| {
        // SAFETY: thread `th` is the only user of its scratch in this
        // region; `prepare` ran on this thread before its first range.
        let Scratch { bytes, own_rows, own_scales, own_sums, .. } = unsafe { ctx.scratch.get(th) };
        let own;
        let rows = match (int8_block, limb_rows) {
            (Some(x_block), _) => {
                let (values, blocks) = own_int8_layout(own_rows, m, kp, x_block);
                own = Rows { q: &own_rows[values], qscale: &own_scales[..blocks], qsum: &own_sums[..blocks], ..shared };
                &own
            }
            (None, Some(first)) => {
                own =
                    Rows { limbs: LimbRows { first, digits: own_rows, scales: own_scales, sums: own_sums }, ..shared };
                &own
            }
            (None, None) => &shared,
        };
        #[cfg(target_arch = "x86_64")]
        if amx {
            debug_assert!(rows.q.len() >= rows.m * rows.kp);
            // SAFETY: AMX was granted and AVX-512 is there (checked); the
            // weight takes int8 inputs, which `prepare` quantized into this
            // thread's `rows`.
            unsafe { super::amx::tiles(t, rows, range, &out, bytes) };
            return;
        }
        let _ = (amx, bytes);
        run(isa, t, rows, range, &out)
    };
    if m * t.n * t.k >= PARALLEL_MIN_MACS {
        // Pairs of tiles (the vector kernels interleave two), claimed in
        // chunks of at most a quarter of a thread's share (smaller toward
        // its end, see `ThreadPool::for_claimed_ranges`): under a server the
        // OS preempts a compute thread now and then, and a fixed split made
        // the other wait at the end of every projection (a quarter of the
        // CPU time of a served decode went to that wait).
        let pairs = t.tiles.div_ceil(2);
        let chunk = pairs.div_ceil(4 * ctx.pool.threads()).max(1);
        ctx.pool.for_claimed_ranges_prepared(pairs, chunk, &prepare, &|r, th| {
            work(2 * r.start..(2 * r.end).min(t.tiles), th)
        });
    } else {
        prepare(0);
        work(0..t.tiles, 0);
    }
}

/// From this many input rows on (a prefill), f32-input products run as a
/// register-blocked GEMM: each thread decodes a tile pair once into an
/// f32 panel (L2-sized) and multiplies every chunk of rows with it.
const GEMM_MIN_ROWS: usize = 64;

/// The AVX-512 GEMM path: A (`m` rows of `k`, zero-padded to `kp`) packed
/// once per call into chunks of [`super::avx512_gemm::MR`] rows stored
/// input-major, so the microkernel's broadcasts read consecutive values;
/// tile pairs claimed by the threads one at a time (the thread that packed
/// A has it in its cache and runs ahead of the others: a fixed split left
/// it waiting at the end of every call).
#[cfg(target_arch = "x86_64")]
fn gemm(t: &Tiled, packed: &mut Vec<f32>, x: &[f32], m: usize, y: &mut [f32], ctx: &Ctx) {
    use super::avx512_gemm::{decode_pair, gemm_panel, MR};
    let (k, kp) = (t.k, t.kp);
    let chunks = m.div_ceil(MR);
    // Every value of A is written below (padding as zeros).
    super::grow_to(packed, chunks * kp * MR);
    let a = Disjoint::new(&mut packed[..chunks * kp * MR]);
    let pack = |range: std::ops::Range<usize>, _t: usize| {
        for chunk in range {
            // SAFETY: chunk `chunk` of A belongs to this range only.
            let dst = unsafe { a.slice(chunk * kp * MR, kp * MR) };
            for lane in 0..MR {
                let r = chunk * MR + lane;
                let row = if r < m { x.get(r * k..(r + 1) * k).unwrap_or_default() } else { &[][..] };
                for c in 0..kp {
                    dst[c * MR + lane] = row.get(c).copied().unwrap_or(0.0);
                }
            }
        }
    };
    ctx.pool.for_ranges(chunks, 1, &pack);
    let packed: &[f32] = &packed[..chunks * kp * MR];
    let out = Disjoint::new(y);
    let n = t.n;
    let pairs = t.tiles.div_ceil(2);
    ctx.pool.for_claimed(pairs, &|pair, th| {
        // SAFETY: thread `th` is the only user of its scratch here.
        let scratch = unsafe { ctx.scratch.get(th) };
        // `decode_pair` writes every value of the panel.
        super::grow_to(&mut scratch.a, kp * 32);
        let panel = &mut scratch.a[..kp * 32];
        let tile = 2 * pair;
        // SAFETY: AVX-512 is available (checked by the caller); the panel
        // holds `32 * kp` values and the weight takes f32 inputs.
        unsafe { decode_pair(t, tile, panel) };
        let first = tile * TILE;
        let width = (2 * TILE).min(n - first);
        for chunk in 0..chunks {
            let rows = MR.min(m - chunk * MR);
            let ptrs: [*mut f32; MR] = std::array::from_fn(|r| {
                if r < rows {
                    // SAFETY: outputs `first..first + width` of this row
                    // belong to this pair, which one thread computes.
                    unsafe { out.slice((chunk * MR + r) * n + first, width) }.as_mut_ptr()
                } else {
                    std::ptr::null_mut()
                }
            });
            // SAFETY: `packed` holds `chunks * kp * MR` values, the panel
            // `kp * 32`; the first `rows` pointers are valid for `width`.
            unsafe { gemm_panel(packed.as_ptr().add(chunk * kp * MR), panel.as_ptr(), kp, rows, &ptrs, width) };
        }
    });
}

/// From this many rows on, an int8-input product on the AMX path runs on
/// tiles; fewer stay on AVX-512 VNNI. Criterion
/// `batch_576x3072_1t/q4_int8_inputs`, one Intel Xeon run, µs VNNI / AMX:
/// 4 rows 50.0 / 65.4, 5 65.9 / 71.5, 6 76.7 / 79.1, 7 95.7 / 82.2, 8 93.4
/// / 84.9, 12 150.2 / 103.4 (VNNI takes 7 rows as calls of 4, 2 and 1).
pub const AMX_MIN_ROWS: usize = 7;

/// The kernel of `isa` over `tiles`.
pub fn run(isa: Isa, t: &Tiled, rows: &Rows<'_>, tiles: std::ops::Range<usize>, y: &Disjoint<'_, f32>) {
    debug_assert!(rows.x.len() >= rows.m * rows.kp);
    debug_assert!(tiles.end <= t.tiles && y.len() >= rows.m * t.n);
    #[cfg(target_arch = "x86_64")]
    {
        if isa.wide() && isa.available() {
            // SAFETY: AVX-512 F/BW/VL/DQ are available (checked), and the
            // buffers hold what `Tiled` and `Rows` promise (asserted above in
            // debug builds, guaranteed by `linear` and the tests).
            unsafe { super::avx512::tiles(t, rows, tiles, y, isa.vnni()) };
            return;
        }
        if isa.x86() && isa.available() {
            // SAFETY: AVX2/FMA/F16C (and AVX-VNNI when `vnni`) are available.
            unsafe { super::avx2::tiles(t, rows, tiles, y, isa.vnni()) };
            return;
        }
    }
    let _ = isa;
    super::portable::tiles(t, rows, tiles, y);
}

/// Output columns tile `tile` covers.
pub fn tile_width(t: &Tiled, tile: usize) -> usize {
    TILE.min(t.n - tile * TILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Quantizer = dyn Fn(&[f32], usize, &mut [i8], &mut [f32], &mut [i32]);

    /// The AVX2 quantization gives [`quantize_portable`]'s bits: values,
    /// scales and sums, on rows with zero blocks, ties (x.5 after scaling),
    /// the block maximum at either end, negative maxima, blocks of 32, 64
    /// and 128, and a last block that is not whole 32s (portable there).
    #[test]
    fn quantization_is_the_same_on_every_path() {
        let mut seed = 0x9e37_79b9u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for (k, x_block) in [(96, 32), (128, 64), (256, 128), (100, 32), (72, 64)] {
            for case in 0..40 {
                let mut x: Vec<f32> = (0..k).map(|_| (next() % 20001) as f32 / 1000.0 - 10.0).collect();
                match case % 4 {
                    // Zero blocks.
                    0 => x[..k.min(32)].iter_mut().for_each(|v| *v = 0.0),
                    // Ties: max 127 gives scale 1, halves round to even.
                    1 => {
                        x[0] = -127.0;
                        x.iter_mut().skip(1).step_by(3).for_each(|v| *v = (next() % 255) as f32 / 2.0 - 63.5);
                    }
                    // The maximum last in its block.
                    2 => x[k - 1] = 50.0,
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
