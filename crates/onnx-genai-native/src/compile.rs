//! The compiler driver: import (lowering with liveness), inference and
//! constant folding, weight packing and fusion, KV binding, dead-code
//! elimination, then the plan.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use onnx_genai_onnx::ir::{Graph as IrGraph, Model};
use onnx_genai_package::{ElementType, Package, Role};

use crate::error::CompileError;
use crate::graph::{Graph, Node, Uses, Vid};
use crate::kernels::attention::AttentionSpec;
use crate::kernels::weights::{Packed, Weight};
use crate::lower::{constant_value, lower};
use crate::ops::Op;
use crate::plan::Plan;
use crate::pool::ThreadPool;
use crate::value::{DType, Value};

/// One layer's KV ports and geometry.
pub type LayerBinding = onnx_genai_package::KvPorts;

/// What the manifest says about the decoder's ports: the compiler never
/// guesses a role from a tensor name.
#[derive(Clone, Debug, Default)]
pub struct Binding {
    pub token_ids: String,
    pub position_ids: Option<String>,
    pub attention_mask: Option<String>,
    pub logits: String,
    pub layers: Vec<LayerBinding>,
    pub heads: usize,
    pub kv_f16: bool,
    pub max_sequence_length: usize,
    pub vocab_size: usize,
}

impl Binding {
    /// The bound layers' KV geometry with every value stored as `dtype`
    /// (what a backend keeps per position; its bytes from the one place
    /// that counts them, [`KvGeometry::bytes_per_token`]).
    pub fn kv_geometry(&self, dtype: ElementType) -> onnx_genai_package::KvGeometry {
        onnx_genai_package::KvGeometry::from_ports(dtype, &self.layers)
    }

    pub fn from_package(package: &Package) -> Result<(Self, std::path::PathBuf), CompileError> {
        let (component, path) = package.decoder().map_err(|e| CompileError::Graph(e.to_string()))?;
        let port = |role: Role| {
            component
                .port(role)
                .map(str::to_string)
                .ok_or_else(|| CompileError::Graph(format!("no `{}` port is bound", role.as_str())))
        };
        let geometry = package.kv_tensors();
        let layers = package.kv_ports(component).map_err(|e| CompileError::Graph(e.to_string()))?;
        let a = &package.manifest.architecture;
        let binding = Self {
            token_ids: port(Role::TokenIds)?,
            position_ids: component.port(Role::PositionIds).map(str::to_string),
            attention_mask: component.port(Role::AttentionMask).map(str::to_string),
            logits: port(Role::Logits)?,
            layers,
            heads: a.num_attention_heads as usize,
            kv_f16: geometry.dtype == ElementType::F16,
            max_sequence_length: a.max_sequence_length as usize,
            vocab_size: a.vocab_size as usize,
        };
        Ok((binding, path.to_path_buf()))
    }
}

/// What the passes did, for `inspect` and the compile tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompileStats {
    pub imported_nodes: usize,
    pub folded_nodes: usize,
    pub fusions: Vec<(String, usize)>,
    pub planned_steps: usize,
}

impl CompileStats {
    pub fn fused(&self, kind: &str) -> usize {
        self.fusions.iter().filter(|(k, _)| k == kind).map(|(_, n)| n).sum()
    }
}

/// The form projection weights take in a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightForm {
    /// Repacked into the CPU kernels' tiles (f32 and f16 weights narrowed
    /// to 8-bit blocks, Q4_1's affine 4-bit blocks or f16 where exact:
    /// [`crate::kernels::weights::Weight::narrowed`]): what native-cpu runs.
    Tiled,
    /// Left as output rows (`[N, K]` f32, f16 or 4-bit blocks): for a
    /// backend with kernels of its own (native-cuda uploads these).
    Rows,
}

/// Compiles on the calling thread alone (tests, the fuzzer: small models).
pub fn compile(model: &Model, binding: &Binding) -> Result<Plan, CompileError> {
    compile_with(model, binding, WeightForm::Tiled, &ThreadPool::serial())
}

/// [`compile`] with the projection weights in `form`, narrowing them on
/// `pool`'s threads (a model compiles on the pool it will run on).
pub fn compile_with(
    model: &Model,
    binding: &Binding,
    form: WeightForm,
    pool: &ThreadPool,
) -> Result<Plan, CompileError> {
    let opset =
        model.opset("").ok_or_else(|| CompileError::Graph("the model imports no default-domain opset".into()))?;
    let mut stats = CompileStats::default();
    let mut g = import(&model.graph, binding, opset)?;
    stats.imported_nodes = g.live_nodes().count();
    stats.folded_nodes = infer_and_fold(&mut g)?;
    crate::fuse::run(&mut g, &mut stats)?;
    bind_kv(&mut g, binding)?;
    causal_attention(&mut g);
    let logits = g.find(&binding.logits).ok_or_else(|| CompileError::tensor(&binding.logits, "not in the graph"))?;
    eliminate_dead(&mut g, &[logits]);
    release_unread_constants(&mut g, &[logits]);
    forward_identities(&mut g, &[logits], &mut stats);
    check_kv_is_owned(&g, binding)?;
    if form == WeightForm::Tiled {
        let stacks = crate::fuse::stack_siblings(&mut g, logits, pool);
        if stacks > 0 {
            stats.fusions.push(("stack_projections".into(), stacks));
        }
        for (kind, count) in repack(&mut g, pool) {
            if count > 0 {
                stats.fusions.push((format!("narrow_{kind}"), count));
            }
        }
        gather_weights(&mut g);
    }
    let inputs: Vec<String> = std::iter::once(&binding.token_ids)
        .chain(binding.position_ids.as_ref())
        .chain(binding.attention_mask.as_ref())
        .cloned()
        .collect();
    Plan::build(g, binding, &inputs, &[logits], stats)
}

/// Compiles a standalone graph (no decoder ports, no KV cache): every graph
/// input becomes a plan input bound by name, every graph output is
/// computed. This is how single operators are held to ONNX's own backend
/// test cases (`cargo xtask onnx-tests`); the passes are the decoder's, so
/// what passes here is what a decoder export gets.
pub fn compile_graph(model: &Model) -> Result<Plan, CompileError> {
    let ir = &model.graph;
    // A graph of other domains' ops alone needs no default opset (its nodes
    // are refused by name when lowered).
    let opset = match model.opset("") {
        Some(v) => v,
        None if ir.nodes.iter().all(|n| !n.domain.is_empty()) => 0,
        None => return Err(CompileError::Graph("the model imports no default-domain opset".into())),
    };
    let roots: HashSet<&str> = ir.outputs.iter().map(|o| o.name.as_str()).collect();
    let mut stats = CompileStats::default();
    let mut g = import_from(ir, roots, opset)?;
    stats.imported_nodes = g.live_nodes().count();
    stats.folded_nodes = infer_and_fold(&mut g)?;
    crate::fuse::run(&mut g, &mut stats)?;
    if let Some((_, n)) = g.live_nodes().find(|(_, n)| matches!(n.op, Op::Attention { .. })) {
        let (domain, op) = n.origin.split_once("::").unwrap_or(("ai.onnx", n.origin.as_str()));
        return Err(CompileError::UnsupportedOp {
            node: n.name.clone(),
            op: op.into(),
            domain: domain.into(),
            reason: "attention runs only in a decoder, over a KV cache the manifest binds".into(),
        });
    }
    let mut outputs = Vec::with_capacity(ir.outputs.len());
    for o in &ir.outputs {
        outputs.push(g.find(&o.name).ok_or_else(|| CompileError::tensor(&o.name, "graph output is never produced"))?);
    }
    eliminate_dead(&mut g, &outputs);
    forward_identities(&mut g, &outputs, &mut stats);
    repack(&mut g, &ThreadPool::serial());
    let inputs: Vec<String> = ir.inputs.iter().map(|i| i.name.clone()).collect();
    Plan::build(g, &Binding::default(), &inputs, &outputs, stats)
}

/// Lowers the nodes that contribute to the logits or the KV outputs, walking
/// backwards so that inputs an op ignores never pull in their producers.
fn import(ir: &IrGraph, binding: &Binding, opset: i64) -> Result<Graph, CompileError> {
    if ir.output(&binding.logits).is_none() {
        return Err(CompileError::tensor(&binding.logits, "the logits port is not a graph output"));
    }
    let mut needed: HashSet<&str> = HashSet::new();
    needed.insert(&binding.logits);
    for l in &binding.layers {
        for (port, input) in
            [(&l.present_key, false), (&l.present_value, false), (&l.past_key, true), (&l.past_value, true)]
        {
            let found = if input { ir.input(port).is_some() } else { ir.output(port).is_some() };
            if !found {
                let kind = if input { "input" } else { "output" };
                return Err(CompileError::tensor(
                    port,
                    format!("the manifest binds it as a KV {kind} but the graph has no such {kind}"),
                ));
            }
            if !input {
                needed.insert(port);
            }
        }
    }
    import_from(ir, needed, opset)
}

/// Lowers, walking backwards from `needed`, every node that computes one of
/// those values.
fn import_from<'a>(ir: &'a IrGraph, mut needed: HashSet<&'a str>, opset: i64) -> Result<Graph, CompileError> {
    let mut producers: HashMap<&str, usize> = HashMap::new();
    for (i, n) in ir.nodes.iter().enumerate() {
        for o in n.outputs.iter().filter(|o| !o.is_empty()) {
            if producers.insert(o, i).is_some() {
                return Err(CompileError::tensor(o, "is produced by more than one node"));
            }
        }
    }
    let mut lowered: Vec<Option<(Op, Vec<Option<String>>)>> = vec![None; ir.nodes.len()];
    let mut constants: HashMap<String, Value> = HashMap::new();
    for (i, node) in ir.nodes.iter().enumerate().rev() {
        if !node.outputs.iter().any(|o| needed.contains(o.as_str())) {
            continue;
        }
        if node.domain.is_empty() && node.op_type == "Constant" {
            let v = constant_value(node)?;
            constants.insert(node.outputs.first().cloned().unwrap_or_default(), v);
            continue;
        }
        let (op, used) = lower(node, opset)?;
        // The statistics outputs the RMS norms do not write (an output read
        // but never written would be an empty tensor).
        let statistics: &[usize] = match op {
            Op::SkipRmsNorm { .. } => &[1, 2],
            Op::RmsNorm { .. } => &[1],
            _ => &[],
        };
        if let Some(o) = statistics.iter().find(|o| node.outputs.get(**o).is_some_and(|n| needed.contains(n.as_str())))
        {
            return Err(CompileError::UnsupportedOp {
                node: node.name.clone(),
                op: node.op_type.clone(),
                domain: node.domain.clone(),
                reason: format!("output {o} (mean / inverse std) is not produced by native-cpu"),
            });
        }
        let inputs: Vec<Option<String>> =
            used.iter().map(|u| node.inputs.get(*u).filter(|n| !n.is_empty()).cloned()).collect();
        for u in &used {
            if let Some(name) = node.inputs.get(*u).filter(|n| !n.is_empty()) {
                needed.insert(name);
            }
        }
        lowered[i] = Some((op, inputs));
    }
    let mut g = Graph::default();
    for input in &ir.inputs {
        let v = g.value(&input.name);
        g.values[v].dtype = DType::from_onnx(input.dtype);
        g.values[v].dims =
            input.shape.as_ref().map(|s| s.iter().map(|d| d.fixed().and_then(|x| usize::try_from(x).ok())).collect());
        if DType::from_onnx(input.dtype).is_none() && needed.contains(input.name.as_str()) {
            return Err(CompileError::tensor(
                &input.name,
                format!("graph input of type {} is not supported", input.dtype),
            ));
        }
    }
    for init in &ir.initializers {
        if !needed.contains(init.name.as_str()) {
            continue;
        }
        let value = Value::from_tensor(init).map_err(|e| CompileError::tensor(&init.name, e))?;
        let v = g.value(&init.name);
        g.values[v].konst = Some(Arc::new(value));
    }
    for (name, value) in constants {
        let v = g.value(&name);
        g.values[v].konst = Some(Arc::new(value));
    }
    for (node, low) in ir.nodes.iter().zip(lowered) {
        let Some((op, inputs)) = low else { continue };
        let inputs = inputs.iter().map(|n| n.as_ref().map(|n| g.value(n))).collect();
        let outputs = node
            .outputs
            .iter()
            .enumerate()
            .map(|(i, o)| if o.is_empty() { g.fresh(&format!("{}#{i}", node.name)) } else { g.value(o) })
            .collect();
        let domain = if node.domain.is_empty() { "ai.onnx" } else { &node.domain };
        g.nodes.push(Some(Node {
            name: node.name.clone(),
            origin: format!("{domain}::{}", node.op_type),
            op,
            inputs,
            outputs,
        }));
    }
    // Everything read must come from somewhere.
    let produced: HashSet<Vid> = g.live_nodes().flat_map(|(_, n)| n.outputs.clone()).collect();
    let graph_inputs: HashSet<&str> = ir.inputs.iter().map(|i| i.name.as_str()).collect();
    for (_, n) in g.live_nodes() {
        for v in n.inputs.iter().flatten() {
            let meta = &g.values[*v];
            if meta.konst.is_none() && !produced.contains(v) && !graph_inputs.contains(meta.name.as_str()) {
                return Err(CompileError::node(&n.name, &n.origin, format!("input `{}` is never produced", meta.name)));
            }
        }
    }
    Ok(g)
}

/// Bytes of constants folding may make beyond [`FOLD_PER_INITIALIZER_BYTE`]
/// times the graph's own: a decoder's folds are shapes, masks and
/// weights transposed or dequantized (SmolLM2's int4 export folds one
/// transposed f32 embedding, 113 MB, from initializers of that size and
/// more).
const FOLD_ALLOWANCE: usize = 256 << 20;

/// Folded bytes allowed per byte of initializer: a 4-bit weight
/// dequantized to f32 is 8 times its own.
const FOLD_PER_INITIALIZER_BYTE: usize = 8;

/// Infers every value's dtype and dims in order, and evaluates nodes whose
/// inputs are all constant. Casts of f16 weights into a MatMul are kept so
/// the weight can stay f16 (see `fuse::pack_linear`).
///
/// What folding makes is held to a budget from the graph's initializers:
/// a fold's size is known before it runs (from the inferred dims, or for
/// the ops that grow a constant from a shape or a pair of vectors —
/// `ConstantOfShape`, `Tile`, `Expand`, `Range`, `Gemm` — from those
/// constants; the rest make no more than their inputs or check their
/// output against the kernels' element bound), so a
/// crafted graph asking gigabytes of constants from a few bytes is an
/// error naming the node, not a load that takes the machine's memory.
fn infer_and_fold(g: &mut Graph) -> Result<usize, CompileError> {
    let uses = Uses::of(g);
    let mut folded = 0;
    let initializers: usize =
        g.values.iter().filter_map(|m| m.konst.as_ref()).map(|v| v.len() * v.dtype().size()).sum();
    let budget = FOLD_ALLOWANCE.saturating_add(initializers.saturating_mul(FOLD_PER_INITIALIZER_BYTE));
    let mut made = 0usize;
    let serial = crate::kernels::Runtime::serial();
    for i in 0..g.nodes.len() {
        let Some(node) = g.nodes[i].clone() else { continue };
        let metas: Vec<Option<&crate::graph::Meta>> = node.inputs.iter().map(|v| v.map(|v| &g.values[v])).collect();
        let outs = crate::infer::infer(&node.op, &metas, node.outputs.len())
            .map_err(|e| CompileError::node(&node.name, &node.origin, e))?;
        for (o, (dtype, dims)) in node.outputs.iter().zip(outs) {
            g.values[*o].dtype = dtype;
            g.values[*o].dims = dims;
        }
        let all_const = node.inputs.iter().flatten().all(|v| g.values[*v].konst.is_some());
        if !all_const || !node.op.foldable() || keeps_f16_weight(g, &uses, &node) {
            continue;
        }
        let inputs: Vec<Option<&Value>> = node.inputs.iter().map(|v| v.and_then(|v| g.konst(v))).collect();
        let over = |bytes: usize| {
            CompileError::node(
                &node.name,
                &node.origin,
                format!(
                    "folding it brings the graph's folded constants to {bytes} bytes, past the {budget} \
                     folding may make for it ({FOLD_ALLOWANCE} plus {FOLD_PER_INITIALIZER_BYTE} per byte of \
                     its {initializers} bytes of initializers): a decoder folds shapes, masks and weights, \
                     not this"
                ),
            )
        };
        let ahead = node
            .outputs
            .iter()
            .try_fold(0usize, |n, o| Some(n.saturating_add(fold_bytes(&node.op, &inputs, &g.values[*o])?)));
        if let Some(total) = ahead.map(|bytes| made.saturating_add(bytes)) {
            if total > budget {
                return Err(over(total));
            }
        }
        let mut outputs = vec![Value::default(); node.outputs.len()];
        let mut env = crate::exec::Env { ctx: serial.ctx(), batch: None };
        crate::exec::run(&node.op, &inputs, &mut outputs, &mut env)
            .map_err(|e| CompileError::node(&node.name, &node.origin, e))?;
        made = outputs.iter().fold(made, |made, v| made.saturating_add(v.len() * v.dtype().size()));
        if made > budget {
            return Err(over(made));
        }
        for (o, value) in node.outputs.iter().zip(outputs) {
            g.values[*o].dtype = Some(value.dtype());
            g.values[*o].konst = Some(Arc::new(value));
        }
        g.nodes[i] = None;
        folded += 1;
    }
    Ok(folded)
}

/// The bytes folding `op` makes into `out`, where known before it runs:
/// from `out`'s inferred dims, or for the ops inference leaves unsized
/// that grow a constant from a shape or two vectors, from their constant
/// inputs. `None`:
/// not known (the fold then runs under the kernels' own element bound,
/// and its size counts after).
fn fold_bytes(op: &Op, inputs: &[Option<&Value>], out: &crate::graph::Meta) -> Option<usize> {
    let dtype = out.dtype?;
    let shape = |i: usize| inputs.get(i).copied().flatten().map(|v| v.shape.to_vec());
    let ints = |i: usize| inputs.get(i).copied().flatten().and_then(|v| v.ints());
    let dims: Vec<usize> = match (out.dims.as_ref().and_then(|d| d.iter().copied().collect()), op) {
        (Some(dims), _) => dims,
        (None, Op::ConstantOfShape(_)) => ints(0)?.iter().map(|d| (*d).max(0) as usize).collect(),
        (None, Op::Tile) => {
            shape(0)?.iter().zip(ints(1)?).map(|(d, r)| d.saturating_mul((*r).max(0) as usize)).collect()
        }
        (None, Op::Expand) => {
            let target: Vec<usize> = ints(1)?.iter().map(|d| (*d).max(0) as usize).collect();
            crate::kernels::elementwise::broadcast_shape(&shape(0)?, &target)?.to_vec()
        }
        (None, Op::Range) => {
            let arg = |i: usize| inputs.get(i).copied().flatten();
            // (Past the kernels' own bound: the kernel refuses it, by name.)
            vec![crate::kernels::layout::range_len(arg(0)?, arg(1)?, arg(2)?).ok()?]
        }
        (None, Op::Gemm { trans_a, trans_b, .. }) => {
            let (a, b) = (shape(0)?, shape(1)?);
            let (&[ra, ca], &[rb, cb]) = (a.as_slice(), b.as_slice()) else { return None };
            vec![if *trans_a { ca } else { ra }, if *trans_b { rb } else { cb }]
        }
        _ => return None,
    };
    dims.iter().try_fold(dtype.size(), |n, d| n.checked_mul(*d)).or(Some(usize::MAX))
}

fn keeps_f16_weight(g: &Graph, uses: &Uses, node: &Node) -> bool {
    let (Op::Cast(DType::F32), Some(Some(src))) = (&node.op, node.inputs.first()) else { return false };
    let is_f16 = g.konst(*src).is_some_and(|v| v.dtype() == DType::F16 && v.shape.len() == 2);
    let consumers = &uses.consumers[node.outputs[0]];
    is_f16
        && !consumers.is_empty()
        && consumers.iter().all(|c| {
            g.nodes[*c]
                .as_ref()
                .is_some_and(|n| matches!(n.op, Op::MatMul) && n.inputs.get(1) == Some(&Some(node.outputs[0])))
        })
}

/// Ties each attention's past/present edges to a KV cache layer and fills in
/// its geometry.
fn bind_kv(g: &mut Graph, binding: &Binding) -> Result<(), CompileError> {
    let past_key: HashMap<&str, usize> =
        binding.layers.iter().enumerate().map(|(i, l)| (l.past_key.as_str(), i)).collect();
    let mut bound = vec![false; binding.layers.len()];
    for i in 0..g.nodes.len() {
        let Some(node) = &g.nodes[i] else { continue };
        let Op::Attention { spec, .. } = &node.op else { continue };
        let err = |reason: String| CompileError::node(&node.name, &node.origin, reason);
        let past = node.inputs.get(4).copied().flatten().ok_or_else(|| err("attention has no past_key input: native-cpu keeps the KV cache in place and needs the past/present ports".into()))?;
        let past_name = g.values[past].name.clone();
        let layer = *past_key
            .get(past_name.as_str())
            .ok_or_else(|| err(format!("past key `{past_name}` is not a KV port bound by the manifest")))?;
        let l = &binding.layers[layer];
        let names = |slot: Option<Vid>| slot.map(|v| g.values[v].name.as_str());
        let expect = [
            (names(node.inputs.get(5).copied().flatten()), l.past_value.as_str(), "past value"),
            (names(node.outputs.get(1).copied()), l.present_key.as_str(), "present key"),
            (names(node.outputs.get(2).copied()), l.present_value.as_str(), "present value"),
        ];
        for (found, want, what) in expect {
            if found != Some(want) {
                return Err(err(format!(
                    "{what} is `{}`, the manifest binds layer {layer} to `{want}`",
                    found.unwrap_or("(none)")
                )));
            }
        }
        if bound[layer] {
            return Err(err(format!("a second attention uses layer {layer}'s KV cache")));
        }
        bound[layer] = true;
        let heads = spec.heads.unwrap_or(binding.heads);
        let kv_heads = spec.kv_heads.unwrap_or(l.kv_heads);
        if kv_heads != l.kv_heads || heads % kv_heads.max(1) != 0 {
            return Err(err(format!(
                "{heads} query heads over {kv_heads} KV heads; the manifest declares {} KV heads for layer {layer}",
                l.kv_heads
            )));
        }
        let (v, what) = (past, "past key");
        if let Some(dims) = &g.values[v].dims {
            let want = [None, Some(l.kv_heads), None, Some(l.head_dim)];
            let bad =
                dims.len() != 4 || dims.iter().zip(want).any(|(d, w)| matches!((d, w), (Some(a), Some(b)) if *a != b));
            if bad {
                return Err(err(format!(
                    "{what} `{}` has dims {dims:?}; the manifest's KV geometry is [batch, {}, past, {}]",
                    g.values[v].name, l.kv_heads, l.head_dim
                )));
            }
        }
        let want = if binding.kv_f16 { DType::F16 } else { DType::F32 };
        if let Some(dt) = g.values[v].dtype.filter(|dt| *dt != want) {
            return Err(err(format!("{what} `{}` is {dt}; the manifest's KV dtype is {want}", g.values[v].name)));
        }
        let resolved = AttentionSpec {
            heads,
            kv_heads,
            head_dim: l.head_dim,
            scale: spec.scale.unwrap_or(1.0 / (l.head_dim as f32).sqrt()),
            q_layout: spec.q_layout,
            kv_layout: spec.kv_layout,
            out_layout: spec.out_layout,
            bias: spec.bias,
        };
        let Some(node) = g.nodes[i].as_mut() else { continue };
        if let Op::Attention { spec, layer: slot } = &mut node.op {
            spec.resolved = Some(resolved);
            *slot = Some(layer);
        }
        // The past inputs (4 and 5) and present outputs become the cache;
        // rotary caches after them stay inputs.
        let caches: Vec<Option<Vid>> = node.inputs.iter().skip(6).copied().collect();
        node.inputs.truncate(4);
        node.inputs.extend(caches);
        node.outputs.truncate(1);
    }
    Ok(())
}

/// An attention whose additive bias is the graph's own causal mask over an
/// all-ones attention mask (what every run feeds: a sequence has no
/// padding) applies the causal mask itself instead: the masked scores get
/// zero weight either way, and without the bias the mask subgraph is dead,
/// nothing reads the attention mask, and sequences of different lengths
/// can share a run.
fn causal_attention(g: &mut Graph) {
    let uses = Uses::of(g);
    for i in 0..g.nodes.len() {
        let Some(node) = &g.nodes[i] else { continue };
        let Op::Attention { .. } = &node.op else { continue };
        let Some(Some(bias)) = node.inputs.get(3).copied() else { continue };
        let from_mask = uses.producer[bias]
            .and_then(|p| g.nodes[p].as_ref())
            .is_some_and(|p| matches!(p.op, Op::CausalBias { .. }));
        if !from_mask {
            continue;
        }
        let Some(node) = g.nodes[i].as_mut() else { continue };
        node.inputs[3] = None;
        if let Op::Attention { spec, .. } = &mut node.op {
            spec.bias = crate::kernels::attention::Bias::Causal;
            if let Some(r) = spec.resolved.as_mut() {
                r.bias = crate::kernels::attention::Bias::Causal;
            }
        }
    }
}

/// Every projection weight in the kernels' tiled layout (the last pass:
/// fusion stacks row-form weights), f32 and f16 weights first narrowed to
/// 8-bit blocks, affine 4-bit blocks or f16 where that is exact. Returns
/// how many were narrowed to each (`q8`, `q4`, `f16`).
fn repack(g: &mut Graph, pool: &ThreadPool) -> [(&'static str, usize); 3] {
    let mut narrowed = [("q8", 0), ("q4", 0), ("f16", 0)];
    for node in g.nodes.iter_mut().flatten() {
        // A split projection's members count one by one.
        let members = node.op.projection_widths().len();
        let Some(weight) = node.op.projection_weight_mut() else { continue };
        let before = weight.kind();
        // Narrowed without copying the weight (copying a SmolLM2 f32
        // export's weights to narrow them was 540 MB); one that stays as it
        // is is copied only where something else still holds it.
        let empty = Weight { n: 0, k: 0, packed: Packed::F32(Vec::new()) };
        let w = match Arc::try_unwrap(std::mem::replace(weight, Arc::new(empty))) {
            Ok(owned) => owned.narrowed_on(pool),
            Err(shared) => match shared.narrower_on(pool) {
                Some(packed) => Weight { n: shared.n, k: shared.k, packed },
                None => (*shared).clone(),
            },
        };
        for (kind, count) in &mut narrowed {
            *count += members * usize::from(w.kind() == *kind && before != *kind);
        }
        *weight = Arc::new(w.into_tiled());
    }
    narrowed
}

/// Moves every tiled projection weight into one arena on huge pages
/// ([`crate::kernels::storage`]), in plan order, so a decode step streams
/// them as one run of memory.
fn gather_weights(g: &mut Graph) {
    let mut tiles: Vec<&mut crate::kernels::weights::Tiled> = g
        .nodes
        .iter_mut()
        .flatten()
        .filter_map(|node| match &mut Arc::get_mut(node.op.projection_weight_mut()?)?.packed {
            Packed::Tiled(t) => Some(t),
            _ => None,
        })
        .collect();
    crate::kernels::storage::gather(&mut tiles);
}

/// Drops the constants no node reads any more: a fused projection holds
/// its weight packed, and the initializer it was packed from would live on
/// beside it until the plan is built (on SmolLM2's f32 export, 540 MB
/// through narrowing and repacking).
fn release_unread_constants(g: &mut Graph, roots: &[Vid]) {
    let uses = Uses::of(g);
    for (v, (meta, consumers)) in g.values.iter_mut().zip(&uses.consumers).enumerate() {
        if consumers.is_empty() && !roots.contains(&v) {
            meta.konst = None;
        }
    }
}

/// Removes nodes none of whose outputs reach `roots`.
pub(crate) fn eliminate_dead(g: &mut Graph, roots: &[Vid]) {
    let mut live: HashSet<Vid> = roots.iter().copied().collect();
    for i in (0..g.nodes.len()).rev() {
        let Some(node) = &g.nodes[i] else { continue };
        if node.outputs.iter().any(|o| live.contains(o)) {
            live.extend(node.inputs.iter().flatten());
        } else {
            g.nodes[i] = None;
        }
    }
}

/// Removes each Identity whose input is computed by a node for it alone
/// (exporters put one before the logits output): the producer writes the
/// Identity's output itself. A decode step of 16 sequences copied 3 MB of
/// logits there (0.2-0.5 ms a step on SmolLM2). An input that is a graph
/// input, a constant, another reader's or a root itself keeps its copy.
fn forward_identities(g: &mut Graph, roots: &[Vid], stats: &mut CompileStats) {
    let mut uses = Uses::of(g);
    let mut forwarded = 0;
    for i in 0..g.nodes.len() {
        let Some(node) = &g.nodes[i] else { continue };
        let (Op::Identity, [Some(input)], [output]) = (&node.op, node.inputs.as_slice(), node.outputs.as_slice())
        else {
            continue;
        };
        let (input, output) = (*input, *output);
        let Some(producer) = uses.producer[input] else { continue };
        if uses.consumers[input].len() != 1 || roots.contains(&input) || g.values[input].konst.is_some() {
            continue;
        }
        if let Some(p) = g.nodes[producer].as_mut() {
            p.outputs.iter_mut().filter(|o| **o == input).for_each(|o| *o = output);
            g.nodes[i] = None;
            // The producer now writes `output`: an Identity after this one
            // (nodes are in order) forwards to it in turn.
            uses.producer[output] = Some(producer);
            forwarded += 1;
        }
    }
    if forwarded > 0 {
        stats.fusions.push(("identity_forwarded".into(), forwarded));
    }
}

/// After fusion and binding, no generic node may read a past-KV input or
/// produce a present-KV output: those live in the in-place cache.
fn check_kv_is_owned(g: &Graph, binding: &Binding) -> Result<(), CompileError> {
    let ports: HashSet<&str> =
        binding.layers.iter().flat_map(|l| [l.past_key.as_str(), l.past_value.as_str()]).collect();
    for (_, n) in g.live_nodes() {
        for v in n.inputs.iter().flatten() {
            if ports.contains(g.values[*v].name.as_str()) {
                return Err(CompileError::node(
                    &n.name,
                    &n.origin,
                    format!(
                        "reads the KV cache input `{}` outside an attention the compiler recognizes; native-cpu keeps the cache in place and cannot materialize it",
                        g.values[*v].name
                    ),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{forward_identities, release_unread_constants, CompileStats};
    use crate::graph::{Graph, Node, Vid};
    use crate::kernels::elementwise::UnOp;
    use crate::ops::Op;
    use crate::value::Value;

    fn node(g: &mut Graph, op: Op, input: &str, output: &str) -> Vid {
        let (i, o) = (g.value(input), g.value(output));
        g.nodes.push(Some(Node {
            name: output.into(),
            origin: String::new(),
            op,
            inputs: vec![Some(i)],
            outputs: vec![o],
        }));
        o
    }

    /// The compile keeps a constant only while something needs it: one no
    /// node reads (an initializer a fused projection was packed from) is
    /// dropped, one a node reads and one that is a root stay. Watched red
    /// with the root not exempted and with read constants dropped too.
    #[test]
    fn only_unread_constants_are_released() {
        let mut g = Graph::default();
        let [read, unread, root] = ["read", "unread", "root"].map(|name| {
            let v = g.value(name);
            g.values[v].konst = Some(std::sync::Arc::new(Value::f32([1], vec![1.0])));
            v
        });
        let _ = node(&mut g, Op::Unary(UnOp::Neg), "read", "out");
        release_unread_constants(&mut g, &[root]);
        assert!(g.values[read].konst.is_some(), "a constant a node reads stays");
        assert!(g.values[unread].konst.is_none(), "a constant no node reads goes");
        assert!(g.values[root].konst.is_some(), "a root stays");
    }

    /// The logits copy is removed only where no one else can see it: an
    /// Identity over a value its producer computes for it alone goes (the
    /// producer writes the output; a chain of them goes whole), one over a
    /// graph input, a value another node reads too, or a root keeps its
    /// copy.
    #[test]
    fn an_identity_is_forwarded_only_when_its_input_is_its_alone() {
        let mut g = Graph::default();
        let neg = node(&mut g, Op::Unary(UnOp::Neg), "x", "a");
        let between = node(&mut g, Op::Identity, "a", "between");
        let logits = node(&mut g, Op::Identity, "between", "logits");
        let _ = node(&mut g, Op::Identity, "x", "from_input");
        let shared = node(&mut g, Op::Unary(UnOp::Neg), "x", "b");
        let _ = node(&mut g, Op::Identity, "b", "copy_of_shared");
        let _ = node(&mut g, Op::Unary(UnOp::Exp), "b", "other_reader");
        let root = node(&mut g, Op::Unary(UnOp::Neg), "x", "c");
        let _ = node(&mut g, Op::Identity, "c", "copy_of_root");
        let mut stats = CompileStats::default();
        forward_identities(&mut g, &[logits, root], &mut stats);
        assert_eq!(stats.fused("identity_forwarded"), 2);
        let live: Vec<&Node> = g.nodes.iter().flatten().collect();
        assert_eq!(live.len(), 7, "{live:?}");
        assert!(live.iter().any(|n| matches!(n.op, Op::Unary(UnOp::Neg)) && n.outputs == [logits]));
        assert!(!live.iter().any(|n| n.outputs == [neg] || n.outputs == [between] || n.inputs == [Some(between)]));
        assert!(live.iter().any(|n| matches!(n.op, Op::Identity) && n.inputs == [Some(shared)]));
        assert!(live.iter().any(|n| matches!(n.op, Op::Identity) && n.inputs == [Some(root)]));
    }
}
