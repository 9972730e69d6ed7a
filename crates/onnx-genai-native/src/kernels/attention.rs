//! Causal attention over an in-place KV cache. Each layer's cache is
//! preallocated as `[kv_heads, capacity, head_dim]`; a step writes only its
//! new rows and reads the past where it lies, so the cost of a decode step
//! never includes copying the whole past (what a `Concat(past, new)` graph
//! does).

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::math::softmax_row;
use super::simd::{scores as scores_of, weighted_sum};
use crate::value::Value;

#[derive(Clone, Debug)]
pub enum KvStore {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl KvStore {
    fn write(&mut self, at: usize, row: &[f32]) {
        match self {
            KvStore::F32(v) => v[at..at + row.len()].copy_from_slice(row),
            KvStore::F16(v) => v[at..at + row.len()].convert_from_f32_slice(row),
        }
    }

    /// Elements `range` as f32: borrowed, or widened from f16 into `wide`.
    fn span<'a>(&'a self, range: std::ops::Range<usize>, wide: &'a mut Vec<f32>) -> &'a [f32] {
        match self {
            KvStore::F32(v) => &v[range],
            KvStore::F16(v) => {
                wide.resize(range.len(), 0.0);
                v[range].convert_to_f32_slice(wide);
                wide
            }
        }
    }
}

/// One layer's key and value cache.
#[derive(Clone, Debug)]
pub struct LayerCache {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub capacity: usize,
    pub key: KvStore,
    pub value: KvStore,
}

impl LayerCache {
    pub fn new(kv_heads: usize, head_dim: usize, capacity: usize, half: bool) -> Self {
        let n = kv_heads * capacity * head_dim;
        let store = || if half { KvStore::F16(vec![f16::ZERO; n]) } else { KvStore::F32(vec![0.0; n]) };
        Self { kv_heads, head_dim, capacity, key: store(), value: store() }
    }

    fn offset(&self, head: usize, pos: usize) -> usize {
        (head * self.capacity + pos) * self.head_dim
    }

    /// Memory the two stores hold (measured from the buffers; the KV
    /// geometry is where bytes per token are defined).
    pub fn allocated_bytes(&self) -> usize {
        [&self.key, &self.value]
            .iter()
            .map(|s| match s {
                KvStore::F32(v) => std::mem::size_of_val(v.as_slice()),
                KvStore::F16(v) => std::mem::size_of_val(v.as_slice()),
            })
            .sum()
    }
}

/// How a tensor's `[heads, seq, dim]` elements are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[batch, heads, seq, dim]`.
    HeadsFirst,
    /// `[batch, seq, heads * dim]` (also `[batch, seq, heads, dim]`).
    SeqFirst,
}

impl Layout {
    fn index(self, heads: usize, seq: usize, dim: usize, h: usize, t: usize) -> usize {
        match self {
            Layout::HeadsFirst => (h * seq + t) * dim,
            Layout::SeqFirst => (t * heads + h) * dim,
        }
    }

    /// The sequence length of a tensor in this layout.
    pub fn seq_len(self, shape: &[usize], heads: usize, dim: usize) -> Result<usize, String> {
        let bad = || format!("shape {shape:?} is not a batch-1 {self:?} tensor of {heads} heads x {dim}");
        let n: usize = shape.iter().product();
        if shape.first() != Some(&1) || !n.is_multiple_of(heads * dim) {
            return Err(bad());
        }
        let seq = n / (heads * dim);
        let ok = match (self, shape.len()) {
            (Layout::HeadsFirst, 4) => shape[1] == heads && shape[3] == dim,
            (Layout::SeqFirst, 3) => shape[2] == heads * dim,
            (Layout::SeqFirst, 4) => shape[2] == heads && shape[3] == dim,
            _ => false,
        };
        if ok {
            Ok(seq)
        } else {
            Err(bad())
        }
    }
}

/// How an additive bias, if any, maps onto `[head, query, key]` scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bias {
    /// No bias input: the kernel applies the causal mask itself.
    Causal,
    /// `[.., 1 | heads, seq, total]`.
    PerQuery,
    /// The GQA-grouped form `[.., 1 | kv_heads, n_rep * seq, total]`: query
    /// heads of a group are stacked along the row axis.
    Grouped,
}

#[derive(Clone, Debug)]
pub struct AttentionSpec {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub q_layout: Layout,
    pub kv_layout: Layout,
    pub out_layout: Layout,
    pub bias: Bias,
}

const PARALLEL_MIN_MACS: usize = 1 << 14;

/// The tensors one attention step reads: the new tokens' query, key and
/// value, and the additive bias if the form has one.
pub struct AttentionInputs<'a> {
    pub q: &'a Value,
    pub k: &'a Value,
    pub v: &'a Value,
    pub bias: Option<&'a Value>,
    /// Where long contexts may run in parallel (`None`: on this thread).
    pub pool: super::linear::Pool<'a>,
}

/// Appends `k`/`v` (the new tokens) at `past` in `cache`, then attends every
/// query of `q` over positions `0..past + seq`. Writes `out` in
/// `spec.out_layout`.
pub fn attention(
    spec: &AttentionSpec,
    cache: &mut LayerCache,
    past: usize,
    inputs: AttentionInputs,
    out: &mut Value,
) -> Result<(), String> {
    let AttentionInputs { q, k, v, bias, pool } = inputs;
    let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
    if cache.kv_heads != kvh || cache.head_dim != hd {
        return Err(format!(
            "KV cache holds {} heads x {}, the attention needs {kvh} x {hd}",
            cache.kv_heads, cache.head_dim
        ));
    }
    let seq = spec.q_layout.seq_len(&q.shape, heads, hd).map_err(|e| format!("query: {e}"))?;
    for (name, t) in [("key", k), ("value", v)] {
        let s = spec.kv_layout.seq_len(&t.shape, kvh, hd).map_err(|e| format!("{name}: {e}"))?;
        if s != seq {
            return Err(format!("{name} has {s} new positions, the query {seq}"));
        }
    }
    let total = past + seq;
    if total > cache.capacity {
        return Err(format!("{total} positions exceed the KV cache capacity {}", cache.capacity));
    }
    let (q, k, v) = (q.as_f32()?, k.as_f32()?, v.as_f32()?);
    for h in 0..kvh {
        for t in 0..seq {
            let src = spec.kv_layout.index(kvh, seq, hd, h, t);
            let dst = cache.offset(h, past + t);
            cache.key.write(dst, &k[src..src + hd]);
            cache.value.write(dst, &v[src..src + hd]);
        }
    }
    let n_rep = heads / kvh;
    let bias_rows = match (bias, spec.bias) {
        (None, Bias::Causal) => None,
        (Some(b), mode @ (Bias::PerQuery | Bias::Grouped)) => {
            let rows = if mode == Bias::Grouped { n_rep * seq } else { seq };
            let groups = if mode == Bias::Grouped { kvh } else { heads };
            let n = b.len();
            let per_head = rows * total;
            if b.shape.last() != Some(&total) || (n != per_head && n != per_head * groups) {
                return Err(format!("attention bias {:?} does not fit {rows} query rows x {total} positions", b.shape));
            }
            Some((b.as_f32()?, n == per_head, mode))
        }
        _ => return Err("attention bias input does not match the compiled form".into()),
    };
    let cache = &*cache;
    // One KV group at a time over the group's contiguous cache rows:
    // scores = Q K^T, out = softmax(scores) V; the `n_rep` query heads that
    // share the group are rows of the same pass, so each K/V row is read
    // (and widened from f16) once for all of them.
    let rows = n_rep * seq;
    let group = |g: usize, dst: &mut [f32]| {
        let mut qg = vec![0.0f32; rows * hd];
        for r in 0..n_rep {
            for i in 0..seq {
                let qi = spec.q_layout.index(heads, seq, hd, g * n_rep + r, i);
                qg[(r * seq + i) * hd..(r * seq + i + 1) * hd].copy_from_slice(&q[qi..qi + hd]);
            }
        }
        let span = cache.offset(g, 0)..cache.offset(g, total);
        let mut wide = Vec::new();
        let keys = cache.key.span(span.clone(), &mut wide);
        let mut scores = vec![0.0f32; rows * total];
        scores_of(&qg, rows, keys, hd, &mut scores);
        for r in 0..n_rep {
            let h = g * n_rep + r;
            for i in 0..seq {
                let srow = &mut scores[(r * seq + i) * total..(r * seq + i + 1) * total];
                srow.iter_mut().for_each(|s| *s *= spec.scale);
                match bias_rows {
                    None => srow[past + i + 1..].iter_mut().for_each(|s| *s = f32::NEG_INFINITY),
                    Some((b, shared, mode)) => {
                        let (row, grp, nrows) = match mode {
                            Bias::Grouped => (r * seq + i, g, n_rep * seq),
                            _ => (i, h, seq),
                        };
                        let base = if shared { 0 } else { grp * nrows * total };
                        let brow = &b[base + row * total..base + (row + 1) * total];
                        srow.iter_mut().zip(brow).for_each(|(s, b)| *s += b);
                    }
                }
                softmax_row(srow);
            }
        }
        let values = cache.value.span(span, &mut wide);
        weighted_sum(&scores, rows, values, hd, dst);
    };
    // Heads-first output: group g owns heads g*n_rep.. contiguously.
    let mut heads_first = vec![0.0f32; heads * seq * hd];
    if let (Some(p), true) = (pool, heads * seq * total * hd >= PARALLEL_MIN_MACS && kvh > 1) {
        p.install(|| heads_first.par_chunks_mut(rows * hd).enumerate().for_each(|(g, dst)| group(g, dst)));
    } else {
        heads_first.chunks_mut(rows * hd).enumerate().for_each(|(g, dst)| group(g, dst));
    }
    let (shape, data) = match spec.out_layout {
        Layout::HeadsFirst => (vec![1, heads, seq, hd], heads_first),
        Layout::SeqFirst => {
            let mut o = out.recycle_f32(heads * seq * hd);
            for h in 0..heads {
                for t in 0..seq {
                    let src = (h * seq + t) * hd;
                    let dst = (t * heads + h) * hd;
                    o[dst..dst + hd].copy_from_slice(&heads_first[src..src + hd]);
                }
            }
            (vec![1, seq, heads * hd], o)
        }
    };
    *out = Value::f32(shape, data);
    Ok(())
}
