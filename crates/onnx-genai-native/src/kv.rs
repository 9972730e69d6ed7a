//! KV memory in blocks. A sequence holds the blocks its positions fill,
//! each covering [`BLOCK_TOKENS`] positions of every layer, taken from its
//! model's pool as it grows and given back when it shrinks or ends. A new
//! sequence therefore costs nothing until it runs, an idle one holds only
//! what it has filled, and `resident_bytes` is exactly the memory held.
//!
//! Inside a block, layer `l` keeps its keys as `[kv_heads, BLOCK_TOKENS,
//! head_dim]` followed by its values in the same layout, so one head's keys
//! for a block are one contiguous run that attention reads in order.

use std::sync::{Arc, Mutex};

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kernels::storage::HugeBuf;

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

/// One block's storage: at 16 sequences of SmolLM2 the blocks a decode
/// step reads no longer fit in the L3, and on 4 KiB pages every few rows of
/// a head cost a TLB miss; on huge pages (its whole 2 MiB pages, see
/// [`HugeBuf`]) attention at 16 sequences took 3.8-5.2 ms a step against
/// 4.6-6.6 (`examples/batch_profile`, alternating runs).
#[derive(Debug, Clone)]
pub enum Block {
    F32(HugeBuf<f32>),
    F16(HugeBuf<f16>),
}

/// The blocks of one model: new ones are allocated zeroed, returned ones are
/// kept (up to `keep` bytes) for the next sequence that grows.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    free: Mutex<Vec<Block>>,
    keep_blocks: usize,
}

impl KvPool {
    /// A pool that keeps up to `keep_bytes` of returned blocks for reuse.
    pub fn new(layout: KvLayout, keep_bytes: usize) -> Arc<Self> {
        let keep_blocks = keep_bytes / layout.block_bytes().max(1);
        Arc::new(Self { layout, free: Mutex::new(Vec::with_capacity(keep_blocks)), keep_blocks })
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn take(&self) -> Block {
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        reused.unwrap_or_else(|| {
            let n = self.layout.block_elems;
            if self.layout.f16 {
                Block::F16(HugeBuf::zeroed(n))
            } else {
                Block::F32(HugeBuf::zeroed(n))
            }
        })
    }

    fn give(&self, block: Block) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < self.keep_blocks {
            free.push(block);
        }
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
                (to, from) => *to = from.clone(),
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

    /// A block of at least one huge page starts on one and asked the OS
    /// for huge pages (where its THP mode allows the hint), f32 and f16
    /// alike; a smaller one asks nothing (a huge page would be mostly
    /// unused). Blocks start zeroed.
    #[test]
    fn large_blocks_live_on_huge_pages() {
        use crate::kernels::storage::HUGE_PAGE;
        for f16 in [false, true] {
            // 32 layers x 2 x 4 heads x 64 positions x 64 = 4 Mi elements.
            let pool = KvPool::new(KvLayout::new(&[(4, 64); 32], f16), 0);
            assert!(pool.layout().block_bytes() >= HUGE_PAGE);
            let block = pool.take();
            let (start, zero) = match &block {
                Block::F32(b) => (b.start(), b.as_slice().iter().all(|v| *v == 0.0)),
                Block::F16(b) => (b.start(), b.as_slice().iter().all(|v| *v == f16::ZERO)),
            };
            assert_eq!(start as usize % HUGE_PAGE, 0, "f16 {f16}: a block starts on a huge page");
            assert!(zero, "f16 {f16}: a new block is zeroed");
            if let Some(eligible) = crate::kernels::storage::thp_eligible(start) {
                assert!(eligible, "f16 {f16}: the block's mapping is not eligible for huge pages");
            }
            let small = KvPool::new(KvLayout::new(&[(2, 8)], f16), 0);
            let asked = match small.take() {
                Block::F32(b) => b.huge_pages_asked(),
                Block::F16(b) => b.huge_pages_asked(),
            };
            assert!(!asked, "f16 {f16}: a block smaller than a huge page asks for none");
        }
    }

    /// Blocks are taken as positions grow, given back on truncate and drop,
    /// reused by the next sequence, and resident bytes count exactly the
    /// blocks held.
    #[test]
    fn blocks_follow_the_positions_held() {
        let layout = KvLayout::new(&[(2, 4), (1, 8)], false);
        let per_block = layout.block_bytes();
        assert_eq!(per_block, 4 * 2 * BLOCK_TOKENS * (2 * 4 + 8));
        let pool = KvPool::new(layout, 16 * per_block);
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

    /// A fork holds the same positions and values in blocks of its own:
    /// writing one changes nothing in the other.
    #[test]
    fn a_fork_copies_the_cache() {
        let pool = KvPool::new(KvLayout::new(&[(1, 2)], false), 0);
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
        let pool = KvPool::new(KvLayout::new(&[(1, 2)], true), 0);
        let mut s = SeqKv::new(pool, 10);
        s.reserve(1);
        s.write(0, 0, 0, &[1.0 / 3.0, 2.0], &[-0.5, 65504.0]);
        let mut wide = Vec::new();
        let k = s.span(0, false, 0, 0, 1).widened(&mut wide).to_vec();
        assert_eq!(k, vec![f16::from_f32(1.0 / 3.0).to_f32(), 2.0]);
    }
}
