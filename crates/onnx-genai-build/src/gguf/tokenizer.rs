//! `tokenizer.ggml.*` metadata → a Hugging Face `tokenizer.json`:
//! byte-level BPE (`tokenizer.ggml.model = gpt2`) with the vocabulary,
//! merges and special tokens of the file, and the pre-tokenization that
//! `tokenizer.ggml.pre` names (the same split llama.cpp applies for that
//! name).

use serde_json::{json, Map, Value as Json};

use super::{Gguf, GgufError, Value};

/// Llama 3's split: case-insensitive contractions, numbers in groups of at
/// most three, newlines kept together.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGML token types.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The pre-tokenizer for a `tokenizer.ggml.pre` name.
fn pre_tokenizer(name: &str) -> Result<Json, GgufError> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    Ok(match name {
        // ByteLevel's own regex is GPT-2's split: contractions, letters,
        // numbers, other symbols, whitespace runs that leave their last
        // space to the next word.
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        // Every digit is its own pre-token, then GPT-2's split.
        "smollm" | "starcoder" | "refact" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)],
        }),
        "llama3" | "llama-bpe" | "llama-v3" => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ],
        }),
        other => {
            return Err(GgufError::Metadata {
                key: "tokenizer.ggml.pre".into(),
                reason: format!(
                    "pre-tokenizer `{other}` is not supported (supported: default, gpt2, smollm, starcoder, refact, llama-bpe)"
                ),
            })
        }
    })
}

/// The `tokenizer.json` text for the file's tokenizer.
pub fn tokenizer_json(g: &Gguf) -> Result<String, GgufError> {
    let model = g.require("tokenizer.ggml.model", "a string", |v| v.as_str().map(str::to_string))?;
    if model != "gpt2" {
        return Err(GgufError::Metadata {
            key: "tokenizer.ggml.model".into(),
            reason: format!("tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`)"),
        });
    }
    let strings = |key: &str| -> Result<Vec<String>, GgufError> {
        g.require(key, "an array of strings", |v| {
            v.as_array()?.iter().map(|s| s.as_str().map(str::to_string)).collect::<Option<Vec<_>>>()
        })
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(_) => g.require("tokenizer.ggml.token_type", "an array of integers", |v| {
            v.as_array()?.iter().map(|t| if let Value::I32(x) = t { Some(i64::from(*x)) } else { None }).collect()
        })?,
    };
    if types.len() != tokens.len() {
        return Err(GgufError::Metadata {
            key: "tokenizer.ggml.token_type".into(),
            reason: format!("{} types for {} tokens", types.len(), tokens.len()),
        });
    }
    let pre = match g.get("tokenizer.ggml.pre") {
        None => "default".to_string(),
        Some(_) => g.require("tokenizer.ggml.pre", "a string", |v| v.as_str().map(str::to_string))?,
    };
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (token, ty)) in tokens.iter().zip(&types).enumerate() {
        if vocab.insert(token.clone(), json!(id)).is_some() {
            return Err(GgufError::Metadata {
                key: "tokenizer.ggml.tokens".into(),
                reason: format!("token {token:?} appears twice (second at id {id})"),
            });
        }
        if *ty == CONTROL || *ty == USER_DEFINED {
            added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": *ty == CONTROL,
            }));
        }
    }
    let merges: Vec<Json> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ').map(|(a, b)| json!([a, b])).ok_or_else(|| GgufError::Metadata {
                key: "tokenizer.ggml.merges".into(),
                reason: format!("merge #{i} {m:?} is not two tokens separated by a space"),
            })
        })
        .collect::<Result<_, _>>()?;
    let unk = g.get("tokenizer.ggml.unknown_token_id").and_then(Value::as_u64).and_then(|id| tokens.get(id as usize));
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(&pre)?,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    let text = serde_json::to_string(&doc).map_err(|e| GgufError::Unsupported(e.to_string()))?;
    // Loading it back is the check that the file is a tokenizer.
    tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| GgufError::Metadata {
        key: "tokenizer.ggml.*".into(),
        reason: format!("the tokenizer built from the metadata does not load: {e}"),
    })?;
    Ok(text)
}
