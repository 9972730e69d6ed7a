//! The llama family (`LlamaForCausalLM`, `MistralForCausalLM`; SmolLM is a
//! llama) and Qwen2 (`Qwen2ForCausalLM`: the same graph with biases on Q,
//! K and V). Hugging Face's names are the builder's own; projections are
//! stored `[outputs, inputs]` and are turned to the builder's `[inputs,
//! outputs]`.

use std::collections::HashMap;

use super::{refuse_unused, HfError, Keys, Tensors};
use crate::pretrained::{transpose, LlamaShape, Pretrained};
use crate::spec::Spec;

pub(super) fn spec(
    config: &Keys,
    tensors: &mut Tensors,
    mut pretrained: Pretrained,
    name: &str,
    qwen2: bool,
) -> Result<Spec, HfError> {
    let hidden = config.int("hidden_size")?;
    let layers = config.int("num_hidden_layers")?;
    let heads = config.int("num_attention_heads")?;
    let kv_heads = config.int_or("num_key_value_heads", heads)?;
    let ffn = config.int("intermediate_size")?;
    let vocab = config.int("vocab_size")?;
    let context = config.int("max_position_embeddings")?;
    if !hidden.is_multiple_of(heads) || kv_heads > heads || !heads.is_multiple_of(kv_heads) {
        return Err(HfError::Unsupported(format!(
            "{heads} heads ({kv_heads} KV heads) for hidden size {hidden}: KV heads must divide the heads"
        )));
    }
    let head_dim = hidden / heads;
    if config.present("head_dim") && config.value["head_dim"].as_u64() != Some(head_dim.into()) {
        return Err(HfError::Unsupported(format!(
            "config.json head_dim {} differs from hidden_size / num_attention_heads = {head_dim}",
            config.value["head_dim"]
        )));
    }
    if config.present("rope_scaling") {
        return Err(HfError::Unsupported(format!(
            "config.json rope_scaling {} is not supported",
            config.value["rope_scaling"]
        )));
    }
    // Qwen2 states a window it does not use unless `use_sliding_window`
    // (false by default there); Mistral's window is always on.
    let windowed = config.flag("use_sliding_window")?.unwrap_or(!qwen2);
    if let Some(window) = config.value["sliding_window"].as_u64().filter(|w| windowed && *w < u64::from(context)) {
        return Err(HfError::Unsupported(format!(
            "sliding_window {window} is shorter than max_position_embeddings {context}: sliding-window attention is not supported"
        )));
    }
    // What the llama graph does not compute must not be dropped silently
    // (Llama's `attention_bias` also biases the output projection).
    for key in ["attention_bias", "mlp_bias"] {
        if config.flag(key)? == Some(true) {
            return Err(HfError::Unsupported(format!(
                "config.json {key}: true is not supported (the llama graph has no such biases)"
            )));
        }
    }
    if let Some(act) = config.text("hidden_act").filter(|a| *a != "silu") {
        return Err(HfError::Unsupported(format!("config.json hidden_act `{act}` is not supported (silu is)")));
    }
    let tied = config.flag("tie_word_embeddings")?.unwrap_or(false);
    let mut weights = HashMap::new();
    weights
        .insert("model.embed_tokens.weight".to_string(), tensors.get("model.embed_tokens.weight", &[vocab, hidden])?);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            let name = format!("{p}.{norm}.weight");
            weights.insert(name.clone(), tensors.get(&name, &[hidden])?);
        }
        let kv_width = kv_heads * head_dim;
        for (proj, outputs, inputs) in [
            ("self_attn.q_proj", hidden, hidden),
            ("self_attn.k_proj", kv_width, hidden),
            ("self_attn.v_proj", kv_width, hidden),
            ("self_attn.o_proj", hidden, hidden),
            ("mlp.gate_proj", ffn, hidden),
            ("mlp.up_proj", ffn, hidden),
            ("mlp.down_proj", hidden, ffn),
        ] {
            let name = format!("{p}.{proj}.weight");
            weights.insert(name.clone(), transpose(tensors.get(&name, &[outputs, inputs])?));
        }
        if qwen2 {
            for (proj, outputs) in [("q_proj", hidden), ("k_proj", kv_width), ("v_proj", kv_width)] {
                let name = format!("{p}.self_attn.{proj}.bias");
                weights.insert(name.clone(), tensors.get(&name, &[outputs])?);
            }
        }
    }
    weights.insert("model.norm.weight".into(), tensors.get("model.norm.weight", &[hidden])?);
    if !tied {
        weights.insert("lm_head.weight".into(), transpose(tensors.get("lm_head.weight", &[vocab, hidden])?));
    }
    // Rotary frequencies are recomputed from rope_theta; a tied
    // checkpoint's stored output projection is replaced by the embedding
    // when transformers loads it, so it is never read there either.
    refuse_unused(tensors, "llama", |n| n.ends_with("rotary_emb.inv_freq") || (tied && n == "lm_head.weight"))?;
    pretrained.weights = weights;
    let shape = LlamaShape {
        hidden,
        layers,
        heads,
        kv_heads,
        ffn,
        vocab,
        context,
        rope_theta: rope_theta(config)?,
        norm_epsilon: config.float_or("rms_norm_eps", 1e-6)?,
        tied,
        qkv_bias: qwen2,
    };
    Ok(shape.spec(name, pretrained))
}

/// The rotary base. transformers v5 writes it inside `rope_parameters`
/// (with the scaling's type beside it) and no top-level `rope_theta`: read
/// there, the default type only — a base read as absent (10,000 where
/// Llama 3 says 500,000) or a scaling dropped makes a package that
/// validates and writes wrong text.
fn rope_theta(config: &super::Keys<'_>) -> Result<f64, HfError> {
    let top = config.float("rope_theta")?;
    let parameters = &config.value["rope_parameters"];
    if parameters.is_null() {
        return Ok(top.unwrap_or(10_000.0));
    }
    let unsupported = |what: String| HfError::Unsupported(format!("config.json rope_parameters: {what}"));
    let Some(parameters) = parameters.as_object() else {
        return Err(unsupported(format!("{parameters} is not an object")));
    };
    let kind = parameters.get("rope_type").or_else(|| parameters.get("type"));
    if let Some(kind) = kind.filter(|k| k.as_str() != Some("default")) {
        return Err(unsupported(format!("rope_type {kind} is not supported (only the default)")));
    }
    let theta = match parameters.get("rope_theta") {
        None => top.unwrap_or(10_000.0),
        Some(v) => v.as_f64().ok_or_else(|| unsupported(format!("rope_theta {v} is not a number")))?,
    };
    if top.is_some_and(|t| t != theta) {
        return Err(unsupported(format!(
            "rope_theta {theta} differs from the top-level rope_theta {}",
            top.unwrap_or(0.0)
        )));
    }
    Ok(theta)
}
