//! The `package.yaml` schema. Closed: every struct denies unknown fields, and
//! [`crate::schema`] turns each unknown key into a diagnostic with a
//! suggestion. Ports are bound to roles here, never guessed from tensor names.

use serde::{Deserialize, Serialize};

/// The one manifest format version this code reads and writes.
pub const FORMAT: &str = "onnx-genai/1";

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub name: String,
    pub version: String,
    pub architecture: Architecture,
    /// Element type of the weights.
    pub dtype: ElementType,
    /// KV cache layout. Absent means unknown geometry: admission reserves nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<KvCache>,
    pub components: Vec<Component>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<Workflow>,
    pub tokenizer: TokenizerRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    pub generation: Generation,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Gpt2,
    /// A decoder-only transformer described only by its graph (ONNX
    /// Runtime GenAI's generic `decoder` type); imported, never built.
    Decoder,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ElementType {
    F32,
    F16,
}

impl ElementType {
    pub fn size_bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }

    pub fn onnx(self) -> onnx_genai_onnx::DataType {
        match self {
            Self::F32 => onnx_genai_onnx::DataType::Float,
            Self::F16 => onnx_genai_onnx::DataType::Float16,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Architecture {
    pub family: Family,
    pub hidden_size: u32,
    pub num_layers: u32,
    pub num_attention_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// FFN width; absent when imported from a format that does not state it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intermediate_size: Option<u32>,
    pub vocab_size: u32,
    pub max_sequence_length: u32,
    /// RoPE base; present for families with rotary positions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_epsilon: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KvCache {
    pub dtype: ElementType,
    /// Per-layer shapes where layers differ; absent means every layer has the
    /// architecture's `num_kv_heads` x `head_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<Vec<KvLayer>>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayer {
    pub kv_heads: u32,
    pub head_dim: u32,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Component {
    pub name: String,
    /// ONNX file, relative to the package root.
    pub file: String,
    pub ports: Vec<Port>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Port {
    pub role: Role,
    /// The graph's tensor name. Per-layer roles contain `{layer}`, expanded for
    /// layer 0..num_layers.
    pub name: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    TokenIds,
    InputsEmbeds,
    PositionIds,
    AttentionMask,
    PastKey,
    PastValue,
    PresentKey,
    PresentValue,
    Logits,
}

impl Role {
    pub fn per_layer(self) -> bool {
        matches!(self, Role::PastKey | Role::PastValue | Role::PresentKey | Role::PresentValue)
    }

    pub fn is_output(self) -> bool {
        matches!(self, Role::PresentKey | Role::PresentValue | Role::Logits)
    }

    /// The rank a tensor bound to this role must have.
    pub fn rank(self) -> usize {
        match self {
            Role::TokenIds | Role::PositionIds | Role::AttentionMask => 2,
            Role::InputsEmbeds | Role::Logits => 3,
            Role::PastKey | Role::PastValue | Role::PresentKey | Role::PresentValue => 4,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::TokenIds => "token_ids",
            Role::InputsEmbeds => "inputs_embeds",
            Role::PositionIds => "position_ids",
            Role::AttentionMask => "attention_mask",
            Role::PastKey => "past_key",
            Role::PastValue => "past_value",
            Role::PresentKey => "present_key",
            Role::PresentValue => "present_value",
            Role::Logits => "logits",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Workflow {
    /// Inputs a request may bind directly (e.g. `pixel_values`).
    #[serde(default)]
    pub application_inputs: Vec<ApplicationInput>,
    /// The components the interpreter runs, in order. Empty: the package
    /// runs on a decode core.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<WorkflowStep>,
    /// How image features enter the token stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageInput>,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkflowStep {
    pub component: String,
    /// Whether a request may supply this component's outputs instead of
    /// running it.
    #[serde(default)]
    pub overridable: bool,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ImageInput {
    /// The special token a prompt marks an image with; each occurrence
    /// expands to `tokens` positions filled with the image's embeddings.
    pub placeholder: String,
    pub tokens: u32,
    /// The component output holding `[1, tokens, hidden]` image embeddings.
    pub features: PortRef,
    pub preprocess: Preprocess,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PortRef {
    pub component: String,
    pub port: String,
}

/// The largest width and height an image may be resized to (a package's
/// preprocessing) or decoded at (a request's image): 4096 x 4096 RGB is
/// 48 MiB of pixels, 192 MiB as f32 values.
pub const MAX_IMAGE_SIDE: u32 = 4096;

/// Image preprocessing: resize to `width x height` (RGB), scale to [0, 1],
/// then `(x - mean) / std` per channel; laid out `[1, 3, height, width]`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Preprocess {
    pub width: u32,
    pub height: u32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApplicationInput {
    pub name: String,
    pub component: String,
    /// The graph input of `component` the request's tensor feeds.
    pub port: String,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerRef {
    pub file: String,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Generation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub max_new_tokens: u32,
    /// What a request that does not say gets (an ONNX Runtime GenAI
    /// package's `search` section).
    #[serde(default, skip_serializing_if = "SamplingDefaults::is_empty")]
    pub sampling: SamplingDefaults,
}

/// A package's sampling defaults: each applies to a request that leaves it
/// unset (the server's OpenAI defaults, the CLI's greedy decoding, apply
/// otherwise).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingDefaults {
    /// 0 is greedy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// 0 keeps every token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Each default outside the range the engine's sampler accepts, as
    /// (key, value, the range in words).
    pub fn out_of_range(&self) -> Vec<(&'static str, f32, &'static str)> {
        let ranged = [
            (
                "temperature",
                self.temperature,
                "a finite number >= 0 (0 is greedy)",
                self.temperature.is_none_or(|t| t.is_finite() && t >= 0.0),
            ),
            ("top_p", self.top_p, "in [0, 1]", self.top_p.is_none_or(|p| (0.0..=1.0).contains(&p))),
            (
                "repetition_penalty",
                self.repetition_penalty,
                "a finite number > 0 (1 leaves logits alone)",
                self.repetition_penalty.is_none_or(|r| r.is_finite() && r > 0.0),
            ),
        ];
        ranged
            .into_iter()
            .filter_map(|(key, value, range, ok)| value.filter(|_| !ok).map(|v| (key, v, range)))
            .collect()
    }

    /// The defaults Hugging Face's `generate` (and ONNX Runtime GenAI, which
    /// reads the same keys in its `search` section) applies: without
    /// `do_sample: true` it decodes greedily, so temperature, top_k and
    /// top_p are unused and the default is greedy; with it, a key left out
    /// takes their default (temperature 1, top_k 50, top_p 1 — what
    /// `save_pretrained` omits because it is the default);
    /// `repetition_penalty` applies either way.
    pub fn of_generation_config(
        do_sample: Option<bool>,
        temperature: Option<f64>,
        top_k: Option<u32>,
        top_p: Option<f64>,
        repetition_penalty: Option<f64>,
    ) -> Self {
        let sampled = do_sample == Some(true);
        Self {
            temperature: Some(if sampled { temperature.unwrap_or(1.0) as f32 } else { 0.0 }),
            top_k: sampled.then_some(top_k.unwrap_or(50)),
            top_p: sampled.then_some(top_p.unwrap_or(1.0) as f32),
            repetition_penalty: repetition_penalty.map(|r| r as f32),
        }
    }
}

impl Manifest {
    /// The per-layer tensor name of a templated port.
    pub fn expand(template: &str, layer: u32) -> String {
        template.replace("{layer}", &layer.to_string())
    }

    pub fn to_yaml(&self) -> String {
        // Serializing plain data structs to YAML cannot fail.
        serde_yaml_ng::to_string(self).unwrap_or_default()
    }
}
