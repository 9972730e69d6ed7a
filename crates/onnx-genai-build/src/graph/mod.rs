//! Decoder graphs in standard, decomposed ONNX ops (opset 17): no fused or
//! vendor ops. Weights may be f16; compute is f32 (weights are cast once,
//! which ONNX Runtime folds at load), the KV cache is stored in the package's
//! KV dtype.

mod gpt2;
mod llama;

use onnx_genai_onnx::builder::{attr_int, attr_ints};
use onnx_genai_onnx::{DataType, Dim, GraphBuilder, Model, Tensor};
use onnx_genai_package::{ElementType, Family};

use crate::rng::SplitMix64;
use crate::spec::Spec;

pub const OPSET: i64 = 17;
pub const IR_VERSION: i64 = 8;

/// Tensor names of the graph's I/O, bound to roles by the manifest.
pub mod names {
    pub const INPUT_IDS: &str = "input_ids";
    pub const ATTENTION_MASK: &str = "attention_mask";
    pub const POSITION_IDS: &str = "position_ids";
    pub const LOGITS: &str = "logits";
    pub const PAST_KEY: &str = "past_key_values.{layer}.key";
    pub const PAST_VALUE: &str = "past_key_values.{layer}.value";
    pub const PRESENT_KEY: &str = "present.{layer}.key";
    pub const PRESENT_VALUE: &str = "present.{layer}.value";

    pub fn layer(template: &str, layer: u32) -> String {
        template.replace("{layer}", &layer.to_string())
    }
}

pub fn build_decoder(spec: &Spec) -> Model {
    let mut d = Decoder::new(spec);
    match spec.family {
        Family::Llama => llama::build(&mut d),
        Family::Gpt2 => gpt2::build(&mut d),
    }
    d.b.finish(IR_VERSION, env!("CARGO_PKG_VERSION"))
}

/// Shared state while one decoder graph is built.
pub(crate) struct Decoder<'s> {
    pub spec: &'s Spec,
    pub b: GraphBuilder,
    pub rng: SplitMix64,
    /// `[batch, 1, sequence, total]` additive mask, tiled for GQA groups.
    pub mask_bias: String,
}

impl<'s> Decoder<'s> {
    fn new(spec: &'s Spec) -> Self {
        let mut b = GraphBuilder::new(&spec.name, OPSET);
        let kv = spec.dtype.onnx();
        let (batch, seq, total, past) = (dim("batch"), dim("sequence"), dim("total_sequence"), dim("past_sequence"));
        b.input(names::INPUT_IDS, DataType::Int64, vec![batch.clone(), seq.clone()]);
        b.input(names::ATTENTION_MASK, DataType::Int64, vec![batch.clone(), total.clone()]);
        b.input(names::POSITION_IDS, DataType::Int64, vec![batch.clone(), seq.clone()]);
        let (kvh, hd) = (Dim::Fixed(spec.kv_heads().into()), Dim::Fixed(spec.head_dim().into()));
        for layer in 0..spec.num_layers {
            for t in [names::PAST_KEY, names::PAST_VALUE] {
                b.input(&names::layer(t, layer), kv, vec![batch.clone(), kvh.clone(), past.clone(), hd.clone()]);
            }
        }
        b.output(names::LOGITS, DataType::Float, vec![batch.clone(), seq, Dim::Fixed(spec.vocab_size.into())]);
        for layer in 0..spec.num_layers {
            for t in [names::PRESENT_KEY, names::PRESENT_VALUE] {
                b.output(&names::layer(t, layer), kv, vec![batch.clone(), kvh.clone(), total.clone(), hd.clone()]);
            }
        }
        let mut d = Self { spec, b, rng: SplitMix64::new(spec.seed), mask_bias: String::new() };
        d.mask_bias = d.causal_mask_bias();
        d
    }

    /// Adds a weight initializer in the package dtype; returns an f32 value.
    pub fn weight(&mut self, name: &str, dims: &[u32], scale: f32, offset: f32) -> String {
        let n: usize = dims.iter().map(|d| *d as usize).product();
        let values: Vec<f32> = self.rng.fill(n, scale).into_iter().map(|v| v + offset).collect();
        let dims: Vec<i64> = dims.iter().map(|d| i64::from(*d)).collect();
        match self.spec.dtype {
            ElementType::F32 => self.b.initializer(Tensor::from_f32(name, dims, &values)),
            ElementType::F16 => {
                let halves: Vec<half::f16> = values.iter().map(|v| half::f16::from_f32(*v)).collect();
                let stored = self.b.initializer(Tensor::from_f16(name, dims, &halves));
                self.b.op_with("Cast", &[&stored], vec![attr_int("to", DataType::Float.onnx_code().into())])
            }
        }
    }

    /// A `[in, out]` projection weight with fan-in scaling.
    pub fn linear(&mut self, name: &str, inputs: u32, outputs: u32) -> String {
        let scale = 1.0 / (inputs as f32).sqrt();
        self.weight(name, &[inputs, outputs], scale, 0.0)
    }

    pub fn matmul(&mut self, x: &str, w: &str) -> String {
        self.b.op("MatMul", &[x, w])
    }

    /// `x * w / sqrt(mean(x^2) + eps)` over the last axis.
    pub fn rms_norm(&mut self, x: &str, weight_name: &str) -> String {
        let w = self.weight(weight_name, &[self.spec.hidden_size], 0.1, 1.0);
        let sq = self.b.op("Mul", &[x, x]);
        let mean = self.b.op_with("ReduceMean", &[&sq], vec![attr_ints("axes", &[-1]), attr_int("keepdims", 1)]);
        let eps = self.b.scalar_f32(self.spec.norm_epsilon as f32);
        let var = self.b.op("Add", &[&mean, &eps]);
        let rms = self.b.op("Sqrt", &[&var]);
        let normed = self.b.op("Div", &[x, &rms]);
        self.b.op("Mul", &[&normed, &w])
    }

    /// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last axis.
    pub fn layer_norm(&mut self, x: &str, prefix: &str) -> String {
        let h = self.spec.hidden_size;
        let gamma = self.weight(&format!("{prefix}.weight"), &[h], 0.1, 1.0);
        let beta = self.weight(&format!("{prefix}.bias"), &[h], 0.1, 0.0);
        let mean = self.b.op_with("ReduceMean", &[x], vec![attr_ints("axes", &[-1]), attr_int("keepdims", 1)]);
        let centered = self.b.op("Sub", &[x, &mean]);
        let sq = self.b.op("Mul", &[&centered, &centered]);
        let var = self.b.op_with("ReduceMean", &[&sq], vec![attr_ints("axes", &[-1]), attr_int("keepdims", 1)]);
        let eps = self.b.scalar_f32(self.spec.norm_epsilon as f32);
        let var = self.b.op("Add", &[&var, &eps]);
        let std = self.b.op("Sqrt", &[&var]);
        let normed = self.b.op("Div", &[&centered, &std]);
        let scaled = self.b.op("Mul", &[&normed, &gamma]);
        self.b.op("Add", &[&scaled, &beta])
    }

    /// `[batch, seq, heads*dim]` -> `[batch, heads, seq, dim]`.
    pub fn split_heads(&mut self, x: &str, heads: u32) -> String {
        let shape = self.b.const_i64(&[0, 0, heads.into(), self.spec.head_dim().into()]);
        let r = self.b.op("Reshape", &[x, &shape]);
        self.b.op_with("Transpose", &[&r], vec![attr_ints("perm", &[0, 2, 1, 3])])
    }

    /// Additive attention bias `[batch, 1, n_rep*seq, total]`: 0 where a query
    /// may attend (causal and not padding), -1e9 elsewhere.
    fn causal_mask_bias(&mut self) -> String {
        self.b.set_scope("/mask");
        let ids_shape = self.b.op("Shape", &[names::INPUT_IDS]);
        let mask_shape = self.b.op("Shape", &[names::ATTENTION_MASK]);
        let one_idx = self.b.scalar_i64(1);
        let seq = self.b.op_with("Gather", &[&ids_shape, &one_idx], vec![attr_int("axis", 0)]);
        let total = self.b.op_with("Gather", &[&mask_shape, &one_idx], vec![attr_int("axis", 0)]);
        let past = self.b.op("Sub", &[&total, &seq]);
        let zero = self.b.scalar_i64(0);
        let step = self.b.scalar_i64(1);
        let q_pos = self.b.op("Range", &[&past, &total, &step]);
        let k_pos = self.b.op("Range", &[&zero, &total, &step]);
        let ax0 = self.b.const_i64(&[0]);
        let ax1 = self.b.const_i64(&[1]);
        let k_row = self.b.op("Unsqueeze", &[&k_pos, &ax0]);
        let q_col = self.b.op("Unsqueeze", &[&q_pos, &ax1]);
        let causal = self.b.op("LessOrEqual", &[&k_row, &q_col]);
        let ax12 = self.b.const_i64(&[1, 2]);
        let pad = self.b.op("Unsqueeze", &[names::ATTENTION_MASK, &ax12]);
        let pad = self.b.op_with("Cast", &[&pad], vec![attr_int("to", DataType::Bool.onnx_code().into())]);
        let allowed = self.b.op("And", &[&causal, &pad]);
        let open = self.b.scalar_f32(0.0);
        let closed = self.b.scalar_f32(-1e9);
        let bias = self.b.op("Where", &[&allowed, &open, &closed]);
        let n_rep = self.spec.num_attention_heads / self.spec.kv_heads();
        let bias = if n_rep > 1 {
            let reps = self.b.const_i64(&[1, 1, n_rep.into(), 1]);
            self.b.op("Tile", &[&bias, &reps])
        } else {
            bias
        };
        self.b.set_scope("");
        bias
    }

    /// Causal attention over the KV cache with GQA head sharing. `q` is
    /// `[b, heads, s, d]`, `k`/`v` are `[b, kv_heads, s, d]` (f32, rotary
    /// already applied). Appends to the layer's past KV, writes the presents,
    /// and returns `[b, s, heads*d]`.
    pub fn attention(&mut self, layer: u32, q: &str, k: &str, v: &str) -> String {
        let spec = self.spec;
        let (heads, kv_heads, hd) = (spec.num_attention_heads, spec.kv_heads(), spec.head_dim());
        let kv_dtype = spec.dtype.onnx();
        let mut cached = Vec::new();
        for (new, past_t, present_t) in
            [(k, names::PAST_KEY, names::PRESENT_KEY), (v, names::PAST_VALUE, names::PRESENT_VALUE)]
        {
            let stored = if kv_dtype == DataType::Float {
                new.to_string()
            } else {
                self.b.op_with("Cast", &[new], vec![attr_int("to", kv_dtype.onnx_code().into())])
            };
            let present = names::layer(present_t, layer);
            self.b.op_into("Concat", &[&names::layer(past_t, layer), &stored], &[&present], vec![attr_int("axis", 2)]);
            let full = if kv_dtype == DataType::Float {
                present
            } else {
                self.b.op_with("Cast", &[&present], vec![attr_int("to", DataType::Float.onnx_code().into())])
            };
            cached.push(full);
        }
        let n_rep = heads / kv_heads;
        let scale = self.b.scalar_f32(1.0 / (hd as f32).sqrt());
        let q = self.b.op("Mul", &[q, &scale]);
        let grouped_shape = self.b.const_i64(&[0, kv_heads.into(), -1, hd.into()]);
        let q = if n_rep > 1 { self.b.op("Reshape", &[&q, &grouped_shape]) } else { q };
        let kt = self.b.op_with("Transpose", &[&cached[0]], vec![attr_ints("perm", &[0, 1, 3, 2])]);
        let scores = self.b.op("MatMul", &[&q, &kt]);
        let mask = self.mask_bias.clone();
        let scores = self.b.op("Add", &[&scores, &mask]);
        let probs = self.b.op_with("Softmax", &[&scores], vec![attr_int("axis", -1)]);
        let ctx = self.b.op("MatMul", &[&probs, &cached[1]]);
        let ctx = if n_rep > 1 {
            let heads_shape = self.b.const_i64(&[0, heads.into(), -1, hd.into()]);
            self.b.op("Reshape", &[&ctx, &heads_shape])
        } else {
            ctx
        };
        let ctx = self.b.op_with("Transpose", &[&ctx], vec![attr_ints("perm", &[0, 2, 1, 3])]);
        let merged = self.b.const_i64(&[0, 0, i64::from(heads * hd)]);
        self.b.op("Reshape", &[&ctx, &merged])
    }

    /// Final projection to `logits` `[batch, seq, vocab]`.
    pub fn lm_head(&mut self, x: &str, embedding: &str) {
        let spec = self.spec;
        let w = if spec.tie_embeddings {
            self.b.op_with("Transpose", &[embedding], vec![attr_ints("perm", &[1, 0])])
        } else {
            self.linear("lm_head.weight", spec.hidden_size, spec.vocab_size)
        };
        self.b.op_into("MatMul", &[x, &w], &[names::LOGITS], Vec::new());
    }

    /// A constant f32 tensor initializer of `values` with `dims`.
    pub fn table(&mut self, name: &str, dims: Vec<i64>, values: &[f32]) -> String {
        self.b.initializer(Tensor::from_f32(name, dims, values))
    }
}

fn dim(name: &str) -> Dim {
    Dim::Symbolic(name.into())
}
