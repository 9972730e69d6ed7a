//! One sequence's KV cache on the device: per layer a key and a value
//! buffer of `[capacity, kv_heads, head_dim]` f32, position-major so that
//! growing it keeps the prefix where it is. It grows in blocks of
//! [`KV_BLOCK`] positions when a step needs the room (never allocated at
//! full context), and what it holds is what it reports resident.

use std::sync::Arc;

use crate::device::{DBuf, Device};
use crate::error::CudaError;

/// Positions a cache grows by (what admission reserves in).
pub const KV_BLOCK: usize = 64;

pub(crate) struct SeqKv {
    device: Arc<Device>,
    /// `kv_heads * head_dim` of each layer.
    widths: Arc<Vec<usize>>,
    layers: Vec<(DBuf, DBuf)>,
    capacity: usize,
    len: usize,
    context: usize,
}

impl SeqKv {
    pub fn new(device: Arc<Device>, widths: Arc<Vec<usize>>, context: usize) -> Self {
        Self { device, widths, layers: Vec::new(), capacity: 0, len: 0, context }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Room for `positions` in all, grown in whole blocks; the positions
    /// held are copied over.
    pub fn reserve(&mut self, positions: usize) -> Result<(), CudaError> {
        if positions <= self.capacity {
            return Ok(());
        }
        let capacity = positions.div_ceil(KV_BLOCK) * KV_BLOCK;
        let capacity = capacity.min(self.context.max(positions));
        let mut layers = Vec::with_capacity(self.widths.len());
        for (l, width) in self.widths.iter().enumerate() {
            let bytes = capacity * width * 4;
            let (k, v) = (self.device.alloc_uncounted(bytes)?, self.device.alloc_uncounted(bytes)?);
            if let Some((old_k, old_v)) = self.layers.get(l) {
                let held = self.len * width * 4;
                self.device.copy(k.ptr(), old_k.ptr(), held)?;
                self.device.copy(v.ptr(), old_v.ptr(), held)?;
            }
            layers.push((k, v));
        }
        // The copies must finish before the old buffers are freed.
        self.device.sync()?;
        self.layers = layers;
        self.capacity = capacity;
        Ok(())
    }

    pub fn set_len(&mut self, len: usize) {
        self.len = len.min(self.capacity);
    }

    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn clear(&mut self) {
        self.len = 0;
        self.layers.clear();
        self.capacity = 0;
    }

    /// Device addresses of layer `l`'s key and value buffers.
    pub fn pointers(&self, l: usize) -> Option<(u64, u64)> {
        self.layers.get(l).map(|(k, v)| (k.ptr(), v.ptr()))
    }

    pub fn resident_bytes(&self) -> u64 {
        self.layers.iter().map(|(k, v)| (k.bytes() + v.bytes()) as u64).sum()
    }
}
