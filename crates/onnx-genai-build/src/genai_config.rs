//! ONNX Runtime GenAI's `genai_config.json` for a built package, so that
//! packages in that layout can be produced (and imported back) from a spec.

use crate::graph::{names, Variant};
use crate::spec::Spec;
use onnx_genai_package::Family;

/// Written next to `tokenizer.json` in the genai layout, as their builder does.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// The `genai_config.json` text describing the package built as `variant`
/// (contrib: ours, loadable by their runtime; genai: every key their model
/// builder writes for an int4 CPU llama, including
/// `past_present_share_buffer: true`, which its `GroupQueryAttention` graphs
/// get).
pub fn genai_config(spec: &Spec, variant: Variant) -> String {
    let eos = spec.eos_token_id();
    let bos = spec.pretrained.as_ref().and_then(|p| p.bos_token_id).unwrap_or(eos);
    let template = |t: &str| t.replace("{layer}", "%d");
    let theirs = variant == Variant::Genai;
    let mut inputs = serde_json::json!({
        "input_ids": names::INPUT_IDS,
        "attention_mask": names::ATTENTION_MASK,
        "past_key_names": template(names::PAST_KEY),
        "past_value_names": template(names::PAST_VALUE),
    });
    if !theirs {
        inputs["position_ids"] = names::POSITION_IDS.into();
    }
    let mut search = if theirs {
        serde_json::json!({
            "diversity_penalty": 0.0,
            "do_sample": false,
            "early_stopping": true,
            "length_penalty": 1.0,
            "max_length": spec.max_sequence_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": true,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        })
    } else {
        serde_json::json!({
            "do_sample": false,
            "max_length": spec.max_sequence_length,
            "num_beams": 1,
            "past_present_share_buffer": false,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        })
    };
    if let Some(p) = &spec.pretrained {
        carry_sampling(&mut search, &p.sampling);
    }
    let config = serde_json::json!({
        "model": {
            "bos_token_id": bos,
            "context_length": spec.max_sequence_length,
            "decoder": {
                "session_options": { "log_id": "onnxruntime-genai", "provider_options": [] },
                "filename": crate::MODEL_FILE,
                "head_size": spec.head_dim(),
                "hidden_size": spec.hidden_size,
                "inputs": inputs,
                "outputs": {
                    "logits": names::LOGITS,
                    "present_key_names": template(names::PRESENT_KEY),
                    "present_value_names": template(names::PRESENT_VALUE),
                },
                "num_attention_heads": spec.num_attention_heads,
                "num_hidden_layers": spec.num_layers,
                "num_key_value_heads": spec.kv_heads(),
            },
            "eos_token_id": eos,
            "pad_token_id": eos,
            // ONNX Runtime GenAI's `gpt2` type is its combined-KV GPT-2
            // pipeline; our exports keep K and V apart per layer, which its
            // generic `decoder` type runs.
            "type": match spec.family { Family::Llama => "llama", Family::Gpt2 | Family::Decoder => "decoder" },
            "vocab_size": spec.vocab_size,
        },
        "search": search,
    });
    serde_json::to_string_pretty(&config).unwrap_or_default()
}

/// The checkpoint's sampling defaults in `search`, where ONNX Runtime GenAI
/// (and the package reader) take them from: sampled when the default
/// temperature is above 0, every sampling key then written (the contrib
/// template's greedy `top_k: 1` must not survive).
fn carry_sampling(search: &mut serde_json::Value, sampling: &onnx_genai_package::manifest::SamplingDefaults) {
    if sampling.is_empty() {
        return;
    }
    // f32 → the shortest decimal (0.7, not 0.699999988).
    let num = |v: f32| v.to_string().parse::<f64>().map_or(serde_json::Value::Null, serde_json::Value::from);
    let sampled = sampling.temperature.is_some_and(|t| t > 0.0);
    search["do_sample"] = sampled.into();
    if sampled {
        search["temperature"] = num(sampling.temperature.unwrap_or(1.0));
        search["top_p"] = num(sampling.top_p.unwrap_or(1.0));
        // 0 keeps every token, in both readers.
        search["top_k"] = sampling.top_k.unwrap_or(0).into();
    }
    if let Some(r) = sampling.repetition_penalty {
        search["repetition_penalty"] = num(r);
    }
}

/// `tokenizer_config.json` as Hugging Face tokenizers write it: the special
/// tokens and the chat template.
pub fn tokenizer_config(spec: &Spec) -> String {
    // A pretrained tokenizer names its own specials in `tokenizer.json`.
    let eos = spec.pretrained.is_none().then_some(crate::tokenizer::SPECIAL_TOKENS[0]);
    let template = match &spec.pretrained {
        Some(p) => p.chat_template.clone(),
        None => Some(crate::tokenizer::CHAT_TEMPLATE.to_string()),
    };
    let config = serde_json::json!({
        "add_bos_token": false,
        "bos_token": eos,
        "eos_token": eos,
        "chat_template": template,
        "model_max_length": spec.max_sequence_length,
        "tokenizer_class": "GPT2Tokenizer",
    });
    serde_json::to_string_pretty(&config).unwrap_or_default()
}
