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
