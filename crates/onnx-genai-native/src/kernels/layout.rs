//! Shape and layout kernels: they move elements without arithmetic, so each
//! computes an index map and [`select`] copies through it for any dtype.

use crate::value::{Data, Shape, Value};

/// `out[i] = src[index[i]]`, with `shape` as the output shape.
pub fn select(src: &Value, index: &[usize], shape: &[usize], out: &mut Value) {
    fn pick<T: Copy>(v: &[T], index: &[usize], mut o: Vec<T>) -> Vec<T> {
        o.clear();
        o.extend(index.iter().map(|i| v[*i]));
        o
    }
    let n = index.len();
    *out = match &src.data {
        Data::F32(v) => Value::f32(shape, pick(v, index, out.recycle_f32(n))),
        Data::I64(v) => Value::i64(shape, pick(v, index, out.recycle_i64(n))),
        Data::Bool(v) => Value::bool(shape, pick(v, index, out.recycle_bool(n))),
        Data::F16(v) => Value::f16(shape, pick(v, index, out.recycle_f16(n))),
        Data::U8(v) => Value::u8(shape, pick(v, index, out.recycle_u8(n))),
        Data::F64(v) => Value::f64(shape, pick(v, index, out.recycle_f64(n))),
        Data::I32(v) => Value::i32(shape, pick(v, index, out.recycle_i32(n))),
    };
}

/// Copies `src` with a new shape (Reshape, Unsqueeze, Squeeze, Identity).
pub fn reshaped(src: &Value, shape: &[usize], out: &mut Value) -> Result<(), String> {
    if shape.iter().product::<usize>() != src.len() {
        return Err(format!("cannot view {:?} ({} elements) as {shape:?}", src.shape, src.len()));
    }
    fn copy<T: Copy>(v: &[T], mut o: Vec<T>) -> Vec<T> {
        o.clear();
        o.extend_from_slice(v);
        o
    }
    let n = src.len();
    *out = match &src.data {
        Data::F32(v) => Value::f32(shape, copy(v, out.recycle_f32(n))),
        Data::I64(v) => Value::i64(shape, copy(v, out.recycle_i64(n))),
        Data::Bool(v) => Value::bool(shape, copy(v, out.recycle_bool(n))),
        Data::F16(v) => Value::f16(shape, copy(v, out.recycle_f16(n))),
        Data::U8(v) => Value::u8(shape, copy(v, out.recycle_u8(n))),
        Data::F64(v) => Value::f64(shape, copy(v, out.recycle_f64(n))),
        Data::I32(v) => Value::i32(shape, copy(v, out.recycle_i32(n))),
    };
    Ok(())
}

/// The most elements a kernel creates in one tensor (2^32: 16 GiB of f32,
/// above any real decoder's largest value, a prefill's logits included).
/// Shapes computed from a graph's own constants or inputs are checked
/// against it before anything is allocated, so a crafted `ConstantOfShape`
/// or `Range` is an error naming the node, not an abort.
pub const MAX_ELEMENTS: usize = 1 << 32;

/// The element count of `shape`, or an error when it overflows or passes
/// [`MAX_ELEMENTS`].
pub fn checked_elements(shape: &[usize]) -> Result<usize, String> {
    shape
        .iter()
        .try_fold(1usize, |acc, d| acc.checked_mul(*d))
        .filter(|n| *n <= MAX_ELEMENTS)
        .ok_or_else(|| format!("shape {shape:?} holds more than {MAX_ELEMENTS} elements"))
}

/// How many elements a slice visits going `span` (> 0) positions at
/// `step` per move, without overflowing for any step.
fn visits(span: i64, step: i64) -> i64 {
    if span <= 0 {
        0
    } else {
        ((span - 1) as u64 / step.unsigned_abs()) as i64 + 1
    }
}

/// The axes `start..end` of a rank-`rank` shape that ONNX Shape returns
/// (negative values count from the end; both are clamped).
pub fn shape_span(start: i64, end: Option<i64>, rank: usize) -> std::ops::Range<usize> {
    let r = rank as i64;
    let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let (s, e) = (clamp(start), clamp(end.unwrap_or(r)));
    s..e.max(s)
}

/// Resolves an axis that may count from the end.
pub fn axis(axis: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if (0..r).contains(&a) {
        Ok(a as usize)
    } else {
        Err(format!("axis {axis} is out of range for rank {rank}"))
    }
}

/// ONNX Reshape target: 0 copies the input dim, -1 is inferred.
pub fn reshape_target(input: &[usize], target: &[i64]) -> Result<Shape, String> {
    // Declared dims can be anything a file says: counted with overflow
    // checks (a fuzzed graph's product overflowed here).
    let total = checked_elements(input)?;
    let mut out = Shape::new();
    let mut infer = None;
    for (i, t) in target.iter().enumerate() {
        match *t {
            0 => out
                .push(*input.get(i).ok_or_else(|| format!("reshape 0 at axis {i} but input rank is {}", input.len()))?),
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            t if t > 0 => out.push(t as usize),
            t => return Err(format!("invalid reshape dim {t} in {target:?}")),
        }
    }
    if let Some(i) = infer {
        let known = checked_elements(&out)?;
        if known == 0 || !total.is_multiple_of(known) {
            return Err(format!("cannot infer -1 reshaping {input:?} to {target:?}"));
        }
        out[i] = total / known;
    }
    if checked_elements(&out)? != total {
        return Err(format!("cannot reshape {input:?} ({total} elements) to {target:?}"));
    }
    Ok(out)
}

pub fn unsqueeze_target(input: &[usize], axes: &[i64]) -> Result<Shape, String> {
    let rank = input.len() + axes.len();
    let mut resolved = axes.iter().map(|a| axis(*a, rank)).collect::<Result<Shape, _>>()?;
    resolved.sort_unstable();
    let mut out = Shape::new();
    let mut rest = input.iter();
    for i in 0..rank {
        if resolved.binary_search(&i).is_ok() {
            out.push(1);
        } else {
            out.push(*rest.next().ok_or("duplicate unsqueeze axes")?);
        }
    }
    Ok(out)
}

pub fn squeeze_target(input: &[usize], axes: Option<&[i64]>) -> Result<Shape, String> {
    let drop: Shape = match axes {
        Some(axes) => axes.iter().map(|a| axis(*a, input.len())).collect::<Result<_, _>>()?,
        None => (0..input.len()).filter(|i| input[*i] == 1).collect(),
    };
    for d in &drop {
        if input[*d] != 1 {
            return Err(format!("cannot squeeze axis {d} of size {}", input[*d]));
        }
    }
    Ok(input.iter().enumerate().filter(|(i, _)| !drop.contains(i)).map(|(_, d)| *d).collect())
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Source index of every output element of a strided view: output axis `i`
/// walks `counts[i]` steps of `steps[i]` from `base`.
fn strided_index(base: usize, counts: &[usize], steps: &[isize]) -> Vec<usize> {
    let n: usize = counts.iter().product();
    let mut index = Vec::with_capacity(n);
    let mut idx = vec![0usize; counts.len()];
    let mut pos = base as isize;
    for _ in 0..n {
        index.push(pos as usize);
        for a in (0..counts.len()).rev() {
            idx[a] += 1;
            pos += steps[a];
            if idx[a] < counts[a] {
                break;
            }
            pos -= steps[a] * counts[a] as isize;
            idx[a] = 0;
        }
    }
    index
}

/// `Ok` when `perm` names each of `rank` axes once (a malformed Transpose
/// would otherwise read the wrong elements, or past its input's end).
pub fn check_permutation(perm: &[usize], rank: usize) -> Result<(), String> {
    if perm.len() != rank {
        return Err(format!("perm {perm:?} does not match rank {rank}"));
    }
    // (Ranks are a handful of axes: a quadratic scan allocates nothing.)
    if perm.iter().enumerate().any(|(i, a)| *a >= rank || perm[..i].contains(a)) {
        return Err(format!("perm {perm:?} does not name each of the {rank} axes once"));
    }
    Ok(())
}

pub fn transpose(src: &Value, perm: &[usize], out: &mut Value) -> Result<(), String> {
    check_permutation(perm, src.shape.len())?;
    // Moving only size-1 axes keeps the element order: a copy.
    let moved: Vec<usize> = perm.iter().copied().filter(|p| src.shape[*p] != 1).collect();
    if moved.windows(2).all(|w| w[0] < w[1]) {
        let shape: Shape = perm.iter().map(|p| src.shape[*p]).collect();
        return reshaped(src, &shape, out);
    }
    let shape: Vec<usize> = perm.iter().map(|p| src.shape[*p]).collect();
    if let Some((batch, rows, cols)) = as_batched_swap(&src.shape, perm) {
        fn swap<T: Copy>(v: &[T], (batch, rows, cols): (usize, usize, usize), mut o: Vec<T>) -> Vec<T> {
            transpose_into(v, batch, rows, cols, &mut o);
            o
        }
        let dims = (batch, rows, cols);
        let n = src.len();
        *out = match &src.data {
            Data::F32(v) => Value::f32(&shape, swap(v, dims, out.recycle_f32(n))),
            Data::I64(v) => Value::i64(&shape, swap(v, dims, out.recycle_i64(n))),
            Data::Bool(v) => Value::bool(&shape, swap(v, dims, out.recycle_bool(n))),
            Data::F16(v) => Value::f16(&shape, swap(v, dims, out.recycle_f16(n))),
            Data::U8(v) => Value::u8(&shape, swap(v, dims, out.recycle_u8(n))),
            Data::F64(v) => Value::f64(&shape, swap(v, dims, out.recycle_f64(n))),
            Data::I32(v) => Value::i32(&shape, swap(v, dims, out.recycle_i32(n))),
        };
        return Ok(());
    }
    let s = strides(&src.shape);
    let steps: Vec<isize> = perm.iter().map(|p| s[*p] as isize).collect();
    select(src, &strided_index(0, &shape, &steps), &shape, out);
    Ok(())
}

/// A permutation of `shape` that, once its size-1 axes are dropped and the
/// source axes that stay neighbours are merged, swaps the last two of at
/// most three axes: `(batch, rows, cols)`, each output matrix the
/// transpose of a `rows x cols` source one. (A weight `[K, N]` turned
/// `[N, K]`, the tied embedding table folded into the logits projection:
/// written through an index of every element, that took a second of a
/// SmolLM2 load.)
fn as_batched_swap(shape: &[usize], perm: &[usize]) -> Option<(usize, usize, usize)> {
    // Source axes in output order, size-1 axes dropped.
    let kept: Vec<usize> = perm.iter().copied().filter(|p| shape[*p] != 1).collect();
    // Runs of consecutive source axes, in output order.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &axis in &kept {
        match runs.last_mut() {
            Some((_, last)) if continues_run(shape, *last, axis) => *last = axis,
            _ => runs.push((axis, axis)),
        }
    }
    let size = |&(first, last): &(usize, usize)| shape[first..=last].iter().product::<usize>();
    match runs.as_slice() {
        [a, b] if a.0 > b.1 => Some((1, size(b), size(a))),
        [batch, a, b] if batch.1 < b.0 && a.0 > b.1 => Some((size(batch), size(b), size(a))),
        _ => None,
    }
}

/// Whether `axis` continues the run of source axes that ends at `last`:
/// it comes after it, and every axis between them has size 1 (dropped) —
/// none, for the next axis.
fn continues_run(shape: &[usize], last: usize, axis: usize) -> bool {
    axis > last && shape[last + 1..axis].iter().all(|d| *d == 1)
}

/// `dst` = each of `batch` row-major `rows x cols` matrices of `src`
/// transposed (`cols x rows`), in tiles that keep both the rows read and
/// the rows written in cache.
pub(crate) fn transpose_into<T: Copy>(src: &[T], batch: usize, rows: usize, cols: usize, dst: &mut Vec<T>) {
    const TILE: usize = 32;
    let size = rows * cols;
    dst.clear();
    let Some(first) = src.first() else { return };
    dst.resize(batch * size, *first);
    for (s, d) in src.chunks_exact(size).zip(dst.chunks_exact_mut(size)).take(batch) {
        for r0 in (0..rows).step_by(TILE) {
            for c0 in (0..cols).step_by(TILE) {
                for r in r0..(r0 + TILE).min(rows) {
                    let row = &s[r * cols..(r + 1) * cols];
                    for c in c0..(c0 + TILE).min(cols) {
                        d[c * rows + r] = row[c];
                    }
                }
            }
        }
    }
}

/// ONNX Slice with resolved per-axis `(start, end, step)` clamping.
pub fn slice(
    src: &Value,
    starts: &[i64],
    ends: &[i64],
    axes: Option<&[i64]>,
    steps: Option<&[i64]>,
    out: &mut Value,
) -> Result<(), String> {
    let rank = src.shape.len();
    let s = strides(&src.shape);
    let mut counts = src.shape.clone();
    let mut walk: Vec<isize> = s.iter().map(|v| *v as isize).collect();
    let mut base = 0isize;
    for (i, (start, end)) in starts.iter().zip(ends).enumerate() {
        let a = axis(axes.map_or(i as i64, |a| a.get(i).copied().unwrap_or(i as i64)), rank)?;
        let step = steps.and_then(|s| s.get(i).copied()).unwrap_or(1);
        if step == 0 {
            return Err("slice step 0".into());
        }
        let dim = src.shape[a] as i64;
        let norm = |v: i64| if v < 0 { v + dim } else { v };
        let (start, end) = (norm(*start), norm(*end));
        let (first, count) = if step > 0 {
            let (b, e) = (start.clamp(0, dim), end.clamp(0, dim));
            (b, visits(e - b, step))
        } else {
            // ONNX clamps a backward start to [0, dim - 1] (to -1 it read
            // a start below -dim as "nothing"); an empty axis visits none.
            let b = if dim == 0 { -1 } else { start.clamp(0, dim - 1) };
            let e = end.clamp(-1, dim - 1);
            (b, visits(b - e, step))
        };
        counts[a] = count as usize;
        base += first as isize * s[a] as isize;
        // A step past the axis visits one element; clamping keeps the stride
        // from overflowing where it is never taken.
        walk[a] = step.clamp(-dim.max(1), dim.max(1)) as isize * s[a] as isize;
    }
    let index = if counts.contains(&0) { Vec::new() } else { strided_index(base as usize, &counts, &walk) };
    select(src, &index, &counts, out);
    Ok(())
}

pub fn concat(parts: &[&Value], axis_attr: i64, out: &mut Value) -> Result<(), String> {
    let first = parts.first().ok_or("Concat needs at least one input")?;
    let rank = first.shape.len();
    let a = axis(axis_attr, rank)?;
    let mut shape = first.shape.clone();
    shape[a] = 0;
    for p in parts {
        if p.shape.len() != rank || p.dtype() != first.dtype() {
            return Err(format!(
                "cannot concatenate {:?} {} with {:?} {}",
                first.shape,
                first.dtype(),
                p.shape,
                p.dtype()
            ));
        }
        for d in 0..rank {
            if d != a && p.shape[d] != first.shape[d] {
                return Err(format!("concat inputs {:?} and {:?} differ off axis {a}", first.shape, p.shape));
            }
        }
        shape[a] += p.shape[a];
    }
    let outer: usize = shape[..a].iter().product();
    let inner: usize = shape[a + 1..].iter().product();
    // Build the output by concatenating each part's rows; a flat source
    // index over all parts back to back lets `select` do the copy.
    let mut offsets = Vec::with_capacity(parts.len());
    let mut acc = 0;
    for p in parts {
        offsets.push(acc);
        acc += p.len();
    }
    let mut index = Vec::with_capacity(shape.iter().product());
    for o in 0..outer {
        for (p, off) in parts.iter().zip(&offsets) {
            let row = p.shape[a] * inner;
            index.extend((0..row).map(|i| off + o * row + i));
        }
    }
    let joined = join(parts);
    select(&joined, &index, &shape, out);
    Ok(())
}

fn join(parts: &[&Value]) -> Value {
    fn cat<T: Copy>(parts: &[&Value], get: impl Fn(&Value) -> &[T]) -> Vec<T> {
        parts.iter().flat_map(|p| get(p).iter().copied()).collect()
    }
    let shape = Shape::from_slice(&[parts.iter().map(|p| p.len()).sum()]);
    let data = match &parts[0].data {
        Data::F32(_) => Data::F32(cat(parts, |p| p.as_f32().unwrap_or(&[]))),
        Data::I64(_) => Data::I64(cat(parts, |p| p.as_i64().unwrap_or(&[]))),
        Data::Bool(_) => Data::Bool(cat(parts, |p| p.as_bool().unwrap_or(&[]))),
        Data::F16(_) => Data::F16(cat(parts, |p| p.as_f16().unwrap_or(&[]))),
        Data::U8(_) => Data::U8(cat(parts, |p| p.as_u8().unwrap_or(&[]))),
        Data::F64(_) => Data::F64(cat(parts, |p| p.as_f64().unwrap_or(&[]))),
        Data::I32(_) => Data::I32(cat(parts, |p| p.as_i32().unwrap_or(&[]))),
    };
    Value { shape, data }
}

pub fn gather(data: &Value, indices: &Value, axis_attr: i64, out: &mut Value) -> Result<(), String> {
    let a = axis(axis_attr, data.shape.len())?;
    let idx = indices.as_i64()?;
    let dim = data.shape[a];
    let mut shape: Shape = data.shape[..a].iter().copied().collect();
    shape.extend_from_slice(&indices.shape);
    shape.extend_from_slice(&data.shape[a + 1..]);
    if a == 0 {
        // Whole rows (an embedding or a cos/sin table lookup): copied row by
        // row, without an index map.
        let inner: usize = data.shape[1..].iter().product();
        fn rows<T: Copy>(v: &[T], idx: &[i64], dim: usize, inner: usize, mut o: Vec<T>) -> Result<Vec<T>, String> {
            o.clear();
            for i in idx {
                let i = if *i < 0 { *i + dim as i64 } else { *i };
                if !(0..dim as i64).contains(&i) {
                    return Err(format!("index {i} is out of range for axis 0 of size {dim}"));
                }
                let start = i as usize * inner;
                o.extend_from_slice(&v[start..start + inner]);
            }
            Ok(o)
        }
        *out = match &data.data {
            Data::F32(v) => Value::f32(&shape, rows(v, idx, dim, inner, out.recycle_f32(0))?),
            Data::F16(v) => Value::f16(&shape, rows(v, idx, dim, inner, out.recycle_f16(0))?),
            Data::I64(v) => Value::i64(&shape, rows(v, idx, dim, inner, out.recycle_i64(0))?),
            Data::Bool(v) => Value::bool(&shape, rows(v, idx, dim, inner, out.recycle_bool(0))?),
            Data::U8(v) => Value::u8(&shape, rows(v, idx, dim, inner, out.recycle_u8(0))?),
            Data::F64(v) => Value::f64(&shape, rows(v, idx, dim, inner, out.recycle_f64(0))?),
            Data::I32(v) => Value::i32(&shape, rows(v, idx, dim, inner, out.recycle_i32(0))?),
        };
        return Ok(());
    }
    let outer: usize = data.shape[..a].iter().product();
    let inner: usize = data.shape[a + 1..].iter().product();
    let mut index = Vec::with_capacity(outer * idx.len() * inner);
    for o in 0..outer {
        for i in idx {
            let i = if *i < 0 { *i + dim as i64 } else { *i };
            if !(0..dim as i64).contains(&i) {
                return Err(format!("index {i} is out of range for axis {a} of size {dim}"));
            }
            let start = (o * dim + i as usize) * inner;
            index.extend(start..start + inner);
        }
    }
    select(data, &index, &shape, out);
    Ok(())
}

pub fn tile(src: &Value, repeats: &[i64], out: &mut Value) -> Result<(), String> {
    if repeats.len() != src.shape.len() || repeats.iter().any(|r| *r < 0) {
        return Err(format!("repeats {repeats:?} do not fit rank {}", src.shape.len()));
    }
    let shape: Vec<usize> = src
        .shape
        .iter()
        .zip(repeats)
        .map(|(d, r)| {
            d.checked_mul(*r as usize).ok_or_else(|| format!("tiling {:?} by {repeats:?} overflows", src.shape))
        })
        .collect::<Result<_, _>>()?;
    if checked_elements(&shape)? == 0 {
        // (An empty result's index would still grow by its other axes.)
        select(src, &[], &shape, out);
        return Ok(());
    }
    // Built axis by axis from the innermost: each axis repeats the block of
    // source indices assembled so far.
    let s = strides(&src.shape);
    let mut index: Vec<usize> = vec![0];
    for axis in (0..shape.len()).rev() {
        let mut next = Vec::with_capacity(index.len() * shape[axis]);
        for _ in 0..repeats[axis] {
            for i in 0..src.shape[axis] {
                next.extend(index.iter().map(|x| x + i * s[axis]));
            }
        }
        index = next;
    }
    select(src, &index, &shape, out);
    Ok(())
}

pub fn expand(src: &Value, target: &[i64], out: &mut Value) -> Result<(), String> {
    let target: Vec<usize> = target.iter().map(|d| (*d).max(0) as usize).collect();
    let shape = super::elementwise::broadcast_shape(&src.shape, &target)
        .ok_or_else(|| format!("cannot expand {:?} to {target:?}", src.shape))?;
    let padded: Shape =
        std::iter::repeat_n(1, shape.len() - src.shape.len()).chain(src.shape.iter().copied()).collect();
    let reps: Vec<i64> = shape.iter().zip(&padded).map(|(o, i)| (o / i.max(&1)) as i64).collect();
    let view = Value { shape: padded, data: src.data.clone() };
    tile(&view, &reps, out)
}

/// The elements `Range(start, limit, delta)` makes (three i64 or three f32
/// scalars), checked against [`MAX_ELEMENTS`]: what [`range`] allocates,
/// and what the compiler's fold budget counts before it runs one.
pub fn range_len(start: &Value, limit: &Value, delta: &Value) -> Result<usize, String> {
    let ints = |v: &Value| v.as_i64().ok().and_then(|x| (x.len() == 1).then(|| x[0]));
    let floats = |v: &Value| v.as_f32().ok().and_then(|x| (x.len() == 1).then(|| x[0]));
    let (n, what) = match (ints(start), ints(limit), ints(delta)) {
        (Some(s), Some(l), Some(d)) if d != 0 => {
            (((l as f64 - s as f64) / d as f64).ceil().max(0.0), format!("Range({s}, {l}, {d})"))
        }
        _ => match (floats(start), floats(limit), floats(delta)) {
            (Some(s), Some(l), Some(d)) if d != 0.0 => {
                (f64::from(((l - s) / d).ceil().max(0.0)), format!("Range({s}, {l}, {d})"))
            }
            _ => return Err("Range needs three i64 or three f32 scalars and a non-zero delta".into()),
        },
    };
    if n.is_nan() || n > MAX_ELEMENTS as f64 {
        return Err(format!("{what} has {n} elements, more than {MAX_ELEMENTS}"));
    }
    Ok(n as usize)
}

pub fn range(start: &Value, limit: &Value, delta: &Value, out: &mut Value) -> Result<(), String> {
    let n = range_len(start, limit, delta)?;
    if let (Ok(&[s]), Ok(&[d])) = (start.as_i64(), delta.as_i64()) {
        let mut o = out.recycle_i64(n);
        o.iter_mut().enumerate().for_each(|(i, o)| *o = s + i as i64 * d);
        *out = Value::i64([n], o);
    } else if let (Ok(&[s]), Ok(&[d])) = (start.as_f32(), delta.as_f32()) {
        let mut o = out.recycle_f32(n);
        o.iter_mut().enumerate().for_each(|(i, o)| *o = s + i as f32 * d);
        *out = Value::f32([n], o);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 20 (a fuzz finding, `fuzz/regressions/onnx/product-overflow`):
    /// a Reshape over declared dims whose product overflows is an error,
    /// not an overflow panic (or, in release, a wrapped count).
    #[test]
    fn reshape_of_dims_that_overflow_is_an_error() {
        let err = reshape_target(&[usize::MAX / 2, 3], &[-1]).unwrap_err();
        assert!(err.contains("more than"), "{err}");
        assert!(reshape_target(&[2, 3], &[1 << 40, 1 << 40]).is_err());
        assert_eq!(reshape_target(&[2, 3, 4], &[0, -1]).unwrap().as_slice(), &[2, 12]);
    }

    /// Transpose: the tiled path for permutations that reduce to a
    /// (batched) swap of two axes writes what the index of every element
    /// writes, for every permutation of up to four axes over shapes with
    /// size-1 axes, sizes off the tile and empty tensors; a size-1 axis
    /// between two that move together does not keep them off the tiled
    /// path; a perm that does not name each axis once is an error. Watched
    /// red with the tiled writes' index transposed (`d[r * cols + c]`), with
    /// runs never merged across a size-1 axis and with only the perm's
    /// length checked.
    #[test]
    fn tiled_transposes_equal_the_indexed_copy() {
        let shapes: [&[usize]; 7] =
            [&[37, 70], &[3, 33, 5], &[1, 40, 1, 3], &[2, 1, 35, 34], &[4, 3, 2, 5], &[0, 3], &[1, 1]];
        let (mut swapped, mut total) = (0, 0);
        for shape in shapes {
            let n: usize = shape.iter().product();
            let src = Value::f32(shape, (0..n).map(|i| i as f32).collect());
            for perm in permutations(shape.len()) {
                let mut fast = Value::default();
                transpose(&src, &perm, &mut fast).unwrap();
                let out_shape: Vec<usize> = perm.iter().map(|p| shape[*p]).collect();
                let s = strides(shape);
                let steps: Vec<isize> = perm.iter().map(|p| s[*p] as isize).collect();
                let mut slow = Value::default();
                select(&src, &strided_index(0, &out_shape, &steps), &out_shape, &mut slow);
                assert_eq!(fast, slow, "shape {shape:?} perm {perm:?}");
                swapped += usize::from(as_batched_swap(shape, &perm).is_some());
                total += 1;
            }
        }
        // [2, 1, 35, 34] -> [34, 2, 1, 35] is a 70 x 34 matrix transposed.
        assert_eq!(as_batched_swap(&[2, 1, 35, 34], &[3, 0, 1, 2]), Some((1, 70, 34)));
        // Both paths ran: some permutations are swaps, some are not.
        assert!(swapped > 10 && swapped < total, "{swapped} of {total} took the tiled path");
        // A perm that is not a permutation is an error, not a wrong copy.
        let small = Value::f32([2, 1, 3], vec![0.0; 6]);
        for bad in [&[0, 0, 2][..], &[2, 1, 1], &[0, 3, 1], &[0, 1]] {
            let err = transpose(&small, bad, &mut Value::default()).unwrap_err();
            assert!(err.contains("perm"), "{bad:?}: {err}");
        }
        // Other element types take the same path.
        let ints = Value::i64([2, 3], vec![1, 2, 3, 4, 5, 6]);
        let mut t = Value::default();
        transpose(&ints, &[1, 0], &mut t).unwrap();
        assert_eq!(t, Value::i64([3, 2], vec![1, 4, 2, 5, 3, 6]));
    }

    fn permutations(n: usize) -> Vec<Vec<usize>> {
        if n == 0 {
            return vec![Vec::new()];
        }
        let mut all = Vec::new();
        for p in permutations(n - 1) {
            for at in 0..=p.len() {
                let mut q = p.clone();
                q.insert(at, n - 1);
                all.push(q);
            }
        }
        all
    }
}
