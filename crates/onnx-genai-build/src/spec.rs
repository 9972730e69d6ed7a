//! `packages/<name>/spec.yaml`: what the builder makes a package from.

use serde::Deserialize;

use crate::BuildError;
use onnx_genai_package::{ElementType, Family};

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    pub name: String,
    /// Seed of the deterministic weight generator.
    pub seed: u64,
    pub family: Family,
    pub dtype: ElementType,
    pub hidden_size: u32,
    pub num_layers: u32,
    pub num_attention_heads: u32,
    /// Llama family only: 1 = MQA, < heads = GQA, = heads = MHA.
    #[serde(default)]
    pub num_kv_heads: Option<u32>,
    pub intermediate_size: u32,
    pub vocab_size: u32,
    pub max_sequence_length: u32,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    pub norm_epsilon: f64,
    /// Share the token embedding with the output projection.
    pub tie_embeddings: bool,
}

impl Spec {
    pub fn parse(text: &str, origin: &str) -> Result<Self, BuildError> {
        let de = serde_yaml_ng::Deserializer::from_str(text);
        let spec: Spec = serde_path_to_error::deserialize(de).map_err(|e| BuildError::Spec {
            origin: origin.into(),
            reason: format!("{} (at `{}`)", e.inner(), e.path()),
        })?;
        spec.check(origin)?;
        Ok(spec)
    }

    pub fn kv_heads(&self) -> u32 {
        self.num_kv_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> u32 {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    fn check(&self, origin: &str) -> Result<(), BuildError> {
        let fail = |reason: String| Err(BuildError::Spec { origin: origin.into(), reason });
        if self.num_attention_heads == 0 || !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return fail(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.kv_heads() == 0 || !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return fail(format!(
                "num_attention_heads {} is not a multiple of num_kv_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if !self.head_dim().is_multiple_of(2) && self.family == Family::Llama {
            return fail(format!("rotary embedding needs an even head_dim, got {}", self.head_dim()));
        }
        match (self.family, self.rope_theta, self.num_kv_heads) {
            (Family::Llama, None, _) => return fail("the llama family needs rope_theta".into()),
            (Family::Gpt2, Some(_), _) => {
                return fail("the gpt2 family has learned positions; remove rope_theta".into())
            }
            (Family::Gpt2, _, Some(k)) if k != self.num_attention_heads => {
                return fail("the gpt2 family is multi-head attention; remove num_kv_heads".into())
            }
            _ => {}
        }
        let min_vocab = crate::tokenizer::BYTE_TOKENS + crate::tokenizer::SPECIAL_TOKENS.len() as u32;
        if self.vocab_size < min_vocab {
            return fail(format!("vocab_size {} is below the {min_vocab} byte and special tokens", self.vocab_size));
        }
        if self.num_layers == 0 || self.intermediate_size == 0 || self.max_sequence_length == 0 {
            return fail("num_layers, intermediate_size and max_sequence_length must be positive".into());
        }
        Ok(())
    }
}
