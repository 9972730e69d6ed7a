//! Intel AMX tile kernels for int8-input 4-bit weights (`accuracy_level`
//! 4) over many rows at once: a batched decode step or a prefill.
//!
//! AMX multiplies a tile of up to 16 int8 input rows by a tile of weights
//! in one instruction (`tdpbssd`/`tdpbsud`: exact int32 sums), about 8x
//! the multiply-adds a second of AVX-512 VNNI. The 4-bit records stay as
//! they are stored (no int8 copy of the weights): a chunk of records is
//! unpacked into 512-byte tile images in L1 on the way (with more than 16
//! rows, all of a tile pair's records once, read from L2 by every 16-row
//! slice), one record (32 inputs) a tile product, so every quantization block's integer sum is
//! what [`super::avx512`]'s VNNI kernel computes; the sums are stored and
//! scaled and added in f32 in the VNNI kernel's order, so the two paths
//! agree to the last bit. The f32 epilogue (a conversion, a multiply and a
//! fused multiply-add per 16 outputs, row and block) is then most of the
//! work: criterion `batch_576x3072_1t/q4_int8_inputs` at 16 rows ran in
//! about two thirds of VNNI's time on an Intel Xeon with AMX, and lost to
//! it below 7 rows, hence [`super::tiled`]'s minimum of 7 (`AMX_MIN_ROWS`).
//!
//! Tile loads do not take data from stores still in flight, nor vector
//! loads from tile stores: each chunk is unpacked (unless the pair's
//! images are whole already), multiplied and its sums read back in three
//! phases rather than interleaved.
//!
//! Non-finite activations quantize to values no runtime defines (the
//! quantizer's integer conversion of a NaN); there the two paths may give
//! different finite results.
//!
//! The tile registers are not part of a thread's state until the process
//! asks Linux for them ([`available`] does, once); a kernel call loads its
//! tile configuration, and releases the tiles before it returns.

use super::tiled::{Ahead, Rows};
use super::weights::{TileData, Tiled, QBLOCK, TILE};
use crate::pool::Disjoint;
use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

/// Input rows one tile holds.
const TILE_ROWS: usize = 16;

/// Whether this CPU has AMX-TILE and AMX-INT8 and the OS granted this
/// process the tile data state (asked once; Linux refuses it where the
/// kernel or the hypervisor does not enable it).
pub fn available() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| cpu_has_amx_int8() && request_tile_state())
}

fn cpu_has_amx_int8() -> bool {
    // CPUID leaf 7, subleaf 0: EDX bit 24 is AMX-TILE, bit 25 AMX-INT8.
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is asked only where
    // leaf 0 says it exists.
    let (max, edx) = unsafe { (__cpuid(0).eax, __cpuid_count(7, 0).edx) };
    max >= 7 && edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and
    // touches no memory of ours; it fails (-1) where the state is not
    // supported, and succeeding again is harmless.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// A tile configuration (palette 1), the 64 bytes `ldtilecfg` reads.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// The tiles a call uses (the registers the instructions below name): two
/// sets of two int32 sum tiles (one per weight tile of a pair) and an
/// input tile, used by alternate groups, and two weight tiles.
const SUMS_TILES: [usize; 4] = [0, 1, 6, 7];
const INPUT_TILES: [usize; 2] = [2, 3];
const WEIGHT_TILES: [usize; 2] = [4, 5];

impl Config {
    /// `rows` input rows against 32 inputs (one record) a product.
    fn for_rows(rows: usize) -> Self {
        let mut c = Config { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        let rows = rows as u8;
        for t in SUMS_TILES {
            // `rows` rows of 16 int32 sums.
            (c.colsb[t], c.rows[t]) = (64, rows);
        }
        for t in INPUT_TILES {
            // `rows` rows of 32 int8 inputs.
            (c.colsb[t], c.rows[t]) = (QBLOCK as u16, rows);
        }
        for t in WEIGHT_TILES {
            // 8 rows of 16 outputs x 4 consecutive inputs.
            (c.colsb[t], c.rows[t]) = (64, (QBLOCK / 4) as u8);
        }
        c
    }
}

/// Bytes of one record's weight image: row `2i` holds the low nibbles of
/// the record's 64-byte vector `i` (inputs `8i..8i+4` of each of the 16
/// outputs, four bytes per output: the layout the tile product reads), row
/// `2i+1` the high ones (inputs `8i+4..8i+8`).
const IMAGE: usize = 512;

/// Quantization groups a chunk takes: its records unpacked, multiplied and
/// their sums stored, then read back by the f32 epilogue. With groups of
/// one or two records a tile pair's images and sums stay in L1 (16 rows,
/// blocks of 32: 4 groups a chunk ran 5% slower than 8, 18 with every
/// image of a pair unpacked first 50%); blocks of 128 fill the 48 KiB.
const GROUPS_AHEAD: usize = 8;

/// Bytes of one group's stored sums for a tile pair: 16 rows of 16 int32
/// for each tile.
const SUMS: usize = 2 * TILE_ROWS * TILE * 4;

/// Bytes of scratch [`tiles`] needs to hold `records` images of a tile
/// pair, a chunk's sums, and a line to align them to.
fn scratch_bytes(records: usize) -> usize {
    2 * records * IMAGE + GROUPS_AHEAD * SUMS + 64
}

/// Runs the kernel for the int8-input 4-bit weight `t` over `tiles`, every
/// input row, 16 rows a tile product; `images` is this thread's scratch.
///
/// # Safety
/// [`available`] must have returned true and the CPU must have AVX-512
/// F/BW/VL/DQ, AVX2 and FMA (the AVX-512 path's features); `t` must be
/// int8-input 4-bit and `rows` must hold `m` quantized
/// rows of `t.kp` values with their scales and sums (as
/// [`super::tiled::linear`] stages them); `y` must hold `m * t.n` values.
pub unsafe fn tiles(t: &Tiled, rows: &Rows<'_>, tiles: Range<usize>, y: &Disjoint<'_, f32>, images: &mut Vec<i8>) {
    let TileData::Q4 { blocks, int8: true, x_block, symmetric, .. } = t.data else {
        debug_assert!(false, "the AMX kernel takes int8-input 4-bit weights only");
        return;
    };
    let sub = (x_block / QBLOCK).max(1);
    debug_assert!(blocks.is_multiple_of(sub) && rows.qscale.len() >= rows.m * (rows.kp / QBLOCK));
    // More rows than one tile takes (a prefill, a batch of more than 16)
    // multiply every 16-row slice by the same weight images: a pair's
    // records are then unpacked once, all of them, and each slice reads
    // them from L2 (unpacked again chunk by chunk, every slice paid the
    // whole unpacking). One slice keeps the chunks, whose images stay in
    // L1.
    // Criterion `batch_576x3072_1t/q4_int8_inputs` on the Intel Xeon,
    // whole / chunked µs: 17 rows 188.5 / 220.3, 24 215.7 / 233.4, 32
    // 261.1 / 265.9; `prefill128` 1.270 / 1.455 ms.
    let whole = rows.m > TILE_ROWS;
    let records = if whole { blocks } else { GROUPS_AHEAD * sub };
    super::grow_to(images, scratch_bytes(records));
    // Images and sums start on a cache line (a tile row that straddles
    // two lines is two accesses).
    let offset = super::line_offset(images.as_ptr());
    // SAFETY: the scratch has 64 bytes to spare for the alignment.
    let images = unsafe { images.as_mut_ptr().add(offset).cast::<u8>() };
    // SAFETY: the sums follow the images in the scratch.
    let sums = unsafe { images.add(2 * records * IMAGE) };
    #[cfg(test)]
    TILE_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Releases the tiles however this returns (a panic in a pool job is
    // caught and the thread lives on).
    let _held = Held;
    let mut configured = 0;
    let mut tile = tiles.start;
    while tile < tiles.end {
        let width = if tiles.end - tile >= 2 { 2 } else { 1 };
        if whole {
            // SAFETY: `tile..tile + width` are in bounds; the scratch holds
            // `blocks` images of each.
            unsafe { unpack(t, tile, width, 0..blocks, images, symmetric) };
        }
        let mut first = 0;
        while first < rows.m {
            let count = TILE_ROWS.min(rows.m - first);
            if count != configured {
                let config = Config::for_rows(count);
                // SAFETY: AMX is granted (the caller's contract); a valid
                // palette-1 layout.
                unsafe { asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly)) };
                configured = count;
            }
            let kernel: RowsByTiles = if width == 2 { rows_by_tiles::<2> } else { rows_by_tiles::<1> };
            // SAFETY: forwarded contract; rows `first..first + count` are in
            // bounds and the tiles are configured for `count` rows.
            unsafe { kernel(t, rows, (blocks, sub, symmetric), tile, first..first + count, (images, sums, whole), y) };
            first += count;
        }
        tile += width;
    }
}

/// [`rows_by_tiles`] for one or two weight tiles.
type RowsByTiles = unsafe fn(
    &Tiled,
    &Rows<'_>,
    (usize, usize, bool),
    usize,
    Range<usize>,
    (*const u8, *mut u8, bool),
    &Disjoint<'_, f32>,
);

/// Calls of [`tiles`] (tests: the tile path did run).
#[cfg(test)]
static TILE_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Gives the tile state back when dropped (`tilerelease` leaves the tiles
/// unconfigured, also where none were configured).
struct Held;

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: only made in `tiles`, whose caller has AMX granted.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Unpacks `records` of `width` tiles from `tile` into `images`: the
/// `n`-th record of tile `tile + j` at image `n * width + j`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack(t: &Tiled, tile: usize, width: usize, records: Range<usize>, images: *mut u8, symmetric: bool) {
    let base = t.as_bytes().as_ptr();
    // A pair's records interleave: both tiles step by the same stride.
    let stride = t.place(tile).1;
    let starts = [t.place(tile).0, t.place(tile + width - 1).0];
    // The next pair's records (stored right after this pair's) are fetched
    // step by step while this pair's are unpacked, as the VNNI kernel
    // does (16 rows spent 80% of the unpacking waiting on the first load
    // of each record).
    let ahead = Ahead(base.wrapping_add(starts[0] + t.steps() * stride));
    let nibble = _mm512_set1_epi8(0x0f);
    // A symmetric weight's levels are stored as `q - 8` (signed): its zero
    // share is then in the integer sums the tiles compute.
    let zero = _mm512_set1_epi8(if symmetric { 8 } else { 0 });
    for (n, b) in records.enumerate() {
        ahead.fetch(b * stride, stride);
        for (j, start) in starts.iter().enumerate().take(width) {
            // SAFETY: tile `tile + j`'s record `b` holds 256 bytes of
            // nibbles; image `n * width + j` is in `images`.
            unsafe {
                let rec = base.add(start + b * stride);
                let image = images.add((n * width + j) * IMAGE);
                for i in 0..4 {
                    let v = _mm512_loadu_si512(rec.add(64 * i).cast());
                    let low = _mm512_sub_epi8(_mm512_and_si512(v, nibble), zero);
                    _mm512_store_si512(image.add(128 * i).cast(), low);
                    let high = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble), zero);
                    _mm512_store_si512(image.add(128 * i + 64).cast(), high);
                }
            }
        }
    }
}

/// `T` weight tiles from `tile` against the input rows `rows_range` (at
/// most 16, the configured tile height), chunk by chunk of groups
/// ([`GROUPS_AHEAD`]): unpack (unless `whole`: the images then hold every
/// record of the tiles already), multiply, then the f32 epilogue.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_by_tiles<const T: usize>(
    t: &Tiled,
    rows: &Rows<'_>,
    (blocks, sub, symmetric): (usize, usize, bool),
    tile: usize,
    rows_range: Range<usize>,
    (images, sums, whole): (*const u8, *mut u8, bool),
    y: &Disjoint<'_, f32>,
) {
    let (first, count) = (rows_range.start, rows_range.len());
    let kp = rows.kp;
    let per_row = kp / QBLOCK;
    let base = t.as_bytes().as_ptr();
    let stride = t.place(tile).1;
    let starts: [usize; T] = std::array::from_fn(|j| t.place(tile + j).0);
    let q = unsafe { rows.q.as_ptr().add(first * kp) };
    let groups = blocks / sub;
    // Chunk `k`'s products into `sums`: group `c` of the chunk, tile `j`,
    // row `i` at `c * SUMS + j * SUMS / 2 + i * 64`.
    let multiply = |k: usize| {
        let g0 = k * GROUPS_AHEAD;
        let records = g0 * sub..(g0 + GROUPS_AHEAD).min(groups) * sub;
        // The record whose image comes first in the scratch: the chunk's
        // own, or (whole) the tile's first.
        let first_image = if whole { 0 } else { records.start };
        if !whole {
            // SAFETY: `tile` (and `tile + 1` for a pair) are in bounds; the
            // images hold the chunk's records.
            unsafe { unpack(t, tile, T, records, images.cast_mut(), symmetric) };
        }
        let here = GROUPS_AHEAD.min(groups - g0);
        for c in 0..here {
            let g = g0 + c;
            // Consecutive groups alternate between two register sets, so
            // a group's sums can be stored behind the next group's
            // products (tiles are not renamed; set `c % 2` is zeroed only
            // after group `c - 2`'s sums were stored, one group ago).
            let set = c % 2;
            // SAFETY (this block): AMX granted and configured (the
            // caller's contract); rows `first..first + count` hold `kp`
            // inputs each, `kp` apart, and the input tile reads 32 of them
            // from input `32 b` of each; the chunk's images hold 512 bytes
            // each; `sums` 16 rows of 64 bytes for each group and tile.
            for j in 0..T {
                unsafe { zero_sums(set, j) };
            }
            for b in g * sub..(g + 1) * sub {
                unsafe {
                    load_inputs(set, q.add(b * QBLOCK), kp);
                    for j in 0..T {
                        product(set, j, images.add(((b - first_image) * T + j) * IMAGE), symmetric);
                    }
                }
            }
            // The previous group's sums are stored only now, behind this
            // group's products: tile instructions run in order, and a
            // store right after its own products waited out their latency.
            if c > 0 {
                for j in 0..T {
                    unsafe { store_sums(1 - set, j, sums.add((c - 1) * SUMS + j * (SUMS / 2))) };
                }
            }
        }
        // The chunk's last group (a chunk has at least one) is stored
        // right behind its own products: once a chunk, that wait remains.
        let c = here - 1;
        for j in 0..T {
            // SAFETY: as above; the last group's sums.
            unsafe { store_sums(c % 2, j, sums.add(c * SUMS + j * (SUMS / 2))) };
        }
    };
    let mut acc = [[_mm512_setzero_ps(); T]; TILE_ROWS];
    let chunks = groups.div_ceil(GROUPS_AHEAD);
    for k in 0..chunks {
        multiply(k);
        let g0 = k * GROUPS_AHEAD;
        let groups_here = (g0..(g0 + GROUPS_AHEAD).min(groups), sub, symmetric);
        let mut i = 0;
        while i < count {
            // Four rows at a time: eight (row, tile) accumulators are
            // independent chains, enough to hide the multiply-add latency.
            let r = (first + i, per_row);
            // SAFETY: `sums` holds the chunk's sums of row `i` on.
            let sums_at = unsafe { sums.add(i * 64) };
            // SAFETY: forwarded; rows `i..i + R` of the chunk are stored.
            unsafe {
                i += match count - i {
                    4.. => {
                        epilogue::<T, 4>(rows, r, groups_here.clone(), (base, &starts, stride), sums_at, &mut acc[i..])
                    }
                    3 => {
                        epilogue::<T, 3>(rows, r, groups_here.clone(), (base, &starts, stride), sums_at, &mut acc[i..])
                    }
                    2 => {
                        epilogue::<T, 2>(rows, r, groups_here.clone(), (base, &starts, stride), sums_at, &mut acc[i..])
                    }
                    _ => {
                        epilogue::<T, 1>(rows, r, groups_here.clone(), (base, &starts, stride), sums_at, &mut acc[i..])
                    }
                };
            }
        }
    }
    for (i, row) in acc.iter().enumerate().take(count) {
        for (j, v) in row.iter().enumerate() {
            let at = (tile + j) * TILE;
            let width = TILE.min(t.n - at);
            // SAFETY: outputs `at..at + width` of row `first + i` belong to
            // this tile, computed by this thread alone.
            let out = unsafe { y.slice((first + i) * t.n + at, width) };
            unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr(), ((1u32 << width) - 1) as u16, *v) };
        }
    }
}

/// Adds the stored sums of `groups` (group `c` of the chunk, tile `j`, row
/// `i` at `sums + c * SUMS + j * SUMS / 2 + i * 64`) for `R` rows from row
/// `r` into `acc`, per group: the
/// integer sum (a symmetric weight's zero share already in it: its images
/// hold `q - 8`) converted, an asymmetric weight's `zero · Σ xq` taken off
/// (exact: integers below 2^24), times `scale · sx`, added with one fused
/// multiply-add — exactly the VNNI kernel's integers and roundings.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn epilogue<const T: usize, const R: usize>(
    rows: &Rows<'_>,
    (r, per_row): (usize, usize),
    (groups, sub, symmetric): (Range<usize>, usize, bool),
    (base, starts, stride): (*const u8, &[usize; T], usize),
    sums: *const u8,
    acc: &mut [[__m512; T]],
) -> usize {
    let mut regs: [[__m512; T]; R] = std::array::from_fn(|i| acc[i]);
    for (c, g) in groups.clone().enumerate() {
        for (i, row) in regs.iter_mut().enumerate() {
            let r = r + i;
            // SAFETY (this block): row `r`'s scales and sums hold `per_row`
            // entries; record `g * sub` of each tile has its scales at
            // byte 256 and (asymmetric) zero points at 320; the stored
            // sums hold this row.
            let sx = _mm512_set1_ps(unsafe { *rows.qscale.get_unchecked(r * per_row + g * sub) });
            let total = if symmetric {
                0.0
            } else {
                (g * sub..(g + 1) * sub).map(|b| unsafe { *rows.qsum.get_unchecked(r * per_row + b) }).sum::<i32>()
                    as f32
            };
            for j in 0..T {
                let rec = unsafe { base.add(starts[j] + g * sub * stride) };
                let scale = unsafe { _mm512_loadu_ps(rec.add(256).cast()) };
                let int = _mm512_cvtepi32_ps(unsafe {
                    _mm512_loadu_si512(sums.add(c * SUMS + j * (SUMS / 2) + i * 64).cast())
                });
                let exact = if symmetric {
                    int
                } else {
                    let zero = unsafe { _mm512_loadu_ps(rec.add(320).cast()) };
                    _mm512_fnmadd_ps(zero, _mm512_set1_ps(total), int)
                };
                row[j] = _mm512_fmadd_ps(exact, _mm512_mul_ps(scale, sx), row[j]);
            }
        }
    }
    acc[..R].copy_from_slice(&regs);
    R
}

/// Zeroes sum tile `j` of register set `set` (set 0: `tmm0`, `tmm1`; set
/// 1: `tmm6`, `tmm7`).
///
/// # Safety
/// AMX granted and a configuration loaded.
#[inline(always)]
unsafe fn zero_sums(set: usize, j: usize) {
    // SAFETY: the caller's contract; no memory is touched.
    unsafe {
        match (set, j) {
            (0, 0) => asm!("tilezero tmm0", options(nostack, nomem)),
            (0, _) => asm!("tilezero tmm1", options(nostack, nomem)),
            (_, 0) => asm!("tilezero tmm6", options(nostack, nomem)),
            _ => asm!("tilezero tmm7", options(nostack, nomem)),
        }
    }
}

/// Loads the input tile of register set `set` (`tmm2` or `tmm3`): its
/// configured rows of 32 bytes, the first at `at`, `stride` bytes apart.
///
/// # Safety
/// AMX granted and configured; the rows must be readable.
#[inline(always)]
unsafe fn load_inputs(set: usize, at: *const i8, stride: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        match set {
            0 => asm!("tileloadd tmm2, [{0} + {1}*1]", in(reg) at, in(reg) stride, options(nostack, readonly)),
            _ => asm!("tileloadd tmm3, [{0} + {1}*1]", in(reg) at, in(reg) stride, options(nostack, readonly)),
        }
    }
}

/// Loads a weight image into weight tile `j` (`tmm4`/`tmm5`) and adds its
/// products with set `set`'s input tile into the set's sum tile `j`: signed
/// inputs by unsigned weights, or (`signed`) by signed ones.
///
/// # Safety
/// AMX granted and configured; `image` must hold 512 readable bytes.
#[inline(always)]
unsafe fn product(set: usize, j: usize, image: *const u8, signed: bool) {
    macro_rules! tile_product {
        ($load:literal, $product:literal) => {
            asm!($load, $product, in(reg) image, in(reg) 64usize, options(nostack, readonly))
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        match (signed, set, j) {
            (false, 0, 0) => tile_product!("tileloadd tmm4, [{0} + {1}*1]", "tdpbsud tmm0, tmm2, tmm4"),
            (false, 0, _) => tile_product!("tileloadd tmm5, [{0} + {1}*1]", "tdpbsud tmm1, tmm2, tmm5"),
            (false, _, 0) => tile_product!("tileloadd tmm4, [{0} + {1}*1]", "tdpbsud tmm6, tmm3, tmm4"),
            (false, _, _) => tile_product!("tileloadd tmm5, [{0} + {1}*1]", "tdpbsud tmm7, tmm3, tmm5"),
            (true, 0, 0) => tile_product!("tileloadd tmm4, [{0} + {1}*1]", "tdpbssd tmm0, tmm2, tmm4"),
            (true, 0, _) => tile_product!("tileloadd tmm5, [{0} + {1}*1]", "tdpbssd tmm1, tmm2, tmm5"),
            (true, _, 0) => tile_product!("tileloadd tmm4, [{0} + {1}*1]", "tdpbssd tmm6, tmm3, tmm4"),
            (true, _, _) => tile_product!("tileloadd tmm5, [{0} + {1}*1]", "tdpbssd tmm7, tmm3, tmm5"),
        }
    }
}

/// Stores sum tile `j` of set `set`: its configured rows, 64 bytes each,
/// at `to`.
///
/// # Safety
/// AMX granted and configured; `to` must hold 64 writable bytes per row.
#[inline(always)]
unsafe fn store_sums(set: usize, j: usize, to: *mut u8) {
    macro_rules! store {
        ($store:literal) => {
            asm!($store, in(reg) to, in(reg) 64usize, options(nostack))
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        match (set, j) {
            (0, 0) => store!("tilestored [{0} + {1}*1], tmm0"),
            (0, _) => store!("tilestored [{0} + {1}*1], tmm1"),
            (_, 0) => store!("tilestored [{0} + {1}*1], tmm6"),
            _ => store!("tilestored [{0} + {1}*1], tmm7"),
        }
    }
}

/// Int8 multiply-adds per second one thread computes with tile products of
/// the kernel's shape (16 rows by 32 inputs by 16 outputs), four
/// independent sums in flight: the ceiling of [`tiles`].
///
/// # Safety
/// [`available`] must have returned true.
pub unsafe fn int8_rate(reps: usize) -> f64 {
    let config = Config::for_rows(TILE_ROWS);
    let inputs = [1i8; TILE_ROWS * QBLOCK];
    let image = [1u8; IMAGE];
    let started = std::time::Instant::now();
    // SAFETY: AMX granted (the caller's contract); the configuration is
    // valid; the input rows are 32 bytes apart in `inputs`, the image 8
    // rows of 64 bytes.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        load_inputs(0, inputs.as_ptr(), QBLOCK);
        asm!(
            "tileloadd tmm4, [{0} + {1}*1]",
            "tileloadd tmm5, [{0} + {1}*1]",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm6",
            "tilezero tmm7",
            in(reg) image.as_ptr(),
            in(reg) 64usize,
            options(nostack, readonly)
        );
        for _ in 0..reps / 4 {
            asm!(
                "tdpbsud tmm0, tmm2, tmm4",
                "tdpbsud tmm1, tmm2, tmm5",
                "tdpbsud tmm6, tmm2, tmm4",
                "tdpbsud tmm7, tmm2, tmm5",
                options(nostack, nomem)
            );
        }
        asm!("tilerelease", options(nostack, nomem));
    }
    (reps / 4 * 4 * TILE_ROWS * QBLOCK * TILE) as f64 / started.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use crate::kernels::isa::Isa;
    use crate::kernels::linear::linear;
    use crate::kernels::weights::{Packed, Weight};
    use crate::kernels::Runtime;

    /// An int8-input 4-bit weight: `n` outputs, `k` inputs (the last block
    /// partial where `block` does not divide it), blocks of `block`, with
    /// zero points or symmetric.
    fn weight(n: usize, k: usize, block: usize, zeros: bool) -> Weight {
        let blocks = k.div_ceil(block);
        let data = (0..n * blocks * block / 2).map(|i| (i * 37 % 251) as u8).collect();
        let scales = (0..n * blocks).map(|i| 0.01 * (i % 7 + 1) as f32).collect();
        let zeros = zeros.then(|| (0..n * blocks.div_ceil(2)).map(|i| (i * 29 % 256) as u8).collect());
        Weight { n, k, packed: Packed::Q4 { data, scales, zeros, offsets: None, block, blocks, int8: true } }
            .into_tiled()
    }

    /// Pins the AMX path's bit-exactness with AVX-512 VNNI (and so with
    /// ONNX Runtime's integer path, which the VNNI kernel matches) where
    /// its own structure splits the work: more groups than one chunk (18
    /// records; 9 groups of two; 5 of four, the last partial, the images
    /// a chunk holds at their largest), the fewest rows that take tiles, row counts that leave a partial tile
    /// of rows (17, 33: a reconfiguration per pair), a last single weight
    /// tile and a partial one (40 outputs), symmetric and zero-point
    /// weights, one and two threads; every output written.
    #[test]
    fn tile_products_are_the_vnni_kernels_bits() {
        if !Isa::Avx512Amx.available() {
            eprintln!("no AMX here: the tile kernel is not tested on this machine");
            return;
        }
        let least = crate::kernels::tiled::AMX_MIN_ROWS;
        assert!(least <= 16, "the rows below reach the tile path");
        for (block, zeros) in [(32, false), (32, true), (64, false), (64, true), (128, false), (128, true)] {
            let w = weight(40, 576, block, zeros);
            for m in [least, 16, 17, 33] {
                let x: Vec<f32> =
                    (0..m * 576).map(|i| ((i * 7 % 19) as f32 - 9.0) * 0.11 + (i % 5) as f32 * 0.013).collect();
                for threads in [1, 2] {
                    let mut rt = Runtime::new(threads).unwrap();
                    let run = |isa: Isa, rt: &mut Runtime| {
                        rt.isa = isa;
                        let mut y = vec![f32::NAN; m * 40];
                        linear(&x, m, &w, None, &mut y, &rt.ctx());
                        y
                    };
                    let before = super::TILE_CALLS.load(std::sync::atomic::Ordering::Relaxed);
                    let tiles = run(Isa::Avx512Amx, &mut rt);
                    assert!(
                        super::TILE_CALLS.load(std::sync::atomic::Ordering::Relaxed) > before,
                        "m={m}: no tile call"
                    );
                    let vnni = run(Isa::Avx512Vnni, &mut rt);
                    assert!(
                        tiles.iter().all(|v| v.is_finite()),
                        "block {block} zeros {zeros} m={m}: an output unwritten"
                    );
                    let same = tiles.iter().zip(&vnni).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "block {block} zeros {zeros} m={m} threads {threads}: AMX and VNNI differ");
                }
            }
        }
    }
}
