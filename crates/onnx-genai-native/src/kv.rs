//! KV memory in blocks. A sequence holds the blocks its positions fill,
//! each covering [`BLOCK_TOKENS`] positions of every layer, taken from its
//! model's pool as it grows and given back when it shrinks or ends. A new
//! sequence therefore costs nothing until it runs, an idle one holds only
//! what it has filled, and `resident_bytes` is the memory held, within
//! what huge pages add: blocks of half a huge page or more live in chunks
//! of whole huge pages (`Chunk`), and a write faults in the whole huge
//! page it lands in, so a chunk may also hold the rest of the huge pages
//! its held blocks touch (up to 2 MiB at each end of a run of them: a
//! neighbour not yet taken, or one given back) and at most 1/64 of itself
//! unused at its end. (Linux's khugepaged may also fold a split huge page
//! back whole, its freed part again resident as zeros.)
//!
//! Inside a block, layer `l` keeps its keys as `[kv_heads, BLOCK_TOKENS,
//! head_dim]` followed by its values in the same layout, so one head's keys
//! for a block are one contiguous run that attention reads in order.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kernels::storage::{HugeBuf, ZeroValid};

/// Positions per block.
pub const BLOCK_TOKENS: usize = 64;

/// Where each layer lives inside a block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Per layer: `(kv_heads, head_dim, offset)` in elements.
    layers: Vec<(usize, usize, usize)>,
    /// Elements per block.
    block_elems: usize,
    pub f16: bool,
}

impl KvLayout {
    /// `layers`: per layer `(kv_heads, head_dim)`.
    pub fn new(layers: &[(usize, usize)], f16: bool) -> Self {
        let mut offset = 0;
        let mut placed = Vec::with_capacity(layers.len());
        for &(kv_heads, head_dim) in layers {
            placed.push((kv_heads, head_dim, offset));
            offset += 2 * kv_heads * BLOCK_TOKENS * head_dim;
        }
        Self { layers: placed, block_elems: offset, f16 }
    }

    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// `(kv_heads, head_dim)` of layer `l`.
    pub fn geometry(&self, l: usize) -> Option<(usize, usize)> {
        self.layers.get(l).map(|(h, d, _)| (*h, *d))
    }

    fn elem_bytes(&self) -> usize {
        if self.f16 {
            2
        } else {
            4
        }
    }

    /// Bytes one block occupies.
    pub fn block_bytes(&self) -> usize {
        self.block_elems * self.elem_bytes()
    }

    /// Offset of `(layer, value?, head, row)` inside a block.
    fn at(&self, layer: usize, value: bool, head: usize, row: usize) -> usize {
        let (kv_heads, head_dim, base) = self.layers[layer];
        let half = kv_heads * BLOCK_TOKENS * head_dim;
        base + usize::from(value) * half + (head * BLOCK_TOKENS + row) * head_dim
    }
}

/// One block's storage: its part of a `Chunk`. At 16 sequences of
/// SmolLM2 the blocks a decode step reads no longer fit in the L3, and on 4
/// KiB pages every few rows of a head cost a TLB miss; on huge pages (see
/// [`HugeBuf`]) attention at 16 sequences took 3.8-5.2 ms a step against
/// 4.6-6.6 (`examples/batch_profile`, alternating runs).
#[derive(Debug)]
pub enum Block {
    F32(Region<f32>),
    F16(Region<f16>),
}

/// Several blocks in one allocation (private to this module: its buffer is
/// reached only through its regions). A block rarely fills whole huge pages
/// (SmolLM2's f32 block is 2.8125 MiB: alone, its last 0.8 MiB lay on 4
/// KiB pages, and the attention of the layers stored there took 160-200 us
/// a step at 16 sequences against 130-140 for the rest); a chunk of
/// `blocks_per_chunk` of them does (7 of those fill 10 huge pages but
/// 0.3 MiB, advised whole).
#[derive(Debug)]
pub(crate) struct Chunk<T: ZeroValid> {
    buf: HugeBuf<T>,
    block_elems: usize,
}

/// Block `index` of a chunk. Each index of a chunk is made once, when the
/// chunk is, and a `Region` is neither `Clone` nor `Copy`: whoever holds it
/// is the only one who can reach its part.
#[derive(Debug)]
pub struct Region<T: ZeroValid> {
    chunk: Arc<Chunk<T>>,
    index: usize,
}

impl<T: ZeroValid> Region<T> {
    /// A new chunk of `blocks` blocks of `block_elems` values (`None`: one
    /// block, advised as [`HugeBuf::zeroed`] advises): its first block, and
    /// the others last to second (so that popping them hands blocks out in
    /// address order).
    fn carve(blocks: Option<usize>, block_elems: usize) -> (Self, Vec<Self>) {
        let (buf, blocks) = match blocks {
            Some(n) if n > 0 => (HugeBuf::zeroed_whole_pages(n * block_elems), n),
            _ => (HugeBuf::zeroed(block_elems), 1),
        };
        let chunk = Arc::new(Chunk { buf, block_elems });
        let rest = (1..blocks).rev().map(|index| Self { chunk: chunk.clone(), index }).collect();
        (Self { chunk, index: 0 }, rest)
    }

    fn first(&self) -> *mut T {
        // SAFETY: `index < blocks`, so the offset stays inside the chunk's
        // buffer.
        unsafe { self.chunk.buf.base().add(self.index * self.chunk.block_elems) }
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the part lies inside the chunk's buffer (`first`), which
        // lives as long as this region's `Arc`; no other region covers it
        // and the chunk makes no slice of its whole buffer, so nothing
        // writes it while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.first(), self.chunk.block_elems) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only
        // reference to the part.
        unsafe { std::slice::from_raw_parts_mut(self.first(), self.chunk.block_elems) }
    }
}

impl<T: ZeroValid> Drop for Region<T> {
    /// A block dropped while its chunk lives on (other blocks in use, or
    /// never taken) gives back the pages wholly inside it now, so what a
    /// pool holds stays what it counts; the last one frees the chunk with
    /// it. (A huge page it shares with a neighbour is split by that, and
    /// the neighbour's part of it then lies on 4 KiB pages: blocks are
    /// dropped only past what the pool keeps, which a server serving a
    /// steady load does not reach.)
    fn drop(&mut self) {
        if Arc::strong_count(&self.chunk) > 1 {
            let bytes = self.chunk.block_elems * std::mem::size_of::<T>();
            // SAFETY: the part lies in the chunk's live buffer, this
            // region is its only holder and is going away, so nothing
            // reads what it held.
            unsafe { crate::kernels::storage::release_pages(self.first().cast(), bytes) };
        }
    }
}

/// Blocks a chunk holds where chunks pay: the fewest (up to 32) whose
/// total, rounded up to whole huge pages, leaves at most 1/64 of them
/// unused. `None` where no count does, and for blocks under half a huge
/// page: the first write to a chunk faults in a whole huge page, which
/// for a small block would be mostly memory no sequence counts (such a
/// pool allocates one block at a time, advising only its whole huge pages,
/// as [`HugeBuf::zeroed`] does).
fn blocks_per_chunk(block_bytes: usize) -> Option<usize> {
    use crate::kernels::storage::HUGE_PAGE;
    if block_bytes < HUGE_PAGE / 2 {
        return None;
    }
    (1..=32).find(|&n| {
        let Some(total) = block_bytes.checked_mul(n) else { return false };
        let Some(rounded) = total.checked_next_multiple_of(HUGE_PAGE) else { return false };
        rounded - total <= rounded / 64
    })
}

/// The blocks of one model. Returned blocks are kept for the next sequence
/// that grows: up to `keep` bytes for good, and any more until they have
/// lain unused for the pool's `linger` (the most recently returned are
/// taken first, so what a steady load keeps reusing stays and what a past
/// burst left ages out: a block taken or given back, or a server that
/// goes idle, releases those that have). Blocks of a chunk not yet used wait in `fresh`
/// (never touched, so not resident); a new chunk is made only when both
/// are empty.
///
/// Why keep more than `keep`: a block a sequence grows into costs the
/// faults of its pages, and on a VM whose balloon driver reports free
/// memory to its host (Firecracker's free page reporting, in 2 MiB
/// blocks) memory freed and touched again seconds later took 4.4-6.2 ms
/// a huge page to fault, against 0.17 ms when touched again at once
/// (2026-12-07, Zen 4): at 16 SmolLM2 sequences, whose blocks (2.8 MiB
/// each) a 64 MiB keep cannot hold between rounds of requests, a served
/// decode step took 13.0-13.4 ms against 9.4-9.5 with the blocks kept.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    free: Mutex<Vec<Kept>>,
    fresh: Mutex<Vec<Block>>,
    keep_blocks: usize,
    linger: Duration,
    chunk_blocks: Option<usize>,
}

/// A returned block and when it was returned.
#[derive(Debug)]
struct Kept {
    block: Block,
    since: Instant,
}

impl KvPool {
    /// A pool that keeps up to `keep_bytes` of returned blocks for reuse,
    /// and any more for `linger` after their return.
    pub fn new(layout: KvLayout, keep_bytes: usize, linger: Duration) -> Arc<Self> {
        let keep_blocks = keep_bytes / layout.block_bytes().max(1);
        let chunk_blocks = blocks_per_chunk(layout.block_bytes());
        Arc::new(Self {
            layout,
            free: Mutex::new(Vec::with_capacity(keep_blocks)),
            fresh: Mutex::new(Vec::new()),
            keep_blocks,
            linger,
            chunk_blocks,
        })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Blocks one chunk of this pool holds (1: blocks are allocated one
    /// at a time).
    pub fn chunk_blocks(&self) -> usize {
        self.chunk_blocks.unwrap_or(1)
    }

    fn take(&self) -> Block {
        self.take_at(Instant::now)
    }

    /// `take`, the time read by `now` once the free list is locked (so
    /// blocks given back from several threads still lie in time order).
    fn take_at(&self, now: impl FnOnce() -> Instant) -> Block {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let kept = free.pop();
        let now = now();
        self.release_stale(&mut free, now);
        drop(free);
        if let Some(kept) = kept {
            return kept.block;
        }
        let mut fresh = self.fresh.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = fresh.pop() {
            return b;
        }
        let (n, elems) = (self.chunk_blocks, self.layout.block_elems);
        if self.layout.f16 {
            let (first, rest) = Region::carve(n, elems);
            fresh.extend(rest.into_iter().map(Block::F16));
            Block::F16(first)
        } else {
            let (first, rest) = Region::carve(n, elems);
            fresh.extend(rest.into_iter().map(Block::F32));
            Block::F32(first)
        }
    }

    fn give(&self, block: Block) {
        self.give_at(block, Instant::now);
    }

    /// `give`, the time read as in [`KvPool::take_at`].
    fn give_at(&self, block: Block, now: impl FnOnce() -> Instant) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let now = now();
        free.push(Kept { block, since: now });
        self.release_stale(&mut free, now);
    }

    /// Releases the returned blocks past the pool's keep that have lain
    /// unused for its linger, and says how long until the next one will
    /// have (`None`: no block past the keep). A server calls this while
    /// idle, so a past burst's blocks do not stay for good.
    pub fn release_expired(&self) -> Option<Duration> {
        self.release_expired_at(Instant::now)
    }

    /// `release_expired`, the time read as in [`KvPool::take_at`].
    fn release_expired_at(&self, now: impl FnOnce() -> Instant) -> Option<Duration> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let now = now();
        self.release_stale(&mut free, now);
        (free.len() > self.keep_blocks)
            .then(|| free.first().map(|k| self.linger.saturating_sub(now.saturating_duration_since(k.since))))
            .flatten()
    }

    /// Frees the blocks of `free` past `keep_blocks` returned at least
    /// `linger` before `now`: the oldest ones, at its bottom (blocks are
    /// pushed as they return and taken from the top). Freed under the
    /// lock: gathering them to free after it would allocate, here on a
    /// decode step's way (a sequence growing), and a block lingers out
    /// seldom.
    fn release_stale(&self, free: &mut Vec<Kept>, now: Instant) {
        let spare = free.len().saturating_sub(self.keep_blocks);
        let stale = free[..spare].iter().take_while(|k| now.saturating_duration_since(k.since) >= self.linger).count();
        free.drain(..stale).for_each(drop);
    }

    /// Bytes of returned blocks kept for reuse.
    pub fn idle_bytes(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len() * self.layout.block_bytes()
    }
}

/// One sequence's KV cache.
#[derive(Debug)]
pub struct SeqKv {
    pool: Arc<KvPool>,
    blocks: Vec<Block>,
    /// Positions written and kept.
    len: usize,
}

/// A run of one head's keys or values, as stored.
pub enum Span<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl<'a> Span<'a> {
    /// Starts fetching the elements into the cache (a hint).
    pub fn prefetch(&self) {
        match self {
            Span::F32(v) => crate::kernels::simd::prefetch(v),
            Span::F16(v) => crate::kernels::simd::prefetch(v),
        }
    }

    /// The elements, to fetch in step with another loop.
    pub fn alongside(&self) -> crate::kernels::simd::Alongside {
        match self {
            Span::F32(v) => crate::kernels::simd::Alongside::of(v),
            Span::F16(v) => crate::kernels::simd::Alongside::of(v),
        }
    }

    /// The elements as f32: borrowed, or widened into `wide` (the tests'
    /// view; attention widens as it reads, `KvElem`).
    #[cfg(test)]
    pub fn widened(self, wide: &'a mut Vec<f32>) -> &'a [f32] {
        match self {
            Span::F32(v) => v,
            Span::F16(v) => {
                wide.clear();
                wide.resize(v.len(), 0.0);
                v.convert_to_f32_slice(wide);
                wide
            }
        }
    }
}

impl SeqKv {
    /// An empty cache for up to `max_positions` positions (nothing is
    /// allocated but the block list).
    pub fn new(pool: Arc<KvPool>, max_positions: usize) -> Self {
        Self { pool, blocks: Vec::with_capacity(max_positions.div_ceil(BLOCK_TOKENS)), len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn layout(&self) -> &KvLayout {
        &self.pool.layout
    }

    /// Makes room for `positions` positions in all (taking blocks).
    pub fn reserve(&mut self, positions: usize) {
        while self.blocks.len() * BLOCK_TOKENS < positions {
            let b = self.pool.take();
            self.blocks.push(b);
        }
    }

    /// Marks `len` positions as written (they must be reserved).
    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.blocks.len() * BLOCK_TOKENS);
    }

    /// Keeps the first `len` positions and gives back the blocks past them.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        let keep = self.len.div_ceil(BLOCK_TOKENS);
        while self.blocks.len() > keep {
            if let Some(b) = self.blocks.pop() {
                self.pool.give(b);
            }
        }
    }

    /// A copy of this cache in blocks of its own.
    pub fn fork(&self) -> SeqKv {
        let mut copy = SeqKv::new(self.pool.clone(), self.blocks.capacity() * BLOCK_TOKENS);
        for block in &self.blocks {
            let mut mine = self.pool.take();
            match (&mut mine, block) {
                (Block::F32(to), Block::F32(from)) => to.as_mut_slice().copy_from_slice(from.as_slice()),
                (Block::F16(to), Block::F16(from)) => to.as_mut_slice().copy_from_slice(from.as_slice()),
                // One pool makes one kind of block.
                (Block::F32(_), Block::F16(_)) | (Block::F16(_), Block::F32(_)) => {}
            }
            copy.blocks.push(mine);
        }
        copy.len = self.len;
        copy
    }

    /// Bytes of the blocks this sequence holds.
    pub fn resident_bytes(&self) -> usize {
        self.blocks.len() * self.pool.layout.block_bytes()
    }

    /// Writes position `pos` of `layer`'s `head`: its key and value rows
    /// (rounded to f16 for an f16 cache). The position must be reserved.
    pub fn write(&mut self, layer: usize, head: usize, pos: usize, key: &[f32], value: &[f32]) {
        let (b, row) = (pos / BLOCK_TOKENS, pos % BLOCK_TOKENS);
        let layout = &self.pool.layout;
        let (k_at, v_at) = (layout.at(layer, false, head, row), layout.at(layer, true, head, row));
        let Some(block) = self.blocks.get_mut(b) else { return };
        match block {
            Block::F32(data) => {
                let data = data.as_mut_slice();
                data[k_at..k_at + key.len()].copy_from_slice(key);
                data[v_at..v_at + value.len()].copy_from_slice(value);
            }
            Block::F16(data) => {
                let data = data.as_mut_slice();
                data[k_at..k_at + key.len()].convert_from_f32_slice(key);
                data[v_at..v_at + value.len()].convert_from_f32_slice(value);
            }
        }
    }

    /// The first `rows` keys (at most a block's) of `layer`'s first KV
    /// head, where an attention job on this sequence starts reading
    /// (nothing if it holds no block, or the layer no head).
    pub fn first_keys(&self, layer: usize, rows: usize) -> crate::kernels::simd::Alongside {
        let heads = self.pool.layout.geometry(layer).map_or(0, |(h, _)| h);
        match self.blocks.first() {
            Some(_) if heads > 0 => self.span(layer, false, 0, 0, rows.min(BLOCK_TOKENS)).alongside(),
            _ => crate::kernels::simd::Alongside::NONE,
        }
    }

    /// The first `rows` positions of block `b` of `layer`'s `head`: keys
    /// (`value == false`) or values, `rows * head_dim` elements.
    pub fn span(&self, layer: usize, value: bool, head: usize, b: usize, rows: usize) -> Span<'_> {
        let layout = &self.pool.layout;
        let hd = layout.layers[layer].1;
        let at = layout.at(layer, value, head, 0);
        match &self.blocks[b] {
            Block::F32(data) => Span::F32(&data.as_slice()[at..at + rows * hd]),
            Block::F16(data) => Span::F16(&data.as_slice()[at..at + rows * hd]),
        }
    }
}

impl Drop for SeqKv {
    fn drop(&mut self) {
        for b in self.blocks.drain(..) {
            self.pool.give(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk of large blocks starts on a huge page and asked the OS for
    /// huge pages over every block, the last byte of each included (where
    /// its THP mode allows the hint), f32 and f16 alike: SmolLM2's blocks
    /// (2.8125 and 1.40625 MiB, 7 a chunk) and ones of exactly 8 and 4 MiB
    /// (one a chunk). A block mapped alone left its tail past the last
    /// whole huge page on 4 KiB pages. Small blocks (here 8 KiB) ask
    /// nothing: a huge page would be mostly unused. Blocks start zeroed and
    /// do not overlap.
    #[test]
    fn large_blocks_live_on_huge_pages() {
        use crate::kernels::storage::{thp_eligible, HUGE_PAGE};
        let bytes_of = |b: &Block| match b {
            Block::F32(r) => (r.as_slice().as_ptr().cast::<u8>(), std::mem::size_of_val(r.as_slice())),
            Block::F16(r) => (r.as_slice().as_ptr().cast::<u8>(), std::mem::size_of_val(r.as_slice())),
        };
        for f16 in [false, true] {
            for (layers, heads, chunk) in [(30, 3, 7), (32, 4, 1)] {
                let pool = KvPool::new(KvLayout::new(&vec![(heads, 64); layers], f16), 0, Duration::ZERO);
                assert_eq!(pool.chunk_blocks(), chunk, "f16 {f16}, {layers} layers x {heads} heads");
                let blocks: Vec<Block> = (0..chunk).map(|_| pool.take()).collect();
                let (first, size) = bytes_of(&blocks[0]);
                assert_eq!(size, pool.layout().block_bytes());
                assert_eq!(first as usize % HUGE_PAGE, 0, "f16 {f16}: a chunk starts on a huge page");
                for (i, b) in blocks.iter().enumerate() {
                    let (at, _) = bytes_of(b);
                    assert_eq!(at as usize, first as usize + i * size, "f16 {f16}: block {i} follows the one before");
                    let zero = match b {
                        Block::F32(r) => r.as_slice().iter().all(|v| *v == 0.0),
                        Block::F16(r) => r.as_slice().iter().all(|v| *v == f16::ZERO),
                    };
                    assert!(zero, "f16 {f16}: a new block is zeroed");
                    for byte in [at, at.wrapping_add(size - 1)] {
                        if let Some(eligible) = thp_eligible(byte) {
                            assert!(eligible, "f16 {f16}: block {i} at {byte:?} is not eligible for huge pages");
                        }
                    }
                }
            }
            let small = KvPool::new(KvLayout::new(&[(2, 8)], f16), 0, Duration::ZERO);
            assert_eq!((small.chunk_blocks(), blocks_per_chunk(small.layout().block_bytes())), (1, None));
            let asked = match small.take() {
                Block::F32(r) => r.chunk.buf.huge_pages_asked(),
                Block::F16(r) => r.chunk.buf.huge_pages_asked(),
            };
            assert!(!asked, "f16 {f16}: a block smaller than a huge page asks for none");
        }
    }

    /// A block given back past what the pool keeps releases the pages
    /// wholly inside it at once, while its chunk lives on for the other
    /// blocks, and changes no byte of its neighbours: SmolLM2's blocks
    /// (whole 4 KiB pages) and blocks of 1,068,032 bytes, which begin and
    /// end inside pages they share with the blocks beside them. (Pages
    /// counted with `mincore`; nothing to observe off Linux.)
    #[test]
    fn a_dropped_block_gives_its_memory_back() {
        use crate::kernels::storage::resident_pages;
        for layout in [KvLayout::new(&[(3, 64); 30], false), KvLayout::new(&[(1, 2086)], false)] {
            let pool = KvPool::new(layout, 0, Duration::ZERO);
            assert!(pool.chunk_blocks() > 3, "{} bytes a block", pool.layout().block_bytes());
            let mut seqs: Vec<SeqKv> = (0..3).map(|_| SeqKv::new(pool.clone(), 1000)).collect();
            let mut parts = Vec::new();
            for (i, s) in seqs.iter_mut().enumerate() {
                s.reserve(1);
                let Block::F32(r) = &mut s.blocks[0] else { panic!("an f32 pool") };
                r.as_mut_slice().fill(i as f32 + 1.0);
                parts.push((r.as_slice().as_ptr().cast::<u8>(), std::mem::size_of_val(r.as_slice())));
            }
            assert_eq!(parts[1].0 as usize, parts[0].0 as usize + parts[0].1, "blocks lie side by side");
            let (at, bytes) = parts[1];
            let Some((held, pages)) = resident_pages(at, bytes) else { return };
            assert_eq!(held, pages, "a written block is resident");
            drop(seqs.remove(1));
            let (left, _) = resident_pages(at, bytes).unwrap_or((pages, pages));
            assert_eq!(left, 0, "{left} of the dropped block's {pages} pages are still resident");
            for (s, value) in seqs.iter().zip([1.0, 3.0]) {
                let Block::F32(r) = &s.blocks[0] else { panic!("an f32 pool") };
                assert!(r.as_slice().iter().all(|v| *v == value), "a neighbour of the dropped block lost values");
            }
        }
    }

    /// A chunk is the fewest blocks that fill whole huge pages to within
    /// 1/64, or there is none (blocks under half a huge page never chunk).
    #[test]
    fn chunks_waste_at_most_a_64th() {
        let mib = 1 << 20;
        assert_eq!(blocks_per_chunk(3 * mib / 2), Some(4), "6 MiB exactly");
        assert_eq!(blocks_per_chunk(2 * mib), Some(1));
        assert_eq!(blocks_per_chunk(2 * mib - 1024), Some(1), "1 KiB of 2 MiB unused");
        assert_eq!(blocks_per_chunk(2 * mib + 1024), None, "up to 32 blocks, each count leaves more than 1/64 unused");
        assert_eq!(blocks_per_chunk(mib - 512), None, "under half a huge page: one block at a time");
        assert_eq!(blocks_per_chunk(100 << 10), None, "a small block");
        assert_eq!(blocks_per_chunk(0), None);
    }

    /// Blocks are taken as positions grow, given back on truncate and drop,
    /// reused by the next sequence, and resident bytes count exactly the
    /// blocks held.
    #[test]
    fn blocks_follow_the_positions_held() {
        let layout = KvLayout::new(&[(2, 4), (1, 8)], false);
        let per_block = layout.block_bytes();
        assert_eq!(per_block, 4 * 2 * BLOCK_TOKENS * (2 * 4 + 8));
        let pool = KvPool::new(layout, 16 * per_block, Duration::ZERO);
        let mut a = SeqKv::new(pool.clone(), 1000);
        assert_eq!(a.resident_bytes(), 0);
        a.reserve(BLOCK_TOKENS + 1);
        assert_eq!(a.resident_bytes(), 2 * per_block);
        a.write(1, 0, BLOCK_TOKENS, &[1.0; 8], &[2.0; 8]);
        a.set_len(BLOCK_TOKENS + 1);
        let mut wide = Vec::new();
        let Span::F32(k) = a.span(1, false, 0, 1, 1) else { panic!("f32 cache") };
        assert_eq!(k, &[1.0; 8]);
        assert_eq!(a.span(1, true, 0, 1, 1).widened(&mut wide), &[2.0; 8]);
        a.truncate(3);
        assert_eq!((a.len(), a.resident_bytes()), (3, per_block));
        assert_eq!(pool.idle_bytes(), per_block);
        drop(a);
        assert_eq!(pool.idle_bytes(), 2 * per_block);
        let mut b = SeqKv::new(pool.clone(), 1000);
        b.reserve(1);
        assert_eq!(pool.idle_bytes(), per_block, "a returned block is reused");
    }

    /// Returned blocks past the pool's keep stay for its linger, and a
    /// growing sequence takes the most recently returned first; once one
    /// has lain unused for the linger, the next block taken or given back,
    /// or `release_expired`, frees it (the oldest first), down to the keep,
    /// which stays for good. `release_expired` says how long until the
    /// next one ages out, and `None` once nothing past the keep is left.
    #[test]
    fn blocks_past_the_keep_linger_then_go() {
        let layout = KvLayout::new(&[(2, 4)], false);
        let per_block = layout.block_bytes();
        let pool = KvPool::new(layout, 2 * per_block, Duration::from_secs(10));
        let at = |b: &Block| match b {
            Block::F32(r) => r.as_slice().as_ptr() as usize,
            Block::F16(r) => r.as_slice().as_ptr() as usize,
        };
        let t0 = Instant::now();
        let secs = |s: f64| t0 + Duration::from_secs_f64(s);
        let blocks: Vec<Block> = (0..5).map(|_| pool.take()).collect();
        let addresses: Vec<usize> = blocks.iter().map(at).collect();
        for (i, b) in blocks.into_iter().enumerate() {
            pool.give_at(b, || secs(i as f64));
        }
        assert_eq!(pool.idle_bytes(), 5 * per_block, "blocks past the keep are kept while they linger");
        let again = pool.take_at(|| secs(4.0));
        assert_eq!(at(&again), addresses[4], "the most recently returned block is reused first");
        pool.give_at(again, || secs(4.0));
        assert_eq!(pool.release_expired_at(|| secs(9.0)), Some(Duration::from_secs(1)));
        assert_eq!(pool.idle_bytes(), 5 * per_block, "none has lain unused for the linger yet");
        assert_eq!(pool.release_expired_at(|| secs(10.0)), Some(Duration::from_secs(1)));
        assert_eq!(pool.idle_bytes(), 4 * per_block, "the one returned at 0 s is freed once it has lain 10 s");
        assert_eq!(pool.release_expired_at(|| secs(11.5)), Some(Duration::from_secs_f64(0.5)));
        assert_eq!(pool.idle_bytes(), 3 * per_block, "the two returned at 0 s and 1 s are freed");
        let grown = pool.take_at(|| secs(12.0));
        assert_eq!(at(&grown), addresses[4]);
        pool.give_at(grown, || secs(13.0));
        assert_eq!(pool.idle_bytes(), 2 * per_block, "a block given back frees the one that aged out meanwhile");
        let held = |pool: &KvPool| -> Vec<usize> {
            pool.free.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|k| at(&k.block)).collect()
        };
        // The two kept and three new blocks out at 20 s; back at 20 s and 25 s.
        let mut out: Vec<Block> = (0..5).map(|_| pool.take_at(|| secs(20.0))).collect();
        let out_at: Vec<usize> = out.iter().map(at).collect();
        let late = out.split_off(2);
        for b in out {
            pool.give_at(b, || secs(20.0));
        }
        for b in late {
            pool.give_at(b, || secs(25.0));
        }
        assert_eq!(pool.idle_bytes(), 5 * per_block);
        let taken = pool.take_at(|| secs(31.0));
        assert_eq!(at(&taken), out_at[4]);
        assert_eq!(held(&pool), out_at[2..4], "a block taken frees the ones that aged out, down to the keep");
        pool.give_at(taken, || secs(31.0));
        assert_eq!(pool.release_expired_at(|| secs(100.0)), None);
        assert_eq!(held(&pool), out_at[3..5], "the keep holds the most recently returned blocks for good");
    }

    /// A fork holds the same positions and values in blocks of its own:
    /// writing one changes nothing in the other.
    #[test]
    fn a_fork_copies_the_cache() {
        let pool = KvPool::new(KvLayout::new(&[(1, 2)], false), 0, Duration::ZERO);
        let mut a = SeqKv::new(pool, 100);
        a.reserve(BLOCK_TOKENS + 2);
        a.write(0, 0, BLOCK_TOKENS + 1, &[1.0, 2.0], &[3.0, 4.0]);
        a.set_len(BLOCK_TOKENS + 2);
        let mut b = a.fork();
        assert_eq!((b.len(), b.resident_bytes()), (a.len(), a.resident_bytes()));
        let Span::F32(k) = b.span(0, false, 0, 1, 2) else { panic!("f32 cache") };
        assert_eq!(k[2..], [1.0, 2.0]);
        b.write(0, 0, BLOCK_TOKENS + 1, &[9.0, 9.0], &[9.0, 9.0]);
        let Span::F32(k) = a.span(0, false, 0, 1, 2) else { panic!("f32 cache") };
        assert_eq!(k[2..], [1.0, 2.0], "the original is untouched");
    }

    /// An f16 cache rounds on write and widens on read.
    #[test]
    fn f16_blocks_round_and_widen() {
        let pool = KvPool::new(KvLayout::new(&[(1, 2)], true), 0, Duration::ZERO);
        let mut s = SeqKv::new(pool, 10);
        s.reserve(1);
        s.write(0, 0, 0, &[1.0 / 3.0, 2.0], &[-0.5, 65504.0]);
        let mut wide = Vec::new();
        let k = s.span(0, false, 0, 0, 1).widened(&mut wide).to_vec();
        assert_eq!(k, vec![f16::from_f32(1.0 / 3.0).to_f32(), 2.0]);
    }
}
