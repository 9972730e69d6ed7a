//! The execution plan: the compiled steps in order, constants, and a static
//! memory plan. Every value a step produces is assigned a slot at compile
//! time; values whose lifetimes do not overlap share a slot, and a slot's
//! buffer is reused from step to step, so a warmed-up decode step allocates
//! nothing.
//!
//! A run advances a batch of sequences at once: their new positions are the
//! rows of one `[1, rows, ..]` tensor (a ragged batch), so every projection
//! reads its weights once for all of them; attention alone looks at which
//! rows belong to which sequence ([`Segment`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::compile::{Binding, CompileStats};
use crate::error::{CompileError, RunError};
use crate::exec::{self, BatchEnv, Env};
use crate::graph::{Graph, Node, Vid};
use crate::kernels::attention::Segment;
use crate::kernels::linear::linear;
use crate::kernels::Ctx;
use crate::kv::SeqKv;
use crate::ops::Op;
use crate::pool::Disjoint;
use crate::value::{DType, Value};

/// Where a step's input comes from: a constant of the plan or a slot.
#[derive(Clone, Copy, Debug)]
pub enum Ref {
    Const(usize),
    Slot(usize),
}

#[derive(Debug)]
struct Step {
    name: String,
    op: Op,
    inputs: Vec<Option<Ref>>,
    outputs: Vec<usize>,
}

/// One step of a plan, for a backend that runs the plan with kernels of its
/// own (native-cuda): the op, where its inputs come from, the slots its
/// outputs go to.
#[derive(Clone, Copy, Debug)]
pub struct StepView<'a> {
    pub name: &'a str,
    pub op: &'a Op,
    pub inputs: &'a [Option<Ref>],
    pub outputs: &'a [usize],
}

/// The slots the graph inputs are written to and the logits read from.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub token_ids: Option<usize>,
    pub position_ids: Option<usize>,
    pub attention_mask: Option<usize>,
    pub logits: usize,
    /// The step computing the logits when it may run on each sequence's
    /// last row alone.
    pub head: Option<usize>,
}

/// Runs one op on host values outside any batch (no KV cache): constant
/// folding's evaluator, and the host side of a backend that runs some
/// steps elsewhere.
pub fn eval(op: &Op, inputs: &[Option<&Value>], outputs: &mut [Value], ctx: Ctx<'_>) -> Result<(), String> {
    exec::run(op, inputs, outputs, &mut Env { ctx, batch: None })
}

/// A compiled decoder. Immutable and shareable; per-sequence state lives in
/// [`State`].
#[derive(Debug)]
pub struct Plan {
    steps: Vec<Step>,
    consts: Vec<Arc<Value>>,
    /// Each slot's row width (the last dimension of every value it holds),
    /// 0 where the compiler does not know it.
    slot_widths: Vec<usize>,
    token_ids: Option<usize>,
    position_ids: Option<usize>,
    attention_mask: Option<usize>,
    logits: usize,
    /// The step that computes the logits, when it is a projection: it runs
    /// on the rows whose logits are returned (each sequence's last) rather
    /// than on every row of a prefill.
    head: Option<usize>,
    /// Every graph input a step reads, by name.
    inputs: Vec<(String, usize)>,
    /// The values a run returns, by name (a decoder's: its logits).
    outputs: Vec<(String, Ref)>,
    pub binding: Binding,
    pub stats: CompileStats,
    /// Values the plan computes (before slot sharing).
    pub values: usize,
}

/// The buffers of runs of one plan: slots (reused from run to run) and the
/// batch bookkeeping. One per model; a run borrows it exclusively.
#[derive(Debug, Default)]
pub struct Workspace {
    slots: Vec<Value>,
    segments: Vec<Segment>,
    /// When set, each step's wall time is added here (indexed like
    /// [`Plan::step_ops`]).
    pub profile: Option<Vec<Duration>>,
    /// When set, each run replaces this with every step's first output
    /// (for comparing backends step by step).
    pub trace: Option<Vec<Value>>,
}

impl Plan {
    /// Plans `g`: the graph inputs named in `inputs` get slots (in that
    /// order), `outputs` are kept to the end of a run. A decoder's logits are
    /// its first output.
    pub(crate) fn build(
        g: Graph,
        binding: &Binding,
        inputs: &[String],
        outputs: &[Vid],
        mut stats: CompileStats,
    ) -> Result<Self, CompileError> {
        let logits = *outputs.first().ok_or_else(|| CompileError::Graph("the graph has no outputs".into()))?;
        let kept = |v: Vid| outputs.contains(&v);
        let order: Vec<_> = g.live_nodes().map(|(_, n)| n.clone()).collect();
        // Last step that reads each value.
        let mut last_use = vec![None; g.values.len()];
        for (s, n) in order.iter().enumerate() {
            for v in n.inputs.iter().flatten() {
                last_use[*v] = Some(s);
            }
        }
        let mut consts = Vec::new();
        let mut slot_of: Vec<Option<usize>> = vec![None; g.values.len()];
        let mut const_of: Vec<Option<usize>> = vec![None; g.values.len()];
        // Slots are shared only between values of one element type, so a
        // slot's buffer always comes back in the type its next value needs
        // (a recycled buffer of another type would be freed and replaced);
        // and a projection's output shares only with projection outputs of
        // its width (below): buffers are resized, not cleared, so a slot
        // whose values alternate between widths zero-fills its growth every
        // time it widens (`memset` on the calling thread while the others
        // wait: 1-3% of a batched decode step's `perf` samples), while a
        // projection's slot grows only when a step has more rows than the
        // last. (Other values, small beside them, still share by type.)
        let class = |v: Vid| match g.values[v].dtype {
            Some(DType::F32) => 0,
            Some(DType::F16) => 1,
            Some(DType::I64) => 2,
            Some(DType::Bool) => 3,
            Some(DType::U8) => 4,
            Some(DType::F64) => 5,
            Some(DType::I32) => 6,
            None => 7,
        };
        // A row width from the op itself (the value's inferred dims can
        // describe the layout before a fusion changed it); 0: not known.
        let mut width_of = vec![0; g.values.len()];
        let key = |v: Vid, width_of: &[usize]| (class(v), width_of[v]);
        let mut free: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
        let mut slot_widths = Vec::new();
        let mut alloc = |free: &mut HashMap<(usize, usize), Vec<usize>>, c: (usize, usize)| {
            free.get_mut(&c).and_then(Vec::pop).unwrap_or_else(|| {
                slot_widths.push(c.1);
                slot_widths.len() - 1
            })
        };
        // A graph input gets a slot when a step reads it or it is an output.
        let mut input_slots = Vec::new();
        for name in inputs {
            let Some(v) = g.find(name).filter(|v| last_use[*v].is_some() || kept(*v)) else { continue };
            let s = alloc(&mut free, key(v, &width_of));
            slot_of[v] = Some(s);
            input_slots.push((name.clone(), s));
        }
        let input_slot =
            |name: Option<&String>| name.and_then(|name| input_slots.iter().find(|(n, _)| n == name)).map(|(_, s)| *s);
        let token_ids = input_slot(Some(&binding.token_ids));
        let position_ids = input_slot(binding.position_ids.as_ref());
        let attention_mask = input_slot(binding.attention_mask.as_ref());
        let mut steps = Vec::with_capacity(order.len());
        for (s, n) in order.iter().enumerate() {
            let mut inputs = Vec::with_capacity(n.inputs.len());
            for v in &n.inputs {
                inputs.push(match v {
                    None => None,
                    Some(v) => Some(if let Some(c) = const_of[*v] {
                        Ref::Const(c)
                    } else if let Some(k) = &g.values[*v].konst {
                        consts.push(k.clone());
                        const_of[*v] = Some(consts.len() - 1);
                        Ref::Const(consts.len() - 1)
                    } else if let Some(slot) = slot_of[*v] {
                        Ref::Slot(slot)
                    } else {
                        return Err(CompileError::node(
                            &n.name,
                            &n.origin,
                            format!(
                                "input `{}` is not available (is it a graph input the manifest does not bind?)",
                                g.values[*v].name
                            ),
                        ));
                    }),
                });
            }
            // Outputs take slots before inputs are released, so no step
            // writes a buffer it is reading.
            for (v, w) in n.outputs.iter().zip(n.op.projection_widths()) {
                width_of[*v] = w;
            }
            let outputs: Vec<usize> = n.outputs.iter().map(|v| alloc(&mut free, key(*v, &width_of))).collect();
            for (v, slot) in n.outputs.iter().zip(&outputs) {
                slot_of[*v] = Some(*slot);
            }
            for v in n.inputs.iter().flatten() {
                if last_use[*v] == Some(s) && !kept(*v) {
                    if let Some(slot) = slot_of[*v].take() {
                        free.entry(key(*v, &width_of)).or_default().push(slot);
                    }
                }
            }
            for (v, slot) in n.outputs.iter().zip(&outputs) {
                if last_use[*v].is_none() && !kept(*v) {
                    slot_of[*v] = None;
                    free.entry(key(*v, &width_of)).or_default().push(*slot);
                }
            }
            steps.push(Step { name: n.name.clone(), op: n.op.clone(), inputs, outputs });
        }
        let head = head_projection(&order, logits);
        let mut output_refs = Vec::with_capacity(outputs.len());
        for v in outputs {
            let r = if let Some(slot) = slot_of[*v] {
                Ref::Slot(slot)
            } else if let Some(k) = &g.values[*v].konst {
                consts.push(k.clone());
                Ref::Const(consts.len() - 1)
            } else {
                return Err(CompileError::tensor(&g.values[*v].name, "no step computes this output"));
            };
            output_refs.push((g.values[*v].name.clone(), r));
        }
        // A decoder's logits are computed by a step; a standalone graph's
        // first output may be a constant, and it has no logits to collect.
        let logits = match output_refs.first() {
            Some((_, Ref::Slot(s))) => *s,
            _ if binding.logits.is_empty() => 0,
            _ => return Err(CompileError::tensor(&binding.logits, "no step computes the logits")),
        };
        stats.planned_steps = steps.len();
        let values = order.iter().map(|n| n.outputs.len()).sum();
        Ok(Self {
            steps,
            consts,
            slot_widths,
            token_ids,
            position_ids,
            attention_mask,
            logits,
            head,
            inputs: input_slots,
            outputs: output_refs,
            binding: binding.clone(),
            stats,
            values,
        })
    }

    /// The steps in order.
    pub fn steps(&self) -> impl Iterator<Item = StepView<'_>> {
        self.steps.iter().map(|s| StepView { name: &s.name, op: &s.op, inputs: &s.inputs, outputs: &s.outputs })
    }

    /// Constant `i` (a [`Ref::Const`]).
    pub fn constant(&self, i: usize) -> &Value {
        &self.consts[i]
    }

    /// How many constants the steps read.
    pub fn constants(&self) -> usize {
        self.consts.len()
    }

    pub fn ports(&self) -> Ports {
        Ports {
            token_ids: self.token_ids,
            position_ids: self.position_ids,
            attention_mask: self.attention_mask,
            logits: self.logits,
            head: self.head,
        }
    }

    /// Buffer slots after sharing (compare with [`Plan::values`]).
    pub fn slots(&self) -> usize {
        self.slot_widths.len()
    }

    /// The row width every value of `slot` has, when the compiler knows it.
    pub fn slot_width(&self, slot: usize) -> Option<usize> {
        self.slot_widths.get(slot).copied().filter(|w| *w != 0)
    }

    /// Every projection step's weight, in plan order.
    fn projection_weights(&self) -> impl Iterator<Item = &crate::kernels::weights::Weight> + '_ {
        self.steps.iter().filter_map(|s| s.op.projection_weight().map(|w| &**w))
    }

    /// Multiply-adds of the projections per position (every weight used
    /// once; attention, which grows with the context, is not counted).
    pub fn projection_macs(&self) -> u64 {
        self.step_shapes().into_iter().flatten().map(|(n, k)| (n * k) as u64).sum()
    }

    /// Whether any projection quantizes its inputs to int8
    /// (`accuracy_level` 4): its arithmetic is integer, not f32.
    pub fn int8_projections(&self) -> bool {
        self.projection_weights().any(|w| w.int8_inputs())
    }

    /// Whether every tiled projection weight lives in one shared arena
    /// (the huge-page storage of [`crate::kernels::storage`]), and there
    /// is at least one.
    pub fn weights_in_one_arena(&self) -> bool {
        let mut arenas = self.projection_weights().filter_map(|w| match &w.packed {
            crate::kernels::weights::Packed::Tiled(t) => Some(t.lines.arena().map(|a| a.start())),
            _ => None,
        });
        let Some(Some(first)) = arenas.next() else { return false };
        arenas.all(|a| a == Some(first))
    }

    /// Bytes of packed projection weights (what a decode step streams).
    pub fn projection_bytes(&self) -> u64 {
        self.projection_weights().map(|w| w.bytes() as u64).sum()
    }

    /// The ops of the plan in order, by name (for `inspect` and tests).
    pub fn step_ops(&self) -> Vec<String> {
        self.steps.iter().map(|s| s.op.name()).collect()
    }

    /// Each step's projection weight as (outputs, inputs), indexed like
    /// [`Plan::step_ops`]; `None` for steps that project nothing.
    pub fn step_shapes(&self) -> Vec<Option<(usize, usize)>> {
        self.steps.iter().map(|s| s.op.projection_weight().map(|w| (w.n, w.k))).collect()
    }

    /// Whether the logits projection runs on each sequence's last row only
    /// (a prefill computes one row of logits, not one per prompt token).
    pub fn head_selects_rows(&self) -> bool {
        self.head.is_some()
    }

    /// Whether several sequences can share one run: nothing but attention
    /// needs to know where one sequence's rows end (no step reads the
    /// attention mask, no attention takes an additive bias).
    pub fn batchable(&self) -> bool {
        self.attention_mask.is_none()
            && self.steps.iter().all(|s| match &s.op {
                Op::Attention { spec, .. } => spec.bias == crate::kernels::attention::Bias::Causal,
                Op::CausalBias { .. } => false,
                _ => true,
            })
    }

    /// Fresh buffers for runs of this plan.
    pub fn workspace(&self) -> Workspace {
        Workspace { slots: vec![Value::default(); self.slots()], ..Workspace::default() }
    }

    /// Runs `tokens[i]` after what `kvs[i]` holds, for every sequence `i` of
    /// the batch at once, and writes each one's last-position logits into
    /// `logits[i]`. Each cache must have room reserved for its new
    /// positions. On error no cache's length changes.
    pub fn run(
        &self,
        ws: &mut Workspace,
        ctx: Ctx<'_>,
        kvs: &mut [&mut SeqKv],
        tokens: &[&[u32]],
        logits: &mut [&mut Vec<f32>],
    ) -> Result<(), RunError> {
        let fail = |reason: String| RunError { node: "(batch)".into(), op: "run".into(), reason };
        if kvs.len() != tokens.len() || kvs.len() != logits.len() || kvs.is_empty() {
            return Err(fail(format!(
                "{} caches, {} inputs and {} logit buffers do not form a batch",
                kvs.len(),
                tokens.len(),
                logits.len()
            )));
        }
        if kvs.len() > 1 && !self.batchable() {
            return Err(fail("this plan runs one sequence at a time".into()));
        }
        if ws.slots.len() != self.slots() {
            *ws = self.workspace();
        }
        ws.segments.clear();
        let mut rows = 0;
        for (kv, t) in kvs.iter().zip(tokens) {
            if t.is_empty() {
                return Err(fail("every sequence of a batch needs at least one token".into()));
            }
            ws.segments.push(Segment { start: rows, len: t.len(), past: kv.len() });
            rows += t.len();
        }
        self.feed(ws, tokens, rows);
        let Workspace { slots, segments, profile, trace } = ws;
        if let Some(t) = trace.as_mut() {
            t.clear();
        }
        let segments: &[Segment] = segments;
        if let Some(p) = profile.as_mut() {
            p.resize(self.steps.len(), Duration::ZERO);
        }
        let mut env = Env { ctx, batch: Some(BatchEnv { segments, kvs }) };
        for (index, step) in self.steps.iter().enumerate() {
            let started = profile.is_some().then(Instant::now);
            let head_rows = (self.head == Some(index) && segments.len() < rows).then_some(segments);
            let result = self.exec_step(step, slots, &mut env, head_rows);
            if let (Some(t), Some(first)) = (trace.as_mut(), step.outputs.first()) {
                t.push(slots[*first].clone());
            }
            result.map_err(|reason| RunError { node: step.name.clone(), op: step.op.name(), reason })?;
            if let (Some(p), Some(t)) = (profile.as_mut(), started) {
                p[index] += t.elapsed();
            }
        }
        self.collect(&slots[self.logits], segments, rows, logits, &env.ctx)?;
        if let Some(batch) = env.batch {
            for (kv, seg) in batch.kvs.iter_mut().zip(batch.segments) {
                kv.set_len(seg.past + seg.len);
            }
        }
        Ok(())
    }

    /// Runs one step on the slots: its outputs' buffers are taken out, the
    /// kernel writes them, they go back (also on error). With `head_rows`
    /// the step is the logits projection and runs on those rows only.
    fn exec_step(
        &self,
        step: &Step,
        slots: &mut [Value],
        env: &mut Env,
        head_rows: Option<&[Segment]>,
    ) -> Result<(), String> {
        let mut outs: SmallVec<[Value; 4]> = step.outputs.iter().map(|s| std::mem::take(&mut slots[*s])).collect();
        let result = {
            let ins: SmallVec<[Option<&Value>; 12]> = step
                .inputs
                .iter()
                .map(|r| {
                    r.map(|r| match r {
                        Ref::Const(c) => &*self.consts[c],
                        Ref::Slot(s) => &slots[s],
                    })
                })
                .collect();
            match head_rows {
                Some(segments) => self.head_rows(step, &ins, &mut outs, segments, &env.ctx),
                None => exec::run(&step.op, &ins, &mut outs, env),
            }
        };
        for (s, v) in step.outputs.iter().zip(outs) {
            slots[*s] = v;
        }
        result
    }

    /// Runs a standalone graph (see [`crate::compile_graph`]) on named
    /// inputs and returns its outputs in the graph's order. Every input a
    /// step reads must be given; names the plan does not read are ignored.
    pub fn evaluate(
        &self,
        ws: &mut Workspace,
        ctx: Ctx<'_>,
        inputs: Vec<(String, Value)>,
    ) -> Result<Vec<(String, Value)>, RunError> {
        let fail = |reason: String| RunError { node: "(graph)".into(), op: "evaluate".into(), reason };
        if ws.slots.len() != self.slots() {
            *ws = self.workspace();
        }
        let mut fed = vec![false; self.inputs.len()];
        for (name, value) in inputs {
            if let Some(i) = self.inputs.iter().position(|(n, _)| *n == name) {
                ws.slots[self.inputs[i].1] = value;
                fed[i] = true;
            }
        }
        if let Some(i) = fed.iter().position(|f| !f) {
            return Err(fail(format!("graph input `{}` was not given", self.inputs[i].0)));
        }
        let mut env = Env { ctx, batch: None };
        for step in &self.steps {
            self.exec_step(step, &mut ws.slots, &mut env, None).map_err(|reason| RunError {
                node: step.name.clone(),
                op: step.op.name(),
                reason,
            })?;
        }
        Ok(self
            .outputs
            .iter()
            .map(|(name, r)| {
                let value = match r {
                    Ref::Const(c) => (*self.consts[*c]).clone(),
                    Ref::Slot(s) => ws.slots[*s].clone(),
                };
                (name.clone(), value)
            })
            .collect())
    }

    /// Writes the graph inputs: token ids, positions (each sequence's own,
    /// back to back) and, for a plan that reads it, the attention mask.
    fn feed(&self, ws: &mut Workspace, tokens: &[&[u32]], rows: usize) {
        if let Some(s) = self.token_ids {
            let mut ids = ws.slots[s].recycle_i64(0);
            ids.extend(tokens.iter().flat_map(|t| t.iter().map(|id| i64::from(*id))));
            ws.slots[s] = Value::i64([1, rows], ids);
        }
        if let Some(s) = self.position_ids {
            let mut pos = ws.slots[s].recycle_i64(0);
            for seg in &ws.segments {
                pos.extend((seg.past..seg.past + seg.len).map(|p| p as i64));
            }
            ws.slots[s] = Value::i64([1, rows], pos);
        }
        if let (Some(s), Some(seg)) = (self.attention_mask, ws.segments.first()) {
            let total = seg.past + seg.len;
            let mut mask = ws.slots[s].recycle_i64(total);
            mask.iter_mut().for_each(|m| *m = 1);
            ws.slots[s] = Value::i64([1, total], mask);
        }
    }

    /// The logits projection on each sequence's last row only.
    fn head_rows(
        &self,
        step: &Step,
        ins: &[Option<&Value>],
        outs: &mut [Value],
        segments: &[Segment],
        ctx: &Ctx,
    ) -> Result<(), String> {
        let Op::Linear { weight, bias } = &step.op else { return Err("the head is not a projection".into()) };
        let x = ins.first().copied().flatten().ok_or("input 0 is missing")?;
        let xs = x.as_f32()?;
        let k = weight.k;
        if x.shape.last() != Some(&k) {
            return Err(format!("input {:?} does not end in the weight's {k} inputs", x.shape));
        }
        let mut staged = ctx.staging();
        let mut picked = std::mem::take(&mut staged.picked);
        drop(staged);
        picked.clear();
        for seg in segments {
            let last = seg.start + seg.len - 1;
            let row = xs.get(last * k..(last + 1) * k).ok_or("the head's input has fewer rows than the batch")?;
            picked.extend_from_slice(row);
        }
        let out = outs.first_mut().ok_or("no output")?;
        let mut y = out.take_f32();
        linear(&picked, segments.len(), weight, bias.as_deref().map(Vec::as_slice), &mut y, ctx);
        ctx.staging().picked = picked;
        *out = Value::f32([1, segments.len(), weight.n], y);
        Ok(())
    }

    /// Copies each sequence's last-position logits out of the logits value
    /// (one row per sequence after the row-selecting head, else every row).
    /// A batch's rows are copied by all the threads: 16 sequences of
    /// SmolLM2 copy 3 MB a step, 1% of the driver thread's time serving
    /// them while the other thread waited.
    fn collect(
        &self,
        value: &Value,
        segments: &[Segment],
        rows: usize,
        logits: &mut [&mut Vec<f32>],
        ctx: &Ctx,
    ) -> Result<(), RunError> {
        let vocab = self.binding.vocab_size;
        let err = |reason: String| RunError { node: self.binding.logits.clone(), op: "output".into(), reason };
        let data = value.as_f32().map_err(err)?;
        let per_sequence = data.len() == segments.len() * vocab && self.head.is_some() && segments.len() < rows;
        if value.shape.last() != Some(&vocab) || (!per_sequence && data.len() != rows * vocab) {
            return Err(err(format!("logits shape {:?} does not hold {rows} rows of vocab {vocab}", value.shape)));
        }
        let outs = Disjoint::new(logits);
        let copy = |range: std::ops::Range<usize>, _t: usize| {
            for i in range {
                let seg = segments[i];
                let row = if per_sequence { i } else { seg.start + seg.len - 1 };
                // SAFETY: sequence `i`'s buffer belongs to this range alone.
                let out = unsafe { &mut outs.slice(i, 1)[0] };
                out.clear();
                out.extend_from_slice(&data[row * vocab..(row + 1) * vocab]);
            }
        };
        // (One sequence runs inline: `for_ranges` splits nothing smaller
        // than its unit.)
        ctx.pool.for_ranges(segments.len(), 1, &copy);
        Ok(())
    }
}

/// The step index of the projection that computes the logits (the
/// compiler has removed the Identity exporters put before a graph output):
/// it may run on each sequence's last row alone, as nothing else reads its
/// rows.
fn head_projection(order: &[Node], logits: Vid) -> Option<usize> {
    let at = order.iter().position(|n| n.outputs.first() == Some(&logits))?;
    matches!(order[at].op, Op::Linear { .. }).then_some(at)
}
