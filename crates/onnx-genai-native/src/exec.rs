//! Kernel dispatch: runs one op on its input values. Used both by constant
//! folding (no batch, no KV cache) and by the plan at run time.

use crate::kernels::attention::{self, AdditiveBias, Bias, Heads, Layout, RotaryCache, Segment};
use crate::kernels::elementwise as ew;
use crate::kernels::layout as ly;
use crate::kernels::linear::{gated, linear, split, MAX_STACKED};
use crate::kernels::math::Reduce;
use crate::kernels::rotary::{rotary, Angles};
use crate::kernels::{math, select, Ctx};
use crate::kv::SeqKv;
use crate::ops::{Op, PartialAttention};
use crate::pool::Disjoint;
use crate::value::{DType, Value};

/// The batch a plan step runs for: each sequence's rows and KV cache.
pub struct BatchEnv<'a, 'k> {
    pub segments: &'a [Segment],
    /// `kvs[i]` belongs to `segments[i]`.
    pub kvs: &'a mut [&'k mut SeqKv],
}

/// What a step runs with: the pool and scratch, and (at run time) the
/// batch.
pub struct Env<'a, 'k> {
    pub ctx: Ctx<'a>,
    pub batch: Option<BatchEnv<'a, 'k>>,
}

fn arg<'a>(inputs: &[Option<&'a Value>], i: usize) -> Result<&'a Value, String> {
    inputs.get(i).copied().flatten().ok_or_else(|| format!("input {i} is missing"))
}

fn opt<'a>(inputs: &[Option<&'a Value>], i: usize) -> Option<&'a Value> {
    inputs.get(i).copied().flatten()
}

fn ints<'a>(inputs: &[Option<&'a Value>], i: usize, what: &str) -> Result<&'a [i64], String> {
    arg(inputs, i)?.ints().ok_or_else(|| format!("{what} (input {i}) must be i64"))
}

/// Runs `op`; `outputs` holds the recycled buffers to write into.
pub fn run(op: &Op, inputs: &[Option<&Value>], outputs: &mut [Value], env: &mut Env) -> Result<(), String> {
    if let Op::SkipRmsNorm { eps } = op {
        return skip_rms_norm(*eps, inputs, outputs, &env.ctx);
    }
    match op {
        Op::LayerNorm { eps, axis } => return layer_norm(*eps, *axis, inputs, outputs),
        Op::TopK { axis, largest } => {
            let k = ints(inputs, 1, "k")?.first().copied().ok_or("k is empty")?;
            let k = usize::try_from(k).map_err(|_| format!("k={k} is negative"))?;
            return select::top_k(arg(inputs, 0)?, k, *axis, *largest, outputs);
        }
        Op::SplitLinear { weight, widths } => return split_linear(weight, widths, inputs, outputs, &env.ctx),
        Op::Split { axis, sizes } => {
            let x = arg(inputs, 0)?;
            let len = x.shape.get(ly::axis(*axis, x.shape.len())?).copied().unwrap_or(0);
            let given = match (sizes, opt(inputs, 1)) {
                (Some(s), _) => Some(s.as_slice()),
                (None, Some(v)) => Some(v.ints().ok_or("split sizes must be i64")?),
                (None, None) => None,
            };
            let sizes: Vec<usize> = match given {
                Some(s) => s
                    .iter()
                    .map(|v| usize::try_from(*v).map_err(|_| format!("split size {v}")))
                    .collect::<Result<_, _>>()?,
                None => select::even_split(len, outputs.len()),
            };
            return select::split(x, *axis, &sizes, outputs);
        }
        _ => {}
    }
    let out = outputs.first_mut().ok_or("no output")?;
    match op {
        Op::Binary(b) => ew::binary(*b, arg(inputs, 0)?, arg(inputs, 1)?, out),
        Op::Compare(c) => ew::compare(*c, arg(inputs, 0)?, arg(inputs, 1)?, out),
        Op::Logic(l) => ew::logic(*l, arg(inputs, 0)?, arg(inputs, 1)?, out),
        Op::Unary(u) => ew::unary(*u, arg(inputs, 0)?, out),
        Op::Where => ew::where_(arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?, out),
        Op::Cast(t) => ew::cast(arg(inputs, 0)?, *t, out),
        Op::Identity => {
            let x = arg(inputs, 0)?;
            ly::reshaped(x, &x.shape, out)
        }
        Op::MatMul => math::matmul(arg(inputs, 0)?, arg(inputs, 1)?, out),
        Op::Gather { axis } => ly::gather(arg(inputs, 0)?, arg(inputs, 1)?, *axis, out),
        Op::Shape { start, end } => {
            let x = arg(inputs, 0)?;
            let dims = &x.shape[ly::shape_span(*start, *end, x.shape.len())];
            let mut o = out.recycle_i64(dims.len());
            o.iter_mut().zip(dims).for_each(|(o, d)| *o = *d as i64);
            *out = Value::i64([dims.len()], o);
            Ok(())
        }
        Op::Range => ly::range(arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?, out),
        Op::ConstantOfShape(v) => {
            let shape: Vec<usize> = ints(inputs, 0, "shape")?.iter().map(|d| (*d).max(0) as usize).collect();
            let n = ly::checked_elements(&shape)?;
            let index = vec![0; n];
            ly::select(v, &index, &shape, out);
            Ok(())
        }
        Op::Unsqueeze(axes) => {
            let x = arg(inputs, 0)?;
            let axes = match axes {
                Some(a) => a.as_slice(),
                None => ints(inputs, 1, "axes")?,
            };
            ly::reshaped(x, &ly::unsqueeze_target(&x.shape, axes)?, out)
        }
        Op::Squeeze(axes) => {
            let x = arg(inputs, 0)?;
            let axes = match axes {
                Some(a) => Some(a.as_slice()),
                None => opt(inputs, 1).map(|v| v.ints().ok_or("axes must be i64")).transpose()?,
            };
            ly::reshaped(x, &ly::squeeze_target(&x.shape, axes)?, out)
        }
        Op::Reshape => {
            let x = arg(inputs, 0)?;
            ly::reshaped(x, &ly::reshape_target(&x.shape, ints(inputs, 1, "shape")?)?, out)
        }
        Op::Transpose(perm) => {
            let x = arg(inputs, 0)?;
            let perm: Vec<usize> = match perm {
                Some(p) => p.iter().map(|a| ly::axis(*a, x.shape.len())).collect::<Result<_, _>>()?,
                None => (0..x.shape.len()).rev().collect(),
            };
            ly::transpose(x, &perm, out)
        }
        Op::Slice => {
            let axes = opt(inputs, 3).map(|v| v.ints().ok_or("axes must be i64")).transpose()?;
            let steps = opt(inputs, 4).map(|v| v.ints().ok_or("steps must be i64")).transpose()?;
            ly::slice(arg(inputs, 0)?, ints(inputs, 1, "starts")?, ints(inputs, 2, "ends")?, axes, steps, out)
        }
        Op::Concat { axis } => {
            let parts: Vec<&Value> = inputs.iter().flatten().copied().collect();
            ly::concat(&parts, *axis, out)
        }
        Op::Softmax { axis, log } => {
            let x = arg(inputs, 0)?;
            let a = ly::axis(*axis, x.shape.len())?;
            if a + 1 == x.shape.len() && !log {
                math::softmax(x, out)
            } else {
                math::softmax_axis(x, a, *log, out)
            }
        }
        Op::Reduce { kind, axes, keepdims, noop_empty } => {
            let x = arg(inputs, 0)?;
            let axes: &[i64] = match (axes, opt(inputs, 1)) {
                (Some(a), _) => a,
                (None, Some(v)) => v.ints().ok_or("axes must be i64")?,
                (None, None) => &[],
            };
            let rank = x.shape.len();
            if axes.is_empty() && *noop_empty {
                return ly::reshaped(x, &x.shape, out);
            }
            let mut resolved = if axes.is_empty() {
                (0..rank).collect()
            } else {
                axes.iter().map(|a| ly::axis(*a, rank)).collect::<Result<Vec<_>, _>>()?
            };
            resolved.sort_unstable();
            resolved.dedup();
            let count = resolved.len();
            let trailing = resolved.iter().enumerate().all(|(i, a)| *a == rank - count + i);
            let empty = x.shape.contains(&0);
            if trailing && count > 0 && !empty && matches!(kind, Reduce::Mean | Reduce::Sum) {
                math::reduce(*kind, x, count, *keepdims, out)
            } else {
                math::reduce_axes(*kind, x, &resolved, *keepdims, out)
            }
        }
        Op::Tile => ly::tile(arg(inputs, 0)?, ints(inputs, 1, "repeats")?, out),
        Op::Clip { attrs: Some((lo, hi)) } => {
            let (lo, hi) = (Value::f32([1], vec![*lo]), Value::f32([1], vec![*hi]));
            select::clip(arg(inputs, 0)?, Some(&lo), Some(&hi), out)
        }
        Op::Clip { attrs: None } => select::clip(arg(inputs, 0)?, opt(inputs, 1), opt(inputs, 2), out),
        Op::Flatten { axis } => {
            let x = arg(inputs, 0)?;
            let rank = x.shape.len() as i64;
            let a = if *axis < 0 { axis + rank } else { *axis };
            if !(0..=rank).contains(&a) {
                return Err(format!("Flatten axis {axis} of rank {rank}"));
            }
            let (head, tail) = x.shape.split_at(a as usize);
            ly::reshaped(x, &[head.iter().product(), tail.iter().product()], out)
        }
        Op::ArgExtreme { axis, keepdims, last, min } => {
            select::arg_extreme(arg(inputs, 0)?, *axis, *keepdims, *last, *min, out)
        }
        Op::CumSum { exclusive, reverse } => {
            let axis = match arg(inputs, 1)? {
                v if v.dtype() == DType::I32 => v.as_i32()?.first().map(|a| i64::from(*a)),
                v => v.as_i64()?.first().copied(),
            };
            let axis = axis.ok_or("axis is empty")?;
            select::cum_sum(arg(inputs, 0)?, axis, *exclusive, *reverse, out)
        }
        Op::Trilu { upper } => {
            let k = opt(inputs, 1)
                .map(|v| v.ints().and_then(|k| k.first().copied()).ok_or("k must be an i64 scalar"))
                .transpose()?;
            select::trilu(arg(inputs, 0)?, k.unwrap_or(0), *upper, out)
        }
        Op::ScatterNd(how) => select::scatter_nd(arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?, *how, out),
        Op::Gemm { alpha, beta, trans_a, trans_b } => {
            math::gemm(arg(inputs, 0)?, arg(inputs, 1)?, opt(inputs, 2), *alpha, *beta, *trans_a, *trans_b, out)
        }
        Op::TopK { .. } | Op::Split { .. } => Err("dispatched above".into()),
        Op::Nary { op, mean } => {
            let parts: Vec<&Value> = inputs.iter().flatten().copied().collect();
            let (first, rest) = parts.split_first().ok_or("no operands")?;
            let mut acc = (*first).clone();
            for p in rest {
                let mut next = Value::default();
                ew::binary(*op, &acc, p, &mut next)?;
                acc = next;
            }
            if *mean {
                let count = Value::f32([1], vec![parts.len() as f32]);
                ew::binary(ew::BinOp::Div, &acc, &count, out)
            } else {
                *out = acc;
                Ok(())
            }
        }
        Op::CastLike => ew::cast(arg(inputs, 0)?, arg(inputs, 1)?.dtype(), out),
        Op::Size => {
            *out = Value::i64([], vec![arg(inputs, 0)?.len() as i64]);
            Ok(())
        }
        Op::GatherElements { axis } => select::gather_elements(arg(inputs, 0)?, arg(inputs, 1)?, *axis, out),
        Op::Hardmax { axis } => select::hardmax(arg(inputs, 0)?, *axis, out),
        Op::Einsum(equation) => {
            let parts: Vec<&Value> = inputs.iter().flatten().copied().collect();
            select::einsum(equation, &parts, out)
        }
        Op::Activation(act) => ew::activation(*act, arg(inputs, 0)?, out),
        Op::Classify { nan, positive, negative } => ew::classify(arg(inputs, 0)?, *nan, *positive, *negative, out),
        Op::Expand => ly::expand(arg(inputs, 0)?, ints(inputs, 1, "shape")?, out),
        Op::RmsNorm { eps, axis } => {
            let (x, scale) = (arg(inputs, 0)?, arg(inputs, 1)?);
            math::norm_rows(x, *axis, scale)?;
            let mut o = out.recycle_f32(x.len());
            math::rms_norm(x.as_f32()?, scale.as_f32()?, *eps, &mut o);
            *out = Value::f32(&x.shape, o);
            Ok(())
        }
        Op::SkipRmsNorm { .. } | Op::LayerNorm { .. } | Op::SplitLinear { .. } => Err("dispatched above".into()),
        Op::Linear { weight, bias } => {
            let x = arg(inputs, 0)?;
            let (m, shape) = rows(x, weight.k, weight.n)?;
            let mut y = out.take_f32();
            linear(x.as_f32()?, m, weight, bias.as_deref().map(Vec::as_slice), &mut y, &env.ctx);
            *out = Value::f32(shape, y);
            Ok(())
        }
        Op::GatedMlp { weight } => {
            let x = arg(inputs, 0)?;
            let (m, shape) = rows(x, weight.k, weight.n / 2)?;
            let mut y = out.take_f32();
            let mut staged = env.ctx.staging();
            let mut both = std::mem::take(&mut staged.gate);
            drop(staged);
            gated(x.as_f32()?, m, weight, &mut both, &mut y, &env.ctx);
            env.ctx.staging().gate = both;
            *out = Value::f32(shape, y);
            Ok(())
        }
        Op::CausalBias { closed, reps } => {
            let (mask, ids) = (arg(inputs, 0)?, arg(inputs, 1)?);
            let (Some(&total), Some(&seq)) = (mask.shape.get(1), ids.shape.get(1)) else {
                return Err(format!("mask {:?} and token ids {:?} need a sequence axis", mask.shape, ids.shape));
            };
            if mask.shape[0] != 1 || seq > total {
                return Err(format!("mask {:?} does not cover {seq} new tokens of batch 1", mask.shape));
            }
            let m = mask.as_i64()?;
            // (The fused pattern reads the mask's length from another
            // tensor's shape: a mask that is not `[1, total]` indexed past
            // its end.)
            if m.len() != total {
                return Err(format!("mask {:?} is not [1, {total}]", mask.shape));
            }
            let past = total - seq;
            let mut o = out.recycle_f32(ly::checked_elements(&[*reps, seq, total])?);
            for (row, bias) in o.chunks_exact_mut(total.max(1)).enumerate() {
                let q = past + row % seq.max(1);
                for (t, b) in bias.iter_mut().enumerate() {
                    *b = if t <= q && m[t] != 0 { 0.0 } else { *closed };
                }
            }
            *out = Value::f32([1, 1, reps * seq, total], o);
            Ok(())
        }
        Op::GatherQ4 { block } => {
            let (data, ids, scales) = (arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?);
            crate::kernels::gather_q4::gather_q4(data, ids, scales, opt(inputs, 3), *block, out)
        }
        Op::MatMulNBits { .. } => Err("MatMulNBits weights must be constant (they are packed at compile time)".into()),
        Op::Rotary { layout, cached, spec_layout } => {
            let x = arg(inputs, 0)?;
            // ONNX's and ONNX Runtime's 4-D input is heads first (read
            // seq-first when the node had `num_heads`, and a decode step's
            // [1, H, 1, D] rotated head h at position p + h).
            let layout = if *spec_layout && x.shape.len() == 4 { &Layout::HeadsFirst } else { layout };
            if *cached {
                let positions = ints(inputs, 1, "position_ids")?;
                let (cos, sin) = (arg(inputs, 2)?, arg(inputs, 3)?);
                let half = *cos.shape.last().ok_or("cos cache has no axes")?;
                let angles = Angles::Cached { cos: cos.as_f32()?, sin: sin.as_f32()?, positions };
                rotary(x, 2 * half, *layout, &angles, out)
            } else {
                let (cos, sin) = (arg(inputs, 1)?, arg(inputs, 2)?);
                let hd = *cos.shape.last().ok_or("cos has no axes")?;
                rotary(x, hd, *layout, &Angles::Gathered { cos: cos.as_f32()?, sin: sin.as_f32()? }, out)
            }
        }
        Op::Attention { spec, layer } => run_attention(spec, *layer, inputs, out, env),
    }
}

/// `v`'s elements as f32: borrowed, or widened from f16 into `wide`.
fn as_f32_into<'a>(v: &'a Value, wide: &'a mut Vec<f32>) -> Result<&'a [f32], String> {
    match v.dtype() {
        DType::F16 => {
            let h = v.as_f16()?;
            wide.clear();
            wide.extend(h.iter().map(|x| x.to_f32()));
            Ok(wide)
        }
        _ => v.as_f32(),
    }
}

fn run_attention(
    partial: &PartialAttention,
    layer: Option<usize>,
    inputs: &[Option<&Value>],
    out: &mut Value,
    env: &mut Env,
) -> Result<(), String> {
    let (spec, layer) = match (&partial.resolved, layer) {
        (Some(s), Some(l)) => (s, l),
        _ => return Err("attention is not bound to a KV cache layer".into()),
    };
    let batch = env.batch.as_mut().ok_or("attention needs a KV cache")?;
    let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
    // Fused ops may run attention in f16 (an f16 KV cache keeps Q, K and V
    // in one type); compute stays f32 and the result is rounded back to the
    // query's type.
    let query = arg(inputs, 0)?;
    let half_out = query.dtype() == DType::F16;
    let mut staged = env.ctx.staging();
    let crate::kernels::Scratch { a: wq, b: wk, c: wv, d: wb, .. } = &mut *staged;
    let q_all = as_f32_into(query, wq)?;
    let (q, k, v) = if partial.packed_qkv {
        let width = (heads + 2 * kvh) * hd;
        let rows = spec.q_layout.seq_len(&query.shape, heads + 2 * kvh, hd).map_err(|e| format!("packed QKV: {e}"))?;
        let part = |offset: usize, h: usize| Heads {
            data: q_all,
            layout: Layout::SeqFirst,
            heads: h,
            rows,
            head_dim: hd,
            stride: width,
            offset,
        };
        (part(0, heads), part(heads * hd, kvh), part((heads + kvh) * hd, kvh))
    } else {
        let rows = spec.q_layout.seq_len(&query.shape, heads, hd).map_err(|e| format!("query: {e}"))?;
        let (kx, vx) = (arg(inputs, 1)?, arg(inputs, 2)?);
        for (name, t) in [("key", kx), ("value", vx)] {
            let s = spec.kv_layout.seq_len(&t.shape, kvh, hd).map_err(|e| format!("{name}: {e}"))?;
            if s != rows {
                return Err(format!("{name} has {s} new positions, the query {rows}"));
            }
        }
        (
            Heads::plain(q_all, spec.q_layout, heads, rows, hd),
            Heads::plain(as_f32_into(kx, wk)?, spec.kv_layout, kvh, rows, hd),
            Heads::plain(as_f32_into(vx, wv)?, spec.kv_layout, kvh, rows, hd),
        )
    };
    let rows = q.rows;
    let covered: usize = batch.segments.iter().map(|s| s.len).sum();
    if covered != rows {
        return Err(format!("the step has {rows} rows but its sequences hold {covered} new positions"));
    }
    let rotary = if partial.rotary {
        let (cos, sin) = (arg(inputs, 4)?, arg(inputs, 5)?);
        let half = *cos.shape.last().ok_or("cos cache has no axes")?;
        Some(RotaryCache { cos: cos.as_f32()?, sin: sin.as_f32()?, half })
    } else {
        None
    };
    let bias = match (opt(inputs, 3), spec.bias) {
        (None, Bias::Causal) => None,
        (Some(b), mode @ (Bias::PerQuery | Bias::Grouped)) => {
            let [seg] = batch.segments else {
                return Err("an additive attention bias takes one sequence at a time".into());
            };
            let total = seg.past + seg.len;
            let n_rep = heads / kvh.max(1);
            let per_head = if mode == Bias::Grouped { n_rep * seg.len * total } else { seg.len * total };
            let groups = if mode == Bias::Grouped { kvh } else { heads };
            let data = as_f32_into(b, wb)?;
            if b.shape.last() != Some(&total) || (data.len() != per_head && data.len() != per_head * groups) {
                return Err(format!(
                    "attention bias {:?} does not fit {} query rows x {total} positions",
                    b.shape,
                    per_head / total.max(1)
                ));
            }
            Some(AdditiveBias { data, mode, shared: data.len() == per_head })
        }
        _ => return Err("attention bias input does not match the compiled form".into()),
    };
    let mut y = out.recycle_f32(rows * heads * hd);
    let step = attention::Step { layer, segments: batch.segments, q, k, v, rotary, bias };
    attention::attention(spec, &step, batch.kvs, &mut y, &env.ctx)?;
    drop(staged);
    let shape: crate::value::Shape = match spec.out_layout {
        Layout::HeadsFirst => [1, heads, rows, hd].into_iter().collect(),
        Layout::SeqFirst => [1, rows, heads * hd].into_iter().collect(),
    };
    if half_out {
        let mut h = std::mem::take(&mut env.ctx.staging().a);
        h.clear();
        h.extend_from_slice(&y);
        let mut halves = out.recycle_f16(0);
        halves.extend(h.iter().map(|x| half::f16::from_f32(*x)));
        env.ctx.staging().a = h;
        // Give the f32 buffer back to the slot's next recycle.
        drop(y);
        *out = Value::f16(shape, halves);
    } else {
        *out = Value::f32(shape, y);
    }
    Ok(())
}

/// [`Op::SplitLinear`]: one output per member, shaped as its own
/// projection's.
fn split_linear(
    weight: &crate::kernels::weights::Weight,
    widths: &[usize],
    inputs: &[Option<&Value>],
    outputs: &mut [Value],
    ctx: &Ctx,
) -> Result<(), String> {
    let x = arg(inputs, 0)?;
    let (m, _) = rows(x, weight.k, weight.n)?;
    let xs = x.as_f32()?;
    if outputs.len() != widths.len() || widths.iter().sum::<usize>() != weight.n {
        return Err(format!("{} outputs of widths {widths:?} for {} stacked outputs", outputs.len(), weight.n));
    }
    // (At most `MAX_STACKED` members: held inline, no allocation.)
    let mut ys: smallvec::SmallVec<[Vec<f32>; MAX_STACKED]> = outputs.iter_mut().map(Value::take_f32).collect();
    let mut staged = ctx.staging();
    let mut all = std::mem::take(&mut staged.split);
    drop(staged);
    split(xs, m, weight, widths, &mut all, &mut ys, ctx);
    ctx.staging().split = all;
    for ((out, y), &width) in outputs.iter_mut().zip(ys.drain(..)).zip(widths) {
        let (_, shape) = rows(x, weight.k, width)?;
        *out = Value::f32(shape, y);
    }
    Ok(())
}

/// Rows of a projection input `[.., k]` and the output shape `[.., n]`.
fn rows(x: &Value, k: usize, n: usize) -> Result<(usize, crate::value::Shape), String> {
    match x.shape.last() {
        Some(d) if *d == k => {
            let mut shape = x.shape.clone();
            if let Some(last) = shape.last_mut() {
                *last = n;
            }
            Ok((x.len() / k.max(1), shape))
        }
        _ => Err(format!("input {:?} does not end in the weight's {k} inputs", x.shape)),
    }
}

/// Outputs: 0 the normalized sum, 3 the sum itself (1 and 2, mean and
/// inverse deviation, are not produced; the compiler rejects graphs that
/// read them).
/// LayerNormalization with its optional mean and inverse-deviation
/// outputs (shaped like the input with 1 for each normalized axis).
fn layer_norm(eps: f32, axis: i64, inputs: &[Option<&Value>], outputs: &mut [Value]) -> Result<(), String> {
    let (x, gamma) = (arg(inputs, 0)?, arg(inputs, 1)?);
    let from = math::norm_rows(x, axis, gamma)?;
    let beta = opt(inputs, 2).map(|b| b.as_f32()).transpose()?;
    if beta.is_some_and(|b| b.len() != gamma.len()) {
        return Err("beta and gamma differ in length".into());
    }
    let rows = x.len() / gamma.len().max(1);
    let (first, stats) = outputs.split_first_mut().ok_or("no output")?;
    let mut o = first.recycle_f32(x.len());
    if stats.is_empty() {
        // A decoder's layer norm: no statistics, nothing allocated.
        math::layer_norm(x.as_f32()?, gamma.as_f32()?, beta, eps, &mut o, None);
        *first = Value::f32(&x.shape, o);
        return Ok(());
    }
    let (mut mean, mut inv) = (vec![0.0; rows], vec![0.0; rows]);
    math::layer_norm(x.as_f32()?, gamma.as_f32()?, beta, eps, &mut o, Some((&mut mean, &mut inv)));
    *first = Value::f32(&x.shape, o);
    let stat_shape: Vec<usize> = x.shape.iter().enumerate().map(|(i, d)| if i < from { *d } else { 1 }).collect();
    for (out, values) in stats.iter_mut().zip([mean, inv]) {
        *out = Value::f32(&stat_shape, values);
    }
    Ok(())
}

fn skip_rms_norm(eps: f32, inputs: &[Option<&Value>], outputs: &mut [Value], ctx: &Ctx) -> Result<(), String> {
    let (x, skip, gamma) = (arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?);
    if x.shape != skip.shape {
        return Err(format!("input {:?} and skip {:?} differ", x.shape, skip.shape));
    }
    let d = math::norm_width(x, gamma)?;
    let (xs, skips, gamma) = (x.as_f32()?, skip.as_f32()?, gamma.as_f32()?);
    let bias = match opt(inputs, 3) {
        Some(b) => {
            let b = b.as_f32()?;
            if b.len() != d {
                return Err(format!("bias has {} elements, the normalized axis {d}", b.len()));
            }
            Some(b)
        }
        None => None,
    };
    // Without a sum output the sum lives in staging (no allocation). Both
    // buffers are resized, not cleared: every value is written below.
    let mut sum = match outputs.get_mut(3) {
        Some(s) => s.take_f32(),
        None => std::mem::take(&mut ctx.staging().d),
    };
    sum.resize(xs.len(), 0.0);
    let out = outputs.first_mut().ok_or("no output")?;
    let mut o = out.take_f32();
    o.resize(xs.len(), 0.0);
    let rows = xs.len() / d.max(1);
    {
        let (sums, outs) = (Disjoint::new(&mut sum), Disjoint::new(&mut o));
        let work = |r: std::ops::Range<usize>, _t: usize| {
            let (at, n) = (r.start * d, r.len() * d);
            // SAFETY: rows `r` of both buffers belong to this range alone.
            let (s, o) = unsafe { (sums.slice(at, n), outs.slice(at, n)) };
            for ((s, a), b) in s.iter_mut().zip(&xs[at..at + n]).zip(&skips[at..at + n]) {
                *s = a + b;
            }
            if let Some(b) = bias {
                s.chunks_exact_mut(d).for_each(|r| r.iter_mut().zip(b).for_each(|(v, b)| *v += b));
            }
            math::rms_norm(s, gamma, eps, o);
        };
        // Rows normalize independently: a batch's rows split across the
        // threads (serial, 16 sequences of SmolLM2 left the other thread
        // waiting for 2-4% of a decode step, 60 norms a step).
        if xs.len() >= PARALLEL_MIN_NORMALIZED {
            ctx.pool.for_ranges(rows, 1, &work);
        } else {
            work(0..rows, 0);
        }
    }
    *out = Value::f32(&x.shape, o);
    match outputs.get_mut(3) {
        Some(s) => *s = Value::f32(&x.shape, sum),
        None => ctx.staging().d = sum,
    }
    Ok(())
}

/// Values from which a skip-and-normalize splits its rows across the
/// threads (8 rows of SmolLM2's 576).
const PARALLEL_MIN_NORMALIZED: usize = 1 << 12;
