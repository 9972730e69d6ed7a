//! Weight packing and what folds into a projection: MatMul by a constant
//! (or an f16 constant behind a Cast), `MatMulNBits`, affine 4-bit block
//! offsets, a constant bias.

use std::sync::Arc;

use super::{fused, is_bin, Rewrite, M};
use crate::error::CompileError;
use crate::graph::{Graph, Node, Uses, Vid};
use crate::kernels::elementwise::BinOp;
use crate::kernels::linear::MAX_STACKED;
use crate::kernels::weights::{Packed, Weight};
use crate::ops::Op;
use crate::pool::ThreadPool;
use crate::value::DType;

/// `MatMul(x, W)` with a constant 2-D weight (or an f16 weight behind a
/// Cast) becomes a packed `Linear`.
pub(super) fn pack_linear(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
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
pub(super) fn pack_nbits(g: &Graph, _u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    let Op::MatMulNBits { k, n: outs, block, accuracy_level } = n.op else { return Ok(None) };
    let err = |reason: String| CompileError::node(&n.name, &n.origin, reason);
    let konst = |idx: usize| M::input(n, idx).and_then(|v| g.konst(v));
    let (Some(b), Some(scales)) = (konst(1), konst(2)) else {
        return Err(err("the quantized weight and scales must be initializers".into()));
    };
    let blocks = k.div_ceil(block);
    // Counted checked: K and N come from the node's attributes, and a
    // product that wraps could match an empty initializer.
    let (Some(weight_bytes), Some(scale_count)) =
        (outs.checked_mul(blocks).and_then(|c| c.checked_mul(block / 2)), outs.checked_mul(blocks))
    else {
        return Err(err(format!("N={outs} x K={k} in blocks of {block} is more weights than can be addressed")));
    };
    let data = b.as_u8().map_err(|e| err(format!("B: {e}")))?;
    if data.len() != weight_bytes {
        return Err(err(format!(
            "B has {} bytes; N={outs} x {blocks} blocks x {} bytes expected",
            data.len(),
            block / 2
        )));
    }
    let scales = scales.as_f32().map_err(|e| err(format!("scales: {e}")))?;
    if scales.len() != scale_count {
        return Err(err(format!("{} scales for N={outs} x {blocks} blocks", scales.len())));
    }
    let zeros = match M::input(n, 3) {
        None => None,
        Some(v) => {
            let z = g.konst(v).ok_or_else(|| err("zero points must be an initializer".into()))?;
            let z =
                z.as_u8().map_err(|e| err(format!("zero points: {e} (only packed u8 zero points are supported)")))?;
            if Some(z.len()) != outs.checked_mul(blocks.div_ceil(2)) {
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
        // Level 4 lets ONNX Runtime quantize the input to int8, and its CPU
        // kernel does; native-cpu computes as it does.
        packed: Packed::Q4 {
            data: data.to_vec(),
            scales: scales.to_vec(),
            zeros,
            offsets: None,
            block,
            blocks,
            int8: accuracy_level == 4,
        },
    };
    let op = Op::Linear { weight: Arc::new(weight), bias };
    Ok(Some(Rewrite {
        root: i,
        remove: vec![i],
        node: fused(n, op, vec![M::input(n, 0)], n.outputs.clone()),
        update: Vec::new(),
    }))
}

/// `Add(Linear(x), b)` with a constant `[N]` bias.
pub(super) fn linear_bias(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
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

/// `Add(Linear_q4(x), Linear(Linear(x, S), O))` where `S` is the block
/// indicator (`S[b, k] = 1` exactly when input `k` lies in block `b` of the
/// 4-bit weight) -> one 4-bit `Linear(x)` whose blocks carry the offsets `O`
/// (`w = (q - zero) * scale + O[n, b]`): affine 4-bit blocks (GGUF's Q4_1)
/// as exported with a block-sum correction, computed in one pass.
pub(super) fn q4_offsets(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !is_bin(&n.op, BinOp::Add) {
        return Ok(None);
    }
    let linear = |op: &Op| matches!(op, Op::Linear { bias: None, .. });
    for (a, b) in [(0, 1), (1, 0)] {
        let (Some(qv), Some(ov)) = (M::input(n, a), M::input(n, b)) else { continue };
        let (Some((qi, qn)), Some((oi, on))) = (m.from(qv, linear), m.from(ov, linear)) else { continue };
        let (Op::Linear { weight: wq, .. }, Op::Linear { weight: wo, .. }) = (&qn.op, &on.op) else { continue };
        let Packed::Q4 { data, scales, zeros, offsets: None, block, blocks, int8: false } = &wq.packed else {
            continue;
        };
        let Some(sv) = M::input(on, 0) else { continue };
        let Some((si, sn)) = m.from(sv, linear) else { continue };
        let Op::Linear { weight: ws, .. } = &sn.op else { continue };
        let x = M::input(qn, 0);
        if x.is_none() || M::input(sn, 0) != x || oi == qi {
            continue;
        }
        let (Packed::F32(sums), Packed::F32(offsets)) = (&ws.packed, &wo.packed) else { continue };
        let (k, nb) = (wq.k, *blocks);
        if ws.n != nb || ws.k != k || wo.k != nb || wo.n != wq.n {
            continue;
        }
        let indicator = sums
            .chunks_exact(k)
            .enumerate()
            .all(|(bi, row)| row.iter().enumerate().all(|(ki, v)| *v == if ki / block == bi { 1.0 } else { 0.0 }));
        let nodes = vec![qi, oi, si, i];
        if !indicator || !m.private(&nodes, &n.outputs) {
            continue;
        }
        let weight = Weight {
            n: wq.n,
            k,
            packed: Packed::Q4 {
                data: data.clone(),
                scales: scales.clone(),
                zeros: zeros.clone(),
                offsets: Some(offsets.clone()),
                block: *block,
                blocks: nb,
                int8: false,
            },
        };
        let op = Op::Linear { weight: Arc::new(weight), bias: None };
        return Ok(Some(Rewrite::new(i, nodes, fused(n, op, vec![x], n.outputs.clone()))));
    }
    Ok(None)
}

/// Bias-free projections of one input (a layer's Q, K and V, where an
/// export keeps them apart: decomposed, opset-23 and contrib) stacked into one [`Op::SplitLinear`] at the first
/// one's place: a decode step then runs one parallel region over their
/// weights instead of three (on SmolLM2's int4 export at 2 threads, K and
/// V's 192-output projections each took as long as at 1 thread — a region
/// that small is its own overhead). Runs on row-form weights just before
/// repacking, after every other fusion has matched the separate
/// projections. Members must share a storage; f32 ones must also narrow
/// to the same form (narrowing goes block by block, so the stack narrows
/// to it as well and no member ends up stored wider than alone). The
/// logits projection `head` (run on the last rows alone) is never
/// stacked. Returns how many stacks were made.
pub(crate) fn stack_siblings(g: &mut Graph, head: Vid, pool: &ThreadPool) -> usize {
    let uses = Uses::of(g);
    let mut stacks = 0;
    for x in 0..g.values.len() {
        let mut members: Vec<(usize, &Weight)> = Vec::new();
        for &i in &uses.consumers[x] {
            let Some(n) = &g.nodes[i] else { continue };
            let Op::Linear { weight, bias: None } = &n.op else { continue };
            if M::input(n, 0) == Some(x)
                && n.outputs.len() == 1
                && n.outputs[0] != head
                && !members.iter().any(|m| m.0 == i)
            {
                members.push((i, weight));
            }
        }
        if members.len() < 2 {
            continue;
        }
        // (Narrowing a weight to learn its form is costly: only here.)
        let mut members: Vec<(usize, String)> = members.into_iter().map(|(i, w)| (i, stored_kind(w, pool))).collect();
        // Kinds in order of first appearance; a group keeps plan order,
        // and more than `MAX_STACKED` members make several stacks.
        while let Some(kind) = members.first().map(|m| m.1.clone()) {
            let group: Vec<usize> = members.iter().filter(|m| m.1 == kind).map(|m| m.0).collect();
            for part in group.chunks(MAX_STACKED) {
                if part.len() >= 2 && stack_group(g, x, part) {
                    stacks += 1;
                }
            }
            members.retain(|m| m.1 != kind);
        }
    }
    stacks
}

/// The form a weight is stored in after repacking, with what it computes
/// (`f16 as q4`): members narrowed from different forms would not narrow
/// as one stack.
fn stored_kind(w: &Weight, pool: &ThreadPool) -> String {
    match w.narrower_on(pool) {
        Some(packed) => Weight { packed, ..*w }.label(),
        None => w.label(),
    }
}

/// Replaces the projections `group` (in plan order, all reading `x`) by
/// one [`Op::SplitLinear`] at the first one's place (not the last's, as
/// the pattern passes place theirs: its one input `x` comes before every
/// member, and whatever reads a member's output comes after that member);
/// false (the graph untouched) when their weights do not stack.
fn stack_group(g: &mut Graph, x: Vid, group: &[usize]) -> bool {
    let mut stacked: Option<Weight> = None;
    let (mut widths, mut outputs) = (Vec::new(), Vec::new());
    for &i in group {
        let Some(Node { op: Op::Linear { weight, .. }, outputs: outs, .. }) = &g.nodes[i] else { return false };
        let w = (**weight).clone();
        widths.push(w.n);
        outputs.extend(outs.iter().copied());
        stacked = Some(match stacked {
            None => w,
            Some(s) => match Weight::stack(s, w) {
                Ok(s) => s,
                Err(_) => return false,
            },
        });
    }
    let (Some(weight), Some(first)) = (stacked, g.nodes[group[0]].as_ref()) else { return false };
    let node = fused(first, Op::SplitLinear { weight: Arc::new(weight), widths }, vec![Some(x)], outputs);
    for &i in &group[1..] {
        g.nodes[i] = None;
    }
    g.nodes[group[0]] = Some(node);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(g: &mut Graph, x: Vid, name: &str, n: usize, f16: bool) -> usize {
        let k = 8;
        let rows: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 * 0.25).collect();
        let packed =
            if f16 { Packed::F16(rows.iter().map(|v| half::f16::from_f32(*v)).collect()) } else { Packed::F32(rows) };
        let out = g.value(name);
        let op = Op::Linear { weight: Arc::new(Weight { n, k, packed }), bias: None };
        g.nodes.push(Some(Node {
            name: name.into(),
            origin: "MatMul".into(),
            op,
            inputs: vec![Some(x)],
            outputs: vec![out],
        }));
        g.nodes.len() - 1
    }

    /// GGUF Q4_1 values (`d * q + m`, f16 `d` and `m`) as f32 rows, or
    /// (`to_f16`) rounded to f16 as an f16 export stores them.
    fn q4_1_rows(n: usize, k: usize, seed: usize, to_f16: bool) -> Vec<f32> {
        (0..n * k)
            .map(|i| {
                let block = i / 32 + seed;
                let d = half::f16::from_f32(0.003 + (block % 7) as f32 * 0.0011).to_f32();
                let m = half::f16::from_f32(-0.02 - (block % 5) as f32 * 0.004).to_f32();
                let q = match i % 32 {
                    0 => 0,
                    1 => 15,
                    _ => i * 7 % 16,
                };
                let v = d * q as f32 + m;
                if to_f16 {
                    half::f16::from_f32(v).to_f32()
                } else {
                    v
                }
            })
            .collect()
    }

    /// Members stack only when they narrow to the same form from the same
    /// one (`Weight::label`): two f32 projections of Q4_1 values stack, a
    /// third of the same blocks rounded to f16 (also 4-bit once narrowed,
    /// but `f16 as q4`) stays alone — stacked with them it would narrow to
    /// nothing and stay f32, four bytes a weight.
    #[test]
    fn siblings_narrowed_from_other_forms_do_not_stack() {
        let (n, k) = (16, 64);
        let mut g = Graph::default();
        let x = g.value("x");
        let mut add = |name: &str, rows: Vec<f32>| {
            let out = g.value(name);
            let weight = Arc::new(Weight { n, k, packed: Packed::F32(rows) });
            g.nodes.push(Some(Node {
                name: name.into(),
                origin: "MatMul".into(),
                op: Op::Linear { weight, bias: None },
                inputs: vec![Some(x)],
                outputs: vec![out],
            }));
            g.nodes.len() - 1
        };
        let (a, rounded, b) = (
            add("a", q4_1_rows(n, k, 0, false)),
            add("r", q4_1_rows(n, k, 1, true)),
            add("b", q4_1_rows(n, k, 2, false)),
        );
        let label = |i: usize| match &g.nodes[i].as_ref().unwrap().op {
            Op::Linear { weight, .. } => (**weight).clone().narrowed().label(),
            other => panic!("{other:?}"),
        };
        assert_eq!((label(a), label(rounded), label(b)), ("f32 as q4".into(), "f16 as q4".into(), "f32 as q4".into()));
        let head = linear(&mut g, x, "logits", 16, true);
        let head_out = g.nodes[head].as_ref().unwrap().outputs[0];
        assert_eq!(stack_siblings(&mut g, head_out, &ThreadPool::serial()), 1);
        let Some(Node { op: Op::SplitLinear { widths, weight }, .. }) = &g.nodes[a] else {
            panic!("a and b did not stack: {:?}", g.nodes[a]);
        };
        assert_eq!(widths, &[16, 16]);
        assert_eq!((**weight).clone().narrowed().label(), "f32 as q4");
        assert!(g.nodes[b].is_none());
        assert!(matches!(g.nodes[rounded].as_ref().map(|n| &n.op), Some(Op::Linear { .. })), "the f16 values stacked");
    }

    /// Stacking is bounded and keeps order: five f16 projections of one
    /// input make one stack of `MAX_STACKED` (at the first one's place,
    /// outputs in member order) and leave the fifth alone; a projection of
    /// another storage and the logits projection are never stacked.
    #[test]
    fn siblings_stack_in_order_up_to_the_bound() {
        let mut g = Graph::default();
        let x = g.value("x");
        let members: Vec<usize> = (0..5).map(|i| linear(&mut g, x, &format!("p{i}"), 16 + i, true)).collect();
        let other = linear(&mut g, x, "wide", 16, false);
        let head = linear(&mut g, x, "logits", 16, true);
        let head_out = g.nodes[head].as_ref().unwrap().outputs[0];
        let want: Vec<Vid> = members[..4].iter().map(|i| g.nodes[*i].as_ref().unwrap().outputs[0]).collect();
        assert_eq!(stack_siblings(&mut g, head_out, &ThreadPool::serial()), 1);
        let Some(Node { op: Op::SplitLinear { widths, weight }, outputs, .. }) = &g.nodes[members[0]] else {
            panic!("no stack at the first member's place: {:?}", g.nodes[members[0]]);
        };
        assert_eq!(widths, &[16, 17, 18, 19]);
        assert_eq!(weight.n, 70);
        assert_eq!(outputs, &want);
        assert!(members[1..4].iter().all(|i| g.nodes[*i].is_none()), "stacked members stay behind");
        for alone in [members[4], other, head] {
            assert!(
                matches!(g.nodes[alone].as_ref().map(|n| &n.op), Some(Op::Linear { .. })),
                "node {alone} was stacked"
            );
        }
    }
}
