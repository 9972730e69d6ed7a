//! GPT-2 (`GPT2LMHeadModel`): its `Conv1D` projections are stored
//! `[inputs, outputs]`, the builder's own layout, and the fused
//! `attn.c_attn` (`[hidden, 3 * hidden]`) is cut into the builder's Q, K
//! and V projections by columns. Weights are named `transformer.h.N.*`
//! (a `GPT2LMHeadModel` save) or `h.N.*` (a bare `GPT2Model`'s, as the
//! original checkpoints are).

use std::collections::HashMap;
use std::sync::Arc;

use super::{refuse_unused, HfError, Keys, Tensors};
use crate::pretrained::{transpose, Pretrained, PretrainedRef, Weight};
use crate::spec::Spec;

/// `activation_function` values that are the tanh approximation the gpt2
/// graph computes.
const TANH_GELU: [&str; 2] = ["gelu_new", "gelu_pytorch_tanh"];

pub(super) fn spec(
    config: &Keys,
    tensors: &mut Tensors,
    mut pretrained: Pretrained,
    name: &str,
) -> Result<Spec, HfError> {
    let hidden = config.int("n_embd")?;
    let layers = config.int("n_layer")?;
    let heads = config.int("n_head")?;
    let positions = config.int("n_positions")?;
    let vocab = config.int("vocab_size")?;
    // Checked: a crafted n_embd must be an error, not an overflow.
    let times =
        |k: u32| hidden.checked_mul(k).ok_or_else(|| HfError::Unsupported(format!("n_embd {hidden} is too large")));
    let (qkv_width, default_ffn) = (times(3)?, times(4)?);
    let ffn = config.int_or("n_inner", default_ffn)?;
    if !hidden.is_multiple_of(heads) {
        return Err(HfError::Unsupported(format!("n_embd {hidden} is not a multiple of n_head {heads}")));
    }
    let act = config.text("activation_function").unwrap_or("gelu_new");
    if !TANH_GELU.contains(&act) {
        return Err(HfError::Unsupported(format!(
            "config.json activation_function `{act}` is not supported ({} are)",
            TANH_GELU.join(", ")
        )));
    }
    for (key, computed) in
        [("scale_attn_weights", true), ("scale_attn_by_inverse_layer_idx", false), ("add_cross_attention", false)]
    {
        if config.flag(key)?.is_some_and(|v| v != computed) {
            return Err(HfError::Unsupported(format!(
                "config.json {key}: {} is not supported (the gpt2 graph computes {computed})",
                !computed
            )));
        }
    }
    let tied = config.flag("tie_word_embeddings")?.unwrap_or(true);
    let prefix = if tensors.has("transformer.wte.weight") { "transformer." } else { "" };
    let mut weights = HashMap::new();
    let mut put = |ours: String, w: Weight| {
        weights.insert(ours, w);
    };
    let theirs = |n: &str| format!("{prefix}{n}");
    put("transformer.wte.weight".into(), tensors.get(&theirs("wte.weight"), &[vocab, hidden])?);
    put("transformer.wpe.weight".into(), tensors.get(&theirs("wpe.weight"), &[positions, hidden])?);
    for l in 0..layers {
        let (ours, p) = (format!("transformer.h.{l}"), theirs(&format!("h.{l}")));
        for norm in ["ln_1", "ln_2"] {
            for part in ["weight", "bias"] {
                put(format!("{ours}.{norm}.{part}"), tensors.get(&format!("{p}.{norm}.{part}"), &[hidden])?);
            }
        }
        let qkv = tensors.get(&format!("{p}.attn.c_attn.weight"), &[hidden, qkv_width])?;
        let qkv_bias = tensors.get(&format!("{p}.attn.c_attn.bias"), &[qkv_width])?;
        for (i, proj) in ["q_proj", "k_proj", "v_proj"].into_iter().enumerate() {
            put(format!("{ours}.attn.{proj}.weight"), columns(&qkv, i, hidden));
            put(format!("{ours}.attn.{proj}.bias"), columns(&qkv_bias, i, hidden));
        }
        for (proj, inputs, outputs) in
            [("attn.c_proj", hidden, hidden), ("mlp.c_fc", hidden, ffn), ("mlp.c_proj", ffn, hidden)]
        {
            put(format!("{ours}.{proj}.weight"), tensors.get(&format!("{p}.{proj}.weight"), &[inputs, outputs])?);
            put(format!("{ours}.{proj}.bias"), tensors.get(&format!("{p}.{proj}.bias"), &[outputs])?);
        }
    }
    for part in ["weight", "bias"] {
        put(format!("transformer.ln_f.{part}"), tensors.get(&theirs(&format!("ln_f.{part}")), &[hidden])?);
    }
    if !tied {
        put("lm_head.weight".into(), transpose(tensors.get("lm_head.weight", &[vocab, hidden])?));
    }
    // `attn.bias` / `attn.masked_bias` are the causal-mask buffers old
    // checkpoints store; a tied checkpoint's output projection is the
    // embedding when transformers loads it.
    refuse_unused(tensors, "gpt2", |n| {
        n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias") || (tied && n == "lm_head.weight")
    })?;
    pretrained.weights = weights;
    Ok(Spec {
        name: name.into(),
        seed: 0,
        family: onnx_genai_package::Family::Gpt2,
        dtype: onnx_genai_package::ElementType::F32,
        hidden_size: hidden,
        num_layers: layers,
        num_attention_heads: heads,
        num_kv_heads: None,
        intermediate_size: ffn,
        vocab_size: vocab,
        max_sequence_length: positions,
        rope_theta: None,
        norm_epsilon: config.float_or("layer_norm_epsilon", 1e-5)?,
        tie_embeddings: tied,
        qkv_bias: false,
        vision: None,
        genai: Default::default(),
        pretrained: Some(PretrainedRef(Arc::new(pretrained))),
    })
}

/// The `i`-th block of `width` columns of a `[rows, k * width]` matrix
/// (or of a vector).
fn columns(w: &Weight, i: usize, width: u32) -> Weight {
    let width = width as usize;
    let stride = *w.dims.last().unwrap_or(&0) as usize;
    let values: Vec<f32> =
        w.values.chunks_exact(stride).flat_map(|row| row[i * width..(i + 1) * width].iter().copied()).collect();
    let mut dims = w.dims.clone();
    if let Some(last) = dims.last_mut() {
        *last = width as u32;
    }
    Weight { dims, values, q4: None }
}
