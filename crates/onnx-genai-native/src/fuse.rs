//! Pattern fusion. Each pass finds a subgraph by walking producers from a
//! root node, checks that no value inside it is read from outside, and
//! replaces it by one fused node at the root's position. A pattern that does
//! not match exactly is left to the generic kernels, which compute the same
//! result more slowly — except for KV-cache attention, which must fuse (the
//! compiler then refuses the graph, naming the node).

use std::sync::Arc;

use crate::compile::CompileStats;
use crate::error::CompileError;
use crate::graph::{Graph, Node, Uses, Vid};
use crate::kernels::attention::{Bias, Layout};
use crate::kernels::elementwise::{BinOp, UnOp};
use crate::kernels::linear::{Packed, Weight};
use crate::kernels::math::Reduce;
use crate::ops::{Op, PartialAttention};
use crate::value::{DType, Value};

type Pass = fn(&Graph, &Uses, usize) -> Result<Option<Rewrite>, CompileError>;

/// Replace `remove` (which includes the root) by `node` at the root, and
/// rewrite the nodes in `update` in place.
pub struct Rewrite {
    root: usize,
    remove: Vec<usize>,
    node: Node,
    update: Vec<(usize, Node)>,
}

impl Rewrite {
    pub(crate) fn new(root: usize, remove: Vec<usize>, node: Node) -> Self {
        Self { root, remove, node, update: Vec::new() }
    }
}

pub fn run(g: &mut Graph, stats: &mut CompileStats) -> Result<(), CompileError> {
    let passes: [(&str, Pass); 11] = [
        ("causal_mask", crate::fuse_mask::causal_mask),
        ("linear", pack_linear),
        ("matmul_nbits", pack_nbits),
        ("linear_bias", linear_bias),
        // LayerNorm first: its centred core also looks like an RMSNorm.
        ("layer_norm", layer_norm),
        ("rms_norm", rms_norm),
        ("gated_mlp", gated_mlp),
        ("gelu_tanh", gelu_tanh),
        ("rotary", rotary),
        ("attention", attention),
        ("head_layout", head_layout),
    ];
    for (name, pass) in passes {
        let mut count = 0;
        let mut i = 0;
        let mut uses = Uses::of(g);
        while i < g.nodes.len() {
            if g.nodes[i].is_some() {
                if let Some(rw) = pass(g, &uses, i)? {
                    for r in &rw.remove {
                        g.nodes[*r] = None;
                    }
                    for (at, node) in rw.update {
                        g.nodes[at] = Some(node);
                    }
                    g.nodes[rw.root] = Some(rw.node);
                    uses = Uses::of(g);
                    count += 1;
                }
            }
            i += 1;
        }
        if count > 0 {
            stats.fusions.push((name.to_string(), count));
        }
    }
    Ok(())
}

/// Read-only helpers over a graph and its use lists.
pub(crate) struct M<'a> {
    pub g: &'a Graph,
    pub u: &'a Uses,
}

impl<'a> M<'a> {
    pub(crate) fn producer(&self, v: Vid) -> Option<(usize, &'a Node)> {
        let i = self.u.producer[v]?;
        self.g.nodes[i].as_ref().map(|n| (i, n))
    }
    /// The producer of `v` if its op satisfies `pred`.
    pub(crate) fn from(&self, v: Vid, pred: impl Fn(&Op) -> bool) -> Option<(usize, &'a Node)> {
        self.producer(v).filter(|(_, n)| pred(&n.op))
    }
    pub(crate) fn input(n: &Node, i: usize) -> Option<Vid> {
        n.inputs.get(i).copied().flatten()
    }
    pub(crate) fn konst(&self, v: Vid) -> Option<&'a Value> {
        self.g.konst(v)
    }
    pub(crate) fn scalar(&self, v: Vid) -> Option<f32> {
        self.konst(v).and_then(Value::scalar_f32)
    }
    /// Whether every value `nodes` produce — except `exported` ones, which
    /// the fused node will produce itself — is read only inside `nodes`.
    pub(crate) fn private(&self, nodes: &[usize], exported: &[Vid]) -> bool {
        nodes
            .iter()
            .filter_map(|ni| self.g.nodes[*ni].as_ref())
            .flat_map(|n| n.outputs.iter())
            .all(|v| exported.contains(v) || self.read_only_by(*v, nodes))
    }

    /// Whether every reader of `v` is one of `nodes`.
    pub(crate) fn read_only_by(&self, v: Vid, nodes: &[usize]) -> bool {
        self.u.consumers[v].iter().all(|c| nodes.contains(c))
    }
    pub(crate) fn ints(&self, v: Option<Vid>) -> Option<&'a [i64]> {
        self.konst(v?).and_then(Value::ints)
    }
}

fn is_bin(op: &Op, b: BinOp) -> bool {
    matches!(op, Op::Binary(x) if *x == b)
}

pub(crate) fn fused(root: &Node, op: Op, inputs: Vec<Option<Vid>>, outputs: Vec<Vid>) -> Node {
    Node { name: root.name.clone(), origin: format!("fused {}", op.name()), op, inputs, outputs }
}

/// `MatMul(x, W)` with a constant 2-D weight (or an f16 weight behind a
/// Cast) becomes a packed `Linear`.
fn pack_linear(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    let (Op::MatMul, Some(x), Some(w)) = (&n.op, M::input(n, 0), M::input(n, 1)) else { return Ok(None) };
    let (weight, mut remove) = if let Some(v) = m.konst(w) {
        let [k, out] = v.shape[..] else { return Ok(None) };
        let Ok(data) = v.as_f32() else { return Ok(None) };
        (Weight::from_kn_f32(data, k, out), vec![i])
    } else if let Some((ci, cast)) = m.from(w, |op| matches!(op, Op::Cast(DType::F32))) {
        let Some(v) = M::input(cast, 0).and_then(|s| m.konst(s)) else { return Ok(None) };
        let ([k, out], Ok(data)) = (&v.shape[..], v.as_f16()) else { return Ok(None) };
        let remove = if m.read_only_by(w, &[i]) { vec![i, ci] } else { vec![i] };
        (Weight::from_kn_f16(data, *k, *out), remove)
    } else {
        return Ok(None);
    };
    remove.dedup();
    let op = Op::Linear { weight: Arc::new(weight), bias: None };
    Ok(Some(Rewrite { root: i, remove, node: fused(n, op, vec![Some(x)], n.outputs.clone()), update: Vec::new() }))
}

/// com.microsoft `MatMulNBits` with constant blocks, scales and zero points.
fn pack_nbits(g: &Graph, _u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    let Op::MatMulNBits { k, n: outs, block, accuracy_level } = n.op else { return Ok(None) };
    let err = |reason: String| CompileError::node(&n.name, &n.origin, reason);
    let konst = |idx: usize| M::input(n, idx).and_then(|v| g.konst(v));
    let (Some(b), Some(scales)) = (konst(1), konst(2)) else {
        return Err(err("the quantized weight and scales must be initializers".into()));
    };
    let blocks = k.div_ceil(block);
    let data = b.as_u8().map_err(|e| err(format!("B: {e}")))?;
    if data.len() != outs * blocks * block / 2 {
        return Err(err(format!(
            "B has {} bytes; N={outs} x {blocks} blocks x {} bytes expected",
            data.len(),
            block / 2
        )));
    }
    let scales = scales.as_f32().map_err(|e| err(format!("scales: {e}")))?;
    if scales.len() != outs * blocks {
        return Err(err(format!("{} scales for N={outs} x {blocks} blocks", scales.len())));
    }
    let zeros = match M::input(n, 3) {
        None => None,
        Some(v) => {
            let z = g.konst(v).ok_or_else(|| err("zero points must be an initializer".into()))?;
            let z =
                z.as_u8().map_err(|e| err(format!("zero points: {e} (only packed u8 zero points are supported)")))?;
            if z.len() != outs * blocks.div_ceil(2) {
                return Err(err(format!("{} zero-point bytes for N={outs} x {blocks} blocks", z.len())));
            }
            Some(z.to_vec())
        }
    };
    let bias = match M::input(n, 5) {
        None => None,
        Some(v) => {
            let b = g
                .konst(v)
                .and_then(|b| b.as_f32().ok())
                .ok_or_else(|| err("bias must be an f32 initializer".into()))?;
            if b.len() != outs {
                return Err(err(format!("bias has {} elements for N={outs}", b.len())));
            }
            Some(Arc::new(b.to_vec()))
        }
    };
    let weight = Weight {
        n: outs,
        k,
        packed: Packed::Q4 { data: data.to_vec(), scales: scales.to_vec(), zeros, block, blocks },
    };
    // Level 4 lets ONNX Runtime quantize the input to int8, and its CPU
    // kernel does; native-cpu computes as it does.
    let weight = if accuracy_level == 4 { weight.into_int8_products() } else { weight };
    let op = Op::Linear { weight: Arc::new(weight), bias };
    Ok(Some(Rewrite {
        root: i,
        remove: vec![i],
        node: fused(n, op, vec![M::input(n, 0)], n.outputs.clone()),
        update: Vec::new(),
    }))
}

/// `Add(Linear(x), b)` with a constant `[N]` bias.
fn linear_bias(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !is_bin(&n.op, BinOp::Add) {
        return Ok(None);
    }
    for (a, b) in [(0, 1), (1, 0)] {
        let (Some(y), Some(bias)) = (M::input(n, a), M::input(n, b)) else { continue };
        let Some((li, lin)) = m.from(y, |op| matches!(op, Op::Linear { bias: None, .. })) else { continue };
        let Op::Linear { weight, .. } = &lin.op else { continue };
        let Some(bv) = m.konst(bias).filter(|v| v.shape[..] == [weight.n]).and_then(|v| v.as_f32().ok()) else {
            continue;
        };
        if !m.read_only_by(y, &[i]) {
            continue;
        }
        let op = Op::Linear { weight: weight.clone(), bias: Some(Arc::new(bv.to_vec())) };
        return Ok(Some(Rewrite {
            root: i,
            remove: vec![li, i],
            node: fused(n, op, lin.inputs.clone(), n.outputs.clone()),
            update: Vec::new(),
        }));
    }
    Ok(None)
}

/// `(Mul(x, x) | Pow(x, 2)) -> ReduceMean(last) -> Add eps -> Sqrt`, returning
/// `(x, eps, nodes)` for `Sqrt`'s output `s`.
fn rms_of(m: &M, s: Vid) -> Option<(Vid, f32, Vec<usize>)> {
    let (si, sqrt) = m.from(s, |op| matches!(op, Op::Unary(UnOp::Sqrt)))?;
    let (ai, add) = m.from(M::input(sqrt, 0)?, |op| is_bin(op, BinOp::Add))?;
    let (mean, eps) = match (M::input(add, 0)?, M::input(add, 1)?) {
        (a, b) if m.scalar(b).is_some() => (a, m.scalar(b)?),
        (a, b) => (b, m.scalar(a)?),
    };
    let (ri, red) = m.from(
        mean,
        |op| matches!(op, Op::Reduce { kind: Reduce::Mean, keepdims: true, axes: Some(a) } if a.as_slice() == [-1]),
    )?;
    let sq = M::input(red, 0)?;
    let (qi, square) = m.from(sq, |op| is_bin(op, BinOp::Mul) || is_bin(op, BinOp::Pow))?;
    let x = M::input(square, 0)?;
    let ok = match square.op {
        Op::Binary(BinOp::Mul) => M::input(square, 1) == Some(x),
        _ => M::input(square, 1).and_then(|e| m.scalar(e)) == Some(2.0),
    };
    let inner = [qi, ri, ai, si];
    let private =
        m.read_only_by(sq, &inner) && m.read_only_by(mean, &inner) && m.read_only_by(M::input(sqrt, 0)?, &inner);
    (ok && private).then(|| (x, eps, inner.to_vec()))
}

/// `Mul(Div(x, rms(x)), w)` -> `RmsNorm(x, w)`.
fn rms_norm(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !is_bin(&n.op, BinOp::Mul) {
        return Ok(None);
    }
    for (a, b) in [(0, 1), (1, 0)] {
        let (Some(normed), Some(w)) = (M::input(n, a), M::input(n, b)) else { continue };
        if m.konst(w).is_none_or(|v| v.shape.len() != 1) {
            continue;
        }
        let Some((di, div)) = m.from(normed, |op| is_bin(op, BinOp::Div)) else { continue };
        let (Some(x), Some(s)) = (M::input(div, 0), M::input(div, 1)) else { continue };
        let Some((x2, eps, mut nodes)) = rms_of(&m, s) else { continue };
        if x2 != x || !m.read_only_by(normed, &[i]) || !m.read_only_by(s, &[di]) {
            continue;
        }
        nodes.extend([di, i]);
        let op = Op::RmsNorm { eps };
        return Ok(Some(Rewrite {
            root: i,
            remove: nodes,
            node: fused(n, op, vec![Some(x), Some(w)], n.outputs.clone()),
            update: Vec::new(),
        }));
    }
    Ok(None)
}

/// `Add(Mul(Div(c, rms(c)), gamma), beta)` with `c = x - mean(x)` ->
/// `LayerNorm(x, gamma, beta)`.
fn layer_norm(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !is_bin(&n.op, BinOp::Add) {
        return Ok(None);
    }
    for (a, b) in [(0, 1), (1, 0)] {
        let (Some(scaled), Some(beta)) = (M::input(n, a), M::input(n, b)) else { continue };
        if m.konst(beta).is_none_or(|v| v.shape.len() != 1) {
            continue;
        }
        let Some((mi, mul)) = m.from(scaled, |op| is_bin(op, BinOp::Mul)) else { continue };
        for (c, d) in [(0, 1), (1, 0)] {
            let (Some(normed), Some(gamma)) = (M::input(mul, c), M::input(mul, d)) else { continue };
            if m.konst(gamma).is_none_or(|v| v.shape.len() != 1) {
                continue;
            }
            let Some((di, div)) = m.from(normed, |op| is_bin(op, BinOp::Div)) else { continue };
            let (Some(centered), Some(s)) = (M::input(div, 0), M::input(div, 1)) else { continue };
            let Some((c2, eps, mut nodes)) = rms_of(&m, s) else { continue };
            let Some((ci, sub)) = m.from(centered, |op| is_bin(op, BinOp::Sub)) else { continue };
            let (Some(x), Some(mean)) = (M::input(sub, 0), M::input(sub, 1)) else { continue };
            let Some((ri, red)) = m.from(mean, |op| matches!(op, Op::Reduce { kind: Reduce::Mean, keepdims: true, axes: Some(a) } if a.as_slice() == [-1])) else { continue };
            if c2 != centered || M::input(red, 0) != Some(x) {
                continue;
            }
            nodes.extend([di, mi, ci, ri, i]);
            let private = m.read_only_by(centered, &nodes)
                && m.read_only_by(mean, &nodes)
                && m.read_only_by(normed, &nodes)
                && m.read_only_by(scaled, &nodes)
                && m.read_only_by(s, &nodes);
            if !private {
                continue;
            }
            let op = Op::LayerNorm { eps };
            let inputs = vec![Some(x), Some(gamma), Some(beta)];
            return Ok(Some(Rewrite {
                root: i,
                remove: nodes,
                node: fused(n, op, inputs, n.outputs.clone()),
                update: Vec::new(),
            }));
        }
    }
    Ok(None)
}

/// `Mul(Mul(g, Sigmoid(g)), up)` with `g`, `up` bias-free projections of
/// the same input -> `GatedMlp(x)`.
fn gated_mlp(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !is_bin(&n.op, BinOp::Mul) {
        return Ok(None);
    }
    for (a, b) in [(0, 1), (1, 0)] {
        let (Some(act), Some(up)) = (M::input(n, a), M::input(n, b)) else { continue };
        let Some((pi, silu)) = m.from(act, |op| is_bin(op, BinOp::Mul)) else { continue };
        for (c, d) in [(0, 1), (1, 0)] {
            let (Some(gate), Some(sig)) = (M::input(silu, c), M::input(silu, d)) else { continue };
            let Some((si, sigmoid)) = m.from(sig, |op| matches!(op, Op::Unary(UnOp::Sigmoid))) else { continue };
            let is_plain_linear = |op: &Op| matches!(op, Op::Linear { bias: None, .. });
            let (Some((gi, gl)), Some((ui, ul))) = (m.from(gate, is_plain_linear), m.from(up, is_plain_linear)) else {
                continue;
            };
            if M::input(sigmoid, 0) != Some(gate) || gl.inputs != ul.inputs || gi == ui {
                continue;
            }
            let nodes = vec![gi, ui, si, pi, i];
            if !(m.read_only_by(gate, &nodes)
                && m.read_only_by(up, &nodes)
                && m.read_only_by(sig, &nodes)
                && m.read_only_by(act, &nodes))
            {
                continue;
            }
            let (Op::Linear { weight: wg, .. }, Op::Linear { weight: wu, .. }) = (&gl.op, &ul.op) else { continue };
            if wg.n != wu.n {
                continue;
            }
            let Ok(stacked) = Weight::stack((**wg).clone(), (**wu).clone()) else { continue };
            let op = Op::GatedMlp { weight: Arc::new(stacked) };
            return Ok(Some(Rewrite {
                root: i,
                remove: nodes,
                node: fused(n, op, gl.inputs.clone(), n.outputs.clone()),
                update: Vec::new(),
            }));
        }
    }
    Ok(None)
}

/// `Add(Mul(x, cos), Mul(Concat(Neg(x[half:]), x[:half]), sin))` over the
/// last axis of a heads-first `x` -> `Rotary(x, cos, sin)`.
fn rotary(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !is_bin(&n.op, BinOp::Add) {
        return Ok(None);
    }
    let last_axis = |v: Option<Vid>| matches!(m.ints(v), Some([3]) | Some([-1]));
    for (a, b) in [(0, 1), (1, 0)] {
        let (Some(pa), Some(pb)) = (M::input(n, a), M::input(n, b)) else { continue };
        let (Some((ai, ma)), Some((bi, mb))) =
            (m.from(pa, |op| is_bin(op, BinOp::Mul)), m.from(pb, |op| is_bin(op, BinOp::Mul)))
        else {
            continue;
        };
        for (c, d) in [(0, 1), (1, 0)] {
            let (Some(rot), Some(sin)) = (M::input(mb, c), M::input(mb, d)) else { continue };
            let Some((ci, cat)) = m.from(rot, |op| matches!(op, Op::Concat { axis: 3 | -1 })) else { continue };
            let (Some(neg), Some(first)) = (M::input(cat, 0), M::input(cat, 1)) else { continue };
            if cat.inputs.len() != 2 {
                continue;
            }
            let Some((ni, negn)) = m.from(neg, |op| matches!(op, Op::Unary(UnOp::Neg))) else { continue };
            let Some(second) = M::input(negn, 0) else { continue };
            let (Some((s1, sl1)), Some((s2, sl2))) =
                (m.from(first, |op| matches!(op, Op::Slice)), m.from(second, |op| matches!(op, Op::Slice)))
            else {
                continue;
            };
            let x = M::input(sl1, 0);
            if x.is_none() || M::input(sl2, 0) != x || sl1.inputs.len() > 4 || sl2.inputs.len() > 4 {
                continue;
            }
            let (Some(&[st1]), Some(&[en1]), Some(&[st2]), Some(&[en2])) = (
                m.ints(M::input(sl1, 1)),
                m.ints(M::input(sl1, 2)),
                m.ints(M::input(sl2, 1)),
                m.ints(M::input(sl2, 2)),
            ) else {
                continue;
            };
            let hd = x.and_then(|x| g.values[x].dims.as_ref()?.get(3).copied().flatten());
            let Some(hd) = hd else { continue };
            let half = (hd / 2) as i64;
            let ends_ok = en2 >= hd as i64;
            if st1 != 0
                || en1 != half
                || st2 != half
                || !ends_ok
                || !last_axis(M::input(sl1, 3))
                || !last_axis(M::input(sl2, 3))
            {
                continue;
            }
            let cos = match (M::input(ma, 0), M::input(ma, 1)) {
                (p, Some(q)) if p == x => q,
                (Some(q), p) if p == x => q,
                _ => continue,
            };
            let nodes = vec![s1, s2, ni, ci, ai, bi, i];
            let private = [first, second, neg, rot, pa, pb].iter().all(|v| m.read_only_by(*v, &nodes));
            if !private || g.values[x.unwrap_or_default()].dims.as_ref().map(Vec::len) != Some(4) {
                continue;
            }
            let op = Op::Rotary { layout: Layout::HeadsFirst, cached: false };
            return Ok(Some(Rewrite {
                root: i,
                remove: nodes,
                node: fused(n, op, vec![x, Some(cos), Some(sin)], n.outputs.clone()),
                update: Vec::new(),
            }));
        }
    }
    Ok(None)
}

/// The decomposed KV-cache attention:
/// `MatMul(Softmax(Add(MatMul(q', Transpose(K)), bias)), V)` where `K`/`V`
/// are `Concat(past, new)` along the sequence (with f16 casts when the cache
/// is f16), `q'` is `q * scale` (reshaped to KV groups for GQA), and for GQA
/// the result is reshaped back to query heads.
fn attention(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !matches!(n.op, Op::MatMul) {
        return Ok(None);
    }
    let (Some(probs), Some(vf)) = (M::input(n, 0), M::input(n, 1)) else { return Ok(None) };
    let Some((pi, soft)) = m.from(probs, |op| matches!(op, Op::Softmax { axis: -1 | 3 })) else { return Ok(None) };
    let Some(scores) = M::input(soft, 0) else { return Ok(None) };
    let Some((ai, add)) = m.from(scores, |op| is_bin(op, BinOp::Add)) else { return Ok(None) };
    let mut found = None;
    for (a, b) in [(0, 1), (1, 0)] {
        let (Some(s), Some(bias)) = (M::input(add, a), M::input(add, b)) else { continue };
        if let Some((si, mm)) = m.from(s, |op| matches!(op, Op::MatMul)) {
            found = Some((s, bias, si, mm));
            break;
        }
    }
    let Some((s, bias, si, qk)) = found else { return Ok(None) };
    let (Some(qs), Some(kt)) = (M::input(qk, 0), M::input(qk, 1)) else { return Ok(None) };
    let Some((ti, tr)) = m.from(kt, |op| matches!(op, Op::Transpose(Some(p)) if p.as_slice() == [0, 1, 3, 2])) else {
        return Ok(None);
    };
    let Some(kf) = M::input(tr, 0) else { return Ok(None) };
    let mut nodes = vec![i, pi, ai, si, ti];
    let Some((k_new, past_k, present_k)) = cache_edge(&m, kf, &mut nodes) else { return Ok(None) };
    let Some((v_new, past_v, present_v)) = cache_edge(&m, vf, &mut nodes) else { return Ok(None) };
    // Query: optional grouping reshape over an optional scale.
    let (grouped, scaled) = match m.from(qs, |op| matches!(op, Op::Reshape)) {
        Some((ri, r)) => {
            nodes.push(ri);
            (true, M::input(r, 0))
        }
        None => (false, Some(qs)),
    };
    let Some(scaled) = scaled else { return Ok(None) };
    let (q, scale) = match m.from(scaled, |op| is_bin(op, BinOp::Mul)) {
        Some((mi, mul)) => {
            let (Some(a), Some(b)) = (M::input(mul, 0), M::input(mul, 1)) else { return Ok(None) };
            let (q, sc) = if let Some(sc) = m.scalar(b) {
                (a, sc)
            } else if let Some(sc) = m.scalar(a) {
                (b, sc)
            } else {
                return Ok(None);
            };
            nodes.push(mi);
            (q, sc)
        }
        None => (scaled, 1.0),
    };
    // Output: for GQA, the reshape back to query heads.
    let (out, bias_mode) = if grouped {
        let readers = &u.consumers[g.nodes[i].as_ref().map_or(0, |n| n.outputs[0])];
        let Some(Some((ri, _))) =
            readers.first().map(|r| g.nodes[*r].as_ref().filter(|n| matches!(n.op, Op::Reshape)).map(|n| (*r, n)))
        else {
            return Ok(None);
        };
        if readers.len() != 1 {
            return Ok(None);
        }
        nodes.push(ri);
        (g.nodes[ri].as_ref().map_or(0, |n| n.outputs[0]), Bias::Grouped)
    } else {
        (n.outputs[0], Bias::PerQuery)
    };
    if !m.private(&nodes, &[out, present_k, present_v]) {
        return Ok(None);
    }
    let _ = s;
    let spec = PartialAttention {
        heads: None,
        kv_heads: None,
        scale: Some(scale),
        q_layout: Layout::HeadsFirst,
        kv_layout: Layout::HeadsFirst,
        out_layout: Layout::HeadsFirst,
        bias: bias_mode,
        packed_qkv: false,
        rotary: false,
        resolved: None,
    };
    let op = Op::Attention { spec, layer: None };
    let root = *nodes.iter().max().unwrap_or(&i);
    let inputs = vec![Some(q), Some(k_new), Some(v_new), Some(bias), Some(past_k), Some(past_v)];
    let node = fused(n, op, inputs, vec![out, present_k, present_v]);
    Ok(Some(Rewrite { root, remove: nodes, node, update: Vec::new() }))
}

/// `[Cast f32](Concat(past, [Cast f16](new), axis=2))`: returns
/// `(new, past, present)` and records the nodes.
fn cache_edge(m: &M, full: Vid, nodes: &mut Vec<usize>) -> Option<(Vid, Vid, Vid)> {
    let present = match m.from(full, |op| matches!(op, Op::Cast(DType::F32))) {
        Some((ci, cast)) => {
            nodes.push(ci);
            M::input(cast, 0)?
        }
        None => full,
    };
    let (ki, cat) = m.from(present, |op| matches!(op, Op::Concat { axis: 2 | -2 }))?;
    if cat.inputs.len() != 2 {
        return None;
    }
    nodes.push(ki);
    let (past, stored) = (M::input(cat, 0)?, M::input(cat, 1)?);
    if m.producer(past).is_some() {
        return None;
    }
    let new = match m.from(stored, |op| matches!(op, Op::Cast(DType::F16))) {
        Some((ci, cast)) => {
            nodes.push(ci);
            M::input(cast, 0)?
        }
        None => stored,
    };
    Some((new, past, present))
}

/// `Transpose(Reshape(x, [0, 0, heads, dim]), [0, 2, 1, 3])` read only by
/// `reader`: returns `x` and the two nodes.
fn split_heads(m: &M, v: Vid, reader: usize) -> Option<(Vid, [usize; 2])> {
    let (ti, t) = m.from(v, |op| matches!(op, Op::Transpose(Some(p)) if p.as_slice() == [0, 2, 1, 3]))?;
    let (ri, r) = m.from(M::input(t, 0)?, |op| matches!(op, Op::Reshape))?;
    let target = m.ints(M::input(r, 1))?;
    let ok = matches!(target, [0, 0, h, d] if *h > 0 && *d > 0);
    let x = M::input(r, 0)?;
    (ok && m.read_only_by(v, &[reader]) && m.read_only_by(M::input(t, 0)?, &[ti])).then_some((x, [ri, ti]))
}

/// Attention (and the rotary feeding it) read the projections in their
/// `[batch, seq, heads*dim]` layout and write the output in it, so the
/// head split and merge (two Reshapes and Transposes per tensor) go away.
fn head_layout(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    let Op::Attention { spec, layer } = &n.op else { return Ok(None) };
    if spec.q_layout != Layout::HeadsFirst || spec.kv_layout != Layout::HeadsFirst {
        return Ok(None);
    }
    let mut inputs = n.inputs.clone();
    let mut remove = vec![i];
    let mut update = Vec::new();
    for (slot, input) in inputs.iter_mut().enumerate().take(3) {
        let Some(v) = M::input(n, slot) else { return Ok(None) };
        if let Some((x, nodes)) = split_heads(&m, v, i) {
            *input = Some(x);
            remove.extend(nodes);
            continue;
        }
        // A heads-first rotary between the split and the attention.
        let Some((ri, rot)) = m.from(v, |op| matches!(op, Op::Rotary { layout: Layout::HeadsFirst, .. })) else {
            return Ok(None);
        };
        let Op::Rotary { cached, .. } = rot.op else { return Ok(None) };
        let Some((x, nodes)) = M::input(rot, 0).and_then(|rx| split_heads(&m, rx, ri)) else { return Ok(None) };
        if !m.read_only_by(v, &[i]) {
            return Ok(None);
        }
        let mut r = rot.clone();
        r.op = Op::Rotary { layout: Layout::SeqFirst, cached };
        r.inputs[0] = Some(x);
        update.push((ri, r));
        remove.extend(nodes);
    }
    let mut spec = spec.clone();
    spec.q_layout = Layout::SeqFirst;
    spec.kv_layout = Layout::SeqFirst;
    let mut outputs = n.outputs.clone();
    // Output: `Reshape(Transpose(y, [0, 2, 1, 3]), [0, 0, heads*dim])`.
    let y = n.outputs[0];
    let readers = &u.consumers[y];
    if let [ti] = readers[..] {
        let merge =
            g.nodes[ti].as_ref().filter(|t| matches!(&t.op, Op::Transpose(Some(p)) if p.as_slice() == [0, 2, 1, 3]));
        if let Some(t) = merge {
            if let [ri] = u.consumers[t.outputs[0]][..] {
                let reshape = g.nodes[ri].as_ref().filter(|r| {
                    matches!(r.op, Op::Reshape) && matches!(m.ints(M::input(r, 1)), Some([0, 0, x]) if *x > 0)
                });
                if let Some(r) = reshape {
                    spec.out_layout = Layout::SeqFirst;
                    outputs[0] = r.outputs[0];
                    remove.extend([ti, ri]);
                    let root = ri;
                    let node = fused(n, Op::Attention { spec, layer: *layer }, inputs, outputs);
                    return Ok(Some(Rewrite { root, remove, node, update }));
                }
            }
        }
    }
    let node = fused(n, Op::Attention { spec, layer: *layer }, inputs, outputs);
    Ok(Some(Rewrite { root: i, remove, node, update }))
}

/// `Mul(Mul(x, 0.5), Add(Tanh(Mul(Add(x, Mul(Mul(Mul(x, x), x), a)), b)), 1))`
/// with `a = 0.044715`, `b = sqrt(2/pi)` -> `GeluTanh(x)` (GPT-2's GELU).
fn gelu_tanh(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !is_bin(&n.op, BinOp::Mul) {
        return Ok(None);
    }
    let close = |v: Option<f32>, want: f32| v.is_some_and(|v| (v - want).abs() <= 1e-6 * want.abs().max(1.0));
    // `Mul(p, q)` with one side the constant `c`: returns the other side.
    let times = |v: Vid, c: f32| -> Option<(usize, Vid)> {
        let (mi, mul) = m.from(v, |op| is_bin(op, BinOp::Mul))?;
        let (a, b) = (M::input(mul, 0)?, M::input(mul, 1)?);
        if close(m.scalar(b), c) {
            Some((mi, a))
        } else if close(m.scalar(a), c) {
            Some((mi, b))
        } else {
            None
        }
    };
    let plus = |v: Vid| -> Option<(usize, Vid, Vid)> {
        let (ai, add) = m.from(v, |op| is_bin(op, BinOp::Add))?;
        Some((ai, M::input(add, 0)?, M::input(add, 1)?))
    };
    let found = (|| {
        for (a, b) in [(0, 1), (1, 0)] {
            let Some((hi, x)) = times(M::input(n, a)?, 0.5) else { continue };
            let Some((oi, p, q)) = plus(M::input(n, b)?) else { continue };
            let th = if close(m.scalar(q), 1.0) {
                p
            } else if close(m.scalar(p), 1.0) {
                q
            } else {
                continue;
            };
            let Some((ti, tanh)) = m.from(th, |op| matches!(op, Op::Unary(UnOp::Tanh))) else { continue };
            let Some((si, inner)) = times(M::input(tanh, 0)?, (2.0 / std::f32::consts::PI).sqrt()) else { continue };
            let Some((ii, p, q)) = plus(inner) else { continue };
            let cube_term = if p == x {
                q
            } else if q == x {
                p
            } else {
                continue;
            };
            let Some((ci, cube)) = times(cube_term, 0.044715) else { continue };
            let Some((c3, m3)) = m.from(cube, |op| is_bin(op, BinOp::Mul)) else { continue };
            let (s1, s2) = (M::input(m3, 0)?, M::input(m3, 1)?);
            let square = if s2 == x {
                s1
            } else if s1 == x {
                s2
            } else {
                continue;
            };
            let Some((c2, m2)) = m.from(square, |op| is_bin(op, BinOp::Mul)) else { continue };
            if M::input(m2, 0) != Some(x) || M::input(m2, 1) != Some(x) {
                continue;
            }
            let nodes = vec![hi, oi, ti, si, ii, ci, c3, c2, i];
            if m.private(&nodes, &n.outputs) {
                return Some((x, nodes));
            }
        }
        None
    })();
    let Some((x, nodes)) = found else { return Ok(None) };
    let op = Op::Unary(UnOp::GeluTanh);
    Ok(Some(Rewrite::new(i, nodes, fused(n, op, vec![Some(x)], n.outputs.clone()))))
}
