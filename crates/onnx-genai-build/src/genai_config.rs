//! ONNX Runtime GenAI's `genai_config.json` for a built package, so that
//! packages in that layout can be produced (and imported back) from a spec.

use crate::graph::names;
use crate::spec::Spec;
use onnx_genai_package::Family;

/// The `genai_config.json` text describing the package [`crate::build_package`] writes.
pub fn genai_config(spec: &Spec) -> String {
    let eos = spec.eos_token_id();
    let bos = spec.pretrained.as_ref().and_then(|p| p.bos_token_id).unwrap_or(eos);
    let template = |t: &str| t.replace("{layer}", "%d");
    let config = serde_json::json!({
        "model": {
            "bos_token_id": bos,
            "context_length": spec.max_sequence_length,
            "decoder": {
                "session_options": { "log_id": "onnxruntime-genai", "provider_options": [] },
                "filename": crate::MODEL_FILE,
                "head_size": spec.head_dim(),
                "hidden_size": spec.hidden_size,
                "inputs": {
                    "input_ids": names::INPUT_IDS,
                    "attention_mask": names::ATTENTION_MASK,
                    "position_ids": names::POSITION_IDS,
                    "past_key_names": template(names::PAST_KEY),
                    "past_value_names": template(names::PAST_VALUE),
                },
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
        "search": {
            "do_sample": false,
            "max_length": spec.max_sequence_length,
            "num_beams": 1,
            "past_present_share_buffer": false,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        }
    });
    serde_json::to_string_pretty(&config).unwrap_or_default()
}
