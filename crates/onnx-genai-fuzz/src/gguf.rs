//! A GGUF file parsed, then what `onnx-genai build --gguf` extracts from
//! it: the llama spec (with its weights) and the tokenizer, which must
//! load.

use onnx_genai_build::gguf::{tokenizer::tokenizer_json, weights::spec_from_gguf, Gguf};

pub(crate) fn run(data: &[u8]) -> Result<(), String> {
    let g = Gguf::parse(data.to_vec()).map_err(|e| e.to_string())?;
    let spec = spec_from_gguf(&g, "fuzz", "fuzz.gguf").map_err(|e| e.to_string());
    // The package build loads what extraction wrote; only a panic on the
    // way is a finding.
    let json = tokenizer_json(&g).map_err(|e| e.to_string())?;
    tokenizers::Tokenizer::from_bytes(json.as_bytes()).map_err(|e| e.to_string())?;
    spec.map(drop)
}
