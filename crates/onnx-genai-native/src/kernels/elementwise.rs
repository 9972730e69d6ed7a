//! Element-wise kernels with numpy broadcasting.

use half::f16;

use crate::value::{DType, Data, Shape, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    /// Integer modulo with the divisor's sign (ONNX Mod, `fmod=0`).
    Mod,
    /// Truncated modulo with the dividend's sign (`fmod=1`, C's fmod).
    Fmod,
    /// `x` where `x >= 0`, else `slope * x` (ONNX PRelu).
    PRelu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    Equal,
    Less,
    LessOrEqual,
    Greater,
    GreaterOrEqual,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogicOp {
    And,
    Or,
    Xor,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnOp {
    Neg,
    Sqrt,
    Reciprocal,
    Exp,
    Sigmoid,
    Tanh,
    Erf,
    Relu,
    Not,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (fused, or ONNX
    /// Gelu with `approximate="tanh"`).
    GeluTanh,
    /// `0.5 x (1 + erf(x / sqrt 2))` (ONNX Gelu).
    Gelu,
    Abs,
    Sign,
    Log,
    Cos,
    Sin,
    Floor,
    Ceil,
    /// Half to even, as ONNX and numpy round.
    Round,
    Softplus,
    Softsign,
    Tan,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Asinh,
    Acosh,
    Atanh,
    /// `x * tanh(softplus(x))`.
    Mish,
    /// `x * max(0, min(1, x / 6 + 1/2))`.
    HardSwish,
}

/// Activations with parameters (ONNX attributes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    LeakyRelu { alpha: f32 },
    Elu { alpha: f32 },
    Celu { alpha: f32 },
    Selu { alpha: f32, gamma: f32 },
    HardSigmoid { alpha: f32, beta: f32 },
    ThresholdedRelu { alpha: f32 },
}

impl Activation {
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::LeakyRelu { alpha } => {
                if x < 0.0 {
                    alpha * x
                } else {
                    x
                }
            }
            Activation::Elu { alpha } => {
                if x < 0.0 {
                    alpha * (x.exp() - 1.0)
                } else {
                    x
                }
            }
            Activation::Celu { alpha } => x.max(0.0) + (0.0f32).min(alpha * ((x / alpha).exp() - 1.0)),
            Activation::Selu { alpha, gamma } => {
                if x <= 0.0 {
                    gamma * (alpha * x.exp() - alpha)
                } else {
                    gamma * x
                }
            }
            Activation::HardSigmoid { alpha, beta } => (alpha * x + beta).clamp(0.0, 1.0),
            Activation::ThresholdedRelu { alpha } => {
                if x > alpha {
                    x
                } else {
                    0.0
                }
            }
        }
    }
}

/// A parametric activation of an f32 tensor.
pub fn activation(act: Activation, a: &Value, out: &mut Value) -> Result<(), String> {
    let x = a.as_f32()?;
    let mut o = out.recycle_f32(x.len());
    o.iter_mut().zip(x).for_each(|(o, x)| *o = act.apply(*x));
    *out = Value::f32(a.shape.clone(), o);
    Ok(())
}

/// IsNaN, or IsInf for the signs asked.
pub fn classify(a: &Value, nan: bool, positive: bool, negative: bool, out: &mut Value) -> Result<(), String> {
    let x = a.as_f32()?;
    let test = |x: f32| {
        if nan {
            x.is_nan()
        } else {
            (positive && x == f32::INFINITY) || (negative && x == f32::NEG_INFINITY)
        }
    };
    *out = Value::bool(a.shape.clone(), x.iter().map(|x| test(*x)).collect());
    Ok(())
}

impl UnOp {
    /// Whether the op only makes sense on floating-point input.
    pub fn float_only(self) -> bool {
        !matches!(self, UnOp::Neg | UnOp::Relu | UnOp::Not | UnOp::Abs | UnOp::Sign)
    }
}

/// Whether [`cast`] converts `from` into `to` (every numeric and boolean
/// pair; u8 holds 4-bit blocks and is never cast).
pub fn can_cast(from: DType, to: DType) -> bool {
    from != DType::U8 && to != DType::U8
}

/// The broadcast result shape of `a` and `b`, or `None` when incompatible.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Shape> {
    let rank = a.len().max(b.len());
    let mut out: Shape = std::iter::repeat_n(0, rank).collect();
    for (i, o) in out.iter_mut().enumerate() {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
        *o = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// Strides of `shape` laid out inside `out` (0 along broadcast axes).
fn broadcast_strides(shape: &[usize], out: &[usize]) -> Shape {
    let mut strides: Shape = std::iter::repeat_n(0, out.len()).collect();
    let offset = out.len() - shape.len();
    let mut stride = 1;
    for i in (0..shape.len()).rev() {
        if shape[i] != 1 {
            strides[offset + i] = stride;
        }
        stride *= shape[i];
    }
    strides
}

/// Calls `f(out_index, a_index, b_index)` over the broadcast of two shapes:
/// an odometer over the outer axes and a tight loop over the last one.
fn for_each_pair(out: &[usize], a: &[usize], b: &[usize], mut f: impl FnMut(usize, usize, usize)) {
    let n: usize = out.iter().product();
    if a == out && b == out {
        (0..n).for_each(|i| f(i, i, i));
        return;
    }
    if n == 0 {
        return;
    }
    let (sa, sb) = (broadcast_strides(a, out), broadcast_strides(b, out));
    let rank = out.len();
    if rank == 0 {
        f(0, 0, 0);
        return;
    }
    let (inner, ia_step, ib_step) = (out[rank - 1], sa[rank - 1], sb[rank - 1]);
    let outer = &out[..rank - 1];
    let mut idx: Shape = std::iter::repeat_n(0, outer.len()).collect();
    let (mut ia, mut ib, mut o) = (0usize, 0usize, 0usize);
    for _ in 0..n / inner.max(1) {
        let (mut xa, mut xb) = (ia, ib);
        for _ in 0..inner {
            f(o, xa, xb);
            o += 1;
            xa += ia_step;
            xb += ib_step;
        }
        for axis in (0..outer.len()).rev() {
            idx[axis] += 1;
            ia += sa[axis];
            ib += sb[axis];
            if idx[axis] < outer[axis] {
                break;
            }
            ia -= sa[axis] * outer[axis];
            ib -= sb[axis] * outer[axis];
            idx[axis] = 0;
        }
    }
}

/// The broadcast shape of `a` and `b`, its size checked before anything
/// of it is allocated (two small operands can broadcast to any size).
fn shape_of(a: &Value, b: &Value) -> Result<Shape, String> {
    let shape = broadcast_shape(&a.shape, &b.shape)
        .ok_or_else(|| format!("shapes {:?} and {:?} do not broadcast", a.shape, b.shape))?;
    super::layout::checked_elements(&shape)?;
    Ok(shape)
}

fn apply_f32(op: BinOp, x: f32, y: f32) -> f32 {
    match op {
        BinOp::Add => x + y,
        BinOp::Sub => x - y,
        BinOp::Mul => x * y,
        BinOp::Div => x / y,
        BinOp::Pow => {
            if y == 2.0 {
                x * x
            } else {
                x.powf(y)
            }
        }
        // NaN wins, as in numpy's maximum/minimum.
        BinOp::Max if x.is_nan() || y.is_nan() => f32::NAN,
        BinOp::Min if x.is_nan() || y.is_nan() => f32::NAN,
        BinOp::Max => x.max(y),
        BinOp::Min => x.min(y),
        BinOp::Mod => {
            let r = x % y;
            if r != 0.0 && (r < 0.0) != (y < 0.0) {
                r + y
            } else {
                r
            }
        }
        BinOp::Fmod => x % y,
        BinOp::PRelu => {
            if x < 0.0 {
                x * y
            } else {
                x
            }
        }
    }
}

fn apply_i64(op: BinOp, x: i64, y: i64) -> Result<i64, String> {
    Ok(match op {
        BinOp::Add => x.wrapping_add(y),
        BinOp::Sub => x.wrapping_sub(y),
        BinOp::Mul => x.wrapping_mul(y),
        BinOp::Div => x.checked_div(y).ok_or("integer division by zero")?,
        BinOp::Pow => x.wrapping_pow(u32::try_from(y).map_err(|_| "negative integer exponent")?),
        BinOp::Max => x.max(y),
        BinOp::Min => x.min(y),
        BinOp::Mod if y == 0 => return Err("integer modulo by zero".into()),
        BinOp::Mod => {
            let r = x.wrapping_rem(y);
            if r != 0 && (r < 0) != (y < 0) {
                r + y
            } else {
                r
            }
        }
        BinOp::Fmod => x.checked_rem(y).ok_or("integer modulo by zero")?,
        BinOp::PRelu => {
            if x < 0 {
                x.wrapping_mul(y)
            } else {
                x
            }
        }
    })
}

pub fn binary(op: BinOp, a: &Value, b: &Value, out: &mut Value) -> Result<(), String> {
    let shape = shape_of(a, b)?;
    let n = shape.iter().product();
    match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => {
            let mut o = out.recycle_f32(n);
            for_each_pair(&shape, &a.shape, &b.shape, |i, ia, ib| o[i] = apply_f32(op, x[ia], y[ib]));
            *out = Value::f32(shape, o);
        }
        (Data::I64(x), Data::I64(y)) => {
            let mut o = out.recycle_i64(n);
            let mut err: Option<String> = None;
            for_each_pair(&shape, &a.shape, &b.shape, |i, ia, ib| match apply_i64(op, x[ia], y[ib]) {
                Ok(v) => o[i] = v,
                Err(e) => err = Some(e),
            });
            if let Some(e) = err {
                return Err(e);
            }
            *out = Value::i64(shape, o);
        }
        _ => return Err(format!("operands are {} and {}; both must be f32 or both i64", a.dtype(), b.dtype())),
    }
    Ok(())
}

pub fn compare(op: CmpOp, a: &Value, b: &Value, out: &mut Value) -> Result<(), String> {
    let shape = shape_of(a, b)?;
    let n = shape.iter().product();
    let mut o = out.recycle_bool(n);
    fn cmp<T: PartialOrd>(op: CmpOp, x: T, y: T) -> bool {
        match op {
            CmpOp::Equal => x == y,
            CmpOp::Less => x < y,
            CmpOp::LessOrEqual => x <= y,
            CmpOp::Greater => x > y,
            CmpOp::GreaterOrEqual => x >= y,
        }
    }
    match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => {
            for_each_pair(&shape, &a.shape, &b.shape, |i, ia, ib| o[i] = cmp(op, x[ia], y[ib]))
        }
        (Data::I64(x), Data::I64(y)) => {
            for_each_pair(&shape, &a.shape, &b.shape, |i, ia, ib| o[i] = cmp(op, x[ia], y[ib]))
        }
        (Data::Bool(x), Data::Bool(y)) if op == CmpOp::Equal => {
            for_each_pair(&shape, &a.shape, &b.shape, |i, ia, ib| o[i] = x[ia] == y[ib])
        }
        _ => return Err(format!("cannot compare {} with {}", a.dtype(), b.dtype())),
    }
    *out = Value::bool(shape, o);
    Ok(())
}

pub fn logic(op: LogicOp, a: &Value, b: &Value, out: &mut Value) -> Result<(), String> {
    let shape = shape_of(a, b)?;
    let (x, y) = (a.as_bool()?, b.as_bool()?);
    let mut o = out.recycle_bool(shape.iter().product());
    for_each_pair(&shape, &a.shape, &b.shape, |i, ia, ib| {
        o[i] = match op {
            LogicOp::And => x[ia] && y[ib],
            LogicOp::Or => x[ia] || y[ib],
            LogicOp::Xor => x[ia] != y[ib],
        }
    });
    *out = Value::bool(shape, o);
    Ok(())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Abramowitz–Stegun 7.1.26 is too coarse for parity; this is the
/// Numerical Recipes erfc Chebyshev fit (|error| < 1.2e-7).
pub fn erf(x: f32) -> f32 {
    let z = f64::from(x.abs());
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = 1.0 - t * poly.exp();
    (if x >= 0.0 { r } else { -r }) as f32
}

pub fn unary(op: UnOp, a: &Value, out: &mut Value) -> Result<(), String> {
    let shape = a.shape.clone();
    match (&a.data, op) {
        (Data::Bool(x), UnOp::Not) => {
            let mut o = out.recycle_bool(x.len());
            o.iter_mut().zip(x).for_each(|(o, x)| *o = !x);
            *out = Value::bool(shape, o);
        }
        (Data::I64(x), UnOp::Neg | UnOp::Relu | UnOp::Abs | UnOp::Sign) => {
            let mut o = out.recycle_i64(x.len());
            let f = |x: i64| match op {
                UnOp::Neg => x.wrapping_neg(),
                UnOp::Abs => x.wrapping_abs(),
                UnOp::Sign => x.signum(),
                _ => x.max(0),
            };
            o.iter_mut().zip(x).for_each(|(o, x)| *o = f(*x));
            *out = Value::i64(shape, o);
        }
        (Data::F32(x), op) if op != UnOp::Not => {
            let mut o = out.recycle_f32(x.len());
            let f = |x: f32| match op {
                UnOp::Neg => -x,
                UnOp::Sqrt => x.sqrt(),
                UnOp::Reciprocal => 1.0 / x,
                UnOp::Exp => x.exp(),
                UnOp::Sigmoid => sigmoid(x),
                UnOp::Tanh => x.tanh(),
                UnOp::Erf => erf(x),
                UnOp::Relu => x.max(0.0),
                UnOp::GeluTanh => {
                    let inner = (2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
                    0.5 * x * (1.0 + inner.tanh())
                }
                UnOp::Gelu => 0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2)),
                UnOp::Abs => x.abs(),
                UnOp::Sign if x.is_nan() => x,
                UnOp::Sign if x == 0.0 => 0.0,
                UnOp::Sign => x.signum(),
                UnOp::Log => x.ln(),
                UnOp::Cos => x.cos(),
                UnOp::Sin => x.sin(),
                UnOp::Floor => x.floor(),
                UnOp::Ceil => x.ceil(),
                UnOp::Round => x.round_ties_even(),
                // ln(1 + e^x) without overflow for large x.
                UnOp::Softplus => x.max(0.0) + (-x.abs()).exp().ln_1p(),
                UnOp::Softsign => x / (1.0 + x.abs()),
                UnOp::Tan => x.tan(),
                UnOp::Asin => x.asin(),
                UnOp::Acos => x.acos(),
                UnOp::Atan => x.atan(),
                UnOp::Sinh => x.sinh(),
                UnOp::Cosh => x.cosh(),
                UnOp::Asinh => x.asinh(),
                UnOp::Acosh => x.acosh(),
                UnOp::Atanh => x.atanh(),
                UnOp::Mish => x * (x.max(0.0) + (-x.abs()).exp().ln_1p()).tanh(),
                UnOp::HardSwish => x * (x / 6.0 + 0.5).clamp(0.0, 1.0),
                UnOp::Not => x,
            };
            o.iter_mut().zip(x).for_each(|(o, x)| *o = f(*x));
            *out = Value::f32(shape, o);
        }
        _ => return Err(format!("{op:?} is not defined for {}", a.dtype())),
    }
    Ok(())
}

pub fn where_(cond: &Value, a: &Value, b: &Value, out: &mut Value) -> Result<(), String> {
    let c = cond.as_bool()?;
    let ab = shape_of(a, b)?;
    let shape = broadcast_shape(&cond.shape, &ab)
        .ok_or_else(|| format!("condition {:?} does not broadcast with {ab:?}", cond.shape))?;
    let n = super::layout::checked_elements(&shape)?;
    // Expand the condition to the output first, then select pairwise.
    let mut mask = vec![false; n];
    for_each_pair(&shape, &cond.shape, &[], |i, ic, _| mask[i] = c[ic]);
    match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => {
            let mut o = out.recycle_f32(n);
            for_each_pair(&shape, &a.shape, &b.shape, |i, ia, ib| o[i] = if mask[i] { x[ia] } else { y[ib] });
            *out = Value::f32(shape, o);
        }
        (Data::I64(x), Data::I64(y)) => {
            let mut o = out.recycle_i64(n);
            for_each_pair(&shape, &a.shape, &b.shape, |i, ia, ib| o[i] = if mask[i] { x[ia] } else { y[ib] });
            *out = Value::i64(shape, o);
        }
        _ => return Err(format!("Where branches are {} and {}", a.dtype(), b.dtype())),
    }
    Ok(())
}

pub fn cast(a: &Value, to: DType, out: &mut Value) -> Result<(), String> {
    let shape = a.shape.clone();
    let n = a.len();
    *out = match (&a.data, to) {
        (Data::F16(x), DType::F32) => {
            let mut o = out.recycle_f32(n);
            x.iter().zip(o.iter_mut()).for_each(|(x, o)| *o = x.to_f32());
            Value::f32(shape, o)
        }
        (Data::F32(x), DType::F16) => {
            let mut o = out.recycle_f16(n);
            x.iter().zip(o.iter_mut()).for_each(|(x, o)| *o = f16::from_f32(*x));
            Value { shape, data: Data::F16(o) }
        }
        (_, to) if a.dtype() == to => Value { shape, data: a.data.clone() },
        _ => {
            // Integers stay integers on the way (an i64 beyond 2^53 is not
            // rounded through f64); floats go through f64, which holds f32
            // and f16 exactly, so each cast rounds once. Floats to integers
            // truncate toward zero, as ONNX's Cast does.
            let num: Vec<Num> = match &a.data {
                Data::F32(v) => v.iter().map(|x| Num::F(f64::from(*x))).collect(),
                Data::F16(v) => v.iter().map(|x| Num::F(x.to_f64())).collect(),
                Data::F64(v) => v.iter().map(|x| Num::F(*x)).collect(),
                Data::I64(v) => v.iter().map(|x| Num::I(*x)).collect(),
                Data::I32(v) => v.iter().map(|x| Num::I(i64::from(*x))).collect(),
                Data::Bool(v) => v.iter().map(|x| Num::I(i64::from(*x))).collect(),
                Data::U8(_) => return Err(format!("cast from u8 to {to} is not supported")),
            };
            let f = |v: &Num| match *v {
                Num::F(f) => f,
                Num::I(i) => i as f64,
            };
            let i = |v: &Num| match *v {
                Num::F(f) => f as i64,
                Num::I(i) => i,
            };
            match to {
                DType::F32 => Value::f32(shape, num.iter().map(|v| f(v) as f32).collect()),
                DType::F16 => Value { shape, data: Data::F16(num.iter().map(|v| f16::from_f64(f(v))).collect()) },
                DType::F64 => Value::f64(shape, num.iter().map(f).collect()),
                DType::I64 => Value::i64(shape, num.iter().map(i).collect()),
                DType::I32 => Value::i32(shape, num.iter().map(|v| i(v) as i32).collect()),
                DType::Bool => Value::bool(shape, num.iter().map(|v| f(v) != 0.0).collect()),
                DType::U8 => return Err(format!("cast from {} to u8 is not supported", a.dtype())),
            }
        }
    };
    Ok(())
}

/// An element on its way through [`cast`].
enum Num {
    F(f64),
    I(i64),
}
