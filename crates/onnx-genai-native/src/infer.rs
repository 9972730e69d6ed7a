//! Shape and dtype inference for the supported ops. Dims are known where
//! the graph fixes them (weights, head counts, hidden sizes) and unknown
//! where only run time knows (batch, sequence). Any definite contradiction
//! is an error that the compiler reports against the node.

use crate::graph::{Dims, Meta};
use crate::kernels::elementwise::{broadcast_shape, BinOp, CmpOp, UnOp};
use crate::kernels::layout as ly;
use crate::ops::Op;
use crate::value::DType;

type Out = (Option<DType>, Dims);

fn dims_of(m: Option<&Meta>) -> Dims {
    match m {
        Some(m) => match &m.konst {
            Some(v) => Some(v.shape.iter().map(|d| Some(*d)).collect()),
            None => m.dims.clone(),
        },
        None => None,
    }
}

fn known(d: &Dims) -> Option<Vec<usize>> {
    d.as_ref()?.iter().copied().collect()
}

fn broadcast(a: &Dims, b: &Dims) -> Result<Dims, String> {
    let (Some(a), Some(b)) = (a, b) else { return Ok(None) };
    let rank = a.len().max(b.len());
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { Some(1) };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { Some(1) };
        out.push(match (da, db) {
            (Some(x), Some(y)) => match broadcast_shape(&[x], &[y]) {
                Some(v) => Some(v[0]),
                None => return Err(format!("dims {x} and {y} do not broadcast (shapes {a:?} and {b:?})")),
            },
            (Some(1), y) | (y, Some(1)) => y,
            (Some(x), None) | (None, Some(x)) => Some(x),
            (None, None) => None,
        });
    }
    Ok(Some(out))
}

fn require_float(what: &str, t: Option<DType>) -> Result<(), String> {
    match t {
        None | Some(DType::F32) => Ok(()),
        Some(DType::F16) => {
            Err(format!("{what} is f16: native-cpu computes in f32 (f16 is for weights and the KV cache)"))
        }
        Some(t) => Err(format!("{what} is {t}, expected f32")),
    }
}

fn same_dtype(a: Option<DType>, b: Option<DType>) -> Result<Option<DType>, String> {
    match (a, b) {
        (Some(x), Some(y)) if x != y => Err(format!("operand dtypes differ: {x} and {y}")),
        (x, y) => Ok(x.or(y)),
    }
}

/// Infers the outputs of `op` from its inputs' metadata.
pub fn infer(op: &Op, inputs: &[Option<&Meta>], outputs: usize) -> Result<Vec<Out>, String> {
    let t = |i: usize| inputs.get(i).copied().flatten().and_then(|m| m.dtype.or(m.konst.as_ref().map(|v| v.dtype())));
    let d = |i: usize| dims_of(inputs.get(i).copied().flatten());
    let konst = |i: usize| inputs.get(i).copied().flatten().and_then(|m| m.konst.clone());
    let single = |o: Out| Ok(vec![o]);
    match op {
        Op::Binary(b) => {
            let dt = same_dtype(t(0), t(1))?;
            // ONNX: floating-point Mod must set `fmod` (ONNX Runtime refuses
            // the node; a Python-style float modulo is nobody's).
            if *b == BinOp::Mod && matches!(dt, Some(DType::F32 | DType::F16 | DType::F64)) {
                return Err("Mod of floats needs fmod=1 (ONNX defines no other float modulo)".into());
            }
            if dt == Some(DType::F16) {
                require_float("the operand", dt)?;
            }
            if let Some(dt) = dt.filter(|dt| !matches!(dt, DType::F32 | DType::I64)) {
                return Err(format!("operands are {dt}: native-cpu computes element-wise in f32 and i64"));
            }
            single((dt, broadcast(&d(0), &d(1))?))
        }
        Op::Compare(c) => {
            let dt = same_dtype(t(0), t(1))?;
            let ok = match dt {
                None | Some(DType::F32 | DType::I64) => true,
                Some(DType::Bool) => *c == CmpOp::Equal,
                _ => false,
            };
            if !ok {
                return Err(format!("cannot compare {} operands with {c:?}", dt.map_or("?", DType::name)));
            }
            single((Some(DType::Bool), broadcast(&d(0), &d(1))?))
        }
        Op::Logic(_) => {
            for i in 0..2 {
                if let Some(dt) = t(i).filter(|dt| *dt != DType::Bool) {
                    return Err(format!("input {i} is {dt}, expected bool"));
                }
            }
            single((Some(DType::Bool), broadcast(&d(0), &d(1))?))
        }
        Op::Unary(u) => {
            if u.float_only() {
                require_float("the input", t(0))?;
            }
            let ok = match (u, t(0)) {
                (_, None) => true,
                (UnOp::Not, Some(dt)) => dt == DType::Bool,
                (_, Some(dt)) => dt == DType::F32 || (dt == DType::I64 && !u.float_only()),
            };
            if !ok {
                return Err(format!("{u:?} of {} is not supported", t(0).map_or("?", DType::name)));
            }
            single((t(0), d(0)))
        }
        Op::Where => {
            if let Some(dt) = t(0).filter(|dt| *dt != DType::Bool) {
                return Err(format!("the condition is {dt}, expected bool"));
            }
            let dt = same_dtype(t(1), t(2))?;
            if let Some(dt) = dt.filter(|dt| !matches!(dt, DType::F32 | DType::I64)) {
                return Err(format!("Where branches are {dt}: native-cpu selects f32 and i64"));
            }
            single((dt, broadcast(&d(0), &broadcast(&d(1), &d(2))?)?))
        }
        Op::Cast(to) => {
            if let Some(from) = t(0).filter(|from| !crate::kernels::elementwise::can_cast(*from, *to)) {
                return Err(format!("cast from {from} to {to} is not supported"));
            }
            single((Some(*to), d(0)))
        }
        Op::Identity => single((t(0), d(0))),
        Op::MatMul => {
            require_float("input A", t(0))?;
            require_float("input B", t(1))?;
            let (a, b) = (d(0), d(1));
            if let (Some(a), Some(b)) = (&a, &b) {
                if a.is_empty() || b.is_empty() {
                    return Err(format!("MatMul of a scalar (ranks {} and {})", a.len(), b.len()));
                }
                if a.len() < 2 || b.len() < 2 {
                    // numpy's 1-D promotion; the kernel drops the axis again.
                    return single((Some(DType::F32), None));
                }
                if let (Some(k1), Some(k2)) = (a[a.len() - 1], b[b.len() - 2]) {
                    if k1 != k2 {
                        return Err(format!("inner dimensions differ: {k1} vs {k2}"));
                    }
                }
                let mut out =
                    broadcast(&Some(a[..a.len() - 2].to_vec()), &Some(b[..b.len() - 2].to_vec()))?.unwrap_or_default();
                out.extend([a[a.len() - 2], b[b.len() - 1]]);
                return single((Some(DType::F32), Some(out)));
            }
            single((Some(DType::F32), None))
        }
        Op::Gather { axis } => {
            if let Some(dt) = t(1).filter(|dt| *dt != DType::I64) {
                return Err(format!("indices are {dt}, expected i64"));
            }
            let dims = match (d(0), d(1)) {
                (Some(data), Some(idx)) => {
                    let a = ly::axis(*axis, data.len())?;
                    let mut out = data[..a].to_vec();
                    out.extend(idx);
                    out.extend(&data[a + 1..]);
                    Some(out)
                }
                _ => None,
            };
            single((t(0), dims))
        }
        Op::Shape { start, end } => {
            single((Some(DType::I64), d(0).map(|x| vec![Some(ly::shape_span(*start, *end, x.len()).len())])))
        }
        Op::Concat { axis } => {
            let mut dt = None;
            let mut out: Option<Vec<Option<usize>>> = None;
            for i in 0..inputs.len() {
                dt = same_dtype(dt, t(i))?;
                let Some(cur) = d(i) else { continue };
                let Some(acc) = &mut out else {
                    out = Some(cur);
                    continue;
                };
                if acc.len() != cur.len() {
                    return Err(format!("inputs have ranks {} and {}", acc.len(), cur.len()));
                }
                let a = ly::axis(*axis, acc.len())?;
                for (j, (x, y)) in acc.iter_mut().zip(&cur).enumerate() {
                    if j == a {
                        *x = match x.zip(*y) {
                            // (Within i64: later ops index these axes in i64.)
                            Some((p, q)) => Some(
                                p.checked_add(q)
                                    .filter(|n| i64::try_from(*n).is_ok())
                                    .ok_or("the concat axis overflows")?,
                            ),
                            None => None,
                        };
                    } else if let (Some(p), Some(q)) = (*x, *y) {
                        if p != q {
                            return Err(format!("inputs differ at axis {j} ({p} vs {q}) off the concat axis {a}"));
                        }
                    }
                }
            }
            single((dt, out))
        }
        Op::Reshape => {
            let dims = match (konst(1), known(&d(0))) {
                (Some(shape), Some(input)) => {
                    let target = shape.ints().ok_or("the shape input must be i64")?;
                    Some(ly::reshape_target(&input, target)?.into_iter().map(Some).collect())
                }
                (Some(shape), None) => {
                    let target = shape.ints().ok_or("the shape input must be i64")?;
                    let input = d(0);
                    Some(
                        target
                            .iter()
                            .enumerate()
                            .map(|(i, t)| match *t {
                                0 => input.as_ref().and_then(|x| x.get(i).copied().flatten()),
                                t if t > 0 => Some(t as usize),
                                _ => None,
                            })
                            .collect(),
                    )
                }
                _ => None,
            };
            single((t(0), dims))
        }
        Op::Transpose(perm) => {
            let dims = match (d(0), perm) {
                (Some(x), Some(p)) => {
                    if p.len() != x.len() {
                        return Err(format!("perm {p:?} does not match rank {}", x.len()));
                    }
                    let axes: Vec<usize> = p.iter().map(|a| ly::axis(*a, x.len())).collect::<Result<_, _>>()?;
                    ly::check_permutation(&axes, x.len())?;
                    Some(axes.iter().map(|a| x[*a]).collect())
                }
                _ => None,
            };
            single((t(0), dims))
        }
        Op::Softmax { .. } => {
            require_float("the input", t(0))?;
            single((t(0), d(0)))
        }
        Op::RmsNorm { axis, .. } | Op::LayerNorm { axis, .. } => {
            require_float("the input", t(0))?;
            let x = d(0);
            let from = x.as_ref().map(|x| ly::axis(*axis, x.len())).transpose()?;
            norm_check(&x, from, &d(1)).map_err(|e| format!("axis={axis}: {e}"))?;
            // The statistics keep the leading axes and 1 for each normalized one.
            let stats =
                x.as_ref().zip(from).map(|(x, a)| (0..x.len()).map(|i| if i < a { x[i] } else { Some(1) }).collect());
            let mut outs = vec![(Some(DType::F32), x)];
            outs.extend((1..outputs).map(|_| (Some(DType::F32), stats.clone())));
            Ok(outs)
        }
        Op::SkipRmsNorm { .. } => {
            require_float("the input", t(0))?;
            norm_check(&d(0), d(0).map(|x| x.len().saturating_sub(1)), &d(2))?;
            let x = (Some(DType::F32), d(0));
            Ok(vec![x.clone(), (None, None), (None, None), x].into_iter().take(outputs.max(1)).collect())
        }
        Op::Linear { weight, .. } | Op::SplitLinear { weight, .. } | Op::GatedMlp { weight } => {
            let mut outs = Vec::with_capacity(outputs.max(1));
            for w in op.projection_widths() {
                outs.extend(linear_out(&d(0), t(0), weight.k, w)?);
            }
            Ok(outs)
        }
        Op::MatMulNBits { k, n, .. } => linear_out(&d(0), t(0), *k, *n),
        Op::GatherQ4 { .. } => {
            if t(0).is_some_and(|t| t != DType::U8) || t(1).is_some_and(|t| t != DType::I64) {
                return Err(format!("data must be u8 and indices i64, found {:?} and {:?}", t(0), t(1)));
            }
            let dims = match (d(0), d(1)) {
                (Some(data), Some(mut ids)) if data.len() == 2 => {
                    let values = data[1].map(|b| b.checked_mul(2).ok_or("the row width overflows")).transpose()?;
                    ids.push(values);
                    Some(ids)
                }
                _ => None,
            };
            single((Some(DType::F32), dims))
        }
        Op::Rotary { .. } => {
            require_float("the input", t(0))?;
            single((Some(DType::F32), d(0)))
        }
        Op::CausalBias { .. } => single((Some(DType::F32), None)),
        Op::CumSum { .. } => {
            if let Some(dt) = t(0).filter(|dt| !matches!(dt, DType::F32 | DType::F64 | DType::I64 | DType::I32)) {
                return Err(format!("CumSum of {dt} is not supported"));
            }
            single((t(0), d(0)))
        }
        Op::Clip { .. } | Op::Trilu { .. } | Op::ScatterNd(_) => {
            if let Some(dt) = t(0).filter(|dt| !matches!(dt, DType::F32 | DType::I64)) {
                return Err(format!("{} of {dt} is not supported", op.name()));
            }
            single((t(0), d(0)))
        }
        Op::Flatten { .. } => single((t(0), None)),
        Op::ArgExtreme { .. } | Op::TopK { .. } => {
            if let Some(dt) = t(0).filter(|dt| !matches!(dt, DType::F32 | DType::I64)) {
                return Err(format!("{} of {dt} is not supported", op.name()));
            }
            if let Op::TopK { .. } = op {
                return Ok(vec![(t(0), None), (Some(DType::I64), None)]);
            }
            single((Some(DType::I64), None))
        }
        Op::Split { .. } => Ok((0..outputs).map(|_| (t(0), None)).collect()),
        Op::Nary { mean, .. } => {
            let mut dt = None;
            let mut dims = Some(Vec::new());
            for i in 0..inputs.len() {
                dt = same_dtype(dt, t(i))?;
                dims = broadcast(&dims, &d(i))?;
            }
            if let Some(dt) = dt.filter(|dt| !(*dt == DType::F32 || (*dt == DType::I64 && !mean))) {
                return Err(format!("{} of {dt} is not supported", op.name()));
            }
            single((dt, dims))
        }
        Op::CastLike => {
            let to = t(1).ok_or("the target type (input 1) is not known at compile time")?;
            if let Some(from) = t(0).filter(|from| !crate::kernels::elementwise::can_cast(*from, to)) {
                return Err(format!("cast from {from} to {to} is not supported"));
            }
            single((Some(to), d(0)))
        }
        Op::Size => single((Some(DType::I64), Some(Vec::new()))),
        Op::GatherElements { .. } => {
            if let Some(dt) = t(1).filter(|dt| *dt != DType::I64) {
                return Err(format!("indices are {dt}, expected i64"));
            }
            single((t(0), d(1)))
        }
        Op::Einsum(_) => {
            let dt = (0..inputs.len()).try_fold(None, |acc, i| same_dtype(acc, t(i)))?;
            if let Some(dt) = dt.filter(|dt| !matches!(dt, DType::F32 | DType::F64)) {
                return Err(format!("Einsum of {dt} is not supported"));
            }
            single((dt.or(Some(DType::F32)), None))
        }
        Op::Hardmax { .. } | Op::Activation(_) => {
            for i in 0..inputs.len() {
                require_float("the input", t(i))?;
            }
            single((Some(DType::F32), d(0)))
        }
        Op::Classify { .. } => {
            require_float("the input", t(0))?;
            single((Some(DType::Bool), d(0)))
        }
        Op::Gemm { .. } => {
            require_float("input A", t(0))?;
            require_float("input B", t(1))?;
            single((Some(DType::F32), None))
        }
        Op::Attention { spec, .. } => {
            for (i, what) in [(0, "query"), (1, "key"), (2, "value")] {
                if t(i) != Some(DType::F16) {
                    require_float(what, t(i))?;
                }
            }
            // A packed projection holds `heads + 2 * kv_heads` heads; the
            // output keeps the query's.
            let dims = match (spec.packed_qkv, spec.heads, spec.kv_heads, d(0)) {
                (false, ..) => d(0),
                (true, Some(h), Some(kv), Some(mut dims)) => {
                    // Head counts come from attributes (positive once
                    // lowered); the sum is checked all the same.
                    let packed = kv.checked_mul(2).and_then(|k| k.checked_add(h)).filter(|n| *n > 0);
                    let packed = packed.ok_or("the packed head count overflows or is zero")?;
                    if let Some(Some(last)) = dims.last_mut() {
                        if *last % packed != 0 {
                            return Err(format!("packed QKV width {last} is not {packed} heads wide"));
                        }
                        *last = *last / packed * h;
                    }
                    Some(dims)
                }
                (true, ..) => None,
            };
            let mut outs = vec![(t(0).or(Some(DType::F32)), dims)];
            outs.extend((1..outputs).map(|i| (t(3 + i), None)));
            Ok(outs)
        }
        Op::Reduce { kind, .. } if t(0).is_some_and(|dt| dt != DType::F32 && !(dt == DType::I64 && kind.on_ints())) => {
            Err(format!("Reduce{kind:?} of {} is not supported", t(0).map_or("?", DType::name)))
        }
        Op::Reduce { axes: Some(axes), keepdims, .. } if d(0).is_some() && !axes.is_empty() => {
            let x = d(0).unwrap_or_default();
            let reduced = axes.iter().map(|a| ly::axis(*a, x.len())).collect::<Result<Vec<_>, _>>()?;
            let dims = x
                .iter()
                .enumerate()
                .filter_map(|(i, v)| match (reduced.contains(&i), *keepdims) {
                    (true, true) => Some(Some(1)),
                    (true, false) => None,
                    (false, _) => Some(*v),
                })
                .collect();
            single((t(0), Some(dims)))
        }
        Op::Unsqueeze(attr) if d(0).is_some() && (attr.is_some() || konst(1).is_some()) => {
            let x = d(0).unwrap_or_default();
            let axes: Vec<i64> = match (attr, konst(1)) {
                (Some(a), _) => a.clone(),
                (None, Some(k)) => k.ints().ok_or("axes must be i64")?.to_vec(),
                (None, None) => return single((t(0), None)),
            };
            let rank = x.len() + axes.len();
            let mut resolved = axes.iter().map(|a| ly::axis(*a, rank)).collect::<Result<Vec<_>, _>>()?;
            resolved.sort_unstable();
            let mut rest = x.into_iter();
            let dims = (0..rank)
                .map(|i| if resolved.binary_search(&i).is_ok() { Some(1) } else { rest.next().flatten() })
                .collect();
            single((t(0), Some(dims)))
        }
        Op::Slice if d(0).is_some() && konst(1).is_some() && konst(2).is_some() => {
            let mut x = d(0).unwrap_or_default();
            let ints = |i: usize| konst(i).and_then(|k| k.ints().map(<[i64]>::to_vec));
            let (starts, ends) = (ints(1).unwrap_or_default(), ints(2).unwrap_or_default());
            let axes = ints(3).unwrap_or_else(|| (0..starts.len() as i64).collect());
            let steps = ints(4);
            for (i, (start, end)) in starts.iter().zip(&ends).enumerate() {
                let a = ly::axis(*axes.get(i).ok_or("fewer axes than starts")?, x.len())?;
                let step = steps.as_ref().and_then(|s| s.get(i).copied()).unwrap_or(1);
                x[a] = match x[a] {
                    Some(dim) if step > 0 => {
                        let dim = i64::try_from(dim).map_err(|_| format!("axis {a} of {dim} is beyond i64"))?;
                        let norm = |v: i64| if v < 0 { v + dim } else { v };
                        let (b, e) = (norm(*start).clamp(0, dim), norm(*end).clamp(0, dim));
                        // Counted without forming `e - b + step`, which
                        // overflows for a step near i64::MAX.
                        Some(if e > b { ((e - b - 1) as u64 / step as u64 + 1) as usize } else { 0 })
                    }
                    _ => None,
                };
            }
            single((t(0), Some(x)))
        }
        Op::Range
        | Op::ConstantOfShape(_)
        | Op::Unsqueeze(_)
        | Op::Squeeze(_)
        | Op::Slice
        | Op::Reduce { .. }
        | Op::Tile
        | Op::Expand => {
            let dt = match op {
                Op::Range => Some(DType::I64),
                Op::ConstantOfShape(v) => Some(v.dtype()),
                _ => t(0),
            };
            if let Op::Range = op {
                // Range follows its operands' type (i64 or f32).
                let dt = t(0).or(Some(DType::I64));
                if let Some(dt) = dt.filter(|dt| !matches!(dt, DType::I64 | DType::F32)) {
                    return Err(format!("Range of {dt} is not supported"));
                }
                return single((dt, None));
            }
            single((dt, None))
        }
    }
}

/// The scale must hold one element per normalized position (the axes of
/// `x` from `from` on).
fn norm_check(x: &Dims, from: Option<usize>, scale: &Dims) -> Result<(), String> {
    if let (Some(x), Some(from), Some(s)) = (x, from, scale) {
        if s.len() != x.len() - from {
            return Err(format!(
                "the scale has rank {} but {} axes are normalized (broadcast scales are not supported)",
                s.len(),
                x.len() - from
            ));
        }
        // Declared dims: counted with overflow checks, as `reshape_target`
        // counts them (a file can declare any size).
        let count = |dims: &[Option<usize>]| -> Result<Option<usize>, String> {
            dims.iter().copied().collect::<Option<Vec<usize>>>().map(|d| ly::checked_elements(&d)).transpose()
        };
        let n = count(s)?;
        let width = count(x.get(from..).unwrap_or_default())?;
        if let (Some(width), Some(n)) = (width, n) {
            if width != n {
                return Err(format!("the scale has {n} elements, the normalized axes {width}"));
            }
        }
    }
    Ok(())
}

fn linear_out(x: &Dims, t: Option<DType>, k: usize, n: usize) -> Result<Vec<Out>, String> {
    require_float("the input", t)?;
    let dims = x.as_ref().map(|x| {
        let mut out = x.clone();
        if let Some(last) = out.last_mut() {
            *last = Some(n);
        }
        out
    });
    if let Some(Some(Some(last))) = x.as_ref().map(|x| x.last().copied()) {
        if last != k {
            return Err(format!("the input's last axis is {last}, the weight takes {k}"));
        }
    }
    Ok(vec![(Some(DType::F32), dims)])
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::value::Value;

    /// Issue 20: a norm's declared dims whose product overflows are an
    /// error (as in `reshape_target`), not an overflow panic.
    #[test]
    fn norm_dims_that_overflow_are_an_error() {
        let huge: Dims = Some(vec![Some(usize::MAX / 2), Some(3)]);
        let err = norm_check(&huge, Some(0), &huge).unwrap_err();
        assert!(err.contains("more than"), "{err}");
        let x: Dims = Some(vec![Some(2), Some(8)]);
        assert!(norm_check(&x, Some(1), &Some(vec![Some(8)])).is_ok());
        assert!(norm_check(&x, Some(1), &Some(vec![Some(4)])).is_err());
    }

    fn meta(dims: &[usize], konst: Option<Value>) -> Meta {
        Meta {
            name: "x".into(),
            dtype: Some(DType::F32),
            dims: Some(dims.iter().map(|d| Some(*d)).collect()),
            konst: konst.map(Arc::new),
        }
    }

    /// Axes stay within i64 (ONNX's own type for them): two concatenated
    /// empty initializers of `[0, i64::MAX]` are an error, not an axis of
    /// 2^64 − 2 that a `Slice` after them read as −2 and `clamp(0, −2)`
    /// panicked on; a `Slice` of an axis beyond i64 is refused too.
    #[test]
    fn axes_beyond_i64_are_an_error() {
        let half = i64::MAX as usize;
        let z = meta(&[0, half], None);
        let err = infer(&Op::Concat { axis: 1 }, &[Some(&z), Some(&z)], 1).unwrap_err();
        assert!(err.contains("the concat axis overflows"), "{err}");
        let fits = infer(&Op::Concat { axis: 1 }, &[Some(&meta(&[0, half - 1], None)), Some(&meta(&[0, 1], None))], 1);
        assert!(fits.is_ok(), "{fits:?}");
        let wide = meta(&[0, half + 2], None);
        let (starts, ends, axes) = (
            meta(&[1], Some(Value::i64([1], vec![0]))),
            meta(&[1], Some(Value::i64([1], vec![1]))),
            meta(&[1], Some(Value::i64([1], vec![1]))),
        );
        let err = infer(&Op::Slice, &[Some(&wide), Some(&starts), Some(&ends), Some(&axes)], 1).unwrap_err();
        assert!(err.contains("beyond i64"), "{err}");
    }
}
