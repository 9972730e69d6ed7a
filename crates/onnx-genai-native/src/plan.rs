//! The execution plan: the compiled steps in order, constants, and a static
//! memory plan. Every value a step produces is assigned a slot at compile
//! time; values whose lifetimes do not overlap share a slot, and a slot's
//! buffer is reused from step to step, so a warmed-up decode step allocates
//! (almost) nothing.

use std::sync::Arc;

use crate::compile::{Binding, CompileStats};
use crate::error::{CompileError, RunError};
use crate::exec::{self, KvContext};
use crate::graph::{Graph, Vid};
use crate::kernels::attention::LayerCache;
use crate::ops::Op;
use crate::value::Value;

#[derive(Clone, Copy, Debug)]
enum Ref {
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

/// A compiled decoder. Immutable and shareable; per-sequence state lives in
/// [`State`].
#[derive(Debug)]
pub struct Plan {
    steps: Vec<Step>,
    consts: Vec<Arc<Value>>,
    slots: usize,
    token_ids: Option<usize>,
    position_ids: Option<usize>,
    attention_mask: Option<usize>,
    logits: usize,
    pub binding: Binding,
    pub stats: CompileStats,
    /// Values the plan computes (before slot sharing).
    pub values: usize,
}

/// One sequence's buffers and KV cache.
pub struct State {
    slots: Vec<Value>,
    cache: Vec<LayerCache>,
    len: usize,
}

impl State {
    /// Tokens held in the KV cache.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Forgets positions from `len` on; O(1): the cache is overwritten in
    /// place by later steps.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    pub fn kv_bytes(&self) -> usize {
        self.cache.iter().map(LayerCache::allocated_bytes).sum()
    }
}

impl Plan {
    pub(crate) fn build(
        g: Graph,
        binding: &Binding,
        logits: Vid,
        mut stats: CompileStats,
    ) -> Result<Self, CompileError> {
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
        let mut free: Vec<usize> = Vec::new();
        let mut slots = 0;
        let mut alloc = |free: &mut Vec<usize>| {
            free.pop().unwrap_or_else(|| {
                slots += 1;
                slots - 1
            })
        };
        let input_slot = |name: &Option<String>,
                          slot_of: &mut Vec<Option<usize>>,
                          free: &mut Vec<usize>,
                          alloc: &mut dyn FnMut(&mut Vec<usize>) -> usize| {
            let v = name.as_ref().and_then(|n| g.find(n))?;
            last_use[v]?;
            let s = alloc(free);
            slot_of[v] = Some(s);
            Some(s)
        };
        let token_ids = input_slot(&Some(binding.token_ids.clone()), &mut slot_of, &mut free, &mut alloc);
        let position_ids = input_slot(&binding.position_ids, &mut slot_of, &mut free, &mut alloc);
        let attention_mask = input_slot(&binding.attention_mask, &mut slot_of, &mut free, &mut alloc);
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
            let outputs: Vec<usize> = n.outputs.iter().map(|_| alloc(&mut free)).collect();
            for (v, slot) in n.outputs.iter().zip(&outputs) {
                slot_of[*v] = Some(*slot);
            }
            for v in n.inputs.iter().flatten() {
                if last_use[*v] == Some(s) && *v != logits {
                    if let Some(slot) = slot_of[*v].take() {
                        free.push(slot);
                    }
                }
            }
            for (v, slot) in n.outputs.iter().zip(&outputs) {
                if last_use[*v].is_none() && *v != logits {
                    slot_of[*v] = None;
                    free.push(*slot);
                }
            }
            steps.push(Step { name: n.name.clone(), op: n.op.clone(), inputs, outputs });
        }
        let logits =
            slot_of[logits].ok_or_else(|| CompileError::tensor(&binding.logits, "no step computes the logits"))?;
        stats.planned_steps = steps.len();
        let values = order.iter().map(|n| n.outputs.len()).sum();
        Ok(Self {
            steps,
            consts,
            slots,
            token_ids,
            position_ids,
            attention_mask,
            logits,
            binding: binding.clone(),
            stats,
            values,
        })
    }

    /// Buffer slots after sharing (compare with [`Plan::values`]).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The ops of the plan in order, by name (for `inspect` and tests).
    pub fn step_ops(&self) -> Vec<String> {
        self.steps.iter().map(|s| s.op.name()).collect()
    }

    /// A fresh sequence with a KV cache of `capacity` positions.
    pub fn new_state(&self, capacity: usize) -> State {
        let cache = self
            .binding
            .layers
            .iter()
            .map(|l| LayerCache::new(l.kv_heads, l.head_dim, capacity, self.binding.kv_f16))
            .collect();
        State { slots: vec![Value::default(); self.slots], cache, len: 0 }
    }

    /// Runs `tokens` after what `state` holds; returns the last position's
    /// logits. On error the state's length is unchanged.
    /// `pool`: where large kernels may run in parallel (`None`: all on
    /// the calling thread).
    pub fn run(
        &self,
        state: &mut State,
        tokens: &[u32],
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Vec<f32>, RunError> {
        self.run_profiled(state, tokens, pool, None)
    }

    /// [`Plan::run`], adding each step's wall time to `profile` (indexed
    /// like [`Plan::step_ops`]) when given.
    pub fn run_profiled(
        &self,
        state: &mut State,
        tokens: &[u32],
        pool: Option<&rayon::ThreadPool>,
        mut profile: Option<&mut Vec<std::time::Duration>>,
    ) -> Result<Vec<f32>, RunError> {
        if let Some(p) = profile.as_deref_mut() {
            p.resize(self.steps.len(), std::time::Duration::ZERO);
        }
        let past = state.len;
        let total = past + tokens.len();
        let feed = |slot: Option<usize>, v: Value, slots: &mut Vec<Value>| {
            if let Some(s) = slot {
                slots[s] = v;
            }
        };
        let seq = tokens.len();
        feed(
            self.token_ids,
            Value::i64(vec![1, seq], tokens.iter().map(|t| i64::from(*t)).collect()),
            &mut state.slots,
        );
        feed(self.position_ids, Value::i64(vec![1, seq], (past as i64..total as i64).collect()), &mut state.slots);
        feed(self.attention_mask, Value::i64(vec![1, total], vec![1; total]), &mut state.slots);
        let mut kv = KvContext { layers: &mut state.cache, past, pool };
        for (index, step) in self.steps.iter().enumerate() {
            let started = profile.is_some().then(std::time::Instant::now);
            let mut outs: Vec<Value> = step.outputs.iter().map(|s| std::mem::take(&mut state.slots[*s])).collect();
            let result = {
                let ins: Vec<Option<&Value>> = step
                    .inputs
                    .iter()
                    .map(|r| {
                        r.map(|r| match r {
                            Ref::Const(c) => &*self.consts[c],
                            Ref::Slot(s) => &state.slots[s],
                        })
                    })
                    .collect();
                exec::run(&step.op, &ins, &mut outs, Some(&mut kv))
            };
            for (s, v) in step.outputs.iter().zip(outs) {
                state.slots[*s] = v;
            }
            result.map_err(|reason| RunError { node: step.name.clone(), op: step.op.name(), reason })?;
            if let (Some(p), Some(t)) = (profile.as_deref_mut(), started) {
                p[index] += t.elapsed();
            }
        }
        let logits = &state.slots[self.logits];
        let vocab = self.binding.vocab_size;
        let data = logits.as_f32().map_err(|reason| RunError {
            node: self.binding.logits.clone(),
            op: "output".into(),
            reason,
        })?;
        if logits.shape.last() != Some(&vocab) || data.len() < vocab {
            return Err(RunError {
                node: self.binding.logits.clone(),
                op: "output".into(),
                reason: format!("logits shape {:?} does not end in vocab {vocab}", logits.shape),
            });
        }
        state.len = total;
        Ok(data[data.len() - vocab..].to_vec())
    }
}
