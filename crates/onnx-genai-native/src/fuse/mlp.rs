//! The MLP activations: the SiLU-gated MLP (both projections stacked) and
//! the tanh GELU.

use std::sync::Arc;

use super::{fused, is_bin, Rewrite, M};
use crate::error::CompileError;
use crate::graph::{Graph, Uses, Vid};
use crate::kernels::elementwise::{BinOp, UnOp};
use crate::kernels::weights::Weight;
use crate::ops::Op;

/// `Mul(Mul(g, Sigmoid(g)), up)` with `g`, `up` bias-free projections of
/// the same input -> `GatedMlp(x)`.
pub(super) fn gated_mlp(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
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

/// `Mul(Mul(x, 0.5), Add(Tanh(Mul(Add(x, Mul(Mul(Mul(x, x), x), a)), b)), 1))`
/// with `a = 0.044715`, `b = sqrt(2/pi)` -> `GeluTanh(x)` (GPT-2's GELU).
pub(super) fn gelu_tanh(g: &Graph, u: &Uses, i: usize) -> Result<Option<Rewrite>, CompileError> {
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
