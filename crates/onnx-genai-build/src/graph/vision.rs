//! The three components of a vision-language package: a patch-embedding
//! vision encoder (`pixel_values` -> `image_embeds`), the token-embedding
//! component (`input_ids` -> `inputs_embeds`), and a llama decoder that
//! takes `inputs_embeds`.

use onnx_genai_onnx::builder::{attr_int, attr_ints};
use onnx_genai_onnx::{DataType, Dim, GraphBuilder, Model, Tensor};

use super::{names, Decoder, Variant, IR_VERSION_DECOMPOSED, OPSET_DECOMPOSED};
use crate::rng::SplitMix64;
use crate::spec::Spec;

pub struct VisionLanguage {
    pub vision: Model,
    pub embed: Model,
    pub decoder: Model,
}

/// Builds the components for a spec with a `vision` section.
pub fn build(spec: &Spec) -> Option<VisionLanguage> {
    let vision = spec.vision.as_ref()?;
    let mut d = Decoder::new(spec, Variant::Decomposed);
    super::llama::build(&mut d);
    let embedding = d.embedding.take()?;
    let decoder = d.b.finish(IR_VERSION_DECOMPOSED, env!("CARGO_PKG_VERSION"));

    let (batch, seq) = (Dim::Symbolic("batch".into()), Dim::Symbolic("sequence".into()));
    let h = i64::from(spec.hidden_size);
    let mut e = GraphBuilder::new(&format!("{}-embed", spec.name), OPSET_DECOMPOSED);
    e.input(names::INPUT_IDS, DataType::Int64, vec![batch.clone(), seq.clone()]);
    e.output(names::INPUTS_EMBEDS, DataType::Float, vec![batch.clone(), seq, Dim::Fixed(h)]);
    let table =
        e.initializer(Tensor::from_f32(&embedding.name, vec![i64::from(spec.vocab_size), h], &embedding.values));
    e.op_into("Gather", &[&table, names::INPUT_IDS], &[names::INPUTS_EMBEDS], vec![attr_int("axis", 0)]);
    let embed = e.finish(IR_VERSION_DECOMPOSED, env!("CARGO_PKG_VERSION"));

    // Patchify [1, C, S, S] -> [1, N, C*p*p], then project to the hidden size.
    let (c, size, p) = (i64::from(vision.channels), i64::from(vision.image_size), i64::from(vision.patch_size));
    let (grid, patch) = (size / p, c * p * p);
    let mut rng = SplitMix64::new(spec.seed ^ 0x005E_ED0F_1A6E);
    let mut v = GraphBuilder::new(&format!("{}-vision", spec.name), OPSET_DECOMPOSED);
    v.input(
        names::PIXEL_VALUES,
        DataType::Float,
        vec![Dim::Fixed(1), Dim::Fixed(c), Dim::Fixed(size), Dim::Fixed(size)],
    );
    let n = i64::from(vision.tokens_per_image());
    v.output(names::IMAGE_EMBEDS, DataType::Float, vec![Dim::Fixed(1), Dim::Fixed(n), Dim::Fixed(h)]);
    let split = v.const_i64(&[1, c, grid, p, grid, p]);
    let x = v.op("Reshape", &[names::PIXEL_VALUES, &split]);
    let x = v.op_with("Transpose", &[&x], vec![attr_ints("perm", &[0, 2, 4, 1, 3, 5])]);
    let flat = v.const_i64(&[1, n, patch]);
    let x = v.op("Reshape", &[&x, &flat]);
    let scale = 1.0 / (patch as f32).sqrt();
    let w = v.initializer(Tensor::from_f32(
        "vision.patch_embed.weight",
        vec![patch, h],
        &rng.fill((patch * h) as usize, scale),
    ));
    let b = v.initializer(Tensor::from_f32("vision.patch_embed.bias", vec![h], &rng.fill(h as usize, 0.1)));
    let y = v.op("MatMul", &[&x, &w]);
    v.op_into("Add", &[&y, &b], &[names::IMAGE_EMBEDS], Vec::new());
    let vision = v.finish(IR_VERSION_DECOMPOSED, env!("CARGO_PKG_VERSION"));
    Some(VisionLanguage { vision, embed, decoder })
}
