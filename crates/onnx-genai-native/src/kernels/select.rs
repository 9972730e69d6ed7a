//! Index-computing kernels that standard ONNX graphs use around a decoder:
//! arg-extrema, top-k, cumulative sums, triangular masks, scatters,
//! splits and clipping. Each views its input as `[outer, axis, inner]`.

use crate::value::{Data, Value};

use super::layout::{axis as resolve, select};

/// `(outer, len, inner)` of `shape` around `axis`.
fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

/// The elements as f64 for ordering (f32 and i64 inputs).
fn ordered(x: &Value) -> Result<Vec<f64>, String> {
    match &x.data {
        Data::F32(v) => Ok(v.iter().map(|x| f64::from(*x)).collect()),
        Data::I64(v) => Ok(v.iter().map(|x| *x as f64).collect()),
        _ => Err(format!("ordering {} values is not supported", x.dtype())),
    }
}

/// ArgMax (or ArgMin with `min`) along `axis`; ties go to the first index
/// unless `last`.
pub fn arg_extreme(x: &Value, axis: i64, keepdims: bool, last: bool, min: bool, out: &mut Value) -> Result<(), String> {
    let a = resolve(axis, x.shape.len())?;
    let (outer, len, inner) = around(&x.shape, a);
    if len == 0 {
        return Err(format!("arg-extreme over the empty axis {a} of {:?}", x.shape));
    }
    let v = ordered(x)?;
    let mut o = out.recycle_i64(outer * inner);
    for p in 0..outer {
        for q in 0..inner {
            let at = |i: usize| v[(p * len + i) * inner + q];
            let mut best = 0;
            for i in 1..len {
                let (cur, b) = (at(i), at(best));
                let better = if min { cur < b } else { cur > b };
                if better || (last && cur == b) {
                    best = i;
                }
            }
            o[p * inner + q] = best as i64;
        }
    }
    let mut shape = x.shape.to_vec();
    if keepdims {
        shape[a] = 1;
    } else {
        shape.remove(a);
    }
    *out = Value::i64(shape, o);
    Ok(())
}

/// TopK: the `k` largest (or smallest) along `axis` and their indices;
/// equal values keep the lower index first.
pub fn top_k(x: &Value, k: usize, axis: i64, largest: bool, outputs: &mut [Value]) -> Result<(), String> {
    let a = resolve(axis, x.shape.len())?;
    let (outer, len, inner) = around(&x.shape, a);
    if k > len {
        return Err(format!("k={k} exceeds the axis length {len}"));
    }
    let v = ordered(x)?;
    let mut index = Vec::with_capacity(outer * k * inner);
    let mut order: Vec<usize> = Vec::with_capacity(len);
    let mut picks = vec![0i64; outer * k * inner];
    for p in 0..outer {
        for q in 0..inner {
            let at = |i: usize| v[(p * len + i) * inner + q];
            order.clear();
            order.extend(0..len);
            order.sort_by(|&i, &j| {
                let (x, y) = (at(i), at(j));
                let by_value = if largest { y.total_cmp(&x) } else { x.total_cmp(&y) };
                by_value.then(i.cmp(&j))
            });
            for (r, i) in order.iter().take(k).enumerate() {
                picks[(p * k + r) * inner + q] = *i as i64;
            }
        }
    }
    for p in 0..outer {
        for r in 0..k {
            for q in 0..inner {
                index.push((p * len + picks[(p * k + r) * inner + q] as usize) * inner + q);
            }
        }
    }
    let mut shape = x.shape.to_vec();
    shape[a] = k;
    let [values, indices, ..] = outputs else { return Err("TopK has two outputs".into()) };
    select(x, &index, &shape, values);
    *indices = Value::i64(shape, picks);
    Ok(())
}

/// Cumulative sum along `axis`, optionally exclusive and/or reversed.
pub fn cum_sum(x: &Value, axis: i64, exclusive: bool, reverse: bool, out: &mut Value) -> Result<(), String> {
    let a = resolve(axis, x.shape.len())?;
    let (outer, len, inner) = around(&x.shape, a);
    fn scan<T: Copy + std::ops::Add<Output = T> + Default>(
        v: &[T],
        (outer, len, inner): (usize, usize, usize),
        exclusive: bool,
        reverse: bool,
    ) -> Vec<T> {
        let mut o = vec![T::default(); v.len()];
        for p in 0..outer {
            for q in 0..inner {
                let mut acc = T::default();
                for step in 0..len {
                    let i = if reverse { len - 1 - step } else { step };
                    let at = (p * len + i) * inner + q;
                    if exclusive {
                        o[at] = acc;
                        acc = acc + v[at];
                    } else {
                        acc = acc + v[at];
                        o[at] = acc;
                    }
                }
            }
        }
        o
    }
    let dims = (outer, len, inner);
    *out = match &x.data {
        Data::F32(v) => Value::f32(&x.shape, scan(v, dims, exclusive, reverse)),
        Data::F64(v) => Value::f64(&x.shape, scan(v, dims, exclusive, reverse)),
        Data::I64(v) => Value::i64(&x.shape, scan(v, dims, exclusive, reverse)),
        Data::I32(v) => Value::i32(&x.shape, scan(v, dims, exclusive, reverse)),
        _ => return Err(format!("CumSum of {} is not supported", x.dtype())),
    };
    Ok(())
}

/// Trilu: keeps the upper (or lower) triangle of the last two axes from
/// diagonal `k`, zeroing the rest.
pub fn trilu(x: &Value, k: i64, upper: bool, out: &mut Value) -> Result<(), String> {
    let rank = x.shape.len();
    if rank < 2 {
        return Err(format!("Trilu needs rank >= 2, got {:?}", x.shape));
    }
    let (rows, cols) = (x.shape[rank - 2], x.shape[rank - 1]);
    let keep = |i: usize| {
        let (r, c) = ((i / cols % rows.max(1)) as i64, (i % cols.max(1)) as i64);
        if upper {
            c - r >= k
        } else {
            c - r <= k
        }
    };
    *out = match &x.data {
        Data::F32(v) => {
            Value::f32(&x.shape, v.iter().enumerate().map(|(i, x)| if keep(i) { *x } else { 0.0 }).collect())
        }
        Data::I64(v) => Value::i64(&x.shape, v.iter().enumerate().map(|(i, x)| if keep(i) { *x } else { 0 }).collect()),
        Data::Bool(v) => Value::bool(&x.shape, v.iter().enumerate().map(|(i, x)| keep(i) && *x).collect()),
        _ => return Err(format!("Trilu of {} is not supported", x.dtype())),
    };
    Ok(())
}

/// How ScatterND combines an update with the element it lands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combine {
    Replace,
    Add,
    Mul,
    Max,
    Min,
}

/// ScatterND: `data` with `updates` written at the index tuples of
/// `indices` (`[.., r]` tuples address the first `r` axes).
pub fn scatter_nd(data: &Value, indices: &Value, updates: &Value, how: Combine, out: &mut Value) -> Result<(), String> {
    let idx = indices.as_i64()?;
    let r = *indices.shape.last().ok_or("indices need at least one axis")?;
    if r == 0 || r > data.shape.len() {
        return Err(format!("index tuples of {r} for data of rank {}", data.shape.len()));
    }
    let slab: usize = data.shape[r..].iter().product();
    let tuples = idx.len() / r;
    if updates.len() != tuples * slab {
        return Err(format!(
            "updates hold {} elements, {tuples} slabs of {slab} need {}",
            updates.len(),
            tuples * slab
        ));
    }
    let mut offsets = Vec::with_capacity(tuples);
    for t in idx.chunks_exact(r) {
        let mut at = 0usize;
        for (axis, i) in t.iter().enumerate() {
            let dim = data.shape[axis] as i64;
            let i = if *i < 0 { i + dim } else { *i };
            if !(0..dim).contains(&i) {
                return Err(format!("index {i} is out of range for axis {axis} of {:?}", data.shape));
            }
            at = at * data.shape[axis] + i as usize;
        }
        offsets.push(at * slab);
    }
    fn apply<T: Copy>(o: &mut [T], u: &[T], offsets: &[usize], slab: usize, f: impl Fn(T, T) -> T) {
        for (t, base) in offsets.iter().enumerate() {
            for j in 0..slab {
                o[base + j] = f(o[base + j], u[t * slab + j]);
            }
        }
    }
    *out = match (&data.data, &updates.data) {
        (Data::F32(d), Data::F32(u)) => {
            let mut o = d.clone();
            apply(&mut o, u, &offsets, slab, |a: f32, b: f32| match how {
                Combine::Replace => b,
                Combine::Add => a + b,
                Combine::Mul => a * b,
                Combine::Max => a.max(b),
                Combine::Min => a.min(b),
            });
            Value::f32(&data.shape, o)
        }
        (Data::I64(d), Data::I64(u)) => {
            let mut o = d.clone();
            apply(&mut o, u, &offsets, slab, |a: i64, b: i64| match how {
                Combine::Replace => b,
                Combine::Add => a.wrapping_add(b),
                Combine::Mul => a.wrapping_mul(b),
                Combine::Max => a.max(b),
                Combine::Min => a.min(b),
            });
            Value::i64(&data.shape, o)
        }
        _ => return Err(format!("ScatterND of {} with {} updates", data.dtype(), updates.dtype())),
    };
    Ok(())
}

/// Splits `x` along `axis` into pieces of `sizes` (which must add up to
/// the axis length).
pub fn split(x: &Value, axis: i64, sizes: &[usize], outputs: &mut [Value]) -> Result<(), String> {
    let a = resolve(axis, x.shape.len())?;
    let (outer, len, inner) = around(&x.shape, a);
    // (Summed checked: sizes from a graph can wrap around to the length.)
    let total = sizes.iter().try_fold(0usize, |sum, s| sum.checked_add(*s));
    if total != Some(len) || sizes.len() != outputs.len() {
        return Err(format!(
            "split sizes {sizes:?} into {} outputs do not cover axis {a} of {:?}",
            outputs.len(),
            x.shape
        ));
    }
    let mut start = 0;
    for (size, out) in sizes.iter().zip(outputs.iter_mut()) {
        let mut index = Vec::with_capacity(outer * size * inner);
        for p in 0..outer {
            let base = (p * len + start) * inner;
            index.extend(base..base + size * inner);
        }
        let mut shape = x.shape.to_vec();
        shape[a] = *size;
        select(x, &index, &shape, out);
        start += size;
    }
    Ok(())
}

/// The sizes of an even split of `len` into `parts` (the last may be
/// smaller, as ONNX's `num_outputs` splits).
pub fn even_split(len: usize, parts: usize) -> Vec<usize> {
    let each = len.div_ceil(parts.max(1));
    (0..parts).map(|i| each.min(len.saturating_sub(i * each))).collect()
}

/// Clip to `[min, max]` (either bound optional).
pub fn clip(x: &Value, min: Option<&Value>, max: Option<&Value>, out: &mut Value) -> Result<(), String> {
    fn bound<T: Copy>(v: Option<&Value>, get: fn(&Value) -> Result<&[T], String>) -> Result<Option<T>, String> {
        v.map(|v| get(v).and_then(|s| s.first().copied().ok_or_else(|| "an empty bound".to_string()))).transpose()
    }
    *out = match &x.data {
        Data::F32(v) => {
            let (lo, hi) = (bound(min, Value::as_f32)?, bound(max, Value::as_f32)?);
            Value::f32(
                &x.shape,
                v.iter()
                    .map(|x| {
                        let x = lo.map_or(*x, |l| if *x < l { l } else { *x });
                        hi.map_or(x, |h| if x > h { h } else { x })
                    })
                    .collect(),
            )
        }
        Data::I64(v) => {
            let (lo, hi) = (bound(min, Value::as_i64)?, bound(max, Value::as_i64)?);
            Value::i64(
                &x.shape,
                v.iter()
                    .map(|x| hi.map_or((*x).max(lo.unwrap_or(i64::MIN)), |h| (*x).max(lo.unwrap_or(i64::MIN)).min(h)))
                    .collect(),
            )
        }
        _ => return Err(format!("Clip of {} is not supported", x.dtype())),
    };
    Ok(())
}

/// GatherElements: `out[.., i, ..] = data[.., indices[.., i, ..], ..]`
/// along `axis` (indices and output share a shape).
pub fn gather_elements(data: &Value, indices: &Value, axis: i64, out: &mut Value) -> Result<(), String> {
    let rank = data.shape.len();
    let a = resolve(axis, rank)?;
    let idx = indices.as_i64()?;
    if indices.shape.len() != rank {
        return Err(format!("indices {:?} and data {:?} differ in rank", indices.shape, data.shape));
    }
    let strides: Vec<usize> = (0..rank).map(|i| data.shape[i + 1..].iter().product()).collect();
    let dim = data.shape[a] as i64;
    let mut index = Vec::with_capacity(idx.len());
    let mut coord = vec![0usize; rank];
    for i in idx {
        let i = if *i < 0 { *i + dim } else { *i };
        if !(0..dim).contains(&i) {
            return Err(format!("index {i} is out of range for axis {a} of size {dim}"));
        }
        let mut at = 0;
        for (axis_i, c) in coord.iter().enumerate() {
            let c = if axis_i == a { i as usize } else { *c };
            if c >= data.shape[axis_i] {
                return Err(format!("indices {:?} exceed data {:?} off the gather axis", indices.shape, data.shape));
            }
            at += c * strides[axis_i];
        }
        index.push(at);
        for axis_i in (0..rank).rev() {
            coord[axis_i] += 1;
            if coord[axis_i] < indices.shape[axis_i] {
                break;
            }
            coord[axis_i] = 0;
        }
    }
    select(data, &index, &indices.shape, out);
    Ok(())
}

/// Hardmax along `axis`: 1 at the first maximum, 0 elsewhere.
pub fn hardmax(x: &Value, axis: i64, out: &mut Value) -> Result<(), String> {
    let a = resolve(axis, x.shape.len())?;
    let (outer, len, inner) = around(&x.shape, a);
    let v = x.as_f32()?;
    let mut o = vec![0.0f32; v.len()];
    for p in 0..outer {
        for q in 0..inner {
            let at = |i: usize| (p * len + i) * inner + q;
            if let Some(best) = (0..len).reduce(|b, i| if v[at(i)] > v[at(b)] { i } else { b }) {
                o[at(best)] = 1.0;
            }
        }
    }
    *out = Value::f32(&x.shape, o);
    Ok(())
}

/// Einsum over one or two operands, by walking every assignment of the
/// equation's letters (the sizes here are small; decoders that use Einsum
/// for a batched product get the same answer as a MatMul).
pub fn einsum(equation: &str, inputs: &[&Value], out: &mut Value) -> Result<(), String> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = eq.split_once("->").ok_or("an Einsum without `->` (implicit output) is not supported")?;
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != inputs.len() || terms.iter().chain([&rhs]).any(|t| t.contains('.')) {
        return Err(format!("equation `{equation}` for {} inputs (ellipses are not supported)", inputs.len()));
    }
    let mut letters: Vec<char> = Vec::new();
    let mut sizes: Vec<usize> = Vec::new();
    for (term, x) in terms.iter().zip(inputs) {
        if term.chars().count() != x.shape.len() {
            return Err(format!("`{term}` names {} axes, the input has shape {:?}", term.len(), x.shape));
        }
        for (c, d) in term.chars().zip(x.shape.iter()) {
            match letters.iter().position(|l| *l == c) {
                Some(i) if sizes[i] != *d => return Err(format!("`{c}` is {} and {d}", sizes[i])),
                Some(_) => {}
                None => {
                    letters.push(c);
                    sizes.push(*d);
                }
            }
        }
    }
    let pos =
        |c: char| letters.iter().position(|l| *l == c).ok_or_else(|| format!("output letter `{c}` is not an input's"));
    let out_axes: Vec<usize> = rhs.chars().map(pos).collect::<Result<_, _>>()?;
    let in_axes: Vec<Vec<usize>> = terms.iter().map(|t| t.chars().map(pos).collect()).collect::<Result<_, _>>()?;
    if let Some(c) = rhs.chars().enumerate().find_map(|(i, c)| rhs.chars().skip(i + 1).any(|d| d == c).then_some(c)) {
        return Err(format!("output letter `{c}` appears more than once in `{equation}`"));
    }
    let out_shape: Vec<usize> = out_axes.iter().map(|a| sizes[*a]).collect();
    // Sized before anything is allocated or iterated: the output, and the
    // products visited (every assignment of the letters).
    super::layout::checked_elements(&out_shape)?;
    super::layout::checked_elements(&sizes)?;
    let shapes: Vec<&[usize]> = inputs.iter().map(|x| x.shape.as_slice()).collect();
    let plan =
        Contraction { sizes: &sizes, in_axes: &in_axes, shapes: &shapes, out_axes: &out_axes, out_shape: &out_shape };
    *out = match inputs.first().map(|x| x.dtype()) {
        Some(crate::value::DType::F64) => {
            let values: Vec<&[f64]> = inputs.iter().map(|x| x.as_f64()).collect::<Result<_, _>>()?;
            Value::f64(&out_shape, plan.run(&values))
        }
        _ => {
            let values: Vec<&[f32]> = inputs.iter().map(|x| x.as_f32()).collect::<Result<_, _>>()?;
            Value::f32(&out_shape, plan.run(&values))
        }
    };
    Ok(())
}

/// An Einsum with its letters resolved: each letter's size, the letters of
/// each input and of the output.
struct Contraction<'a> {
    sizes: &'a [usize],
    in_axes: &'a [Vec<usize>],
    shapes: &'a [&'a [usize]],
    out_axes: &'a [usize],
    out_shape: &'a [usize],
}

impl Contraction<'_> {
    fn run<T>(&self, values: &[&[T]]) -> Vec<T>
    where
        T: Copy + Default + std::ops::Mul<Output = T> + std::ops::AddAssign + From<u8>,
    {
        let mut o = vec![T::default(); self.out_shape.iter().product()];
        let total: usize = self.sizes.iter().product();
        let mut assign = vec![0usize; self.sizes.len()];
        let flat = |axes: &[usize], dims: &[usize], assign: &[usize]| {
            axes.iter().zip(dims).fold(0, |acc, (a, d)| acc * d + assign[*a])
        };
        for _ in 0..total {
            let mut product = T::from(1u8);
            for ((axes, dims), v) in self.in_axes.iter().zip(self.shapes).zip(values) {
                product = product * v[flat(axes, dims, &assign)];
            }
            o[flat(self.out_axes, self.out_shape, &assign)] += product;
            for i in (0..assign.len()).rev() {
                assign[i] += 1;
                if assign[i] < self.sizes[i] {
                    break;
                }
                assign[i] = 0;
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Split sizes from a graph are summed checked: sizes that wrap
    /// around to the axis length (2^64 − 1 twice, then 2) are refused,
    /// not taken as covering it and then allocated.
    #[test]
    fn split_sizes_that_wrap_are_refused() {
        let x = Value::f32([1, 0], Vec::new());
        let mut outputs = vec![Value::default(), Value::default(), Value::default()];
        let err = split(&x, 1, &[usize::MAX, usize::MAX, 2], &mut outputs).unwrap_err();
        assert!(err.contains("do not cover axis 1"), "{err}");
        let y = Value::f32([1, 3], vec![1.0, 2.0, 3.0]);
        split(&y, 1, &[1, 0, 2], &mut outputs).unwrap();
        assert_eq!(outputs[2].shape.as_slice(), &[1, 2]);
    }
}
