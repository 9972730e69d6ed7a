//! The operations of a compiled graph: standard ONNX ops the decomposed
//! export uses, the fused forms the compiler makes, and the opset-23 and
//! com.microsoft ops real packages use.

use std::sync::Arc;

use crate::kernels::attention::AttentionSpec;
use crate::kernels::attention::Layout;
use crate::kernels::elementwise::{BinOp, CmpOp, LogicOp, UnOp};
use crate::kernels::math::Reduce;
use crate::kernels::weights::Weight;
use crate::value::{DType, Value};

#[derive(Clone, Debug)]
pub enum Op {
    Binary(BinOp),
    Compare(CmpOp),
    Logic(LogicOp),
    Unary(UnOp),
    Where,
    Cast(DType),
    Identity,
    MatMul,
    Gather {
        axis: i64,
    },
    /// Dims `start..end` of the input's shape (ONNX clamping).
    Shape {
        start: i64,
        end: Option<i64>,
    },
    Range,
    ConstantOfShape(Value),
    /// Axes from the attribute (opset < 13) or, when `None`, the second input.
    Unsqueeze(Option<Vec<i64>>),
    Squeeze(Option<Vec<i64>>),
    Reshape,
    Transpose(Option<Vec<i64>>),
    Slice,
    Concat {
        axis: i64,
    },
    /// Along one axis (opset 13 semantics); `log` for LogSoftmax.
    Softmax {
        axis: i64,
        log: bool,
    },
    Reduce {
        kind: Reduce,
        axes: Option<Vec<i64>>,
        keepdims: bool,
        /// Empty axes leave the input as it is (`noop_with_empty_axes`)
        /// instead of reducing everything.
        noop_empty: bool,
    },
    Tile,
    Expand,
    /// Bounds from attributes (before opset 11) or inputs 1 and 2.
    Clip {
        attrs: Option<(f32, f32)>,
    },
    Flatten {
        axis: i64,
    },
    /// ArgMax, or ArgMin with `min`.
    ArgExtreme {
        axis: i64,
        keepdims: bool,
        last: bool,
        min: bool,
    },
    /// Inputs `x, k`; outputs `values, indices`.
    TopK {
        axis: i64,
        largest: bool,
    },
    /// Inputs `x, axis`.
    CumSum {
        exclusive: bool,
        reverse: bool,
    },
    /// Inputs `x[, k]`.
    Trilu {
        upper: bool,
    },
    ScatterNd(crate::kernels::select::Combine),
    /// Sizes from the attribute (before opset 13) or input 1, else `parts`
    /// even pieces (one per output).
    Split {
        axis: i64,
        sizes: Option<Vec<i64>>,
    },
    /// Two or more operands folded left to right (`mean` divides by the
    /// count): ONNX Sum, Mean, and Max/Min of other than two inputs.
    Nary {
        op: crate::kernels::elementwise::BinOp,
        mean: bool,
    },
    /// Cast to the element type of input 1.
    CastLike,
    /// The element count, an i64 scalar.
    Size,
    GatherElements {
        axis: i64,
    },
    Hardmax {
        axis: i64,
    },
    Einsum(String),
    Activation(crate::kernels::elementwise::Activation),
    /// IsNaN (`nan`), or IsInf for the signs set.
    Classify {
        nan: bool,
        positive: bool,
        negative: bool,
    },
    Gemm {
        alpha: f32,
        beta: f32,
        trans_a: bool,
        trans_b: bool,
    },
    /// `x / rms(x) * scale` over the axes from `axis` on (-1: the last;
    /// fused, ONNX RMSNormalization, com.microsoft
    /// SimplifiedLayerNormalization).
    RmsNorm {
        eps: f32,
        axis: i64,
    },
    /// Inputs `input, skip, gamma[, bias]`; outputs `normed, (mean), (inv_std),
    /// sum` (com.microsoft SkipSimplifiedLayerNormalization).
    SkipRmsNorm {
        eps: f32,
    },
    /// Inputs `x, gamma[, beta]`, normalized over the axes from `axis` on;
    /// outputs `y[, mean, inv_std]`.
    LayerNorm {
        eps: f32,
        axis: i64,
    },
    /// `x @ W + b` with a packed constant weight.
    Linear {
        weight: Arc<Weight>,
        bias: Option<Arc<Vec<f32>>>,
    },
    /// Sibling projections of one input (a layer's Q, K and V) as one:
    /// `x @ W` over their stacked bias-free weights, its columns split into
    /// one output per member, `widths[i]` wide, in member order. A decode
    /// step then streams the three in one pass over the threads instead of
    /// three (each output's arithmetic is its member's own).
    SplitLinear {
        weight: Arc<Weight>,
        widths: Vec<usize>,
    },
    /// `silu(x Wg) * (x Wu)`; the weight stacks gate over up rows.
    GatedMlp {
        weight: Arc<Weight>,
    },
    /// com.microsoft GatherBlockQuantized (4-bit): inputs `data, indices,
    /// scales[, zero_points]`.
    GatherQ4 {
        block: usize,
    },
    /// com.microsoft MatMulNBits before its constants are packed.
    MatMulNBits {
        k: usize,
        n: usize,
        block: usize,
        /// 0–4; 4 means int8 inputs (see `kernels::linear_int8`).
        accuracy_level: u8,
    },
    /// Inputs `x, cos, sin` (gathered tables) or, with `cached`,
    /// `x, position_ids, cos_cache, sin_cache`. With `spec_layout` (a
    /// `RotaryEmbedding` node as ONNX and ONNX Runtime define it), a 4-D
    /// input is `[batch, heads, seq, head_dim]` whatever `layout` says (it
    /// then only describes a 3-D `[batch, seq, hidden]` input); the
    /// attention fusion's rewrite sets its own layout for any rank.
    Rotary {
        layout: Layout,
        cached: bool,
        spec_layout: bool,
    },
    /// Inputs `attention_mask, token_ids`: the additive causal + padding bias
    /// `[1, 1, reps * seq, total]` (0 where a query may attend, `closed`
    /// elsewhere), query rows repeated `reps` times for grouped attention.
    CausalBias {
        closed: f32,
        reps: usize,
    },
    /// Inputs `q, k, v[, bias][, past_key, past_value][, cos_cache,
    /// sin_cache]`; outputs `y[, present_key, present_value]`. Until the KV
    /// binding pass, `layer` is `None` and the past/present tensors are
    /// still graph edges; binding removes them.
    Attention {
        spec: PartialAttention,
        layer: Option<usize>,
    },
}

/// An attention as read from the graph: head counts may come from the node,
/// the rest from the KV binding.
#[derive(Clone, Debug)]
pub struct PartialAttention {
    pub heads: Option<usize>,
    pub kv_heads: Option<usize>,
    pub scale: Option<f32>,
    pub q_layout: Layout,
    pub kv_layout: Layout,
    pub out_layout: Layout,
    pub bias: crate::kernels::attention::Bias,
    /// Q, K and V arrive as one `[batch, seq, (heads + 2 * kv_heads) *
    /// head_dim]` projection (com.microsoft `GroupQueryAttention` with
    /// empty key and value inputs).
    pub packed_qkv: bool,
    /// Rotary is applied to Q and K inside the op, from cos/sin caches at
    /// the positions after the cached past (`do_rotary`); the caches are the
    /// op's last two inputs.
    pub rotary: bool,
    /// Set by the binding pass.
    pub resolved: Option<AttentionSpec>,
}

impl Op {
    /// The packed weight of a projection step (`Linear`, `SplitLinear`,
    /// `GatedMlp`).
    pub fn projection_weight(&self) -> Option<&Arc<Weight>> {
        match self {
            Op::Linear { weight, .. } | Op::SplitLinear { weight, .. } | Op::GatedMlp { weight } => Some(weight),
            _ => None,
        }
    }

    /// The widths of a projection step's outputs, in output order: a split
    /// projection's members, a gated MLP's half of its stacked rows, a
    /// linear's rows; none for other ops.
    pub fn projection_widths(&self) -> smallvec::SmallVec<[usize; crate::kernels::linear::MAX_STACKED]> {
        match self {
            Op::Linear { weight, .. } => smallvec::smallvec![weight.n],
            Op::SplitLinear { widths, .. } => widths.iter().copied().collect(),
            Op::GatedMlp { weight } => smallvec::smallvec![weight.n / 2],
            _ => smallvec::SmallVec::new(),
        }
    }

    /// [`Op::projection_weight`], to replace or repack it.
    pub fn projection_weight_mut(&mut self) -> Option<&mut Arc<Weight>> {
        match self {
            Op::Linear { weight, .. } | Op::SplitLinear { weight, .. } | Op::GatedMlp { weight } => Some(weight),
            _ => None,
        }
    }

    /// A short name for plans and errors.
    pub fn name(&self) -> String {
        match self {
            Op::Binary(b) => format!("{b:?}"),
            Op::Compare(c) => format!("{c:?}"),
            Op::Logic(l) => format!("{l:?}"),
            Op::Unary(u) => format!("{u:?}"),
            Op::Cast(t) => format!("Cast({t})"),
            Op::Gather { .. } => "Gather".into(),
            Op::Shape { .. } => "Shape".into(),
            Op::ConstantOfShape(_) => "ConstantOfShape".into(),
            Op::Unsqueeze(_) => "Unsqueeze".into(),
            Op::Squeeze(_) => "Squeeze".into(),
            Op::Transpose(_) => "Transpose".into(),
            Op::Concat { .. } => "Concat".into(),
            Op::Softmax { log: false, .. } => "Softmax".into(),
            Op::Softmax { log: true, .. } => "LogSoftmax".into(),
            Op::Reduce { kind, .. } => format!("Reduce{kind:?}"),
            Op::RmsNorm { .. } => "RmsNorm".into(),
            Op::SkipRmsNorm { .. } => "SkipRmsNorm".into(),
            Op::LayerNorm { .. } => "LayerNorm".into(),
            Op::Linear { weight, bias } => {
                format!("Linear[{}{}]", weight.label(), if bias.is_some() { "+bias" } else { "" })
            }
            Op::SplitLinear { weight, .. } => format!("SplitLinear[{}]", weight.label()),
            Op::GatedMlp { .. } => "GatedMlp".into(),
            Op::MatMulNBits { .. } => "MatMulNBits".into(),
            Op::GatherQ4 { .. } => "GatherQ4".into(),
            Op::Rotary { .. } => "Rotary".into(),
            Op::Attention { .. } => "Attention".into(),
            Op::CausalBias { .. } => "CausalBias".into(),
            other => format!("{other:?}"),
        }
    }

    /// Whether constant inputs may be evaluated at compile time.
    pub fn foldable(&self) -> bool {
        !matches!(
            self,
            Op::Attention { .. }
                | Op::Linear { .. }
                | Op::SplitLinear { .. }
                | Op::GatedMlp { .. }
                | Op::MatMulNBits { .. }
        )
    }
}
