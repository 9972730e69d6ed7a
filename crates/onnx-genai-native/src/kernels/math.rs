//! Reductions, normalizations and the general (non-weight) matrix product.

use crate::value::Value;

pub use super::simd::dot;

pub use super::simd::softmax as softmax_row;

fn last_dim(x: &Value) -> Result<usize, String> {
    match x.shape.last() {
        Some(d) if *d > 0 => Ok(*d),
        _ => Err(format!("needs a non-empty last axis, got shape {:?}", x.shape)),
    }
}

pub fn softmax(x: &Value, out: &mut Value) -> Result<(), String> {
    let d = last_dim(x)?;
    let mut o = out.recycle_f32(0);
    o.extend_from_slice(x.as_f32()?);
    o.chunks_exact_mut(d).for_each(|row| {
        softmax_row(row);
    });
    *out = Value::f32(x.shape.clone(), o);
    Ok(())
}

/// Softmax (or log-softmax) along `axis` of `x` (any axis; rows are
/// gathered with a stride when the axis is not the last).
pub fn softmax_axis(x: &Value, axis: usize, log: bool, out: &mut Value) -> Result<(), String> {
    let v = x.as_f32()?;
    let d = x.shape.get(axis).copied().ok_or_else(|| format!("axis {axis} of {:?}", x.shape))?;
    let inner: usize = x.shape[axis + 1..].iter().product();
    let mut o = out.recycle_f32(v.len());
    if d > 0 && inner > 0 {
        let mut row = vec![0.0f32; d];
        for (block, dst) in v.chunks_exact(d * inner).zip(o.chunks_exact_mut(d * inner)) {
            for j in 0..inner {
                row.iter_mut().enumerate().for_each(|(i, r)| *r = block[i * inner + j]);
                if log {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let lse = max + row.iter().map(|r| (r - max).exp()).sum::<f32>().ln();
                    row.iter_mut().for_each(|r| *r -= lse);
                } else {
                    softmax_row(&mut row);
                }
                row.iter().enumerate().for_each(|(i, r)| dst[i * inner + j] = *r);
            }
        }
    }
    *out = Value::f32(x.shape.clone(), o);
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Mean,
    Sum,
    Max,
    Min,
    Prod,
    SumSquare,
    L1,
    L2,
    LogSum,
    LogSumExp,
}

impl Reduce {
    /// Whether the reduction is defined on i64 (exactly) here.
    pub fn on_ints(self) -> bool {
        matches!(self, Reduce::Sum | Reduce::Max | Reduce::Min | Reduce::Prod)
    }

    fn row_f32(self, row: &[f32]) -> f32 {
        let sum = |f: fn(f32) -> f32| row.iter().map(|x| f(*x)).sum::<f32>();
        match self {
            Reduce::Sum => sum(|x| x),
            Reduce::Mean => sum(|x| x) / row.len() as f32,
            Reduce::Max => row.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            Reduce::Min => row.iter().copied().fold(f32::INFINITY, f32::min),
            Reduce::Prod => row.iter().product(),
            Reduce::SumSquare => sum(|x| x * x),
            Reduce::L1 => sum(f32::abs),
            Reduce::L2 => sum(|x| x * x).sqrt(),
            Reduce::LogSum => sum(|x| x).ln(),
            Reduce::LogSumExp => {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                if max.is_infinite() {
                    max
                } else {
                    max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln()
                }
            }
        }
    }

    fn row_i64(self, row: &[i64]) -> i64 {
        match self {
            Reduce::Max => row.iter().copied().max().unwrap_or(i64::MIN),
            Reduce::Min => row.iter().copied().min().unwrap_or(i64::MAX),
            Reduce::Prod => row.iter().fold(1i64, |a, b| a.wrapping_mul(*b)),
            _ => row.iter().fold(0i64, |a, b| a.wrapping_add(*b)),
        }
    }
}

/// Reduces `x` over `axes` (sorted, distinct, any positions): the reduced
/// axes are moved last, then each row is reduced.
pub fn reduce_axes(kind: Reduce, x: &Value, axes: &[usize], keepdims: bool, out: &mut Value) -> Result<(), String> {
    let rank = x.shape.len();
    let kept: Vec<usize> = (0..rank).filter(|a| !axes.contains(a)).collect();
    let perm: Vec<usize> = kept.iter().chain(axes).copied().collect();
    let mut moved = Value::default();
    super::layout::transpose(x, &perm, &mut moved)?;
    let inner: usize = axes.iter().map(|a| x.shape[*a]).product();
    let outer: usize = kept.iter().map(|a| x.shape[*a]).product();
    let shape: Vec<usize> = if keepdims {
        (0..rank).map(|a| if axes.contains(&a) { 1 } else { x.shape[a] }).collect()
    } else {
        kept.iter().map(|a| x.shape[*a]).collect()
    };
    let rows = |n: usize| (0..outer).map(move |r| r * n..(r + 1) * n);
    match &moved.data {
        crate::value::Data::F32(v) => {
            let o: Vec<f32> = rows(inner).map(|r| kind.row_f32(&v[r])).collect();
            *out = Value::f32(shape, o);
        }
        crate::value::Data::I64(v) if kind.on_ints() => {
            let o: Vec<i64> = rows(inner).map(|r| kind.row_i64(&v[r])).collect();
            *out = Value::i64(shape, o);
        }
        _ => return Err(format!("Reduce{kind:?} of {} is not supported", x.dtype())),
    }
    Ok(())
}

/// Reduces the trailing `count` axes (the only form decoder graphs use;
/// the compiler checks the axes before it gets here).
pub fn reduce(kind: Reduce, x: &Value, count: usize, keepdims: bool, out: &mut Value) -> Result<(), String> {
    let rank = x.shape.len();
    if count == 0 || count > rank {
        return Err(format!("cannot reduce {count} trailing axes of rank {rank}"));
    }
    let inner: usize = x.shape[rank - count..].iter().product();
    let outer: usize = x.shape[..rank - count].iter().product();
    let mut shape = x.shape[..rank - count].to_vec();
    if keepdims {
        shape.extend(std::iter::repeat_n(1, count));
    }
    let scale = if kind == Reduce::Mean { 1.0 / inner.max(1) as f32 } else { 1.0 };
    match x.as_f32() {
        Ok(v) => {
            let mut o = out.recycle_f32(outer);
            for (o, row) in o.iter_mut().zip(v.chunks_exact(inner.max(1))) {
                *o = row.iter().sum::<f32>() * scale;
            }
            *out = Value::f32(shape, o);
        }
        Err(_) if kind == Reduce::Sum => {
            let v = x.as_i64()?;
            let mut o = out.recycle_i64(outer);
            for (o, row) in o.iter_mut().zip(v.chunks_exact(inner.max(1))) {
                *o = row.iter().sum();
            }
            *out = Value::i64(shape, o);
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

/// `x / sqrt(mean(x^2) + eps) * scale` over the last axis.
pub fn rms_norm(x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) {
    let d = scale.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = dot(row, row) / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), s) in o.iter_mut().zip(row).zip(scale) {
            *o = v * inv * s;
        }
    }
}

/// `(x - mean) / sqrt(var + eps) * gamma + beta` over rows of
/// `gamma.len()`; each row's mean and inverse deviation go to `stats` when
/// given (one element per row each).
pub fn layer_norm(
    x: &[f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
    mut stats: Option<(&mut [f32], &mut [f32])>,
) {
    let d = gamma.len();
    if d == 0 {
        return;
    }
    for (r, (row, o)) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        if let Some((means, invs)) = stats.as_mut() {
            (means[r], invs[r]) = (mean, inv);
        }
        for (i, (o, v)) in o.iter_mut().zip(row).enumerate() {
            *o = (v - mean) * inv * gamma[i] + beta.map_or(0.0, |b| b[i]);
        }
    }
}

/// Checks a normalization over the axes of `x` from `axis` on against its
/// scale (one element per normalized position); returns the first
/// normalized axis.
pub fn norm_rows(x: &Value, axis: i64, scale: &Value) -> Result<usize, String> {
    let from = super::layout::axis(axis, x.shape.len())?;
    let width: usize = x.shape[from..].iter().product();
    if width == 0 || scale.len() != width {
        return Err(format!("scale has {} elements, the normalized axes of {:?} hold {width}", scale.len(), x.shape));
    }
    Ok(from)
}

/// Checks a normalization's operands and returns the row width.
pub fn norm_width(x: &Value, scale: &Value) -> Result<usize, String> {
    let d = last_dim(x)?;
    if scale.len() != d {
        return Err(format!("scale has {} elements, the normalized axis has {d}", scale.len()));
    }
    Ok(d)
}

/// `a @ b` for f32 tensors with broadcast batch axes; a 1-D operand is a
/// row (`a`) or column (`b`) whose axis is dropped from the result, as in
/// numpy.
pub fn matmul(a: &Value, b: &Value, out: &mut Value) -> Result<(), String> {
    if a.shape.len() == 1 || b.shape.len() == 1 {
        let (a1, b1) = (a.shape.len() == 1, b.shape.len() == 1);
        let mut va = a.clone();
        let mut vb = b.clone();
        if a1 {
            va.shape.insert(0, 1);
        }
        if b1 {
            vb.shape.push(1);
        }
        matmul(&va, &vb, out)?;
        let rank = out.shape.len();
        if b1 {
            out.shape.remove(rank - 1);
        }
        if a1 {
            out.shape.remove(out.shape.len() - 1 - usize::from(!b1));
        }
        return Ok(());
    }
    let (x, y) = (a.as_f32()?, b.as_f32()?);
    let (ra, rb) = (a.shape.len(), b.shape.len());
    if ra < 2 || rb < 2 {
        return Err(format!("native MatMul needs rank >= 2 operands, got {:?} and {:?}", a.shape, b.shape));
    }
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (k2, n) = (b.shape[rb - 2], b.shape[rb - 1]);
    if k != k2 {
        return Err(format!("inner dimensions differ: {:?} @ {:?}", a.shape, b.shape));
    }
    let batch = super::elementwise::broadcast_shape(&a.shape[..ra - 2], &b.shape[..rb - 2])
        .ok_or_else(|| format!("batch axes of {:?} and {:?} do not broadcast", a.shape, b.shape))?;
    let batches = super::layout::checked_elements(&batch)?;
    // An [m, 1] @ [1, n] product is m x n from m + n values: sized before
    // it is allocated.
    super::layout::checked_elements(&[batches, m, n])?;
    let index = |shape: &[usize], i: usize| -> usize {
        // Maps a broadcast batch index back to the operand's own batch index.
        let mut rem = i;
        let mut idx = 0;
        let mut stride = 1;
        let offset = batch.len() - shape.len();
        for axis in (0..batch.len()).rev() {
            let coord = rem % batch[axis];
            rem /= batch[axis];
            if axis >= offset {
                let d = shape[axis - offset];
                idx += if d == 1 { 0 } else { coord * stride };
                stride *= d;
            }
        }
        idx
    };
    let mut o = out.recycle_f32(batches * m * n);
    for bi in 0..batches {
        let (ia, ib) = (index(&a.shape[..ra - 2], bi), index(&b.shape[..rb - 2], bi));
        let (pa, pb) = (&x[ia * m * k..(ia + 1) * m * k], &y[ib * k * n..(ib + 1) * k * n]);
        let pc = &mut o[bi * m * n..(bi + 1) * m * n];
        sgemm(m, k, n, pa, (k, 1), pb, (n, 1), pc);
    }
    let mut shape = batch;
    shape.extend([m, n]);
    *out = Value::f32(shape, o);
    Ok(())
}

/// ONNX Gemm: `alpha * op(a) @ op(b) + beta * c` with `op` transposing
/// when asked; `c` broadcasts to `[m, n]`.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    a: &Value,
    b: &Value,
    c: Option<&Value>,
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
    out: &mut Value,
) -> Result<(), String> {
    let (x, y) = (a.as_f32()?, b.as_f32()?);
    let (&[ra, ca], &[rb, cb]) = (a.shape.as_slice(), b.shape.as_slice()) else {
        return Err(format!("Gemm needs 2-D operands, got {:?} and {:?}", a.shape, b.shape));
    };
    let (m, k, sa) = if trans_a { (ca, ra, (1, ca)) } else { (ra, ca, (ca, 1)) };
    let (k2, n, sb) = if trans_b { (cb, rb, (1, cb)) } else { (rb, cb, (cb, 1)) };
    if k != k2 {
        return Err(format!("Gemm inner dimensions differ: {k} vs {k2}"));
    }
    let mut o = out.recycle_f32(super::layout::checked_elements(&[m, n])?);
    sgemm(m, k, n, x, sa, y, sb, &mut o);
    o.iter_mut().for_each(|v| *v *= alpha);
    let mut result = Value::f32([m, n], o);
    if let Some(c) = c.filter(|_| beta != 0.0) {
        let scaled = Value::f32(&c.shape, c.as_f32()?.iter().map(|v| v * beta).collect());
        let mut sum = Value::default();
        super::elementwise::binary(super::elementwise::BinOp::Add, &result, &scaled, &mut sum)?;
        if sum.shape.as_slice() != [m, n] {
            return Err(format!("C {:?} does not broadcast to [{m}, {n}]", c.shape));
        }
        result = sum;
    }
    *out = result;
    Ok(())
}

/// `c = a @ b` with `a` `[m, k]` and `b` `[k, n]` at the given (row, column)
/// strides; `c` is row-major `[m, n]`.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    sa: (usize, usize),
    b: &[f32],
    sb: (usize, usize),
    c: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    // Checked: a wrapped product would pass the bound and read elsewhere.
    let last = |rows: usize, s0: usize, cols: usize, s1: usize| {
        (rows - 1).checked_mul(s0)?.checked_add((cols - 1).checked_mul(s1)?)
    };
    let (max_a, max_b) = (last(m, sa.0, k, sa.1), last(k, sb.0, n, sb.1));
    let strides_fit = [sa.0, sa.1, sb.0, sb.1].iter().all(|s| isize::try_from(*s).is_ok());
    assert!(
        strides_fit
            && max_a.is_some_and(|i| i < a.len())
            && max_b.is_some_and(|i| i < b.len())
            && m.checked_mul(n).is_some_and(|mn| c.len() >= mn),
        "sgemm operands are smaller than their strides"
    );
    // SAFETY: the assertion above proves every element matrixmultiply reads
    // (a up to max_a, b up to max_b) and writes (c, row-major m x n) lies in
    // the slices; the slices do not alias because `c` is borrowed mutably.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            sa.0 as isize,
            sa.1 as isize,
            b.as_ptr(),
            sb.0 as isize,
            sb.1 as isize,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one `unsafe` block: sgemm with transposed strides must equal the
    /// naive product.
    #[test]
    fn sgemm_matches_naive_product_with_transposed_b() {
        let (m, k, n) = (3, 5, 4);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 2.0).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 - 3.0).collect(); // [n, k]
        let mut c = vec![0.0; m * n];
        sgemm(m, k, n, &a, (k, 1), &bt, (1, k), &mut c);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|p| a[i * k + p] * bt[j * k + p]).sum();
                assert!((c[i * n + j] - want).abs() < 1e-5, "c[{i},{j}] = {} want {want}", c[i * n + j]);
            }
        }
    }

    /// Strides whose last element's index wraps `usize` are refused, not
    /// let past the bound (3 rows 2^63 apart wrapped to index 0 of a
    /// one-element slice, and matrixmultiply read at a negative offset).
    #[test]
    fn sgemm_refuses_strides_that_wrap() {
        let mut c = vec![0.0; 3];
        let wrapped = std::panic::catch_unwind(move || sgemm(3, 1, 1, &[1.0], (1 << 63, 1), &[1.0], (1, 1), &mut c));
        let message = wrapped.expect_err("wrapping strides were taken");
        assert!(message.downcast_ref::<&str>().is_some_and(|m| m.contains("smaller than their strides")));
    }

    #[test]
    fn dot_handles_tails() {
        let a: Vec<f32> = (0..13).map(|i| i as f32).collect();
        assert_eq!(dot(&a, &a), (0..13).map(|i| (i * i) as f32).sum::<f32>());
    }
}
