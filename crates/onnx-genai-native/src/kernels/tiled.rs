//! Projections on [`Tiled`] weights: the inputs are staged once per call
//! (padded to whole blocks), the output tiles are split across the pool's
//! threads in contiguous ranges, and each thread runs the kernel of the
//! chosen instruction set over its tiles for every input row — rows it
//! quantized to int8 (`accuracy_level` 4) or split into limbs for itself
//! as its region started.

use super::isa::Isa;
use super::quantize::{quantize_into, quantized_blocks};
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
    let (q, scales, sums) = (&mut s.own_rows[values], &mut s.own_scales[..blocks], &mut s.own_sums[..blocks]);
    if kp.is_multiple_of(x_block.max(1)) {
        // Rows of whole blocks are quantized as one run of blocks (no block
        // spans two rows), which the vector path takes eight at a time.
        quantize_into(&a[..m * kp], x_block, q, scales, sums);
        return;
    }
    let outputs = q.chunks_exact_mut(kp).zip(scales.chunks_exact_mut(per_row).zip(sums.chunks_exact_mut(per_row)));
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

/// `y[m, n] = x[m, :] . W[n, :]` for a tiled weight on `isa` (which must be
/// available on this CPU).
pub fn linear(t: &Tiled, x: &[f32], m: usize, y: &mut [f32], ctx: &Ctx, isa: Isa) {
    // (The kernels read `m` rows through raw pointers: a short input read
    // past its end.)
    assert!(
        x.len() >= m * t.k && y.len() >= m * t.n,
        "{} inputs, {} outputs for {m} rows of {} x {}",
        x.len(),
        y.len(),
        t.k,
        t.n
    );
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
        let mut scratch = ctx.scratch.take(th);
        if let Some(x_block) = int8_block {
            quantize_own(&mut scratch, a, m, kp, x_block);
        } else if let Some(first) = limb_rows {
            split_own(&mut scratch, &a[first * kp..m * kp], kp);
        }
    };
    let work = |range: std::ops::Range<usize>, th: usize| {
        // (`prepare` ran on this thread before its first range.)
        let mut scratch = ctx.scratch.take(th);
        let Scratch { bytes, own_rows, own_scales, own_sums, .. } = &mut *scratch;
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
            assert!(rows.q.len() >= rows.m * rows.kp && range.start.is_multiple_of(2) && range.end <= t.tiles);
            assert!(out.len() >= rows.m * t.n);
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
        let th = ctx.pool.inline_index();
        prepare(th);
        work(0..t.tiles, th);
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
        let mut scratch = ctx.scratch.take(th);
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

/// The kernel of `isa` over `tiles`, which start on a pair (the vector
/// kernels read two tiles interleaved). Checked in every build: the
/// kernels read and write through raw pointers by these counts.
fn run(isa: Isa, t: &Tiled, rows: &Rows<'_>, tiles: std::ops::Range<usize>, y: &Disjoint<'_, f32>) {
    assert!(rows.x.len() >= rows.m * rows.kp, "{} input values for {} rows of {}", rows.x.len(), rows.m, rows.kp);
    assert!(tiles.start.is_multiple_of(2) && tiles.end <= t.tiles, "tiles {tiles:?} of {}", t.tiles);
    assert!(y.len() >= rows.m * t.n, "{} outputs for {} rows of {}", y.len(), rows.m, t.n);
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
    use crate::kernels::weights::{Packed, Weight};
    use crate::kernels::Runtime;

    /// An input shorter than its rows is refused on every path this CPU
    /// has, before a kernel reads past it (the padding copy took only the
    /// rows present and the kernels read `m` rows on, by raw pointer).
    #[test]
    fn a_short_input_is_refused_before_any_kernel_reads_it() {
        let (n, k, m) = (40, 64, 3);
        let w = Weight { n, k, packed: Packed::F32((0..n * k).map(|i| (i % 13) as f32 * 0.1).collect()) };
        let t = Tiled::from_rows(&w).expect("tileable");
        for isa in Isa::all_available() {
            let rt = Runtime::serial();
            let x = vec![0.5; m * k - 1];
            let mut y = vec![0.0; m * n];
            let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                linear(&t, &x, m, &mut y, &rt.ctx(), isa);
            }));
            let message = refused.expect_err("a short input was read");
            let message = message.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(message.contains("191 inputs"), "{isa:?}: {message}");
        }
    }
}
