//! A Hugging Face checkpoint directory → a [`Spec`] carrying its weights:
//! `config.json` for the architecture, `model.safetensors` (or the shards
//! `model.safetensors.index.json` names, each memory-mapped) for the
//! weights, `tokenizer.json`, the chat template of `chat_template.jinja` or
//! `tokenizer_config.json`, and the special tokens and sampling defaults
//! of `generation_config.json` / `config.json`. The llama family (Llama,
//! Mistral, SmolLM) and Qwen2 (biases on Q, K and V) become llama specs,
//! GPT-2 a gpt2 spec; every export form the builder makes can then be
//! built from the spec.

mod gpt2;
mod llama;
mod tensors;

use std::path::{Path, PathBuf};

use onnx_genai_package::manifest::SamplingDefaults;
use serde_json::Value;

use crate::pretrained::Pretrained;
use crate::spec::Spec;
use tensors::Tensors;

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// A file that does not read as what it must be (the file, then why).
    #[error("{file}: {reason}")]
    Invalid { file: String, reason: String },
    /// A checkpoint this importer does not take, and why.
    #[error("{0}")]
    Unsupported(String),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
}

/// The `architectures` this importer reads.
pub const ARCHITECTURES: [&str; 4] = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"];

const GENERATION_CONFIG: &str = "generation_config.json";

/// The most bytes a checkpoint's text file (config, tokenizer, template)
/// is read to: a large vocabulary's `tokenizer.json` is tens of MB.
const MAX_TEXT_FILE: u64 = 256 << 20;

/// A text file of the checkpoint: a regular file (through symlinks, as the
/// Hugging Face cache links its files) of at most [`MAX_TEXT_FILE`] bytes —
/// a `tokenizer.json` linked to `/dev/zero` was read until the process was
/// killed, one linked to a pipe waited for good.
fn read(dir: &Path, file: &str) -> Result<String, HfError> {
    use std::io::Read;
    let path = dir.join(file);
    let io = |source| HfError::Io { path: path.clone(), source };
    if !std::fs::metadata(&path).map_err(io)?.is_file() {
        return Err(HfError::Invalid { file: file.into(), reason: "is not a regular file".into() });
    }
    let mut text = String::new();
    std::fs::File::open(&path).map_err(io)?.take(MAX_TEXT_FILE + 1).read_to_string(&mut text).map_err(io)?;
    if text.len() as u64 > MAX_TEXT_FILE {
        return Err(HfError::Invalid {
            file: file.into(),
            reason: format!("holds more than {} MiB", MAX_TEXT_FILE >> 20),
        });
    }
    Ok(text)
}

fn json(dir: &Path, file: &str) -> Result<Value, HfError> {
    serde_json::from_str(&read(dir, file)?).map_err(|e| HfError::Invalid { file: file.into(), reason: e.to_string() })
}

/// A JSON object of the checkpoint whose keys are read with their types
/// checked: a wrong type is an error naming the file and the key.
struct Keys<'a> {
    file: &'a str,
    value: &'a Value,
}

/// A JSON number that is a `u32` (a count, a token id).
fn as_u32(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|v| u32::try_from(v).ok())
}

impl Keys<'_> {
    fn invalid(&self, key: &str, want: &str) -> HfError {
        HfError::Invalid { file: self.file.into(), reason: format!("`{key}` must be {want}, got {}", self.value[key]) }
    }

    fn present(&self, key: &str) -> bool {
        !self.value[key].is_null()
    }

    /// A positive integer that must be there.
    fn int(&self, key: &str) -> Result<u32, HfError> {
        as_u32(&self.value[key]).filter(|v| *v > 0).ok_or_else(|| self.invalid(key, "a positive integer"))
    }

    fn int_or(&self, key: &str, default: u32) -> Result<u32, HfError> {
        if self.present(key) {
            self.int(key)
        } else {
            Ok(default)
        }
    }

    /// A non-negative integer, when present.
    fn count(&self, key: &str) -> Result<Option<u32>, HfError> {
        match &self.value[key] {
            Value::Null => Ok(None),
            v => as_u32(v).map(Some).ok_or_else(|| self.invalid(key, "a count")),
        }
    }

    fn float(&self, key: &str) -> Result<Option<f64>, HfError> {
        match &self.value[key] {
            Value::Null => Ok(None),
            v => v.as_f64().map(Some).ok_or_else(|| self.invalid(key, "a number")),
        }
    }

    fn float_or(&self, key: &str, default: f64) -> Result<f64, HfError> {
        Ok(self.float(key)?.unwrap_or(default))
    }

    fn flag(&self, key: &str) -> Result<Option<bool>, HfError> {
        match &self.value[key] {
            Value::Null => Ok(None),
            v => v.as_bool().map(Some).ok_or_else(|| self.invalid(key, "true or false")),
        }
    }

    fn text(&self, key: &str) -> Option<&str> {
        self.value[key].as_str()
    }
}

/// The checkpoint at `dir` as a spec named `name` (f32; set `dtype` for an
/// f16 export).
pub fn spec_from_hf(dir: &Path, name: &str) -> Result<Spec, HfError> {
    let value = json(dir, "config.json")?;
    let config = Keys { file: "config.json", value: &value };
    let arch = value["architectures"].get(0).and_then(Value::as_str).unwrap_or("");
    if !ARCHITECTURES.contains(&arch) {
        return Err(HfError::Unsupported(format!(
            "config.json architectures {:?} is not supported (this importer reads {})",
            value["architectures"],
            ARCHITECTURES.join(", ")
        )));
    }
    let text = text_files(dir, &config)?;
    let mut tensors = Tensors::open(dir)?;
    let spec = match arch {
        "GPT2LMHeadModel" => gpt2::spec(&config, &mut tensors, text, name)?,
        _ => llama::spec(&config, &mut tensors, text, name, arch == "Qwen2ForCausalLM")?,
    };
    spec.check(&dir.display().to_string()).map_err(|e| HfError::Unsupported(e.to_string()))?;
    Ok(spec)
}

/// A tensor of the checkpoint the graph does not read would be lost:
/// refused by name. `ignored` names what is not a weight (buffers a
/// checkpoint may carry, like rotary frequencies or causal masks).
fn refuse_unused(tensors: &Tensors, family: &str, ignored: impl Fn(&str) -> bool) -> Result<(), HfError> {
    match tensors.unused().into_iter().find(|n| !ignored(n)) {
        Some(name) => {
            Err(HfError::Tensor { name, reason: format!("is in the checkpoint but not read by a {family} graph") })
        }
        None => Ok(()),
    }
}

/// Everything of the checkpoint but its weights: tokenizer, chat template,
/// special tokens, generation defaults.
fn text_files(dir: &Path, config: &Keys) -> Result<Pretrained, HfError> {
    let tokenizer_json = read(dir, "tokenizer.json").map_err(|e| {
        HfError::Unsupported(format!(
            "{e}: the importer needs Hugging Face's fast-tokenizer file (`AutoTokenizer.from_pretrained(...).save_pretrained(dir)` writes it)"
        ))
    })?;
    let chat_template = if dir.join("chat_template.jinja").is_file() {
        Some(read(dir, "chat_template.jinja")?)
    } else if dir.join("tokenizer_config.json").is_file() {
        let tc = json(dir, "tokenizer_config.json")?;
        match &tc["chat_template"] {
            Value::String(s) => Some(s.clone()),
            Value::Array(named) => {
                named.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_string)
            }
            _ => None,
        }
    } else {
        None
    };
    let generation_value =
        if dir.join(GENERATION_CONFIG).is_file() { json(dir, GENERATION_CONFIG)? } else { Value::Null };
    let generation = Keys { file: GENERATION_CONFIG, value: &generation_value };
    let special = |key: &str| if generation.present(key) { &generation.value[key] } else { &config.value[key] };
    // A malformed id is an error naming its file, not dropped: a BOS of -1
    // silently became none, and an end-of-sequence list kept what parsed.
    let id = |key: &str, v: &Value| {
        as_u32(v).ok_or_else(|| HfError::Invalid {
            file: if generation.present(key) { GENERATION_CONFIG } else { "config.json" }.into(),
            reason: format!("`{key}` must be a token id (or a list of them), got {v}"),
        })
    };
    let eos_token_ids: Vec<u32> = match special("eos_token_id") {
        Value::Array(ids) => ids.iter().map(|v| id("eos_token_id", v)).collect::<Result<_, _>>()?,
        Value::Null => Vec::new(),
        v => vec![id("eos_token_id", v)?],
    };
    let bos_token_id = match special("bos_token_id") {
        Value::Null => None,
        v => Some(id("bos_token_id", v)?),
    };
    if eos_token_ids.is_empty() {
        let file = if generation.present("eos_token_id") { GENERATION_CONFIG } else { "config.json" };
        return Err(HfError::Invalid {
            file: file.into(),
            reason: format!("no usable eos_token_id ({}): generation could not stop", special("eos_token_id")),
        });
    }
    let (sampling, max_new_tokens) = if generation_value.is_object() {
        let top_k = generation.count("top_k")?;
        let sampling = SamplingDefaults::of_generation_config(
            generation.flag("do_sample")?,
            generation.float("temperature")?,
            top_k,
            generation.float("top_p")?,
            generation.float("repetition_penalty")?,
        );
        if let Some((key, v, range)) = sampling.out_of_range().into_iter().next() {
            return Err(HfError::Invalid {
                file: GENERATION_CONFIG.into(),
                reason: format!("`{key}` {v} must be {range}"),
            });
        }
        let max_new = if generation.present("max_new_tokens") { Some(generation.int("max_new_tokens")?) } else { None };
        (sampling, max_new)
    } else {
        (SamplingDefaults::default(), None)
    };
    Ok(Pretrained {
        weights: Default::default(),
        tokenizer_json,
        chat_template,
        bos_token_id,
        eos_token_ids,
        sampling,
        max_new_tokens,
        origin: dir.display().to_string(),
    })
}
