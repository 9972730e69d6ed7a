//! `packages/<name>/spec.yaml`: what the builder makes a package from.

use serde::Deserialize;

use crate::BuildError;
use onnx_genai_package::{ElementType, Family};

/// The most max_sequence_length x head_dim may be (2^28): the rotary cos
/// and sin tables hold half that each, 512 MiB of f32; Llama 3.1's 131,072
/// positions of 128 make 2^24.
const MAX_ROTARY_VALUES: u64 = 1 << 28;

/// The widest intermediate (feed-forward) size the builder takes.
const MAX_INTERMEDIATE: u64 = 1 << 18;

/// The most parameters a spec without pretrained weights may draw (2^30:
/// 4 GiB of f32, held in memory while the graph is written). Random
/// weights test the toolchain, which a billion of them already does; a
/// spec asking for a Llama-70B shape took the machine's memory until the
/// process was killed.
const MAX_RANDOM_PARAMETERS: u64 = 1 << 30;

/// ONNX Runtime's `GroupQueryAttention` runs only head sizes that are a
/// multiple of this (its CPU kernel: "head_size must be a multiple of 8").
pub const GQA_HEAD_MULTIPLE: u32 = 8;
/// ... and, when it applies rotary itself (`do_rotary`), of this ("head_size
/// shall be a multiple of 16").
pub const GQA_ROTARY_HEAD_MULTIPLE: u32 = 16;

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
    /// Llama family: biases on the Q, K and V projections (Qwen2's
    /// layout; the gpt2 family's projections are always biased).
    #[serde(default)]
    pub qkv_bias: bool,
    /// Makes a vision-language package: a vision encoder, a token-embedding
    /// component and a decoder that takes `inputs_embeds`, run as a
    /// declared workflow.
    #[serde(default)]
    pub vision: Option<VisionSpec>,
    /// How the `genai` export (ONNX Runtime GenAI's own layout, llama
    /// family) quantizes; absent means its model builder's CPU defaults.
    #[serde(default)]
    pub genai: GenaiExport,
    /// Trained weights and tokenizer (from a GGUF), never from YAML: the
    /// seed is then unused.
    #[serde(skip)]
    pub pretrained: Option<crate::pretrained::PretrainedRef>,
}

/// A patch-embedding image encoder: a square `image_size` image of
/// `channels` cut into `patch_size` patches, each projected to one
/// embedding (so an image is `(image_size / patch_size)^2` tokens).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VisionSpec {
    pub image_size: u32,
    pub patch_size: u32,
    pub channels: u32,
}

/// The choices ONNX Runtime GenAI's model builder offers for an int4 CPU
/// export (`-p int4 -e cpu`), with its defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenaiExport {
    /// Symmetric blocks use `MatMulNBits`' default zero point 8; asymmetric
    /// ones carry packed `uint8` zero points.
    #[serde(default = "yes")]
    pub symmetric: bool,
    /// `MatMulNBits`' `accuracy_level` (0–4): how ONNX Runtime may compute
    /// (4 quantizes activations to int8 blocks).
    #[serde(default = "cpu_accuracy_level")]
    pub accuracy_level: u8,
    /// One 4-bit table for the output projection and, through
    /// `GatherBlockQuantized`, the token embedding (needs tied embeddings).
    #[serde(default)]
    pub shared_embeddings: bool,
}

fn yes() -> bool {
    true
}

fn cpu_accuracy_level() -> u8 {
    4
}

impl Default for GenaiExport {
    fn default() -> Self {
        Self { symmetric: true, accuracy_level: cpu_accuracy_level(), shared_embeddings: false }
    }
}

impl VisionSpec {
    pub fn tokens_per_image(&self) -> u32 {
        (self.image_size / self.patch_size).pow(2)
    }
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

    /// The export forms this spec is built in (a vision-language package is
    /// a workflow over decomposed graphs).
    pub fn variants(&self) -> Vec<crate::Variant> {
        crate::Variant::ALL.into_iter().filter(|v| self.refusal(*v).is_none()).collect()
    }

    /// Why this spec is not built as `variant`, if it is not.
    pub fn refusal(&self, variant: crate::Variant) -> Option<String> {
        use crate::Variant::{Contrib, Decomposed, Genai};
        if self.vision.is_some() && variant != Decomposed {
            return Some("a vision-language package is a workflow over decomposed graphs".into());
        }
        if self.family == Family::Gpt2 && variant == Genai {
            return Some("ONNX Runtime GenAI's builder has no llama-form GPT-2".into());
        }
        // ONNX Runtime's GroupQueryAttention refuses other head sizes at the
        // first run, so an export using it would validate and never decode.
        // The genai export rotates inside it, which needs a multiple of 16.
        let multiple = match variant {
            Contrib => GQA_HEAD_MULTIPLE,
            Genai => GQA_ROTARY_HEAD_MULTIPLE,
            _ => 1,
        };
        if !self.head_dim().is_multiple_of(multiple) {
            return Some(format!(
                "ONNX Runtime's GroupQueryAttention (the {} export's attention{}) needs a head size that is a multiple of {multiple}; head_dim is {}",
                variant.name(),
                if variant == Genai { ", rotating inside" } else { "" },
                self.head_dim()
            ));
        }
        // GatherBlockQuantized returns whole 4-bit blocks: a shared table
        // whose rows end in a partial block would hand the first layer a
        // padded hidden state (ONNX Runtime then refuses the model).
        let block = crate::graph::NBITS_BLOCK as u32;
        if variant == Genai && self.genai.shared_embeddings && !self.hidden_size.is_multiple_of(block) {
            return Some(format!(
                "genai.shared_embeddings gathers whole {block}-element blocks (GatherBlockQuantized); hidden_size {} is not a multiple of {block}",
                self.hidden_size
            ));
        }
        None
    }

    /// Special tokens beyond the standard ones (the image placeholder).
    pub fn extra_specials(&self) -> &'static [&'static str] {
        if self.vision.is_some() {
            &[crate::tokenizer::IMAGE_TOKEN]
        } else {
            &[]
        }
    }

    /// `<|endoftext|>`: the first special token after the merges.
    pub fn eos_token_id(&self) -> u32 {
        if let Some(id) = self.pretrained.as_ref().and_then(|p| p.eos_token_ids.first()) {
            return *id;
        }
        self.vocab_size - (crate::tokenizer::SPECIAL_TOKENS.len() + self.extra_specials().len()) as u32
    }

    pub fn kv_heads(&self) -> u32 {
        self.num_kv_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> u32 {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Checks the spec before anything is built from it, so that every
    /// size the builder forms from it is bounded.
    pub(crate) fn check(&self, origin: &str) -> Result<(), BuildError> {
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
            (Family::Gpt2, _, _) if self.qkv_bias => {
                return fail("the gpt2 family's projections always carry biases; remove qkv_bias".into())
            }
            _ => {}
        }
        // The bounds a package's manifest must keep (validation refuses
        // more): every product the builder forms from them then fits.
        for (key, value) in [
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_kv_heads", self.kv_heads()),
            ("head_dim", self.head_dim()),
            ("vocab_size", self.vocab_size),
            ("max_sequence_length", self.max_sequence_length),
        ] {
            let bound = onnx_genai_package::validate::bound_of(key);
            if value > bound {
                return fail(format!("{key} {value} is above the {bound} a package may declare"));
            }
        }
        // Tables the builder allocates whole, sized by products of these:
        // a file of a few megabytes may declare any of them.
        let rotary = u64::from(self.max_sequence_length) * u64::from(self.head_dim());
        if self.family == Family::Llama && rotary > MAX_ROTARY_VALUES {
            return fail(format!(
                "max_sequence_length {} x head_dim {} is above the {MAX_ROTARY_VALUES} the builder's rotary \
                 tables take",
                self.max_sequence_length,
                self.head_dim()
            ));
        }
        let widest = (u64::from(self.hidden_size) * 64).clamp(4096, MAX_INTERMEDIATE);
        if u64::from(self.intermediate_size) > widest {
            return fail(format!(
                "intermediate_size {} is above the {widest} the builder takes for hidden_size {} (64 times it, \
                 at least 4096 and at most {MAX_INTERMEDIATE}): a 4-bit down projection's block sums grow with \
                 its square",
                self.intermediate_size, self.hidden_size
            ));
        }
        let min_vocab = crate::tokenizer::BYTE_TOKENS
            + (crate::tokenizer::SPECIAL_TOKENS.len() + self.extra_specials().len()) as u32;
        if self.vocab_size < min_vocab {
            return fail(format!("vocab_size {} is below the {min_vocab} byte and special tokens", self.vocab_size));
        }
        if let Some(v) = &self.vision {
            if v.patch_size == 0 || !v.image_size.is_multiple_of(v.patch_size) {
                return fail(format!(
                    "vision image_size {} is not a positive multiple of patch_size {}",
                    v.image_size, v.patch_size
                ));
            }
            // The package's preprocessing hands the encoder RGB pixels.
            if v.channels != 3 {
                return fail(format!("vision channels {} is not 3: images are preprocessed as RGB", v.channels));
            }
            let side = onnx_genai_package::manifest::MAX_IMAGE_SIDE;
            if v.image_size > side {
                return fail(format!("vision image_size {} is above the {side} a package may declare", v.image_size));
            }
            if v.tokens_per_image() >= self.max_sequence_length {
                return fail(format!(
                    "an image of {} tokens does not fit the context of {}",
                    v.tokens_per_image(),
                    self.max_sequence_length
                ));
            }
            if self.family != Family::Llama || self.tie_embeddings {
                return fail("vision packages are llama-family with untied embeddings".into());
            }
        }
        // Values that make every logit NaN (a rotary base of 0 or less, a
        // norm epsilon of 0 or less) or every norm 0 (one past f32's range)
        // build a package that validates: refused here, for every source.
        if self.rope_theta.is_some_and(|t| !(t.is_finite() && t > 0.0)) {
            return fail(format!("rope_theta {:?} is not a positive number", self.rope_theta.unwrap_or(0.0)));
        }
        if !(self.norm_epsilon.is_finite() && self.norm_epsilon > 0.0 && self.norm_epsilon <= 1.0) {
            return fail(format!("norm_epsilon {} is not above 0 and at most 1", self.norm_epsilon));
        }
        if self.genai.accuracy_level > 4 {
            return fail(format!("genai.accuracy_level {} is not 0–4", self.genai.accuracy_level));
        }
        if self.genai.shared_embeddings && !self.tie_embeddings {
            return fail("genai.shared_embeddings needs tie_embeddings: true".into());
        }
        if self.num_layers == 0 || self.intermediate_size == 0 || self.max_sequence_length == 0 {
            return fail("num_layers, intermediate_size and max_sequence_length must be positive".into());
        }
        let drawn = self.decoder_parameters();
        if self.pretrained.is_none() && drawn > MAX_RANDOM_PARAMETERS {
            return fail(format!(
                "the spec draws about {:.1} billion random parameters, above the {MAX_RANDOM_PARAMETERS} the builder \
                 draws (a model that size wants its trained weights: `onnx-genai import` a checkpoint)",
                drawn as f64 / 1e9
            ));
        }
        Ok(())
    }

    /// The decoder's parameters: projections, norms left out, embeddings
    /// (the learned positions too for gpt2). The bounds checked before it
    /// keep every product far below u64's range.
    fn decoder_parameters(&self) -> u64 {
        let (hidden, inter) = (u64::from(self.hidden_size), u64::from(self.intermediate_size));
        let q = u64::from(self.num_attention_heads) * u64::from(self.head_dim());
        let kv = u64::from(self.kv_heads()) * u64::from(self.head_dim());
        // (A `decoder`-family spec is refused when built; counted as llama.)
        let mlp = match self.family {
            Family::Gpt2 => 2 * hidden * inter,
            Family::Llama | Family::Decoder => 3 * hidden * inter,
        };
        let per_layer = 2 * hidden * q + 2 * hidden * kv + mlp;
        let tables = if self.tie_embeddings { 1 } else { 2 };
        let positions = if self.family == Family::Gpt2 { u64::from(self.max_sequence_length) * hidden } else { 0 };
        u64::from(self.num_layers) * per_layer + tables * u64::from(self.vocab_size) * hidden + positions
    }
}
