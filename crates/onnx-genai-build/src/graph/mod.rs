//! Decoder graphs. One spec is exported in up to four forms from the same
//! weights ([`Variant`]): standard decomposed ops (opset 17), the fused
//! ONNX opset-23 ops, the com.microsoft contrib ops with 4-bit weights, and
//! (llama family) the graph ONNX Runtime GenAI's own model builder emits.
//! Weights may be f16; compute is f32; the KV cache is stored in the
//! package's KV dtype.

mod forms;
mod genai;
mod gpt2;
mod llama;
pub mod vision;

use onnx_genai_onnx::builder::attr_int;
use onnx_genai_onnx::{DataType, Dim, GraphBuilder, Model, Tensor};
use onnx_genai_package::{ElementType, Family};

use crate::rng::SplitMix64;
use crate::spec::Spec;

/// How the decoder is expressed in ONNX.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    /// Standard basic ops only (opset 17).
    Decomposed,
    /// ONNX opset 23 `RMSNormalization`, `RotaryEmbedding`, `Attention`
    /// with past/present KV.
    Opset23,
    /// com.microsoft `SimplifiedLayerNormalization`,
    /// `SkipSimplifiedLayerNormalization`, `RotaryEmbedding`,
    /// `GroupQueryAttention`, and `MatMulNBits` (4-bit, blocks of 32).
    Contrib,
    /// What ONNX Runtime GenAI's model builder emits for an int4 CPU llama
    /// (`-p int4 -e cpu`), in its directory layout (`genai_config.json`, no
    /// `package.yaml`): no `position_ids` input (positions and GQA sequence
    /// lengths come from `attention_mask` inside the graph), one packed QKV
    /// `MatMulNBits` per layer feeding `GroupQueryAttention` with rotary
    /// inside, `SkipSimplifiedLayerNormalization`, f32 I/O and KV, and
    /// weights in `model.onnx.data`. Quantization follows [`crate::spec::GenaiExport`].
    Genai,
}

impl Variant {
    pub const ALL: [Variant; 4] = [Variant::Decomposed, Variant::Opset23, Variant::Contrib, Variant::Genai];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Decomposed => "decomposed",
            Variant::Opset23 => "opset23",
            Variant::Contrib => "contrib",
            Variant::Genai => "genai",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.name() == s)
    }

    fn opset(self) -> i64 {
        match self {
            Variant::Opset23 => 23,
            Variant::Genai => 21,
            _ => 17,
        }
    }

    fn ir_version(self) -> i64 {
        match self {
            Variant::Opset23 => 11,
            Variant::Genai => 10,
            _ => 8,
        }
    }

    /// Whether the graph uses the com.microsoft fused ops.
    pub fn contrib_ops(self) -> bool {
        matches!(self, Variant::Contrib | Variant::Genai)
    }
}

pub const MS_DOMAIN: &str = "com.microsoft";
pub(crate) const OPSET_DECOMPOSED: i64 = 17;
pub(crate) const IR_VERSION_DECOMPOSED: i64 = 8;
/// `MatMulNBits` block size of the contrib export.
pub const NBITS_BLOCK: usize = 32;

/// Tensor names of the graph's I/O, bound to roles by the manifest.
pub mod names {
    pub const INPUT_IDS: &str = "input_ids";
    pub const INPUTS_EMBEDS: &str = "inputs_embeds";
    pub const PIXEL_VALUES: &str = "pixel_values";
    pub const IMAGE_EMBEDS: &str = "image_embeds";
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

pub fn build_decoder(spec: &Spec, variant: Variant) -> Result<Model, crate::BuildError> {
    let mut d = Decoder::new(spec, variant);
    match spec.family {
        Family::Llama => llama::build(&mut d),
        Family::Gpt2 => gpt2::build(&mut d),
        Family::Decoder => {
            return Err(crate::BuildError::Spec {
                origin: spec.name.clone(),
                reason: "the `decoder` family is what imported packages of a generic type get; build `llama` or `gpt2`"
                    .into(),
            })
        }
    }
    Ok(d.b.finish(variant.ir_version(), env!("CARGO_PKG_VERSION")))
}

/// A weight's values before storage: the f16 package rounds them through
/// f16 first, so every export (including the 4-bit one) starts from the
/// same numbers.
#[derive(Clone)]
pub(crate) struct WeightValues {
    pub name: String,
    pub dims: Vec<u32>,
    pub values: Vec<f32>,
    /// A pretrained projection's own 4-bit blocks (see [`crate::pretrained::Q4Blocks`]).
    pub q4: Option<std::sync::Arc<crate::pretrained::Q4Blocks>>,
}

/// Shared state while one decoder graph is built.
pub(crate) struct Decoder<'s> {
    pub spec: &'s Spec,
    pub variant: Variant,
    pub b: GraphBuilder,
    pub rng: SplitMix64,
    /// The additive attention bias, made on first use (decomposed and
    /// opset 23; contrib attention is causal by itself).
    mask_bias: Option<String>,
    /// Vision-language decoders take `inputs_embeds`; the embedding table
    /// goes to the separate embedding component.
    pub embeds_input: bool,
    pub embedding: Option<WeightValues>,
    /// The genai export's shared 4-bit table (`[vocab, blocks, 16]`
    /// nibbles and its scales): the embedding gathers from it, the output
    /// projection multiplies by it.
    pub tied_q4: Option<forms::StoredQ4>,
}

/// The element type of activations, KV cache and stored float weights: the
/// genai export is f32 throughout, as ONNX Runtime GenAI's int4 CPU export is.
pub(crate) fn io_dtype(spec: &Spec, variant: Variant) -> ElementType {
    if variant == Variant::Genai {
        ElementType::F32
    } else {
        spec.dtype
    }
}

impl<'s> Decoder<'s> {
    fn new(spec: &'s Spec, variant: Variant) -> Self {
        let mut b = GraphBuilder::new(&spec.name, variant.opset());
        if variant.contrib_ops() {
            b.opset(MS_DOMAIN, 1);
        }
        let kv = io_dtype(spec, variant).onnx();
        let (batch, seq, total, past) = (dim("batch"), dim("sequence"), dim("total_sequence"), dim("past_sequence"));
        let embeds_input = spec.vision.is_some();
        if embeds_input {
            let hidden = Dim::Fixed(spec.hidden_size.into());
            b.input(names::INPUTS_EMBEDS, DataType::Float, vec![batch.clone(), seq.clone(), hidden]);
        } else {
            b.input(names::INPUT_IDS, DataType::Int64, vec![batch.clone(), seq.clone()]);
        }
        b.input(names::ATTENTION_MASK, DataType::Int64, vec![batch.clone(), total.clone()]);
        if variant != Variant::Genai {
            b.input(names::POSITION_IDS, DataType::Int64, vec![batch.clone(), seq.clone()]);
        }
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
        Self {
            spec,
            variant,
            b,
            rng: SplitMix64::new(spec.seed),
            mask_bias: None,
            embeds_input,
            embedding: None,
            tied_q4: None,
        }
    }

    /// Draws a weight's values (uniform in `offset ± scale`), rounded through
    /// f16 for f16 packages.
    /// A pretrained spec takes the weight of that name instead; its loader
    /// has checked that every weight the graph asks for is there.
    pub fn draw(&mut self, name: &str, dims: &[u32], scale: f32, offset: f32) -> WeightValues {
        let n: usize = dims.iter().map(|d| *d as usize).product();
        let (mut values, q4): (Vec<f32>, _) = match &self.spec.pretrained {
            Some(p) => match p.weights.get(name) {
                Some(w) if w.dims == dims => (w.values.clone(), w.q4.clone()),
                found => panic!(
                    "{}: the loader must provide weight `{name}` {dims:?}, found {:?}",
                    p.origin,
                    found.map(|w| &w.dims)
                ),
            },
            None => (self.rng.fill(n, scale).into_iter().map(|v| v + offset).collect(), None),
        };
        if self.spec.dtype == ElementType::F16 {
            values.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32());
        }
        WeightValues { name: name.into(), dims: dims.to_vec(), values, q4 }
    }

    /// Stores a weight in the package dtype; returns an f32 value.
    pub fn store(&mut self, w: &WeightValues) -> String {
        let dims: Vec<i64> = w.dims.iter().map(|d| i64::from(*d)).collect();
        match io_dtype(self.spec, self.variant) {
            ElementType::F32 => self.b.initializer(Tensor::from_f32(&w.name, dims, &w.values)),
            ElementType::F16 => {
                let halves: Vec<half::f16> = w.values.iter().map(|v| half::f16::from_f32(*v)).collect();
                let stored = self.b.initializer(Tensor::from_f16(&w.name, dims, &halves));
                self.b.op_with("Cast", &[&stored], vec![attr_int("to", DataType::Float.onnx_code().into())])
            }
        }
    }

    /// A stored weight (norm scales, biases, embeddings).
    pub fn weight(&mut self, name: &str, dims: &[u32], scale: f32, offset: f32) -> String {
        let w = self.draw(name, dims, scale, offset);
        self.store(&w)
    }

    /// `x @ W` for a `[inputs, outputs]` weight with fan-in scaling.
    pub fn project(&mut self, x: &str, name: &str, inputs: u32, outputs: u32) -> String {
        let w = self.draw_projection(name, inputs, outputs);
        self.apply_weight(x, &w)
    }

    /// A `[inputs, outputs]` projection weight with fan-in scaling.
    pub fn draw_projection(&mut self, name: &str, inputs: u32, outputs: u32) -> WeightValues {
        self.draw(name, &[inputs, outputs], 1.0 / (inputs as f32).sqrt(), 0.0)
    }

    /// `x @ W` in the variant's form: MatMul, or MatMulNBits for contrib.
    pub fn apply_weight(&mut self, x: &str, w: &WeightValues) -> String {
        if self.variant.contrib_ops() {
            forms::matmul_nbits(self, x, w)
        } else {
            let stored = self.store(w);
            self.b.op("MatMul", &[x, &stored])
        }
    }

    /// `x @ W + b` (GPT-2 projections).
    pub fn biased_project(&mut self, x: &str, prefix: &str, inputs: u32, outputs: u32) -> String {
        let y = self.project(x, &format!("{prefix}.weight"), inputs, outputs);
        let b = self.draw(&format!("{prefix}.bias"), &[outputs], 0.1, 0.0);
        self.add_bias(&y, &b)
    }

    /// `y + b` for a projection's bias.
    pub fn add_bias(&mut self, y: &str, bias: &WeightValues) -> String {
        let b = self.store(bias);
        self.b.op("Add", &[y, &b])
    }

    /// `[batch, seq, heads*dim]` -> `[batch, heads, seq, dim]`.
    pub fn split_heads(&mut self, x: &str, heads: u32) -> String {
        let shape = self.b.const_i64(&[0, 0, heads.into(), self.spec.head_dim().into()]);
        let r = self.b.op("Reshape", &[x, &shape]);
        self.b.op_with("Transpose", &[&r], vec![onnx_genai_onnx::builder::attr_ints("perm", &[0, 2, 1, 3])])
    }

    /// `[batch, heads, seq, dim]` -> `[batch, seq, heads*dim]`.
    pub fn merge_heads(&mut self, x: &str) -> String {
        let spec = self.spec;
        let t = self.b.op_with("Transpose", &[x], vec![onnx_genai_onnx::builder::attr_ints("perm", &[0, 2, 1, 3])]);
        let merged = self.b.const_i64(&[0, 0, i64::from(spec.num_attention_heads * spec.head_dim())]);
        self.b.op("Reshape", &[&t, &merged])
    }

    /// The additive attention bias (made once): 0 where a query may attend
    /// (causal and not padding), -1e9 elsewhere; `[batch, 1, seq, total]`,
    /// or tiled to `[batch, 1, n_rep*seq, total]` for grouped decomposed GQA.
    pub fn mask_bias(&mut self) -> String {
        if let Some(m) = &self.mask_bias {
            return m.clone();
        }
        let bias = forms::causal_mask_bias(self);
        self.mask_bias = Some(bias.clone());
        bias
    }

    /// Final projection to `logits` `[batch, seq, vocab]`.
    pub fn lm_head(&mut self, x: &str, embedding: &WeightValues, embedding_value: &str) {
        let spec = self.spec;
        let logits = if spec.tie_embeddings {
            match self.variant {
                // A pretrained table keeps its own precision: quantizing the
                // output projection to 4 bits costs more accuracy than any
                // other weight.
                // ONNX Runtime GenAI's builder quantizes the output
                // projection too, pretrained or not.
                Variant::Genai => match self.tied_q4.clone() {
                    Some(tied) => forms::nbits_apply(self, x, &tied),
                    None => {
                        let w = transposed_embedding(spec, embedding);
                        forms::matmul_nbits(self, x, &w)
                    }
                },
                Variant::Contrib if spec.pretrained.is_none() => {
                    let w = transposed_embedding(spec, embedding);
                    forms::matmul_nbits(self, x, &w)
                }
                _ => {
                    let w = self.b.op_with(
                        "Transpose",
                        &[embedding_value],
                        vec![onnx_genai_onnx::builder::attr_ints("perm", &[1, 0])],
                    );
                    self.b.op("MatMul", &[x, &w])
                }
            }
        } else {
            self.project(x, "lm_head.weight", spec.hidden_size, spec.vocab_size)
        };
        self.b.op_into("Identity", &[&logits], &[names::LOGITS], Vec::new());
    }

    /// A constant f32 tensor initializer of `values` with `dims`.
    pub fn table(&mut self, name: &str, dims: Vec<i64>, values: &[f32]) -> String {
        self.b.initializer(Tensor::from_f32(name, dims, values))
    }
}

/// The tied output projection as a `[hidden, vocab]` weight: `MatMulNBits`
/// wants `[K, N]` semantics, and the tied weight is the embedding transposed.
pub(crate) fn transposed_embedding(spec: &Spec, embedding: &WeightValues) -> WeightValues {
    let (v, h) = (spec.vocab_size as usize, spec.hidden_size as usize);
    let mut t = vec![0.0; v * h];
    for (tok, row) in embedding.values.chunks_exact(h).enumerate() {
        for (j, x) in row.iter().enumerate() {
            t[j * v + tok] = *x;
        }
    }
    WeightValues { name: "lm_head.tied".into(), dims: vec![spec.hidden_size, spec.vocab_size], values: t, q4: None }
}

fn dim(name: &str) -> Dim {
    Dim::Symbolic(name.into())
}
