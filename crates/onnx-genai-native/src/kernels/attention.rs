//! Causal attention over the blocked KV cache ([`crate::kv`]), for a batch
//! of sequences at once. The rows of a step are the new positions of every
//! sequence back to back (a ragged batch); each sequence's [`Segment`]
//! names its rows and how many positions its cache already holds. A step
//! writes only its new K/V rows and reads the past where it lies, so a
//! decode step never copies the past.

use super::simd::{scores as scores_of, weighted_sum};
use super::Ctx;
use crate::kv::{SeqKv, Span};
use crate::pool::Disjoint;

/// How a tensor's `[rows, heads, dim]` elements are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[batch, heads, seq, dim]`.
    HeadsFirst,
    /// `[batch, seq, heads * dim]` (also `[batch, seq, heads, dim]`).
    SeqFirst,
}

impl Layout {
    /// The sequence length of a tensor in this layout.
    pub fn seq_len(self, shape: &[usize], heads: usize, dim: usize) -> Result<usize, String> {
        let bad = || format!("shape {shape:?} is not a batch-1 {self:?} tensor of {heads} heads x {dim}");
        let n: usize = shape.iter().product();
        if shape.first() != Some(&1) || heads * dim == 0 || !n.is_multiple_of(heads * dim) {
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

/// One sequence's rows in a batch step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First row of the step that belongs to this sequence.
    pub start: usize,
    /// Its new positions.
    pub len: usize,
    /// Positions its cache held before the step.
    pub past: usize,
}

/// A projection attention reads: the element `(row, head, d)` of a
/// `[rows, heads, head_dim]` tensor in `layout`, possibly packed with others
/// in wider rows (`stride` elements per row, this one starting at
/// `offset`).
#[derive(Clone, Copy)]
pub struct Heads<'a> {
    pub data: &'a [f32],
    pub layout: Layout,
    pub heads: usize,
    pub rows: usize,
    pub head_dim: usize,
    pub stride: usize,
    pub offset: usize,
}

impl<'a> Heads<'a> {
    /// A plain (unpacked) tensor of `rows` rows.
    pub fn plain(data: &'a [f32], layout: Layout, heads: usize, rows: usize, head_dim: usize) -> Self {
        Self { data, layout, heads, rows, head_dim, stride: heads * head_dim, offset: 0 }
    }

    fn at(&self, row: usize, head: usize) -> usize {
        match self.layout {
            Layout::HeadsFirst => (head * self.rows + row) * self.head_dim,
            Layout::SeqFirst => row * self.stride + self.offset + head * self.head_dim,
        }
    }

    fn row(&self, row: usize, head: usize) -> &'a [f32] {
        let at = self.at(row, head);
        &self.data[at..at + self.head_dim]
    }

    fn check(&self, what: &str) -> Result<(), String> {
        let last = match self.rows.checked_sub(1) {
            None => return Ok(()),
            Some(r) => self.at(r, self.heads.saturating_sub(1)).max(self.at(r, 0)),
        };
        if last + self.head_dim > self.data.len() {
            return Err(format!(
                "{what} has {} values, {} rows x {} heads x {} need more",
                self.data.len(),
                self.rows,
                self.heads,
                self.head_dim
            ));
        }
        Ok(())
    }
}

/// Half-width cos/sin caches for rotary applied inside the attention (at
/// each row's absolute position).
#[derive(Clone, Copy)]
pub struct RotaryCache<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub half: usize,
}

impl RotaryCache<'_> {
    fn rotate(&self, src: &[f32], pos: usize, dst: &mut [f32]) -> Result<(), String> {
        let h = self.half;
        if (pos + 1) * h > self.cos.len() || (pos + 1) * h > self.sin.len() || 2 * h > src.len() {
            return Err(format!("position {pos} is beyond the rotary cache ({} positions)", self.cos.len() / h.max(1)));
        }
        let (c, s) = (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h]);
        for i in 0..h {
            dst[i] = src[i] * c[i] - src[i + h] * s[i];
            dst[i + h] = src[i + h] * c[i] + src[i] * s[i];
        }
        dst[2 * h..].copy_from_slice(&src[2 * h..]);
        Ok(())
    }
}

/// An additive bias for one sequence (graphs whose mask the compiler does
/// not recognize as causal run one sequence at a time).
#[derive(Clone, Copy)]
pub struct AdditiveBias<'a> {
    pub data: &'a [f32],
    pub mode: Bias,
    /// One bias shared by every head (group) rather than one per head.
    pub shared: bool,
}

/// The new positions of one attention layer for a whole batch.
pub struct Step<'a> {
    pub layer: usize,
    pub segments: &'a [Segment],
    pub q: Heads<'a>,
    pub k: Heads<'a>,
    pub v: Heads<'a>,
    pub rotary: Option<RotaryCache<'a>>,
    pub bias: Option<AdditiveBias<'a>>,
}

/// Appends every segment's new K/V rows to its cache (`kvs[i]` belongs to
/// `segments[i]`; each must have room reserved), then attends every query
/// row over its sequence's positions `0..=past + i`. `out` receives
/// `rows x heads x head_dim` values in `spec.out_layout`.
pub fn attention(
    spec: &AttentionSpec,
    step: &Step<'_>,
    kvs: &mut [&mut SeqKv],
    out: &mut [f32],
    ctx: &Ctx<'_>,
) -> Result<(), String> {
    let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
    if kvh == 0 || heads % kvh != 0 || hd == 0 {
        return Err(format!("{heads} query heads over {kvh} KV heads of {hd} is not a grouped attention"));
    }
    let rows = step.q.rows;
    step.q.check("query")?;
    step.k.check("key")?;
    step.v.check("value")?;
    if out.len() != rows * heads * hd {
        return Err(format!("attention output holds {} values, {rows} rows x {heads} x {hd} expected", out.len()));
    }
    if step.segments.len() != kvs.len() {
        return Err(format!("{} segments for {} KV caches", step.segments.len(), kvs.len()));
    }
    if step.bias.is_some() && step.segments.len() != 1 {
        return Err("an additive attention bias takes one sequence at a time".into());
    }
    if hd > MAX_HEAD_DIM {
        return Err(format!("head_dim {hd} is larger than native-cpu supports ({MAX_HEAD_DIM})"));
    }
    for seg in step.segments {
        if seg.start + seg.len > rows {
            return Err(format!("segment {seg:?} is outside the step's {rows} rows"));
        }
    }
    let n_rep = heads / kvh;
    let target = Disjoint::new(out);
    let failed = std::sync::Mutex::new(None::<String>);
    let fail = |e: String| *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
    let one_chunk_each = step.segments.iter().all(|seg| (1..=ATTENTION_ROW_CHUNK).contains(&seg.len));
    if one_chunk_each && kvs.len() >= PER_SEQUENCE_MIN {
        // A decode step of many sequences: one job per sequence appends
        // its new rows, then attends each of its KV groups. The append is
        // spread over the threads with the rest (done first for every
        // sequence on the calling thread, it was 10% of the attention at
        // 16 SmolLM2 sequences while the other thread waited).
        let caches = Disjoint::new(kvs);
        ctx.pool.for_claimed(step.segments.len(), &|s, t| {
            // SAFETY: sequence `s`'s cache belongs to this job alone.
            let kv: &mut SeqKv = unsafe { caches.slice(s, 1)[0] };
            // SAFETY: thread `t` is the only user of its scratch in this region.
            let scratch = unsafe { ctx.scratch.get(t) };
            let seg = step.segments[s];
            let result = append(step, seg, kv, kvh, hd).and_then(|()| {
                (0..kvh).try_for_each(|g| attend_group(spec, step, kv, seg, g, 0..seg.len, n_rep, &target, scratch))
            });
            if let Err(e) = result {
                fail(e);
            }
        });
    } else {
        // 1. Append every sequence's new keys and values.
        for (seg, kv) in step.segments.iter().zip(kvs.iter_mut()) {
            append(step, *seg, kv, kvh, hd)?;
        }
        // 2. Attend: one job per (segment, KV group, chunk of query rows),
        //    claimed by the threads one at a time. The group's query heads
        //    share every key and value row they read; a prefill's rows are
        //    chunked so its few groups (3 on SmolLM2) still split evenly
        //    across threads, and claimed because later rows see more keys.
        let jobs: usize = step.segments.iter().map(|seg| seg.len.div_ceil(ATTENTION_ROW_CHUNK) * kvh).sum();
        let kvs: &[&mut SeqKv] = kvs;
        ctx.pool.for_claimed(jobs, &|job, t| {
            // SAFETY: thread `t` is the only user of its scratch in this region.
            let scratch = unsafe { ctx.scratch.get(t) };
            // A decode step (one chunk per segment) maps jobs directly; only
            // steps with a long segment walk the segments.
            let place = if one_chunk_each { Some((job / kvh, job % kvh, 0)) } else { job_at(step.segments, kvh, job) };
            let Some((s, g, first)) = place else { return };
            let seg = step.segments[s];
            let rows = first..(first + ATTENTION_ROW_CHUNK).min(seg.len);
            if let Err(e) = attend_group(spec, step, kvs[s], seg, g, rows, n_rep, &target, scratch) {
                fail(e);
            }
        });
    }
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Head dimensions native-cpu attends over at most (the rotated row is a
/// stack buffer).
const MAX_HEAD_DIM: usize = 512;

/// From this many sequences on, a decode step's attention runs one job per
/// sequence (its append and all its groups); below, one job per (sequence,
/// KV group), so that a few sequences still split across the threads.
const PER_SEQUENCE_MIN: usize = 4;

/// Writes segment `seg`'s new K/V rows into its cache (the keys rotated
/// first when the op applies rotary itself).
fn append(step: &Step<'_>, seg: Segment, kv: &mut SeqKv, kvh: usize, hd: usize) -> Result<(), String> {
    let (geometry_heads, geometry_dim) = kv.layout().geometry(step.layer).unwrap_or((0, 0));
    if (geometry_heads, geometry_dim) != (kvh, hd) {
        return Err(format!(
            "KV cache layer {} holds {geometry_heads} heads x {geometry_dim}, the attention needs {kvh} x {hd}",
            step.layer
        ));
    }
    let mut rotated = [0f32; MAX_HEAD_DIM];
    for i in 0..seg.len {
        let pos = seg.past + i;
        for h in 0..kvh {
            let key = step.k.row(seg.start + i, h);
            let key = match &step.rotary {
                Some(r) => {
                    r.rotate(key, pos, &mut rotated[..hd])?;
                    &rotated[..hd]
                }
                None => key,
            };
            kv.write(step.layer, h, pos, key, step.v.row(seg.start + i, h));
        }
    }
    Ok(())
}

/// Query rows one attention job covers at most.
const ATTENTION_ROW_CHUNK: usize = 16;

/// Job `job` of a step as (segment, KV group, first query row): jobs run
/// through the segments in order, each segment's row chunks in order, the
/// groups of a chunk innermost. (Found by walking the segments, so a step
/// allocates nothing for its job list.)
fn job_at(segments: &[Segment], kvh: usize, mut job: usize) -> Option<(usize, usize, usize)> {
    for (s, seg) in segments.iter().enumerate() {
        let here = seg.len.div_ceil(ATTENTION_ROW_CHUNK) * kvh;
        if job < here {
            return Some((s, job % kvh, (job / kvh) * ATTENTION_ROW_CHUNK));
        }
        job -= here;
    }
    None
}

/// The `n_rep` query heads of KV group `g` of one sequence: per row, the
/// scores of every head against each key (read once for all of them), a
/// softmax per head, and the weighted sum of each value row (read once).
#[allow(clippy::too_many_arguments)]
fn attend_group(
    spec: &AttentionSpec,
    step: &Step<'_>,
    kv: &SeqKv,
    seg: Segment,
    g: usize,
    query_rows: std::ops::Range<usize>,
    n_rep: usize,
    out: &Disjoint<'_, f32>,
    scratch: &mut super::Scratch,
) -> Result<(), String> {
    let hd = spec.head_dim;
    let rows = step.q.rows;
    let total = seg.past + seg.len;
    let super::Scratch { a: qbuf, b: srow, d: acc, .. } = scratch;
    super::sized(qbuf, n_rep * hd);
    super::sized(srow, n_rep * total);
    super::sized(acc, n_rep * hd);
    let block = crate::kv::BLOCK_TOKENS;
    for i in query_rows {
        let pos = seg.past + i;
        let r = seg.start + i;
        for j in 0..n_rep {
            let q = step.q.row(r, g * n_rep + j);
            let dst = &mut qbuf[j * hd..(j + 1) * hd];
            match &step.rotary {
                Some(rot) => rot.rotate(q, pos, dst)?,
                None => dst.copy_from_slice(q),
            }
        }
        // Causal: keys 0..=pos, unless an explicit bias decides. Head j's
        // scores are row j (stride `visible`).
        let visible = if step.bias.is_some() { total } else { pos + 1 };
        let blocks = visible.div_ceil(block);
        let span_rows = |b: usize| block.min(visible - b * block);
        for b in 0..blocks {
            let first = b * block;
            // A sequence's blocks lie anywhere in memory: fetch the next
            // block's keys, and this block's values (read after the
            // softmax), while these keys are scored.
            if b + 1 < blocks {
                kv.span(step.layer, false, g, b + 1, span_rows(b + 1)).prefetch();
            }
            kv.span(step.layer, true, g, b, span_rows(b)).prefetch();
            let scores = &mut srow[first..];
            match kv.span(step.layer, false, g, b, block.min(visible - first)) {
                Span::F32(keys) => scores_of(qbuf, n_rep, keys, hd, scores, visible),
                Span::F16(keys) => scores_of(qbuf, n_rep, keys, hd, scores, visible),
            }
        }
        for j in 0..n_rep {
            let h = g * n_rep + j;
            let scores = &mut srow[j * visible..(j + 1) * visible];
            scores.iter_mut().for_each(|s| *s *= spec.scale);
            if let Some(bias) = &step.bias {
                let (row, group, nrows) = match bias.mode {
                    Bias::Grouped => ((h % n_rep) * seg.len + i, g, n_rep * seg.len),
                    _ => (i, h, seg.len),
                };
                let base = if bias.shared { 0 } else { group * nrows * total };
                let at = base + row * total;
                let b = bias.data.get(at..at + total).ok_or_else(|| {
                    format!(
                        "attention bias of {} values does not cover row {row} of {total} positions",
                        bias.data.len()
                    )
                })?;
                scores.iter_mut().zip(b).for_each(|(s, b)| *s += b);
            }
            super::simd::softmax(scores);
        }
        acc.iter_mut().for_each(|v| *v = 0.0);
        for b in 0..visible.div_ceil(block) {
            let first = b * block;
            let p = &srow[first..];
            match kv.span(step.layer, true, g, b, block.min(visible - first)) {
                Span::F32(values) => weighted_sum(p, n_rep, visible, values, hd, acc),
                Span::F16(values) => weighted_sum(p, n_rep, visible, values, hd, acc),
            }
        }
        for j in 0..n_rep {
            let h = g * n_rep + j;
            let at = match spec.out_layout {
                Layout::HeadsFirst => (h * rows + r) * hd,
                Layout::SeqFirst => (r * spec.heads + h) * hd,
            };
            // SAFETY: (row r, head h) belongs to exactly one job (its
            // group's), so no other thread writes these `hd` elements.
            unsafe { out.slice(at, hd) }.copy_from_slice(&acc[j * hd..(j + 1) * hd]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Runtime;
    use crate::kv::{KvLayout, KvPool};

    /// Attention of one query row at position `pos` against keys and values
    /// `0..=pos` of one sequence, computed directly (per head: scores,
    /// softmax, weighted sum).
    fn naive(q: &[f32], keys: &[f32], values: &[f32], pos: usize, spec: &AttentionSpec) -> Vec<f32> {
        let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
        let mut out = vec![0.0; heads * hd];
        for h in 0..heads {
            let g = h / (heads / kvh);
            let key = |t: usize| &keys[(t * kvh + g) * hd..(t * kvh + g + 1) * hd];
            let s: Vec<f32> = (0..=pos)
                .map(|t| q[h * hd..(h + 1) * hd].iter().zip(key(t)).map(|(a, b)| a * b).sum::<f32>() * spec.scale)
                .collect();
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = s.iter().map(|v| (v - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            for (t, w) in e.iter().enumerate() {
                for d in 0..hd {
                    out[h * hd + d] += w / sum * values[(t * kvh + g) * hd + d];
                }
            }
        }
        out
    }

    /// A step over several sequences with ragged row counts and histories
    /// (a 37-row prefill beside a 3-row one, then a 1-row decode beside a
    /// 20-row chunk, then a decode step of both; and five sequences whose
    /// steps run one job per sequence with its append, once every segment
    /// fits one chunk) equals direct attention row by row, serial and on
    /// two threads: the row chunks of a long segment and the claimed jobs
    /// (INVARIANTS B1: a sequence's result does not depend on its batch)
    /// cover every (sequence, row, head) exactly once, and every new key
    /// and value lands at its position.
    #[test]
    fn ragged_batches_equal_direct_attention() {
        let (heads, kvh, hd) = (6, 2, 8);
        let spec = AttentionSpec {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            scale: 0.35,
            q_layout: Layout::SeqFirst,
            kv_layout: Layout::SeqFirst,
            out_layout: Layout::SeqFirst,
            bias: Bias::Causal,
        };
        let value = |i: usize| ((i * 2654435761) % 1000) as f32 / 500.0 - 1.0;
        let batches: [&[&[usize]]; 2] =
            [&[&[37, 3], &[1, 20], &[1, 1]], &[&[37, 3, 1, 5, 16], &[1, 1, 1, 1, 1], &[2, 1, 16, 1, 3]]];
        for steps in batches {
            let n = steps[0].len();
            for rt in [Runtime::serial(), Runtime::new(2).unwrap()] {
                let pool = KvPool::new(KvLayout::new(&[(kvh, hd)], false), 0);
                let mut caches: Vec<SeqKv> = (0..n).map(|_| SeqKv::new(pool.clone(), 64)).collect();
                // Every key and value each sequence has been given, by position.
                let mut history: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); n];
                let mut seed = 0;
                for lens in steps {
                    let rows: usize = lens.iter().sum();
                    let mut gen = |n: usize| -> Vec<f32> {
                        seed += n;
                        (0..n).map(|i| value(seed + i)).collect()
                    };
                    let (q, k, v) = (gen(rows * heads * hd), gen(rows * kvh * hd), gen(rows * kvh * hd));
                    let mut segments = Vec::new();
                    for (cache, len) in caches.iter().zip(lens.iter()) {
                        let start = segments.last().map_or(0, |s: &Segment| s.start + s.len);
                        segments.push(Segment { start, len: *len, past: cache.len() });
                    }
                    for (s, seg) in segments.iter().enumerate() {
                        caches[s].reserve(seg.past + seg.len);
                        let span = seg.start * kvh * hd..(seg.start + seg.len) * kvh * hd;
                        history[s].0.extend_from_slice(&k[span.clone()]);
                        history[s].1.extend_from_slice(&v[span]);
                    }
                    let step = Step {
                        layer: 0,
                        segments: &segments,
                        q: Heads::plain(&q, Layout::SeqFirst, heads, rows, hd),
                        k: Heads::plain(&k, Layout::SeqFirst, kvh, rows, hd),
                        v: Heads::plain(&v, Layout::SeqFirst, kvh, rows, hd),
                        rotary: None,
                        bias: None,
                    };
                    let mut out = vec![f32::NAN; rows * heads * hd];
                    let mut refs: Vec<&mut SeqKv> = caches.iter_mut().collect();
                    attention(&spec, &step, &mut refs, &mut out, &rt.ctx()).unwrap();
                    for (s, seg) in segments.iter().enumerate() {
                        caches[s].set_len(seg.past + seg.len);
                        for i in 0..seg.len {
                            let r = seg.start + i;
                            let want = naive(
                                &q[r * heads * hd..(r + 1) * heads * hd],
                                &history[s].0,
                                &history[s].1,
                                seg.past + i,
                                &spec,
                            );
                            let got = &out[r * heads * hd..(r + 1) * heads * hd];
                            for (g, w) in got.iter().zip(&want) {
                                assert!(
                                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                                    "{n} sequences, seq {s} row {i}: {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
