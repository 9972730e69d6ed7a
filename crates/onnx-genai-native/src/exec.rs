//! Kernel dispatch: runs one op on its input values. Used both by constant
//! folding (no KV cache) and by the plan at run time.

use std::borrow::Cow;

use crate::kernels::attention::{attention, AttentionInputs, AttentionSpec, LayerCache};
use crate::kernels::elementwise as ew;
use crate::kernels::layout as ly;
use crate::kernels::linear::{gated, linear};
use crate::kernels::math;
use crate::kernels::rotary::{rotary, Angles};
use crate::ops::Op;
use crate::value::Value;

/// The KV state a step runs against.
pub struct KvContext<'a> {
    pub layers: &'a mut [LayerCache],
    pub past: usize,
    /// Where kernels may split large work (`None`: everything runs on the
    /// calling thread). Small ops never leave the calling thread.
    pub pool: crate::kernels::linear::Pool<'a>,
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
pub fn run(
    op: &Op,
    inputs: &[Option<&Value>],
    outputs: &mut [Value],
    kv: Option<&mut KvContext>,
) -> Result<(), String> {
    if let Op::SkipRmsNorm { eps } = op {
        return skip_rms_norm(*eps, inputs, outputs);
    }
    let out = outputs.first_mut().ok_or("no output")?;
    let pool = kv.as_ref().and_then(|k| k.pool);
    match op {
        Op::Binary(b) => ew::binary(*b, arg(inputs, 0)?, arg(inputs, 1)?, out),
        Op::Compare(c) => ew::compare(*c, arg(inputs, 0)?, arg(inputs, 1)?, out),
        Op::Logic(l) => ew::logic(*l, arg(inputs, 0)?, arg(inputs, 1)?, out),
        Op::Unary(u) => ew::unary(*u, arg(inputs, 0)?, out),
        Op::Where => ew::where_(arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?, out),
        Op::Cast(t) => ew::cast(arg(inputs, 0)?, *t, out),
        Op::Identity => {
            let x = arg(inputs, 0)?;
            ly::reshaped(x, x.shape.clone(), out)
        }
        Op::MatMul => math::matmul(arg(inputs, 0)?, arg(inputs, 1)?, out),
        Op::Gather { axis } => ly::gather(arg(inputs, 0)?, arg(inputs, 1)?, *axis, out),
        Op::Shape => {
            let x = arg(inputs, 0)?;
            *out = Value::i64(vec![x.shape.len()], x.shape.iter().map(|d| *d as i64).collect());
            Ok(())
        }
        Op::Range => ly::range(arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?, out),
        Op::ConstantOfShape(v) => {
            let shape: Vec<usize> = ints(inputs, 0, "shape")?.iter().map(|d| (*d).max(0) as usize).collect();
            let n = shape.iter().product();
            let index = vec![0; n];
            ly::select(v, &index, shape, out);
            Ok(())
        }
        Op::Unsqueeze(axes) => {
            let x = arg(inputs, 0)?;
            let axes = match axes {
                Some(a) => a.as_slice(),
                None => ints(inputs, 1, "axes")?,
            };
            ly::reshaped(x, ly::unsqueeze_target(&x.shape, axes)?, out)
        }
        Op::Squeeze(axes) => {
            let x = arg(inputs, 0)?;
            let axes = match axes {
                Some(a) => Some(a.as_slice()),
                None => opt(inputs, 1).map(|v| v.ints().ok_or("axes must be i64")).transpose()?,
            };
            ly::reshaped(x, ly::squeeze_target(&x.shape, axes)?, out)
        }
        Op::Reshape => {
            let x = arg(inputs, 0)?;
            ly::reshaped(x, ly::reshape_target(&x.shape, ints(inputs, 1, "shape")?)?, out)
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
        Op::Softmax { axis } => {
            let x = arg(inputs, 0)?;
            if ly::axis(*axis, x.shape.len())? + 1 != x.shape.len() {
                return Err(format!("softmax over axis {axis} of {:?}: only the last axis is supported", x.shape));
            }
            math::softmax(x, out)
        }
        Op::Reduce { kind, axes, keepdims } => {
            let x = arg(inputs, 0)?;
            let axes = match axes {
                Some(a) => a.clone(),
                None => match opt(inputs, 1) {
                    Some(v) => v.ints().ok_or("axes must be i64")?.to_vec(),
                    None => (0..x.shape.len() as i64).collect(),
                },
            };
            let rank = x.shape.len();
            let mut resolved = axes.iter().map(|a| ly::axis(*a, rank)).collect::<Result<Vec<_>, _>>()?;
            resolved.sort_unstable();
            let count = resolved.len();
            if resolved.iter().enumerate().any(|(i, a)| *a != rank - count + i) {
                return Err(format!("reducing axes {axes:?} of rank {rank}: only trailing axes are supported"));
            }
            math::reduce(*kind, x, count, *keepdims, out)
        }
        Op::Tile => ly::tile(arg(inputs, 0)?, ints(inputs, 1, "repeats")?, out),
        Op::Expand => ly::expand(arg(inputs, 0)?, ints(inputs, 1, "shape")?, out),
        Op::RmsNorm { eps } => {
            let (x, scale) = (arg(inputs, 0)?, arg(inputs, 1)?);
            math::norm_width(x, scale)?;
            let mut o = out.recycle_f32(x.len());
            math::rms_norm(x.as_f32()?, scale.as_f32()?, *eps, &mut o);
            *out = Value::f32(x.shape.clone(), o);
            Ok(())
        }
        Op::SkipRmsNorm { .. } => Err("dispatched above".into()),
        Op::LayerNorm { eps } => {
            let (x, gamma) = (arg(inputs, 0)?, arg(inputs, 1)?);
            math::norm_width(x, gamma)?;
            let beta = opt(inputs, 2).map(|b| b.as_f32()).transpose()?;
            if beta.is_some_and(|b| b.len() != gamma.len()) {
                return Err("beta and gamma differ in length".into());
            }
            let mut o = out.recycle_f32(x.len());
            math::layer_norm(x.as_f32()?, gamma.as_f32()?, beta, *eps, &mut o);
            *out = Value::f32(x.shape.clone(), o);
            Ok(())
        }
        Op::Linear { weight, bias } => {
            let x = arg(inputs, 0)?;
            let (m, shape) = rows(x, weight.k, weight.n)?;
            let mut y = out.recycle_f32(0);
            linear(x.as_f32()?, m, weight, bias.as_deref().map(Vec::as_slice), &mut y, pool);
            *out = Value::f32(shape, y);
            Ok(())
        }
        Op::GatedMlp { weight } => {
            let x = arg(inputs, 0)?;
            let (m, shape) = rows(x, weight.k, weight.n / 2)?;
            let mut y = out.recycle_f32(0);
            let mut scratch = Vec::new();
            gated(x.as_f32()?, m, weight, &mut scratch, &mut y, pool);
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
            let past = total - seq;
            let mut o = out.recycle_f32(reps * seq * total);
            for (row, bias) in o.chunks_exact_mut(total).enumerate() {
                let q = past + row % seq;
                for (t, b) in bias.iter_mut().enumerate() {
                    *b = if t <= q && m[t] != 0 { 0.0 } else { *closed };
                }
            }
            *out = Value::f32(vec![1, 1, reps * seq, total], o);
            Ok(())
        }
        Op::GatherQ4 { block } => {
            let (data, ids, scales) = (arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?);
            crate::kernels::gather_q4::gather_q4(data, ids, scales, opt(inputs, 3), *block, out)
        }
        Op::MatMulNBits { .. } => Err("MatMulNBits weights must be constant (they are packed at compile time)".into()),
        Op::Rotary { layout, cached } => {
            let x = arg(inputs, 0)?;
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
        Op::Attention { spec: partial, layer } => {
            let (spec, layer) = match (&partial.resolved, layer) {
                (Some(s), Some(l)) => (s, *l),
                _ => return Err("attention is not bound to a KV cache layer".into()),
            };
            let kv = kv.ok_or("attention needs a KV cache")?;
            let cache = kv.layers.get_mut(layer).ok_or_else(|| format!("no KV cache for layer {layer}"))?;
            // Fused ops may run attention in f16 (an f16 KV cache keeps Q, K
            // and V in one type); compute stays f32 and the result is
            // rounded back to the query's type.
            let query = arg(inputs, 0)?;
            let mut parts: Vec<Cow<Value>> = Vec::new();
            let take = |i: usize| -> Result<Cow<Value>, String> { widened(arg(inputs, i)?) };
            if partial.packed_qkv {
                parts.extend(split_qkv(take(0)?.as_ref(), spec)?.map(Cow::Owned));
            } else {
                parts.extend([take(0)?, take(1)?, take(2)?]);
            }
            if partial.rotary {
                let (cos, sin) = (arg(inputs, 4)?, arg(inputs, 5)?);
                let half = *cos.shape.last().ok_or("cos cache has no axes")?;
                let start = [kv.past as i64];
                let angles = Angles::Cached { cos: cos.as_f32()?, sin: sin.as_f32()?, positions: &start };
                for part in parts.iter_mut().take(2) {
                    let mut rotated = Value::default();
                    rotary(part, 2 * half, spec.q_layout, &angles, &mut rotated)?;
                    *part = Cow::Owned(rotated);
                }
            }
            let bias = opt(inputs, 3).map(widened).transpose()?;
            let [q, k, v] = &parts[..] else { return Err("attention needs Q, K and V".into()) };
            let inputs = AttentionInputs { q, k, v, bias: bias.as_deref(), pool };
            attention(spec, cache, kv.past, inputs, out)?;
            if query.dtype() == crate::value::DType::F16 {
                let y = std::mem::take(out);
                ew::cast(&y, crate::value::DType::F16, out)?;
            }
            Ok(())
        }
    }
}

/// `v` in f32: widened from f16, or borrowed.
fn widened(v: &Value) -> Result<Cow<'_, Value>, String> {
    if v.dtype() == crate::value::DType::F16 {
        let mut w = Value::default();
        ew::cast(v, crate::value::DType::F32, &mut w)?;
        Ok(Cow::Owned(w))
    } else {
        Ok(Cow::Borrowed(v))
    }
}

/// Splits a packed `[1, seq, (heads + 2 * kv_heads) * head_dim]` projection
/// into Q, K and V in the seq-first layout.
fn split_qkv(x: &Value, spec: &AttentionSpec) -> Result<[Value; 3], String> {
    let widths = [spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.kv_heads * spec.head_dim];
    let row: usize = widths.iter().sum();
    let data = x.as_f32()?;
    if x.shape.len() != 3 || x.shape[0] != 1 || x.shape[2] != row {
        return Err(format!("packed QKV {:?} is not [1, seq, {row}]", x.shape));
    }
    let seq = x.shape[1];
    let mut parts = widths.map(|w| Vec::with_capacity(seq * w));
    for r in data.chunks_exact(row) {
        let mut at = 0;
        for (part, w) in parts.iter_mut().zip(widths) {
            part.extend_from_slice(&r[at..at + w]);
            at += w;
        }
    }
    let [q, k, v] = parts;
    Ok([
        Value::f32(vec![1, seq, widths[0]], q),
        Value::f32(vec![1, seq, widths[1]], k),
        Value::f32(vec![1, seq, widths[2]], v),
    ])
}

/// Rows of a projection input `[.., k]` and the output shape `[.., n]`.
fn rows(x: &Value, k: usize, n: usize) -> Result<(usize, Vec<usize>), String> {
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
fn skip_rms_norm(eps: f32, inputs: &[Option<&Value>], outputs: &mut [Value]) -> Result<(), String> {
    let (x, skip, gamma) = (arg(inputs, 0)?, arg(inputs, 1)?, arg(inputs, 2)?);
    if x.shape != skip.shape {
        return Err(format!("input {:?} and skip {:?} differ", x.shape, skip.shape));
    }
    let d = math::norm_width(x, gamma)?;
    let mut sum = outputs.get_mut(3).map_or_else(Vec::new, |s| s.recycle_f32(0));
    sum.extend(x.as_f32()?.iter().zip(skip.as_f32()?).map(|(a, b)| a + b));
    if let Some(b) = opt(inputs, 3) {
        let b = b.as_f32()?;
        if b.len() != d {
            return Err(format!("bias has {} elements, the normalized axis {d}", b.len()));
        }
        sum.chunks_exact_mut(d).for_each(|r| r.iter_mut().zip(b).for_each(|(v, b)| *v += b));
    }
    let out = outputs.first_mut().ok_or("no output")?;
    let mut o = out.recycle_f32(sum.len());
    math::rms_norm(&sum, gamma.as_f32()?, eps, &mut o);
    *out = Value::f32(x.shape.clone(), o);
    if let Some(s) = outputs.get_mut(3) {
        *s = Value::f32(x.shape.clone(), sum);
    }
    Ok(())
}
