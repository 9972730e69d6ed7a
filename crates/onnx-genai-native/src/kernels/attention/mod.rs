//! Causal attention over the blocked KV cache ([`crate::kv`]), for a batch
//! of sequences at once. The rows of a step are the new positions of every
//! sequence back to back (a ragged batch); each sequence's [`Segment`]
//! names its rows and how many positions its cache already holds. A step
//! writes only its new K/V rows and reads the past where it lies, so a
//! decode step never copies the past.

use super::simd::{scores as scores_of, weighted_sum, Alongside};
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
    // In order and apart: two jobs writing one row's output at once would
    // race.
    let mut free_from = 0;
    for seg in step.segments {
        match seg.start.checked_add(seg.len) {
            Some(end) if end <= rows && seg.start >= free_from => free_from = end,
            Some(end) if end <= rows => return Err(format!("segment {seg:?} overlaps the one before it")),
            _ => return Err(format!("segment {seg:?} is outside the step's {rows} rows")),
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
        // 16 SmolLM2 sequences while the other thread waited). Each thread
        // walks its own share of the sequences in order (then takes what
        // is left of the others' from their backs), so the next job is
        // mostly `s + 1`: the keys it scores first are fetched while this
        // one's last values are summed. (A model runs at most `MAX_BATCH`
        // sequences a step; more would only go without that fetch.)
        //
        // Most of this op's time is the KV's way from memory: run twice
        // in a row, the second pass took 0.53 against 1.1 ms a step at 8
        // SmolLM2 sequences and 1.2 against 2.2 at 16. Fetching the next
        // layer's KV into the cache beside the projections before it
        // (per tile pair, in step with each weight block) did cut this op
        // by 25-33%, but the projections slowed by as much and the step
        // did not gain (Zen 4, 2 vCPUs, 2026-12-07, `batch_profile`, three
        // alternating pairs): the two streams share one memory path. An
        // f16 cache halves the bytes instead (`--kv-cache f16`).
        let mut firsts = [Alongside::NONE; crate::model::MAX_BATCH];
        for ((first, kv), seg) in firsts.iter_mut().zip(kvs.iter()).zip(step.segments) {
            *first = kv.first_keys(step.layer, (seg.past + seg.len).min(crate::kv::BLOCK_TOKENS));
        }
        let caches = Disjoint::new(kvs);
        ctx.pool.for_claimed_ranges(step.segments.len(), 1, &|jobs, t| {
            for s in jobs {
                // SAFETY: sequence `s`'s cache belongs to this job alone.
                let kv: &mut SeqKv = unsafe { caches.slice(s, 1)[0] };
                let mut scratch = ctx.scratch.take(t);
                let seg = step.segments[s];
                let then = Some(firsts.get(s + 1).copied().unwrap_or(Alongside::NONE));
                let result = append(step, seg, kv, kvh, hd).and_then(|()| {
                    (0..kvh).try_for_each(|g| {
                        attend_group(spec, step, kv, seg, g, 0..seg.len, n_rep, &target, &mut scratch, then)
                    })
                });
                if let Err(e) = result {
                    fail(e);
                }
            }
        });
    } else {
        // 1. Append every sequence's new keys and values.
        for (seg, kv) in step.segments.iter().zip(kvs.iter_mut()) {
            append(step, *seg, kv, kvh, hd)?;
        }
        let kvs: &[&mut SeqKv] = kvs;
        if splits_parts(step, kvs.len()) {
            return attend_in_parts(spec, step, kvs, out, ctx);
        }
        // 2. Attend: one job per (segment, KV group, chunk of query rows),
        //    claimed by the threads one at a time. The group's query heads
        //    share every key and value row they read; a prefill's rows are
        //    chunked so its few groups (3 on SmolLM2) still split evenly
        //    across threads, and claimed because later rows see more keys.
        let jobs: usize = step.segments.iter().map(|seg| seg.len.div_ceil(ATTENTION_ROW_CHUNK) * kvh).sum();
        ctx.pool.for_claimed(jobs, &|job, t| {
            let mut scratch = ctx.scratch.take(t);
            // A decode step (one chunk per segment) maps jobs directly; only
            // steps with a long segment walk the segments.
            let place = if one_chunk_each { Some((job / kvh, job % kvh, 0)) } else { job_at(step.segments, kvh, job) };
            let Some((s, g, first)) = place else { return };
            let seg = step.segments[s];
            let rows = first..(first + ATTENTION_ROW_CHUNK).min(seg.len);
            if let Err(e) = attend_group(spec, step, kvs[s], seg, g, rows, n_rep, &target, &mut scratch, None) {
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

/// Positions one pass of attention covers at most. A query row that sees
/// more attends them in parts of this many (whole KV blocks), each with
/// its own softmax, and merges the parts by their maxima and sums
/// ([`merge_parts`]). Every path computes a row this way, so a decode step
/// of few sequences can run the parts of one (sequence, KV group) as jobs
/// of their own — a long context then keeps every thread busy, not one
/// per KV group — and get the bits one job running them in turn gets.
pub(crate) const PART_POSITIONS: usize = 8 * crate::kv::BLOCK_TOKENS;

/// Floats one part's result takes per query head: its normalized weighted
/// sum (`head_dim`), then (after every head's sum) its maximum score and
/// its softmax sum.
fn part_stride(n_rep: usize, hd: usize) -> usize {
    n_rep * (hd + 2)
}

/// The floats attention's parts need at most, for a model whose layers'
/// query heads, KV heads and head dimension are at most these and whose
/// sequences hold up to `max_positions`: per thread (one row's parts,
/// attended in turn) and in the runtime's `attention_parts` (every part
/// of a decode step of few sequences, run as jobs). Reserved when a model
/// loads, so no decode step allocates them. `None` where the counts
/// overflow (a manifest's geometry: checked, not trusted).
pub fn part_buffers(n_rep: usize, head_dim: usize, kv_heads: usize, max_positions: usize) -> Option<(usize, usize)> {
    let stride = n_rep.checked_mul(head_dim.checked_add(2)?)?;
    let row = max_positions.div_ceil(PART_POSITIONS).checked_mul(stride)?;
    let step =
        (PER_SEQUENCE_MIN - 1).checked_mul(kv_heads)?.checked_mul(row)?.checked_add(n_rep.checked_mul(head_dim)?)?;
    Some((row, step))
}

/// Whether `step` is a decode step of few sequences with a context long
/// enough to split: then each part of each (sequence, KV group) is a job.
fn splits_parts(step: &Step<'_>, sequences: usize) -> bool {
    sequences < PER_SEQUENCE_MIN
        && step.bias.is_none()
        && step.segments.iter().all(|s| s.len == 1)
        && step.segments.iter().any(|s| s.past + 1 > PART_POSITIONS)
}

/// The decode step of [`splits_parts`], its new K/V rows appended: one
/// job per (sequence, KV group, part), each writing its part's result into
/// runtime's `attention_parts`, then each (sequence, group) merged in part
/// order.
fn attend_in_parts(
    spec: &AttentionSpec,
    step: &Step<'_>,
    kvs: &[&mut SeqKv],
    out: &mut [f32],
    ctx: &Ctx<'_>,
) -> Result<(), String> {
    let (kvh, hd) = (spec.kv_heads, spec.head_dim);
    let n_rep = spec.heads / kvh;
    let parts_of = |seg: &Segment| (seg.past + 1).div_ceil(PART_POSITIONS);
    let jobs: usize = step.segments.iter().map(|seg| kvh * parts_of(seg)).sum();
    let stride = part_stride(n_rep, hd);
    let mut buffer = ctx.attention_parts.lock().unwrap_or_else(|p| p.into_inner());
    // Every job's slot, then the merged heads of one group.
    let (results, acc) = super::sized(&mut buffer, jobs * stride + n_rep * hd).split_at_mut(jobs * stride);
    let slots = Disjoint::new(results);
    let failed = std::sync::Mutex::new(None::<String>);
    ctx.pool.for_claimed(jobs, &|job, t| {
        // Jobs run through the segments in order, each segment's groups in
        // order, a group's parts innermost.
        let mut first = 0;
        for (s, seg) in step.segments.iter().enumerate() {
            let parts = parts_of(seg);
            if job < first + kvh * parts {
                let (g, p) = ((job - first) / parts, (job - first) % parts);
                let mut scratch = ctx.scratch.take(t);
                let super::Scratch { a: q, b: srow, .. } = &mut *scratch;
                let q = super::sized(q, n_rep * hd);
                // SAFETY: job `job` alone writes slot `job`.
                let slot = unsafe { slots.slice(job * stride, stride) };
                let visible = seg.past + 1;
                let keys = p * PART_POSITIONS..visible.min((p + 1) * PART_POSITIONS);
                let result = group_queries(step, seg.start, seg.past, g, n_rep, hd, q)
                    .and_then(|()| attend_part(spec, step, kvs[s], *seg, g, 0, q, n_rep, keys, srow, slot, None));
                if let Err(e) = result {
                    *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
                return;
            }
            first += kvh * parts;
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let target = Disjoint::new(out);
    let mut first = 0;
    for seg in step.segments {
        let parts = parts_of(seg);
        for g in 0..kvh {
            let at = (first + g * parts) * stride;
            merge_parts(&results[at..at + parts * stride], n_rep, hd, acc);
            write_group(spec, step.q.rows, seg.start, g, n_rep, acc, &target);
        }
        first += kvh * parts;
    }
    Ok(())
}

/// Query heads `g * n_rep ..` of step row `r` (position `pos`) into `q`,
/// rotated where the op applies rotary itself.
fn group_queries(
    step: &Step<'_>,
    r: usize,
    pos: usize,
    g: usize,
    n_rep: usize,
    hd: usize,
    q: &mut [f32],
) -> Result<(), String> {
    for j in 0..n_rep {
        let src = step.q.row(r, g * n_rep + j);
        let dst = &mut q[j * hd..(j + 1) * hd];
        match &step.rotary {
            Some(rot) => rot.rotate(src, pos, dst)?,
            None => dst.copy_from_slice(src),
        }
    }
    Ok(())
}

/// Writes the `n_rep` heads of group `g` of step row `r` (`src`, head after
/// head) where `spec.out_layout` puts them.
fn write_group(
    spec: &AttentionSpec,
    rows: usize,
    r: usize,
    g: usize,
    n_rep: usize,
    src: &[f32],
    out: &Disjoint<'_, f32>,
) {
    let hd = spec.head_dim;
    for j in 0..n_rep {
        let h = g * n_rep + j;
        let at = match spec.out_layout {
            Layout::HeadsFirst => (h * rows + r) * hd,
            Layout::SeqFirst => (r * spec.heads + h) * hd,
        };
        // SAFETY: (row r, head h) belongs to exactly one job (its group's,
        // or the merge after every job), so no other thread writes these
        // `hd` elements.
        unsafe { out.slice(at, hd) }.copy_from_slice(&src[j * hd..(j + 1) * hd]);
    }
}

/// The `n_rep` query heads of KV group `g` of one sequence: per row, the
/// scores of every head against each key (read once for all of them), a
/// softmax per head, and the weighted sum of each value row (read once) —
/// in parts of [`PART_POSITIONS`] positions, merged, where the row sees
/// more. With `then` (a decode job that runs every group of its sequence
/// in turn), the values fetch what the job reads next in step: see
/// [`attend_part`].
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
    then: Option<Alongside>,
) -> Result<(), String> {
    let hd = spec.head_dim;
    let total = seg.past + seg.len;
    let stride = part_stride(n_rep, hd);
    let super::Scratch { a: q, b: srow, c: results, d: acc, .. } = scratch;
    let q = super::sized(q, n_rep * hd);
    super::sized(acc, n_rep * hd);
    for i in query_rows {
        let pos = seg.past + i;
        let r = seg.start + i;
        group_queries(step, r, pos, g, n_rep, hd, q)?;
        // Causal: keys 0..=pos, unless an explicit bias decides.
        let visible = if step.bias.is_some() { total } else { pos + 1 };
        let parts = visible.div_ceil(PART_POSITIONS);
        // Each slot is written in full by `attend_part`.
        super::grow_to(results, parts * stride);
        let results = &mut results[..parts * stride];
        for (p, slot) in results.chunks_mut(stride).enumerate() {
            let keys = p * PART_POSITIONS..visible.min((p + 1) * PART_POSITIONS);
            attend_part(spec, step, kv, seg, g, i, q, n_rep, keys, srow, slot, then)?;
        }
        if parts == 1 {
            write_group(spec, step.q.rows, r, g, n_rep, results, out);
        } else {
            merge_parts(results, n_rep, hd, acc);
            write_group(spec, step.q.rows, r, g, n_rep, acc, out);
        }
    }
    Ok(())
}

/// Query row `i` of `seg` (its group `g` heads in `q`, rotated) over the
/// positions `keys` (starting on a block): the scores of every head against
/// each key (head j's at `srow[j * keys.len()..]`), a softmax per head, and
/// the weighted sum of the values into `slot` (`n_rep * hd`), followed by
/// each head's maximum score and softmax sum. With `then` (the job runs
/// the groups in turn), each block of values fetches the next group's keys
/// of that block in step, and the last group's first block `then` (the
/// next job's first keys); other jobs fetch nothing ahead (the next group
/// is another job's, perhaps another thread's).
#[allow(clippy::too_many_arguments)]
fn attend_part(
    spec: &AttentionSpec,
    step: &Step<'_>,
    kv: &SeqKv,
    seg: Segment,
    g: usize,
    i: usize,
    q: &[f32],
    n_rep: usize,
    keys: std::ops::Range<usize>,
    srow: &mut Vec<f32>,
    slot: &mut [f32],
    then: Option<Alongside>,
) -> Result<(), String> {
    let hd = spec.head_dim;
    let total = seg.past + seg.len;
    let width = keys.len();
    // Every score is written before it is read: grown, never zero-filled
    // (a prefill job sized it once per row).
    super::grow_to(srow, n_rep * width);
    let srow = &mut srow[..n_rep * width];
    let block = crate::kv::BLOCK_TOKENS;
    let blocks = keys.start / block..keys.end.div_ceil(block);
    let rows_of = |b: usize| block.min(keys.end - b * block);
    for b in blocks.clone() {
        // A sequence's blocks lie anywhere in memory: fetch the next
        // block's keys now, and this block's values (read after the
        // softmax) in step with these keys as they are scored.
        if b + 1 < blocks.end {
            kv.span(step.layer, false, g, b + 1, rows_of(b + 1)).prefetch();
        }
        let values = kv.span(step.layer, true, g, b, rows_of(b)).alongside();
        let scores = &mut srow[b * block - keys.start..];
        match kv.span(step.layer, false, g, b, rows_of(b)) {
            Span::F32(k) => scores_of(q, n_rep, k, hd, scores, width, values),
            Span::F16(k) => scores_of(q, n_rep, k, hd, scores, width, values),
        }
    }
    let (sums, stats) = slot.split_at_mut(n_rep * hd);
    for j in 0..n_rep {
        let h = g * n_rep + j;
        let scores = &mut srow[j * width..(j + 1) * width];
        scores.iter_mut().for_each(|s| *s *= spec.scale);
        if let Some(bias) = &step.bias {
            let (row, group, nrows) = match bias.mode {
                Bias::Grouped => ((h % n_rep) * seg.len + i, g, n_rep * seg.len),
                _ => (i, h, seg.len),
            };
            let base = if bias.shared { 0 } else { group * nrows * total };
            let at = base + row * total;
            let b = bias.data.get(at + keys.start..at + keys.end).ok_or_else(|| {
                format!("attention bias of {} values does not cover row {row} of {total} positions", bias.data.len())
            })?;
            scores.iter_mut().zip(b).for_each(|(s, b)| *s += b);
        }
        // A part whose every key is masked (an additive bias of -inf over
        // it) weighs nothing: a softmax over it would be NaN, and NaN
        // times its zero weight is still NaN in the merge.
        let (max, sum) = if scores.iter().all(|s| *s == f32::NEG_INFINITY) {
            scores.iter_mut().for_each(|s| *s = 0.0);
            (f32::NEG_INFINITY, 0.0)
        } else {
            super::simd::softmax(scores)
        };
        stats[j] = max;
        stats[n_rep + j] = sum;
    }
    sums.iter_mut().for_each(|v| *v = 0.0);
    let kv_heads = kv.layout().geometry(step.layer).map_or(0, |(h, _)| h);
    for b in blocks {
        let p = &srow[b * block - keys.start..];
        let next = match then {
            Some(_) if g + 1 < kv_heads => kv.span(step.layer, false, g + 1, b, rows_of(b)).alongside(),
            Some(next_job) if b * block == keys.start => next_job,
            _ => Alongside::NONE,
        };
        match kv.span(step.layer, true, g, b, rows_of(b)) {
            Span::F32(v) => weighted_sum(p, n_rep, width, v, hd, sums, next),
            Span::F16(v) => weighted_sum(p, n_rep, width, v, hd, sums, next),
        }
    }
    Ok(())
}

/// One row's parts (each as [`attend_part`] leaves it, in position order)
/// merged into `out` (`n_rep * hd`): per head, each part's normalized sum
/// weighted by its share of the row's softmax mass — part p's weight is
/// `s_p · exp(m_p − m) / Σ_q s_q · exp(m_q − m)`, where `m_p` and `s_p` are
/// its maximum and softmax sum and `m` the largest maximum — added in part
/// order. A head whose every part is masked comes out zero.
fn merge_parts(results: &[f32], n_rep: usize, hd: usize, out: &mut [f32]) {
    let stride = part_stride(n_rep, hd);
    let parts = results.len() / stride;
    for j in 0..n_rep {
        let stat = |p: usize, k: usize| results[p * stride + n_rep * hd + k * n_rep + j];
        let max = (0..parts).map(|p| stat(p, 0)).fold(f32::NEG_INFINITY, f32::max);
        let o = &mut out[j * hd..(j + 1) * hd];
        o.iter_mut().for_each(|v| *v = 0.0);
        if max == f32::NEG_INFINITY {
            continue;
        }
        // A masked part's mass is 0 · exp(−inf) = 0.
        let mass = |p: usize| stat(p, 1) * (stat(p, 0) - max).exp();
        let total: f32 = (0..parts).map(mass).sum();
        for p in 0..parts {
            let w = mass(p) / total;
            let sums = &results[p * stride + j * hd..p * stride + (j + 1) * hd];
            o.iter_mut().zip(sums).for_each(|(o, v)| *o += w * v);
        }
    }
}

#[cfg(test)]
mod tests;
