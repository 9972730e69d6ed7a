//! Attention: rotary in rotate-half form, the decomposed KV-cache
//! attention (which must fuse), and the head layout that lets attention
//! read the projections as they are.

use super::{fused, is_bin, Rewrite, M};
use crate::error::CompileError;
use crate::graph::{Graph, Uses, Vid};
use crate::kernels::attention::{Bias, Layout};
use crate::kernels::elementwise::{BinOp, UnOp};
use crate::ops::{Op, PartialAttention};
use crate::value::DType;

/// `Add(Mul(x, cos), Mul(Concat(Neg(x[half:]), x[:half]), sin))` over the
/// last axis of a heads-first `x` -> `Rotary(x, cos, sin)`.
pub(super) fn rotary(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
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
            let op = Op::Rotary { layout: Layout::HeadsFirst, cached: false, spec_layout: false };
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
pub(super) fn attention(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !matches!(n.op, Op::MatMul) {
        return Ok(None);
    }
    let (Some(probs), Some(vf)) = (M::input(n, 0), M::input(n, 1)) else { return Ok(None) };
    let Some((pi, soft)) = m.from(probs, |op| matches!(op, Op::Softmax { axis: -1 | 3, log: false })) else {
        return Ok(None);
    };
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
pub(super) fn cache_edge(m: &M, full: Vid, nodes: &mut Vec<usize>) -> Option<(Vid, Vid, Vid)> {
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
pub(super) fn split_heads(m: &M, v: Vid, reader: usize) -> Option<(Vid, [usize; 2])> {
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
pub(super) fn head_layout(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
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
        r.op = Op::Rotary { layout: Layout::SeqFirst, cached, spec_layout: false };
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
