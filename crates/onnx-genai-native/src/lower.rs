//! Lowering: one ONNX node (domain, op type, attributes) becomes one [`Op`],
//! or a compile error that names the node and says why. This is the list of
//! what native-cpu supports.

use onnx_genai_onnx::ir::{AttrValue, Node};

use crate::error::CompileError;
use crate::kernels::attention::{Bias, Layout};
use crate::kernels::elementwise::{Activation, BinOp, CmpOp, LogicOp, UnOp};
use crate::kernels::math::Reduce;
use crate::kernels::select::Combine;
use crate::ops::{Op, PartialAttention};
use crate::value::{DType, Value};

pub const MS_DOMAIN: &str = "com.microsoft";

/// In a lowering's input list: an input slot the op has but the node does
/// not fill.
pub const ABSENT: usize = usize::MAX;

struct Attrs<'n> {
    node: &'n Node,
}

impl Attrs<'_> {
    fn err(&self, reason: impl Into<String>) -> CompileError {
        CompileError::node(&self.node.name, &self.node.op_type, reason)
    }
    fn unsupported(&self, reason: impl Into<String>) -> CompileError {
        CompileError::UnsupportedOp {
            node: self.node.name.clone(),
            op: self.node.op_type.clone(),
            domain: if self.node.domain.is_empty() { "ai.onnx".into() } else { self.node.domain.clone() },
            reason: reason.into(),
        }
    }
    fn no_kernel(&self) -> CompileError {
        CompileError::NoKernel {
            node: self.node.name.clone(),
            op: self.node.op_type.clone(),
            domain: if self.node.domain.is_empty() { "ai.onnx".into() } else { self.node.domain.clone() },
        }
    }
    fn int(&self, name: &str) -> Result<Option<i64>, CompileError> {
        match self.node.attr(name) {
            None => Ok(None),
            Some(AttrValue::Int(v)) => Ok(Some(*v)),
            Some(other) => Err(self.err(format!("attribute `{name}` must be an int, found {other:?}"))),
        }
    }
    fn int_or(&self, name: &str, default: i64) -> Result<i64, CompileError> {
        Ok(self.int(name)?.unwrap_or(default))
    }
    fn float(&self, name: &str) -> Result<Option<f32>, CompileError> {
        match self.node.attr(name) {
            None => Ok(None),
            Some(AttrValue::Float(v)) => Ok(Some(*v)),
            Some(other) => Err(self.err(format!("attribute `{name}` must be a float, found {other:?}"))),
        }
    }
    fn string(&self, name: &str) -> Result<Option<String>, CompileError> {
        match self.node.attr(name) {
            None => Ok(None),
            Some(AttrValue::String(v)) => Ok(Some(v.clone())),
            Some(other) => Err(self.err(format!("attribute `{name}` must be a string, found {other:?}"))),
        }
    }
    fn ints(&self, name: &str) -> Result<Option<Vec<i64>>, CompileError> {
        match self.node.attr(name) {
            None => Ok(None),
            Some(AttrValue::Ints(v)) => Ok(Some(v.clone())),
            Some(other) => Err(self.err(format!("attribute `{name}` must be ints, found {other:?}"))),
        }
    }
    /// An attribute that native-cpu only supports at its default value.
    fn require(&self, name: &str, default: i64, why: &str) -> Result<(), CompileError> {
        match self.int(name)? {
            Some(v) if v != default => Err(self.unsupported(format!("{name}={v}: {why}"))),
            _ => Ok(()),
        }
    }
    fn input_absent(&self, index: usize, what: &str) -> Result<(), CompileError> {
        match self.node.inputs.get(index) {
            Some(name) if !name.is_empty() => Err(self.unsupported(format!("input {index} ({what}) is not supported"))),
            _ => Ok(()),
        }
    }
}

fn cast_target(code: i64) -> Option<DType> {
    let t = onnx_genai_onnx::DataType::from_onnx(i32::try_from(code).ok()?)?;
    match t {
        onnx_genai_onnx::DataType::Uint8 => None,
        t => DType::from_onnx(t),
    }
}

/// An Einsum equation in explicit form (`->` and the output letters; the
/// implicit output is the letters used once, in alphabetical order),
/// without whitespace. Ellipses are refused.
fn explicit_einsum(equation: &str) -> Result<String, String> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    if eq.contains('.') {
        return Err(format!("equation `{equation}`: ellipses (`...`) are not supported"));
    }
    if !eq.chars().all(|c| c.is_ascii_alphabetic() || c == ',' || c == '-' || c == '>') {
        return Err(format!("equation `{equation}` has characters other than letters, `,` and `->`"));
    }
    if eq.contains("->") {
        return Ok(eq);
    }
    let mut once: Vec<char> = eq.chars().filter(|c| c.is_ascii_alphabetic()).collect();
    once.sort_unstable();
    let output: String = once.iter().filter(|c| eq.chars().filter(|d| d == *c).count() == 1).collect();
    Ok(format!("{eq}->{output}"))
}

/// The constant a `Constant` node defines.
pub fn constant_value(node: &Node) -> Result<Value, CompileError> {
    let a = Attrs { node };
    if let Some(AttrValue::Tensor(t)) = node.attr("value") {
        return Value::from_tensor(t).map_err(|e| a.err(e));
    }
    if let Some(v) = a.int("value_int")? {
        return Ok(Value::i64(vec![], vec![v]));
    }
    if let Some(v) = a.float("value_float")? {
        return Ok(Value::f32(vec![], vec![v]));
    }
    if let Some(v) = a.ints("value_ints")? {
        return Ok(Value::i64(vec![v.len()], v));
    }
    Err(a.unsupported("only value, value_int, value_float and value_ints constants are supported"))
}

/// Lowers `node`. Returns the op and, in the op's order, the indices of the
/// node inputs it reads: an input the op ignores is dropped, so whatever
/// computes it can be removed.
pub fn lower(node: &Node, opset: i64) -> Result<(Op, Vec<usize>), CompileError> {
    let a = Attrs { node };
    let all: Vec<usize> = (0..node.inputs.len()).collect();
    let op = match (node.domain.as_str(), node.op_type.as_str()) {
        ("" | "ai.onnx", op) => match op {
            "Add" => Op::Binary(BinOp::Add),
            "Sub" => Op::Binary(BinOp::Sub),
            "Mul" => Op::Binary(BinOp::Mul),
            "Div" => Op::Binary(BinOp::Div),
            "Pow" => Op::Binary(BinOp::Pow),
            "Equal" => Op::Compare(CmpOp::Equal),
            "Less" => Op::Compare(CmpOp::Less),
            "LessOrEqual" => Op::Compare(CmpOp::LessOrEqual),
            "Greater" => Op::Compare(CmpOp::Greater),
            "GreaterOrEqual" => Op::Compare(CmpOp::GreaterOrEqual),
            "And" => Op::Logic(LogicOp::And),
            "Or" => Op::Logic(LogicOp::Or),
            "Not" => Op::Unary(UnOp::Not),
            "Neg" => Op::Unary(UnOp::Neg),
            "Sqrt" => Op::Unary(UnOp::Sqrt),
            "Reciprocal" => Op::Unary(UnOp::Reciprocal),
            "Exp" => Op::Unary(UnOp::Exp),
            "Sigmoid" => Op::Unary(UnOp::Sigmoid),
            "Tanh" => Op::Unary(UnOp::Tanh),
            "Erf" => Op::Unary(UnOp::Erf),
            "Relu" => Op::Unary(UnOp::Relu),
            "Abs" => Op::Unary(UnOp::Abs),
            "Sign" => Op::Unary(UnOp::Sign),
            "Log" => Op::Unary(UnOp::Log),
            "Cos" => Op::Unary(UnOp::Cos),
            "Sin" => Op::Unary(UnOp::Sin),
            "Floor" => Op::Unary(UnOp::Floor),
            "Ceil" => Op::Unary(UnOp::Ceil),
            "Round" => Op::Unary(UnOp::Round),
            "Softplus" => Op::Unary(UnOp::Softplus),
            "Softsign" => Op::Unary(UnOp::Softsign),
            "Gelu" => match a.string("approximate")?.as_deref() {
                None | Some("none") => Op::Unary(UnOp::Gelu),
                Some("tanh") => Op::Unary(UnOp::GeluTanh),
                Some(other) => return Err(a.unsupported(format!("approximate=\"{other}\""))),
            },
            "Max" | "Min" if node.inputs.len() == 2 => Op::Binary(if op == "Max" { BinOp::Max } else { BinOp::Min }),
            "Max" | "Min" | "Sum" | "Mean" => {
                let fold = match op {
                    "Max" => BinOp::Max,
                    "Min" => BinOp::Min,
                    _ => BinOp::Add,
                };
                Op::Nary { op: fold, mean: op == "Mean" }
            }
            "Mod" => Op::Binary(if a.int_or("fmod", 0)? != 0 { BinOp::Fmod } else { BinOp::Mod }),
            "PRelu" => Op::Binary(BinOp::PRelu),
            "Xor" => Op::Logic(LogicOp::Xor),
            "Tan" => Op::Unary(UnOp::Tan),
            "Asin" => Op::Unary(UnOp::Asin),
            "Acos" => Op::Unary(UnOp::Acos),
            "Atan" => Op::Unary(UnOp::Atan),
            "Sinh" => Op::Unary(UnOp::Sinh),
            "Cosh" => Op::Unary(UnOp::Cosh),
            "Asinh" => Op::Unary(UnOp::Asinh),
            "Acosh" => Op::Unary(UnOp::Acosh),
            "Atanh" => Op::Unary(UnOp::Atanh),
            "Mish" => Op::Unary(UnOp::Mish),
            "HardSwish" => Op::Unary(UnOp::HardSwish),
            "LeakyRelu" => Op::Activation(Activation::LeakyRelu { alpha: a.float("alpha")?.unwrap_or(0.01) }),
            "Elu" => Op::Activation(Activation::Elu { alpha: a.float("alpha")?.unwrap_or(1.0) }),
            "Celu" => Op::Activation(Activation::Celu { alpha: a.float("alpha")?.unwrap_or(1.0) }),
            "Selu" => Op::Activation(Activation::Selu {
                alpha: a.float("alpha")?.unwrap_or(1.673_263_2),
                gamma: a.float("gamma")?.unwrap_or(1.050_701),
            }),
            "HardSigmoid" => Op::Activation(Activation::HardSigmoid {
                alpha: a.float("alpha")?.unwrap_or(0.2),
                beta: a.float("beta")?.unwrap_or(0.5),
            }),
            "ThresholdedRelu" => {
                Op::Activation(Activation::ThresholdedRelu { alpha: a.float("alpha")?.unwrap_or(1.0) })
            }
            "IsNaN" => Op::Classify { nan: true, positive: false, negative: false },
            "IsInf" => Op::Classify {
                nan: false,
                positive: a.int_or("detect_positive", 1)? != 0,
                negative: a.int_or("detect_negative", 1)? != 0,
            },
            "CastLike" => {
                if a.int("saturate")?.is_some_and(|s| s != 1) {
                    return Err(a.unsupported("saturate=0 (float8 targets)"));
                }
                Op::CastLike
            }
            "Size" => Op::Size,
            "GatherElements" => Op::GatherElements { axis: a.int_or("axis", 0)? },
            "Hardmax" if opset < 13 => return Err(a.unsupported(format!("Hardmax at opset {opset} (2-D coercion)"))),
            "Hardmax" => Op::Hardmax { axis: a.int_or("axis", -1)? },
            "Einsum" => {
                let equation = a.string("equation")?.ok_or_else(|| a.err("missing attribute `equation`"))?;
                Op::Einsum(explicit_einsum(&equation).map_err(|e| a.unsupported(e))?)
            }
            "Where" => Op::Where,
            "Identity" => Op::Identity,
            "Cast" => {
                let to = a.int("to")?.ok_or_else(|| a.err("missing attribute `to`"))?;
                Op::Cast(cast_target(to).ok_or_else(|| {
                    a.unsupported(format!("cast to ONNX type {to}: native-cpu holds f32, f16, f64, i64, i32 and bool"))
                })?)
            }
            "MatMul" => Op::MatMul,
            "Gather" => Op::Gather { axis: a.int_or("axis", 0)? },
            "Shape" => Op::Shape { start: a.int_or("start", 0)?, end: a.int("end")? },
            "Range" => Op::Range,
            "ConstantOfShape" => {
                let v = match node.attr("value") {
                    Some(AttrValue::Tensor(t)) => Value::from_tensor(t).map_err(|e| a.err(e))?,
                    None => Value::f32(vec![1], vec![0.0]),
                    Some(other) => return Err(a.err(format!("`value` must be a tensor, found {other:?}"))),
                };
                Op::ConstantOfShape(v)
            }
            "Unsqueeze" => Op::Unsqueeze(if opset < 13 { a.ints("axes")? } else { None }),
            "Squeeze" => Op::Squeeze(if opset < 13 { a.ints("axes")? } else { None }),
            "Reshape" => {
                a.require("allowzero", 0, "allowzero reshapes are not supported")?;
                Op::Reshape
            }
            "Transpose" => Op::Transpose(a.ints("perm")?),
            "Slice" => Op::Slice,
            "Concat" => Op::Concat { axis: a.int("axis")?.ok_or_else(|| a.err("missing attribute `axis`"))? },
            "Softmax" | "LogSoftmax" => {
                let axis = a.int_or("axis", if opset < 13 { 1 } else { -1 })?;
                if opset < 13 && axis != -1 {
                    // Before opset 13 the input is flattened to 2-D at `axis`.
                    return Err(a.unsupported(format!("axis={axis} at opset {opset} (2-D coercion)")));
                }
                Op::Softmax { axis, log: op == "LogSoftmax" }
            }
            "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceSumSquare" | "ReduceL1"
            | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" => {
                let kind = match op {
                    "ReduceMean" => Reduce::Mean,
                    "ReduceSum" => Reduce::Sum,
                    "ReduceMax" => Reduce::Max,
                    "ReduceMin" => Reduce::Min,
                    "ReduceProd" => Reduce::Prod,
                    "ReduceSumSquare" => Reduce::SumSquare,
                    "ReduceL1" => Reduce::L1,
                    "ReduceL2" => Reduce::L2,
                    "ReduceLogSum" => Reduce::LogSum,
                    _ => Reduce::LogSumExp,
                };
                Op::Reduce {
                    kind,
                    axes: a.ints("axes")?,
                    keepdims: a.int_or("keepdims", 1)? != 0,
                    noop_empty: a.int_or("noop_with_empty_axes", 0)? != 0,
                }
            }
            "Clip" if opset < 11 => Op::Clip {
                attrs: Some((a.float("min")?.unwrap_or(f32::NEG_INFINITY), a.float("max")?.unwrap_or(f32::INFINITY))),
            },
            "Clip" => Op::Clip { attrs: None },
            "Flatten" => Op::Flatten { axis: a.int_or("axis", 1)? },
            "ArgMax" | "ArgMin" => Op::ArgExtreme {
                axis: a.int_or("axis", 0)?,
                keepdims: a.int_or("keepdims", 1)? != 0,
                last: a.int_or("select_last_index", 0)? != 0,
                min: op == "ArgMin",
            },
            "TopK" if opset < 10 => return Err(a.unsupported("TopK before opset 10 (k as an attribute)")),
            "TopK" => Op::TopK { axis: a.int_or("axis", -1)?, largest: a.int_or("largest", 1)? != 0 },
            "CumSum" => Op::CumSum { exclusive: a.int_or("exclusive", 0)? != 0, reverse: a.int_or("reverse", 0)? != 0 },
            "Trilu" => Op::Trilu { upper: a.int_or("upper", 1)? != 0 },
            "ScatterND" => Op::ScatterNd(match a.string("reduction")?.as_deref() {
                None | Some("none") => Combine::Replace,
                Some("add") => Combine::Add,
                Some("mul") => Combine::Mul,
                Some("max") => Combine::Max,
                Some("min") => Combine::Min,
                Some(other) => return Err(a.unsupported(format!("reduction=\"{other}\""))),
            }),
            "Split" => {
                let sizes = if opset < 13 { a.ints("split")? } else { None };
                Op::Split { axis: a.int_or("axis", 0)?, sizes }
            }
            "Gemm" => Op::Gemm {
                alpha: a.float("alpha")?.unwrap_or(1.0),
                beta: a.float("beta")?.unwrap_or(1.0),
                trans_a: a.int_or("transA", 0)? != 0,
                trans_b: a.int_or("transB", 0)? != 0,
            },
            "Tile" => Op::Tile,
            "Expand" => Op::Expand,
            "RMSNormalization" | "SimplifiedLayerNormalization" => {
                Op::RmsNorm { eps: a.float("epsilon")?.unwrap_or(1e-5), axis: a.int_or("axis", -1)? }
            }
            "LayerNormalization" => {
                Op::LayerNorm { eps: a.float("epsilon")?.unwrap_or(1e-5), axis: a.int_or("axis", -1)? }
            }
            "RotaryEmbedding" => {
                a.require("interleaved", 0, "interleaved rotary is not supported")?;
                a.require("rotary_embedding_dim", 0, "partial rotary is not supported")?;
                if node.inputs.get(3).is_none_or(|n| n.is_empty()) {
                    return Err(a.unsupported("RotaryEmbedding without position_ids is not supported"));
                }
                let layout = if a.int("num_heads")?.is_some() { Layout::SeqFirst } else { Layout::HeadsFirst };
                // ONNX order is (x, cos, sin, positions); normalize to
                // (x, positions, cos, sin) as com.microsoft has it.
                return Ok((Op::Rotary { layout, cached: true, spec_layout: true }, vec![0, 3, 1, 2]));
            }
            "Attention" => {
                if a.float("softcap")?.is_some_and(|s| s != 0.0) {
                    return Err(a.unsupported("softcap is not supported"));
                }
                a.require("qk_matmul_output_mode", 0, "qk matmul outputs are not supported")?;
                a.input_absent(6, "nonpad_kv_seqlen")?;
                if node.outputs.get(3).is_some_and(|n| !n.is_empty()) {
                    return Err(a.unsupported("the qk_matmul_output output is not supported"));
                }
                let has_mask = node.inputs.get(3).is_some_and(|n| !n.is_empty());
                let causal = a.int_or("is_causal", 0)? != 0;
                let bias = match (has_mask, causal) {
                    (true, false) => Bias::PerQuery,
                    (false, true) => Bias::Causal,
                    (true, true) => return Err(a.unsupported("is_causal together with attn_mask is not supported")),
                    (false, false) => {
                        return Err(a.unsupported("attention without a mask or is_causal would see future tokens"))
                    }
                };
                // Head counts as GroupQueryAttention's are bounded: a
                // negative one cast to usize wrapped the products the
                // kernels size their buffers by.
                let count = |name: &str| -> Result<Option<usize>, CompileError> {
                    match a.int(name)? {
                        Some(h) if h <= 0 || h > i64::from(u32::MAX) => {
                            Err(a.err(format!("{name} {h} must be positive (at most {})", u32::MAX)))
                        }
                        h => Ok(h.map(|h| h as usize)),
                    }
                };
                let heads = count("q_num_heads")?;
                let layout = if heads.is_some() { Layout::SeqFirst } else { Layout::HeadsFirst };
                Op::Attention {
                    spec: PartialAttention {
                        heads,
                        kv_heads: count("kv_num_heads")?,
                        scale: a.float("scale")?,
                        q_layout: layout,
                        kv_layout: layout,
                        out_layout: layout,
                        bias,
                        packed_qkv: false,
                        rotary: false,
                        resolved: None,
                    },
                    layer: None,
                }
            }
            _ => return Err(a.no_kernel()),
        },
        (MS_DOMAIN, op) => match op {
            "SimplifiedLayerNormalization" => {
                Op::RmsNorm { eps: a.float("epsilon")?.unwrap_or(1e-5), axis: a.int_or("axis", -1)? }
            }
            // ONNX Runtime's default for its skip norms (`kDefaultSkipLayerNormEpsilon`), not the 1e-5 of
            // the plain ones: a node without the attribute normalized small activations by another scale.
            "SkipSimplifiedLayerNormalization" => Op::SkipRmsNorm { eps: a.float("epsilon")?.unwrap_or(1e-12) },
            "RotaryEmbedding" => {
                a.require("interleaved", 0, "interleaved rotary is not supported")?;
                a.require("rotary_embedding_dim", 0, "partial rotary is not supported")?;
                a.require("is_packed_batching", 0, "packed batching is not supported")?;
                if a.float("scale")?.is_some_and(|s| s != 1.0) {
                    return Err(a.unsupported("scale != 1 is not supported"));
                }
                Op::Rotary { layout: Layout::SeqFirst, cached: true, spec_layout: true }
            }
            "GroupQueryAttention" => {
                a.require("local_window_size", -1, "sliding-window attention is not supported")?;
                a.require("smooth_softmax", 0, "smooth softmax is not supported")?;
                a.require("rotary_interleaved", 0, "interleaved rotary is not supported")?;
                if a.float("softcap")?.is_some_and(|s| s != 0.0) {
                    return Err(a.unsupported("softcap is not supported"));
                }
                let filled = |i: usize| node.inputs.get(i).is_some_and(|n| !n.is_empty());
                let packed_qkv = !filled(1);
                if packed_qkv == filled(2) {
                    return Err(a.unsupported("key without value (or value without key) is not supported"));
                }
                let rotary = match a.int_or("do_rotary", 0)? {
                    0 => false,
                    1 if filled(7) && filled(8) => true,
                    1 => return Err(a.err("do_rotary=1 needs the cos_cache and sin_cache inputs (7 and 8)")),
                    v => return Err(a.err(format!("do_rotary={v}: expected 0 or 1"))),
                };
                for (i, what) in [(9, "position_ids"), (10, "attention_bias"), (11, "head_sink")] {
                    a.input_absent(i, what)?;
                }
                if node.inputs.len() > 12 {
                    return Err(a.unsupported("quantized KV scales and Q/K norm inputs (12 and up) are not supported"));
                }
                let heads = a.int("num_heads")?.ok_or_else(|| a.err("missing attribute `num_heads`"))?;
                let kv_heads = a.int("kv_num_heads")?.ok_or_else(|| a.err("missing attribute `kv_num_heads`"))?;
                if heads <= 0 || kv_heads <= 0 || heads > u32::MAX as i64 || kv_heads > u32::MAX as i64 {
                    return Err(a.err(format!("num_heads {heads} and kv_num_heads {kv_heads} must be positive")));
                }
                let scale = a.float("scale")?.filter(|s| *s != 0.0);
                // Inputs 5 and 6 (seqlens_k, total_sequence_length) describe
                // batch padding and, with rotary inside, positions; a native
                // sequence is batch 1 and its cache knows its own length, so
                // they are not read.
                let mut used = vec![0, 1, 2, ABSENT, 3, 4];
                if rotary {
                    used.extend([7, 8]);
                }
                let spec = PartialAttention {
                    heads: Some(heads as usize),
                    kv_heads: Some(kv_heads as usize),
                    scale,
                    q_layout: Layout::SeqFirst,
                    kv_layout: Layout::SeqFirst,
                    out_layout: Layout::SeqFirst,
                    bias: Bias::Causal,
                    packed_qkv,
                    rotary,
                    resolved: None,
                };
                return Ok((Op::Attention { spec, layer: None }, used));
            }
            "GatherBlockQuantized" => {
                let bits = a.int_or("bits", 4)?;
                if bits != 4 {
                    return Err(a.unsupported(format!("bits={bits}: only 4-bit blocks are supported")));
                }
                a.require("gather_axis", 0, "only rows (axis 0) are gathered")?;
                a.require("quantize_axis", 1, "only blocks along the row (axis 1) are supported")?;
                let block = a.int("block_size")?.ok_or_else(|| a.err("missing attribute `block_size`"))?;
                if !onnx_runtime_block(block) {
                    return Err(a.err(format!("block_size={block} must be a power of two, at least 16")));
                }
                Op::GatherQ4 { block: block as usize }
            }
            "MatMulNBits" => {
                let bits = a.int_or("bits", 4)?;
                if bits != 4 {
                    return Err(a.unsupported(format!("bits={bits}: only 4-bit blocks are supported")));
                }
                a.input_absent(4, "g_idx")?;
                let k = a.int("K")?.ok_or_else(|| a.err("missing attribute `K`"))?;
                let n = a.int("N")?.ok_or_else(|| a.err("missing attribute `N`"))?;
                let block = a.int("block_size")?.ok_or_else(|| a.err("missing attribute `block_size`"))?;
                // (ONNX Runtime's rule, as GatherBlockQuantized's: a block
                // of 48 passed as even, and the int8-input path, which
                // takes blocks a multiple of 32, read other blocks' scales.)
                if k <= 0 || n <= 0 || !onnx_runtime_block(block) {
                    return Err(
                        a.err(format!("invalid K={k}, N={n}, block_size={block} (a power of two, at least 16)"))
                    );
                }
                let accuracy_level = match a.int_or("accuracy_level", 0)? {
                    level @ 0..=4 => level as u8,
                    other => return Err(a.err(format!("accuracy_level={other}: expected 0 to 4"))),
                };
                Op::MatMulNBits { k: k as usize, n: n as usize, block: block as usize, accuracy_level }
            }
            _ => return Err(a.no_kernel()),
        },
        _ => return Err(a.no_kernel()),
    };
    Ok((op, all))
}

/// A 4-bit block size ONNX Runtime's contrib ops take: a power of two, at
/// least 16 (`MatMulNBits` and `GatherBlockQuantized` alike).
fn onnx_runtime_block(block: i64) -> bool {
    block >= 16 && (block & (block - 1)) == 0
}
