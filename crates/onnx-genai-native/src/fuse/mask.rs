//! Fusion of the additive causal-mask subgraph decoder exports compute from
//! the token ids' and attention mask's shapes (about fifteen small ops per
//! step, each growing with the context) into one `CausalBias` op.

use super::{Rewrite, M};
use crate::error::CompileError;
use crate::graph::{Graph, Uses, Vid};
use crate::kernels::elementwise::{BinOp, CmpOp, LogicOp};
use crate::ops::Op;
use crate::value::DType;

/// `Gather(Shape(x), 1)`: returns `x` (the tensor whose axis 1 is read).
fn axis1_of(m: &M, v: Vid, nodes: &mut Vec<usize>) -> Option<Vid> {
    let (gi, g) = m.from(v, |op| matches!(op, Op::Gather { axis: 0 }))?;
    let idx = m.konst(M::input(g, 1)?)?.ints()?;
    if idx != [1] {
        return None;
    }
    let (si, shape) = m.from(M::input(g, 0)?, |op| matches!(op, Op::Shape { start: 0, end: None }))?;
    nodes.extend([gi, si]);
    M::input(shape, 0)
}

/// `Unsqueeze(x, axes)` with constant axes equal to `want`.
fn unsqueezed(m: &M, v: Vid, want: &[i64], nodes: &mut Vec<usize>) -> Option<Vid> {
    let (ui, u) = m.from(v, |op| matches!(op, Op::Unsqueeze(_)))?;
    let axes = match &u.op {
        Op::Unsqueeze(Some(a)) => a.clone(),
        _ => m.ints(M::input(u, 1))?.to_vec(),
    };
    (axes == want).then(|| {
        nodes.push(ui);
        M::input(u, 0)
    })?
}

/// `Range(start, limit, 1)`: returns `(start, limit)`.
fn range_of(m: &M, v: Vid, nodes: &mut Vec<usize>) -> Option<(Vid, Vid)> {
    let (ri, r) = m.from(v, |op| matches!(op, Op::Range))?;
    if m.konst(M::input(r, 2)?)?.ints()? != [1] {
        return None;
    }
    nodes.push(ri);
    Some((M::input(r, 0)?, M::input(r, 1)?))
}

/// Matches, from `Where(allowed, 0, closed)` (optionally tiled along the
/// query axis):
/// `allowed = And(LessOrEqual(k[None, :], q[:, None]), bool(mask[:, None, None, :]))`
/// with `k = Range(0, T, 1)`, `q = Range(T - S, T, 1)`, `T = mask.shape[1]`,
/// `S = ids.shape[1]`.
pub(super) fn causal_mask(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
    let m = M { g, u };
    let Some(n) = &g.nodes[i] else { return Ok(None) };
    if !matches!(n.op, Op::Where) {
        return Ok(None);
    }
    let found = (|| {
        let mut nodes = vec![i];
        let (allowed, open, closed) = (M::input(n, 0)?, M::input(n, 1)?, M::input(n, 2)?);
        if m.scalar(open)? != 0.0 {
            return None;
        }
        let closed = m.scalar(closed)?;
        let (ai, and) = m.from(allowed, |op| matches!(op, Op::Logic(LogicOp::And)))?;
        nodes.push(ai);
        let (causal, pad) = (M::input(and, 0)?, M::input(and, 1)?);
        let (ci, cmp) = m.from(causal, |op| matches!(op, Op::Compare(CmpOp::LessOrEqual)))?;
        nodes.push(ci);
        let k = unsqueezed(&m, M::input(cmp, 0)?, &[0], &mut nodes)?;
        let q = unsqueezed(&m, M::input(cmp, 1)?, &[1], &mut nodes)?;
        let (k_start, k_total) = range_of(&m, k, &mut nodes)?;
        let (q_start, q_total) = range_of(&m, q, &mut nodes)?;
        if m.konst(k_start)?.ints()? != [0] || k_total != q_total {
            return None;
        }
        let (si, sub) = m.from(q_start, |op| matches!(op, Op::Binary(BinOp::Sub)))?;
        nodes.push(si);
        if M::input(sub, 0)? != k_total {
            return None;
        }
        let mask = axis1_of(&m, k_total, &mut nodes)?;
        let ids = axis1_of(&m, M::input(sub, 1)?, &mut nodes)?;
        let (pi, cast) = m.from(pad, |op| matches!(op, Op::Cast(DType::Bool)))?;
        nodes.push(pi);
        if unsqueezed(&m, M::input(cast, 0)?, &[1, 2], &mut nodes)? != mask {
            return None;
        }
        // Optional GQA tiling of the query axis.
        let mut out = n.outputs[0];
        let mut reps = 1;
        if let [ti] = u.consumers[out][..] {
            if let Some(t) = g.nodes[ti].as_ref().filter(|t| matches!(t.op, Op::Tile)) {
                if let Some(&[1, 1, r, 1]) = m.ints(M::input(t, 1)) {
                    if r > 0 {
                        reps = r as usize;
                        nodes.push(ti);
                        out = t.outputs[0];
                    }
                }
            }
        }
        if !m.private(&nodes, &[out]) {
            return None;
        }
        nodes.sort_unstable();
        nodes.dedup();
        Some((nodes, mask, ids, closed, reps, out))
    })();
    let Some((nodes, mask, ids, closed, reps, out)) = found else { return Ok(None) };
    let root = *nodes.iter().max().unwrap_or(&i);
    let op = Op::CausalBias { closed, reps };
    let node = crate::fuse::fused(n, op, vec![Some(mask), Some(ids)], vec![out]);
    Ok(Some(Rewrite::new(root, nodes, node)))
}
