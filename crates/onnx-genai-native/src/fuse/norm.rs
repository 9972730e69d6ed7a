//! RMSNorm and LayerNorm spelled out in elementwise ops.

use super::{fused, is_bin, Rewrite, M};
use crate::error::CompileError;
use crate::graph::{Graph, Uses, Vid};
use crate::kernels::elementwise::{BinOp, UnOp};
use crate::kernels::math::Reduce;
use crate::ops::Op;

/// `(Mul(x, x) | Pow(x, 2)) -> ReduceMean(last) -> Add eps -> Sqrt`, returning
/// `(x, eps, nodes)` for `Sqrt`'s output `s`.
pub(super) fn rms_of(m: &M, s: Vid) -> Option<(Vid, f32, Vec<usize>)> {
    let (si, sqrt) = m.from(s, |op| matches!(op, Op::Unary(UnOp::Sqrt)))?;
    let (ai, add) = m.from(M::input(sqrt, 0)?, |op| is_bin(op, BinOp::Add))?;
    let (mean, eps) = match (M::input(add, 0)?, M::input(add, 1)?) {
        (a, b) if m.scalar(b).is_some() => (a, m.scalar(b)?),
        (a, b) => (b, m.scalar(a)?),
    };
    let (ri, red) = m.from(
        mean,
        |op| matches!(op, Op::Reduce { kind: Reduce::Mean, keepdims: true, axes: Some(a), .. } if a.as_slice() == [-1]),
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
pub(super) fn rms_norm(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
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
        let op = Op::RmsNorm { eps, axis: -1 };
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
pub(super) fn layer_norm(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
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
            let Some((ri, red)) = m.from(mean, |op| matches!(op, Op::Reduce { kind: Reduce::Mean, keepdims: true, axes: Some(a), .. } if a.as_slice() == [-1])) else { continue };
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
            let op = Op::LayerNorm { eps, axis: -1 };
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
