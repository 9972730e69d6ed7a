//! The pieces whose ONNX form depends on the export variant: normalization,
//! rotary embedding, attention with the KV cache, and quantized projections.

use onnx_genai_onnx::builder::{attr_float, attr_int, attr_ints};
use onnx_genai_onnx::{DataType, Tensor};

use super::{names, Decoder, Variant, WeightValues, MS_DOMAIN, NBITS_BLOCK};

fn cast(d: &mut Decoder, x: &str, to: DataType) -> String {
    d.b.op_with("Cast", &[x], vec![attr_int("to", to.onnx_code().into())])
}

/// `x * w / sqrt(mean(x^2) + eps)` over the last axis.
pub fn rms_norm(d: &mut Decoder, x: &str, weight_name: &str) -> String {
    let w = d.weight(weight_name, &[d.spec.hidden_size], 0.1, 1.0);
    let eps = d.spec.norm_epsilon as f32;
    match d.variant {
        Variant::Decomposed => {
            let sq = d.b.op("Mul", &[x, x]);
            let mean = d.b.op_with("ReduceMean", &[&sq], vec![attr_ints("axes", &[-1]), attr_int("keepdims", 1)]);
            let eps = d.b.scalar_f32(eps);
            let var = d.b.op("Add", &[&mean, &eps]);
            let rms = d.b.op("Sqrt", &[&var]);
            let normed = d.b.op("Div", &[x, &rms]);
            d.b.op("Mul", &[&normed, &w])
        }
        Variant::Opset23 => {
            d.b.op_with("RMSNormalization", &[x, &w], vec![attr_int("axis", -1), attr_float("epsilon", eps)])
        }
        Variant::Contrib | Variant::Genai => {
            let out = d.b.fresh("SimplifiedLayerNormalization");
            let attrs = vec![attr_int("axis", -1), attr_float("epsilon", eps)];
            d.b.node_in("", "SimplifiedLayerNormalization", &[x, &w], &[&out], attrs);
            out
        }
    }
}

/// The residual add followed by the next RMSNorm: returns `(x + delta,
/// rms_norm(x + delta))`. Contrib fuses both into
/// `SkipSimplifiedLayerNormalization`.
pub fn residual_rms_norm(d: &mut Decoder, x: &str, delta: &str, weight_name: &str) -> (String, String) {
    if !d.variant.contrib_ops() {
        let sum = d.b.op("Add", &[x, delta]);
        let normed = rms_norm(d, &sum, weight_name);
        return (sum, normed);
    }
    let w = d.weight(weight_name, &[d.spec.hidden_size], 0.1, 1.0);
    let (normed, sum) = (d.b.fresh("SkipSimplifiedLayerNormalization"), d.b.fresh("SkipSum"));
    let attrs = vec![attr_float("epsilon", d.spec.norm_epsilon as f32)];
    d.b.node_in(MS_DOMAIN, "SkipSimplifiedLayerNormalization", &[x, delta, &w], &[&normed, "", "", &sum], attrs);
    (sum, normed)
}

/// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last axis.
pub fn layer_norm(d: &mut Decoder, x: &str, prefix: &str) -> String {
    let h = d.spec.hidden_size;
    let gamma = d.weight(&format!("{prefix}.weight"), &[h], 0.1, 1.0);
    let beta = d.weight(&format!("{prefix}.bias"), &[h], 0.1, 0.0);
    let eps = d.spec.norm_epsilon as f32;
    if d.variant != Variant::Decomposed {
        return d.b.op_with(
            "LayerNormalization",
            &[x, &gamma, &beta],
            vec![attr_int("axis", -1), attr_float("epsilon", eps)],
        );
    }
    let mean = d.b.op_with("ReduceMean", &[x], vec![attr_ints("axes", &[-1]), attr_int("keepdims", 1)]);
    let centered = d.b.op("Sub", &[x, &mean]);
    let sq = d.b.op("Mul", &[&centered, &centered]);
    let var = d.b.op_with("ReduceMean", &[&sq], vec![attr_ints("axes", &[-1]), attr_int("keepdims", 1)]);
    let eps = d.b.scalar_f32(eps);
    let var = d.b.op("Add", &[&var, &eps]);
    let std = d.b.op("Sqrt", &[&var]);
    let normed = d.b.op("Div", &[&centered, &std]);
    let scaled = d.b.op("Mul", &[&normed, &gamma]);
    d.b.op("Add", &[&scaled, &beta])
}

/// Rotary angle tables, computed in f64 (HF rotate-half layout).
pub struct Rotary {
    /// Decomposed: `[batch, 1, seq, head_dim]` gathered by position.
    /// Fused forms: the `[max_positions, head_dim / 2]` caches.
    pub cos: String,
    pub sin: String,
}

pub fn rotary_tables(d: &mut Decoder) -> Rotary {
    let spec = d.spec;
    let hd = spec.head_dim() as usize;
    let half = hd / 2;
    let theta = spec.rope_theta.unwrap_or(10_000.0);
    let max = spec.max_sequence_length as usize;
    let (mut cos, mut sin) = (Vec::with_capacity(max * half), Vec::with_capacity(max * half));
    for pos in 0..max {
        for i in 0..half {
            let angle = pos as f64 / theta.powf((2 * i) as f64 / hd as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    d.b.set_scope("/rotary");
    if d.variant != Variant::Decomposed {
        let dims = vec![max as i64, half as i64];
        return Rotary {
            cos: d.table("rotary.cos_cache", dims.clone(), &cos),
            sin: d.table("rotary.sin_cache", dims, &sin),
        };
    }
    // The decomposed form repeats the half-width table over both halves.
    let full =
        |t: &[f32]| -> Vec<f32> { t.chunks_exact(half).flat_map(|r| r.iter().chain(r.iter()).copied()).collect() };
    let dims = vec![max as i64, hd as i64];
    let cos_t = d.table("rotary.cos", dims.clone(), &full(&cos));
    let sin_t = d.table("rotary.sin", dims, &full(&sin));
    let axis = d.b.const_i64(&[1]);
    let mut by_position = |table: &str| {
        let g = d.b.op_with("Gather", &[table, names::POSITION_IDS], vec![attr_int("axis", 0)]);
        d.b.op("Unsqueeze", &[&g, &axis])
    };
    let (cos, sin) = (by_position(&cos_t), by_position(&sin_t));
    Rotary { cos, sin }
}

/// Rotates `x`: heads-first `[b, heads, s, d]` for decomposed and opset 23,
/// `[b, s, heads*d]` for contrib.
pub fn rotate(d: &mut Decoder, x: &str, r: &Rotary, heads: u32) -> String {
    match d.variant {
        Variant::Decomposed => {
            let hd = i64::from(d.spec.head_dim());
            let axis = d.b.const_i64(&[3]);
            let (s0, mid, end) = (d.b.const_i64(&[0]), d.b.const_i64(&[hd / 2]), d.b.const_i64(&[hd]));
            let first = d.b.op("Slice", &[x, &s0, &mid, &axis]);
            let second = d.b.op("Slice", &[x, &mid, &end, &axis]);
            let neg = d.b.op("Neg", &[&second]);
            let rotated = d.b.op_with("Concat", &[&neg, &first], vec![attr_int("axis", 3)]);
            let a = d.b.op("Mul", &[x, &r.cos]);
            let b = d.b.op("Mul", &[&rotated, &r.sin]);
            d.b.op("Add", &[&a, &b])
        }
        Variant::Opset23 => {
            d.b.op_with("RotaryEmbedding", &[x, &r.cos, &r.sin, names::POSITION_IDS], vec![attr_int("interleaved", 0)])
        }
        Variant::Contrib | Variant::Genai => {
            let out = d.b.fresh("RotaryEmbedding");
            let attrs = vec![attr_int("interleaved", 0), attr_int("num_heads", heads.into())];
            d.b.node_in(MS_DOMAIN, "RotaryEmbedding", &[x, names::POSITION_IDS, &r.cos, &r.sin], &[&out], attrs);
            out
        }
    }
}

/// Causal self-attention over the KV cache with GQA head sharing. `q`, `k`,
/// `v` are the projections `[b, s, heads*d]` (f32); `rotary` is applied to
/// `q` and `k` when given. Appends to the layer's past KV, writes the
/// presents, and returns `[b, s, heads*d]`.
pub fn self_attention(d: &mut Decoder, layer: u32, q: &str, k: &str, v: &str, rotary: Option<&Rotary>) -> String {
    let spec = d.spec;
    let (heads, kv_heads) = (spec.num_attention_heads, spec.kv_heads());
    match d.variant {
        Variant::Decomposed | Variant::Opset23 => {
            let (mut qh, mut kh) = (d.split_heads(q, heads), d.split_heads(k, kv_heads));
            let vh = d.split_heads(v, kv_heads);
            if let Some(r) = rotary {
                qh = rotate(d, &qh, r, heads);
                kh = rotate(d, &kh, r, kv_heads);
            }
            let ctx = if d.variant == Variant::Decomposed {
                decomposed_attention(d, layer, &qh, &kh, &vh)
            } else {
                onnx_attention(d, layer, &qh, &kh, &vh)
            };
            d.merge_heads(&ctx)
        }
        Variant::Contrib | Variant::Genai => {
            let (q, k) = match rotary {
                Some(r) => (rotate(d, q, r, heads), rotate(d, k, r, kv_heads)),
                None => (q.to_string(), k.to_string()),
            };
            group_query_attention(d, layer, &q, &k, v)
        }
    }
}

pub(super) fn present_names(layer: u32) -> (String, String, String, String) {
    (
        names::layer(names::PAST_KEY, layer),
        names::layer(names::PAST_VALUE, layer),
        names::layer(names::PRESENT_KEY, layer),
        names::layer(names::PRESENT_VALUE, layer),
    )
}

/// Basic ops: `Concat` onto the past, `softmax(q k^T * scale + bias) v`.
/// For GQA the query heads are grouped per KV head by a reshape rather than
/// repeating K/V.
fn decomposed_attention(d: &mut Decoder, layer: u32, q: &str, k: &str, v: &str) -> String {
    let spec = d.spec;
    let (heads, kv_heads, hd) = (spec.num_attention_heads, spec.kv_heads(), spec.head_dim());
    let kv_dtype = spec.dtype.onnx();
    let (past_k, past_v, present_k, present_v) = present_names(layer);
    let mut cached = Vec::new();
    for (new, past, present) in [(k, &past_k, &present_k), (v, &past_v, &present_v)] {
        let stored = if kv_dtype == DataType::Float { new.to_string() } else { cast(d, new, kv_dtype) };
        d.b.op_into("Concat", &[past, &stored], &[present], vec![attr_int("axis", 2)]);
        cached.push(if kv_dtype == DataType::Float { present.clone() } else { cast(d, present, DataType::Float) });
    }
    let n_rep = heads / kv_heads;
    let scale = d.b.scalar_f32(1.0 / (hd as f32).sqrt());
    let q = d.b.op("Mul", &[q, &scale]);
    let grouped_shape = d.b.const_i64(&[0, kv_heads.into(), -1, hd.into()]);
    let q = if n_rep > 1 { d.b.op("Reshape", &[&q, &grouped_shape]) } else { q };
    let kt = d.b.op_with("Transpose", &[&cached[0]], vec![attr_ints("perm", &[0, 1, 3, 2])]);
    let scores = d.b.op("MatMul", &[&q, &kt]);
    let mask = d.mask_bias();
    let scores = d.b.op("Add", &[&scores, &mask]);
    let probs = d.b.op_with("Softmax", &[&scores], vec![attr_int("axis", -1)]);
    let ctx = d.b.op("MatMul", &[&probs, &cached[1]]);
    if n_rep > 1 {
        let heads_shape = d.b.const_i64(&[0, heads.into(), -1, hd.into()]);
        d.b.op("Reshape", &[&ctx, &heads_shape])
    } else {
        ctx
    }
}

/// ONNX opset 23 `Attention` on heads-first tensors with an additive mask;
/// for an f16 cache Q, K, V and the mask are cast to f16 (the op keeps Q, K
/// and the past in one type).
fn onnx_attention(d: &mut Decoder, layer: u32, q: &str, k: &str, v: &str) -> String {
    let (past_k, past_v, present_k, present_v) = present_names(layer);
    let mask = d.mask_bias();
    let kv_dtype = d.spec.dtype.onnx();
    let half = kv_dtype != DataType::Float;
    let to_kv = |d: &mut Decoder, x: &str| if half { cast(d, x, kv_dtype) } else { x.to_string() };
    let (q, k, v, mask) = (to_kv(d, q), to_kv(d, k), to_kv(d, v), to_kv(d, &mask));
    let y = d.b.fresh("Attention");
    let attrs = vec![attr_float("scale", 1.0 / (d.spec.head_dim() as f32).sqrt())];
    d.b.node_in("", "Attention", &[&q, &k, &v, &mask, &past_k, &past_v], &[&y, &present_k, &present_v], attrs);
    if half {
        cast(d, &y, DataType::Float)
    } else {
        y
    }
}

/// com.microsoft `GroupQueryAttention`: causal by construction; sequence
/// lengths come from the attention mask.
fn group_query_attention(d: &mut Decoder, layer: u32, q: &str, k: &str, v: &str) -> String {
    let spec = d.spec;
    let (past_k, past_v, present_k, present_v) = present_names(layer);
    let (seqlens, total) = gqa_lengths(d);
    let kv_dtype = super::io_dtype(spec, d.variant).onnx();
    let half = kv_dtype != DataType::Float;
    let to_kv = |d: &mut Decoder, x: &str| if half { cast(d, x, kv_dtype) } else { x.to_string() };
    let (q, k, v) = (to_kv(d, q), to_kv(d, k), to_kv(d, v));
    let out = d.b.fresh("GroupQueryAttention");
    let attrs = vec![
        attr_int("num_heads", spec.num_attention_heads.into()),
        attr_int("kv_num_heads", spec.kv_heads().into()),
        attr_float("scale", 1.0 / (spec.head_dim() as f32).sqrt()),
    ];
    d.b.node_in(
        MS_DOMAIN,
        "GroupQueryAttention",
        &[&q, &k, &v, &past_k, &past_v, &seqlens, &total],
        &[&out, &present_k, &present_v],
        attrs,
    );
    if half {
        cast(d, &out, DataType::Float)
    } else {
        out
    }
}

/// `seqlens_k = sum(mask) - 1` (int32 `[batch]`) and `total_sequence_length`
/// (int32 scalar), shared by every layer.
pub(super) fn gqa_lengths(d: &mut Decoder) -> (String, String) {
    let scope = "/gqa_lengths";
    let seqlens = format!("{scope}/seqlens_k");
    let total = format!("{scope}/total_sequence_length");
    if d.b.has_value(&seqlens) {
        return (seqlens, total);
    }
    let one = d.b.const_i64(&[1]);
    let sum = d.b.op_with("ReduceSum", &[names::ATTENTION_MASK, &one], vec![attr_int("keepdims", 0)]);
    let one_s = d.b.scalar_i64(1);
    let minus = d.b.op("Sub", &[&sum, &one_s]);
    d.b.op_into("Cast", &[&minus], &[&seqlens], vec![attr_int("to", DataType::Int32.onnx_code().into())]);
    let shape = d.b.op("Shape", &[names::ATTENTION_MASK]);
    let idx = d.b.scalar_i64(1);
    let t = d.b.op_with("Gather", &[&shape, &idx], vec![attr_int("axis", 0)]);
    d.b.op_into("Cast", &[&t], &[&total], vec![attr_int("to", DataType::Int32.onnx_code().into())]);
    (seqlens, total)
}

/// The additive attention bias; see [`Decoder::mask_bias`].
pub fn causal_mask_bias(d: &mut Decoder) -> String {
    let spec = d.spec;
    let seq_source = if d.embeds_input { names::INPUTS_EMBEDS } else { names::INPUT_IDS };
    let b = &mut d.b;
    b.set_scope("/mask");
    let ids_shape = b.op("Shape", &[seq_source]);
    let mask_shape = b.op("Shape", &[names::ATTENTION_MASK]);
    let one_idx = b.scalar_i64(1);
    let seq = b.op_with("Gather", &[&ids_shape, &one_idx], vec![attr_int("axis", 0)]);
    let total = b.op_with("Gather", &[&mask_shape, &one_idx], vec![attr_int("axis", 0)]);
    let past = b.op("Sub", &[&total, &seq]);
    let zero = b.scalar_i64(0);
    let step = b.scalar_i64(1);
    let q_pos = b.op("Range", &[&past, &total, &step]);
    let k_pos = b.op("Range", &[&zero, &total, &step]);
    let ax0 = b.const_i64(&[0]);
    let ax1 = b.const_i64(&[1]);
    let k_row = b.op("Unsqueeze", &[&k_pos, &ax0]);
    let q_col = b.op("Unsqueeze", &[&q_pos, &ax1]);
    let causal = b.op("LessOrEqual", &[&k_row, &q_col]);
    let ax12 = b.const_i64(&[1, 2]);
    let pad = b.op("Unsqueeze", &[names::ATTENTION_MASK, &ax12]);
    let pad = b.op_with("Cast", &[&pad], vec![attr_int("to", DataType::Bool.onnx_code().into())]);
    let allowed = b.op("And", &[&causal, &pad]);
    let open = b.scalar_f32(0.0);
    let closed = b.scalar_f32(-1e9);
    let bias = b.op("Where", &[&allowed, &open, &closed]);
    let n_rep = spec.num_attention_heads / spec.kv_heads();
    let bias = if n_rep > 1 && d.variant == Variant::Decomposed {
        let reps = d.b.const_i64(&[1, 1, n_rep.into(), 1]);
        d.b.op("Tile", &[&bias, &reps])
    } else {
        bias
    };
    d.b.set_scope("");
    bias
}

/// 4-bit blocks of a `[K, N]` weight in `MatMulNBits` order: per output
/// column, `blocks` blocks of [`NBITS_BLOCK`] along K, low nibble first.
pub(crate) struct Q4 {
    pub packed: Vec<u8>,
    pub scales: Vec<f32>,
    /// Asymmetric blocks: one zero point per block, two per byte (`[N,
    /// ceil(blocks / 2)]`); symmetric ones use the op's default, 8.
    pub zeros: Option<Vec<u8>>,
    pub blocks: usize,
}

/// Quantizes `w` (`[K, N]` values). Symmetric: scale `max|w| / 7`, stored
/// as `q + 8`. Asymmetric: the block's range (widened to hold 0) over 15
/// steps, with the zero point that puts 0 on a step.
pub(crate) fn quantize_q4(values: &[f32], k: usize, n: usize, symmetric: bool) -> Q4 {
    let blocks = k.div_ceil(NBITS_BLOCK);
    let mut packed = vec![0u8; n * blocks * NBITS_BLOCK / 2];
    let mut scales = vec![0f32; n * blocks];
    let zero_bytes = blocks.div_ceil(2);
    let mut zeros = (!symmetric).then(|| vec![0u8; n * zero_bytes]);
    for col in 0..n {
        for b in 0..blocks {
            let rows = b * NBITS_BLOCK..((b + 1) * NBITS_BLOCK).min(k);
            let column = rows.clone().map(|r| values[r * n + col]);
            let (scale, zero) = if symmetric {
                let max = column.fold(0.0f32, |m, v| m.max(v.abs()));
                (if max > 0.0 { max / 7.0 } else { 1.0 }, 8u8)
            } else {
                let (lo, hi) = column.fold((0.0f32, 0.0f32), |(lo, hi), v| (lo.min(v), hi.max(v)));
                let scale = if hi > lo { (hi - lo) / 15.0 } else { 1.0 };
                (scale, (-lo / scale).round().clamp(0.0, 15.0) as u8)
            };
            scales[col * blocks + b] = scale;
            if let Some(z) = zeros.as_mut() {
                z[col * zero_bytes + b / 2] |= if b % 2 == 0 { zero } else { zero << 4 };
            }
            for (j, r) in rows.enumerate() {
                let q = ((values[r * n + col] / scale).round() as i32 + i32::from(zero)).clamp(0, 15) as u8;
                let byte = &mut packed[(col * blocks + b) * NBITS_BLOCK / 2 + j / 2];
                *byte |= if j % 2 == 0 { q } else { q << 4 };
            }
        }
    }
    Q4 { packed, scales, zeros, blocks }
}

/// A 4-bit `[K, N]` weight stored as initializers: the `[N, blocks, 16]`
/// nibbles, `N * blocks` scales and, when asymmetric, the zero points.
#[derive(Clone, Debug)]
pub struct StoredQ4 {
    pub weight: String,
    pub scales: String,
    pub zeros: Option<String>,
    pub k: usize,
    pub n: usize,
    pub blocks: usize,
}

/// com.microsoft `MatMulNBits` of `x` and `w` (`[K, N]`): a pretrained
/// projection keeps its own blocks (contrib); otherwise 4-bit quantization,
/// symmetric except where the genai export asks for zero points.
pub fn matmul_nbits(d: &mut Decoder, x: &str, w: &WeightValues) -> String {
    let (k, n) = (w.dims[0] as usize, w.dims[1] as usize);
    if let Some(q) =
        w.q4.as_deref().filter(|q| q.n == n && q.blocks * NBITS_BLOCK == k && d.variant == Variant::Contrib)
    {
        return matmul_q4_blocks(d, x, w, q);
    }
    let symmetric = d.variant != Variant::Genai || d.spec.genai.symmetric;
    let q = quantize_q4(&w.values, k, n, symmetric);
    let stored = store_q4(d, &w.name, k, n, q);
    nbits_apply(d, x, &stored)
}

pub(crate) fn store_q4(d: &mut Decoder, name: &str, k: usize, n: usize, q: Q4) -> StoredQ4 {
    let weight = d.b.initializer(Tensor {
        name: format!("{name}.q4"),
        dtype: DataType::Uint8,
        dims: vec![n as i64, q.blocks as i64, (NBITS_BLOCK / 2) as i64],
        raw: q.packed.into(),
    });
    let scales = d.b.initializer(Tensor::from_f32(format!("{name}.scales"), vec![(n * q.blocks) as i64], &q.scales));
    let zeros = q.zeros.map(|z| {
        d.b.initializer(Tensor {
            name: format!("{name}.zero_points"),
            dtype: DataType::Uint8,
            dims: vec![(z.len()) as i64],
            raw: z.into(),
        })
    });
    StoredQ4 { weight, scales, zeros, k, n, blocks: q.blocks }
}

/// One `MatMulNBits` (4 bits, blocks of [`NBITS_BLOCK`]) over a stored
/// weight; the genai export also states its `accuracy_level`.
pub(crate) fn nbits_apply(d: &mut Decoder, x: &str, w: &StoredQ4) -> String {
    let out = d.b.fresh("MatMulNBits");
    let mut attrs = vec![
        attr_int("K", w.k as i64),
        attr_int("N", w.n as i64),
        attr_int("bits", 4),
        attr_int("block_size", NBITS_BLOCK as i64),
    ];
    if d.variant == Variant::Genai {
        attrs.push(attr_int("accuracy_level", d.spec.genai.accuracy_level.into()));
    }
    let mut inputs = vec![x, w.weight.as_str(), w.scales.as_str()];
    if let Some(z) = &w.zeros {
        inputs.push(z);
    }
    d.b.node_in(MS_DOMAIN, "MatMulNBits", &inputs, &[&out], attrs);
    out
}

/// A pretrained projection's own 4-bit blocks (`value = d·q + m`), used as
/// they are: `MatMulNBits` with the default zero point 8 gives
/// `Σ d·(q − 8)·x` per block, and the rest, `Σ_b (m_b + 8·d_b) · Σ_{k∈b} x_k`,
/// is the block sums of `x` (one shared `[K, blocks]` 0/1 matrix) times a
/// small `[blocks, N]` matrix. Nothing is quantized twice.
fn matmul_q4_blocks(d: &mut Decoder, x: &str, w: &WeightValues, q: &crate::pretrained::Q4Blocks) -> String {
    let (k, n, blocks) = (w.dims[0] as usize, w.dims[1] as usize, q.blocks);
    let blocks4 = Q4 { packed: q.packed.clone(), scales: q.scales.clone(), zeros: None, blocks };
    let stored = store_q4(d, &w.name, k, n, blocks4);
    let quantized = nbits_apply(d, x, &stored);
    let sums = format!("q4.block_sums.{k}");
    if !d.b.has_value(&sums) {
        let ones: Vec<f32> =
            (0..k * blocks).map(|i| if (i / blocks) / NBITS_BLOCK == i % blocks { 1.0 } else { 0.0 }).collect();
        d.b.initializer(Tensor::from_f32(&sums, vec![k as i64, blocks as i64], &ones));
    }
    let mut offsets = vec![0f32; blocks * n];
    for col in 0..n {
        for b in 0..blocks {
            offsets[b * n + col] = q.mins[col * blocks + b] + 8.0 * q.scales[col * blocks + b];
        }
    }
    let oname =
        d.b.initializer(Tensor::from_f32(format!("{}.block_offsets", w.name), vec![blocks as i64, n as i64], &offsets));
    let block_sums = d.b.op("MatMul", &[x, &sums]);
    let offset = d.b.op("MatMul", &[&block_sums, &oname]);
    d.b.op("Add", &[&quantized, &offset])
}
