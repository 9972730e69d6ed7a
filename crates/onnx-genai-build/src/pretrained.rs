//! Weights, tokenizer and chat template that come from a trained model
//! (today: a GGUF file) instead of the deterministic generator. A spec that
//! carries them builds the same graphs from these numbers.

use std::collections::HashMap;
use std::sync::Arc;

/// One weight in the builder's layout (projections `[inputs, outputs]`).
#[derive(Clone, Debug)]
pub struct Weight {
    pub dims: Vec<u32>,
    pub values: Vec<f32>,
    /// The file's own 4-bit blocks of a projection, when it stored them as
    /// `value = d·q + m` (GGUF Q4_1): the 4-bit export uses them as they
    /// are instead of quantizing `values` again.
    pub q4: Option<Arc<Q4Blocks>>,
}

/// 4-bit blocks of 32 along the inputs, per output row `n`: `value =
/// scales[n·blocks + b] · q + mins[n·blocks + b]`, the nibbles packed as
/// `MatMulNBits` reads them (element `2i` in the low nibble of byte `i`).
#[derive(Debug)]
pub struct Q4Blocks {
    pub n: usize,
    pub blocks: usize,
    pub packed: Vec<u8>,
    pub scales: Vec<f32>,
    pub mins: Vec<f32>,
}

#[derive(Debug, Default)]
pub struct Pretrained {
    /// By the builder's (Hugging Face style) names.
    pub weights: HashMap<String, Weight>,
    pub tokenizer_json: String,
    pub chat_template: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Sampling defaults (Hugging Face's `generation_config.json`).
    pub sampling: onnx_genai_package::manifest::SamplingDefaults,
    /// `max_new_tokens` of `generation_config.json`.
    pub max_new_tokens: Option<u32>,
    /// Where the numbers came from (for messages).
    pub origin: String,
}

/// Shared, compared by identity (two specs are equal only when they carry
/// the very same weights).
#[derive(Clone, Debug)]
pub struct PretrainedRef(pub Arc<Pretrained>);

impl PartialEq for PretrainedRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::ops::Deref for PretrainedRef {
    type Target = Pretrained;
    fn deref(&self) -> &Pretrained {
        &self.0
    }
}

/// `[rows][cols]` → `[cols][rows]`: a checkpoint's `[outputs, inputs]`
/// matrix in the builder's `[inputs, outputs]` layout. 4-bit blocks stay
/// per output row: only the f32 view turns.
pub fn transpose(w: Weight) -> Weight {
    let (r, c) = (w.dims[0] as usize, w.dims[1] as usize);
    let mut out = vec![0.0; w.values.len()];
    for (i, row) in w.values.chunks_exact(c).enumerate() {
        for (j, v) in row.iter().enumerate() {
            out[j * r + i] = *v;
        }
    }
    Weight { dims: vec![w.dims[1], w.dims[0]], values: out, q4: w.q4 }
}

/// A pretrained llama checkpoint's architecture numbers (GGUF metadata,
/// Hugging Face's `config.json`).
pub struct LlamaShape {
    pub hidden: u32,
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub ffn: u32,
    pub vocab: u32,
    pub context: u32,
    pub rope_theta: f64,
    pub norm_epsilon: f64,
    pub tied: bool,
    /// Biases on the Q, K and V projections (Qwen2).
    pub qkv_bias: bool,
}

impl LlamaShape {
    /// The f32 llama spec named `name` that builds from `weights`.
    pub fn spec(&self, name: &str, weights: Pretrained) -> crate::spec::Spec {
        crate::spec::Spec {
            name: name.into(),
            seed: 0,
            family: onnx_genai_package::Family::Llama,
            dtype: onnx_genai_package::ElementType::F32,
            hidden_size: self.hidden,
            num_layers: self.layers,
            num_attention_heads: self.heads,
            num_kv_heads: Some(self.kv_heads),
            intermediate_size: self.ffn,
            vocab_size: self.vocab,
            max_sequence_length: self.context,
            rope_theta: Some(self.rope_theta),
            norm_epsilon: self.norm_epsilon,
            tie_embeddings: self.tied,
            qkv_bias: self.qkv_bias,
            vision: None,
            genai: Default::default(),
            pretrained: Some(PretrainedRef(Arc::new(weights))),
        }
    }
}
