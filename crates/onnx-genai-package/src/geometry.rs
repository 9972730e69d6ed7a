//! KV geometry: the one place that computes KV bytes per token.

use crate::manifest::{ElementType, Manifest};

/// One layer's KV tensor shape (per token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKv {
    pub kv_heads: u32,
    pub head_dim: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    pub dtype: ElementType,
    pub layers: Vec<LayerKv>,
}

impl KvGeometry {
    /// The geometry a manifest declares, or `None` when it declares no KV
    /// cache (unknown geometry: admission reserves nothing for it).
    pub fn from_manifest(m: &Manifest) -> Option<Self> {
        let kv = m.kv_cache.as_ref()?;
        let layers = match &kv.layers {
            Some(layers) => layers.iter().map(|l| LayerKv { kv_heads: l.kv_heads, head_dim: l.head_dim }).collect(),
            None => {
                let a = &m.architecture;
                vec![LayerKv { kv_heads: a.num_kv_heads, head_dim: a.head_dim }; a.num_layers as usize]
            }
        };
        Some(Self { dtype: kv.dtype, layers })
    }

    /// The geometry of bound KV ports (their shapes) with every value
    /// stored as `dtype`: what a backend keeps per position, which may be
    /// narrower or wider than the manifest declares.
    pub fn from_ports(dtype: ElementType, ports: &[crate::KvPorts]) -> Self {
        let layers = ports.iter().map(|p| LayerKv { kv_heads: p.kv_heads as u32, head_dim: p.head_dim as u32 });
        Self { dtype, layers: layers.collect() }
    }

    /// Bytes one token occupies across every layer's key and value tensors:
    /// `sum over layers of 2 * kv_heads * head_dim * dtype_bytes`.
    /// Saturates rather than wraps: validation bounds the sizes so that it
    /// never needs to, but a figure admission trusts must never come out small.
    pub fn bytes_per_token(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| {
                (2 * u64::from(l.kv_heads))
                    .saturating_mul(u64::from(l.head_dim))
                    .saturating_mul(self.dtype.size_bytes())
            })
            .fold(0u64, u64::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_token_is_two_times_layers_heads_dim_dtype() {
        let g = KvGeometry { dtype: ElementType::F16, layers: vec![LayerKv { kv_heads: 3, head_dim: 64 }; 30] };
        assert_eq!(g.bytes_per_token(), 2 * 30 * 3 * 64 * 2);
    }

    #[test]
    fn layers_that_differ_are_summed() {
        let g = KvGeometry {
            dtype: ElementType::F32,
            layers: vec![LayerKv { kv_heads: 2, head_dim: 16 }, LayerKv { kv_heads: 1, head_dim: 8 }],
        };
        assert_eq!(g.bytes_per_token(), 2 * (2 * 16 + 8) * 4);
    }
}
