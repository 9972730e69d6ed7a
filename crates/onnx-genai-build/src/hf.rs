//! A Hugging Face checkpoint directory → a [`Spec`] carrying its weights,
//! for the llama family (`LlamaForCausalLM`, `MistralForCausalLM`;
//! SmolLM is a llama): `config.json` for the architecture,
//! `model.safetensors` (or the shards `model.safetensors.index.json`
//! names, each memory-mapped) for the weights, `tokenizer.json`, the chat
//! template of `tokenizer_config.json` and the special tokens of
//! `generation_config.json` / `config.json`. Hugging Face's names are the
//! builder's own; projections are stored `[outputs, inputs]` and are
//! turned to the builder's `[inputs, outputs]`. Every export form the
//! builder makes can then be built from the spec.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::pretrained::{transpose, LlamaShape, Pretrained, Weight};
use crate::spec::Spec;

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

/// The `architectures` this importer reads (llama-family graphs).
pub const ARCHITECTURES: [&str; 2] = ["LlamaForCausalLM", "MistralForCausalLM"];

fn read(dir: &Path, file: &str) -> Result<String, HfError> {
    let path = dir.join(file);
    std::fs::read_to_string(&path).map_err(|source| HfError::Io { path, source })
}

fn json(dir: &Path, file: &str) -> Result<Value, HfError> {
    serde_json::from_str(&read(dir, file)?).map_err(|e| HfError::Invalid { file: file.into(), reason: e.to_string() })
}

/// The checkpoint at `dir` as a spec named `name` (f32; set `dtype` for an
/// f16 export).
pub fn spec_from_hf(dir: &Path, name: &str) -> Result<Spec, HfError> {
    let config = json(dir, "config.json")?;
    let arch = config["architectures"].get(0).and_then(Value::as_str).unwrap_or("");
    if !ARCHITECTURES.contains(&arch) {
        return Err(HfError::Unsupported(format!(
            "config.json architectures {:?} is not supported (this importer reads {})",
            config["architectures"],
            ARCHITECTURES.join(", ")
        )));
    }
    let int = |key: &str| -> Result<u32, HfError> {
        config[key].as_u64().and_then(|v| u32::try_from(v).ok()).filter(|v| *v > 0).ok_or_else(|| HfError::Invalid {
            file: "config.json".into(),
            reason: format!("`{key}` must be a positive integer, got {}", config[key]),
        })
    };
    let hidden = int("hidden_size")?;
    let layers = int("num_hidden_layers")?;
    let heads = int("num_attention_heads")?;
    let kv_heads = if config["num_key_value_heads"].is_null() { heads } else { int("num_key_value_heads")? };
    let ffn = int("intermediate_size")?;
    let vocab = int("vocab_size")?;
    let context = int("max_position_embeddings")?;
    if !hidden.is_multiple_of(heads) || kv_heads > heads || !heads.is_multiple_of(kv_heads) {
        return Err(HfError::Unsupported(format!(
            "{heads} heads ({kv_heads} KV heads) for hidden size {hidden}: KV heads must divide the heads"
        )));
    }
    let head_dim = hidden / heads;
    if !config["head_dim"].is_null() && config["head_dim"].as_u64() != Some(head_dim.into()) {
        return Err(HfError::Unsupported(format!(
            "config.json head_dim {} differs from hidden_size / num_attention_heads = {head_dim}",
            config["head_dim"]
        )));
    }
    if !config["rope_scaling"].is_null() {
        return Err(HfError::Unsupported(format!(
            "config.json rope_scaling {} is not supported",
            config["rope_scaling"]
        )));
    }
    if let Some(window) = config["sliding_window"].as_u64().filter(|w| *w < u64::from(context)) {
        return Err(HfError::Unsupported(format!(
            "sliding_window {window} is shorter than max_position_embeddings {context}: sliding-window attention is not supported"
        )));
    }
    // What the llama graph does not compute must not be dropped silently.
    for key in ["attention_bias", "mlp_bias"] {
        if config[key].as_bool() == Some(true) {
            return Err(HfError::Unsupported(format!(
                "config.json {key}: true is not supported (no projection biases)"
            )));
        }
    }
    if let Some(act) = config["hidden_act"].as_str().filter(|a| *a != "silu") {
        return Err(HfError::Unsupported(format!("config.json hidden_act `{act}` is not supported (silu is)")));
    }
    let tied = config["tie_word_embeddings"].as_bool().unwrap_or(false);
    let mut tensors = Tensors::open(dir)?;
    let mut weights = HashMap::new();
    weights
        .insert("model.embed_tokens.weight".to_string(), tensors.get("model.embed_tokens.weight", &[vocab, hidden])?);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            let name = format!("{p}.{norm}.weight");
            weights.insert(name.clone(), tensors.get(&name, &[hidden])?);
        }
        for (proj, outputs, inputs) in [
            ("self_attn.q_proj", hidden, hidden),
            ("self_attn.k_proj", kv_heads * head_dim, hidden),
            ("self_attn.v_proj", kv_heads * head_dim, hidden),
            ("self_attn.o_proj", hidden, hidden),
            ("mlp.gate_proj", ffn, hidden),
            ("mlp.up_proj", ffn, hidden),
            ("mlp.down_proj", hidden, ffn),
        ] {
            let name = format!("{p}.{proj}.weight");
            weights.insert(name.clone(), transpose(tensors.get(&name, &[outputs, inputs])?));
        }
    }
    weights.insert("model.norm.weight".into(), tensors.get("model.norm.weight", &[hidden])?);
    if !tied {
        weights.insert("lm_head.weight".into(), transpose(tensors.get("lm_head.weight", &[vocab, hidden])?));
    }
    // A tensor the graph does not read (a bias, an extra layer) would be
    // lost: refused by name. Rotary frequencies are recomputed from
    // rope_theta.
    if let Some(extra) = tensors.unused(&weights).into_iter().find(|n| !n.ends_with("rotary_emb.inv_freq")) {
        return Err(HfError::Tensor {
            name: extra,
            reason: "is in the checkpoint but not read by a llama graph".into(),
        });
    }
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
    let generation =
        if dir.join("generation_config.json").is_file() { json(dir, "generation_config.json")? } else { Value::Null };
    let id_of = |v: &Value| v.as_u64().and_then(|v| u32::try_from(v).ok());
    let special = |key: &str| if generation[key].is_null() { &config[key] } else { &generation[key] };
    let eos_token_ids: Vec<u32> = match special("eos_token_id") {
        Value::Array(ids) => ids.iter().filter_map(id_of).collect(),
        v => id_of(v).into_iter().collect(),
    };
    if eos_token_ids.is_empty() {
        return Err(HfError::Invalid {
            file: "config.json".into(),
            reason: "no eos_token_id (here or in generation_config.json): generation could not stop".into(),
        });
    }
    let pretrained = Pretrained {
        weights,
        tokenizer_json,
        chat_template,
        bos_token_id: id_of(special("bos_token_id")),
        eos_token_ids,
        origin: dir.display().to_string(),
    };
    let shape = LlamaShape {
        hidden,
        layers,
        heads,
        kv_heads,
        ffn,
        vocab,
        context,
        rope_theta: config["rope_theta"].as_f64().unwrap_or(10_000.0),
        norm_epsilon: config["rms_norm_eps"].as_f64().unwrap_or(1e-6),
        tied,
    };
    let spec = shape.spec(name, pretrained);
    spec.check(&dir.display().to_string()).map_err(|e| HfError::Unsupported(e.to_string()))?;
    Ok(spec)
}

/// The checkpoint's safetensors files, memory-mapped, and which holds
/// which tensor.
struct Tensors {
    maps: Vec<(String, memmap2::Mmap)>,
    /// Tensor name → index into `maps`.
    at: HashMap<String, usize>,
}

impl Tensors {
    fn open(dir: &Path) -> Result<Self, HfError> {
        const INDEX: &str = "model.safetensors.index.json";
        let files: Vec<String> = if dir.join(INDEX).is_file() {
            let index = json(dir, INDEX)?;
            let map = index["weight_map"]
                .as_object()
                .ok_or_else(|| HfError::Invalid { file: INDEX.into(), reason: "no `weight_map` object".into() })?;
            let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(str::to_string).collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".into()]
        };
        let mut maps = Vec::new();
        let mut at = HashMap::new();
        for file in files {
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(HfError::Invalid {
                    file: INDEX.into(),
                    reason: format!("`{file}` is not a file of the checkpoint"),
                });
            }
            let path = dir.join(&file);
            let handle = std::fs::File::open(&path).map_err(|source| HfError::Io { path: path.clone(), source })?;
            // SAFETY: the map is only read, and the checkpoint's files are
            // not modified while the import runs (as every safetensors
            // reader assumes); a truncated file is caught by the header
            // check below, not by reading past the end.
            let map = unsafe { memmap2::Mmap::map(&handle) }.map_err(|source| HfError::Io { path, source })?;
            let names = safetensors::SafeTensors::deserialize(&map)
                .map_err(|e| HfError::Invalid { file: file.clone(), reason: e.to_string() })?
                .names()
                .into_iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>();
            for name in names {
                at.insert(name, maps.len());
            }
            maps.push((file, map));
        }
        Ok(Self { maps, at })
    }

    /// The checkpoint's tensors not among `used`, sorted.
    fn unused(&self, used: &HashMap<String, Weight>) -> Vec<String> {
        let mut names: Vec<String> = self.at.keys().filter(|n| !used.contains_key(*n)).cloned().collect();
        names.sort();
        names
    }

    /// Tensor `name`, which must have exactly `shape`, as f32 values
    /// (F32, F16 and BF16 are read).
    fn get(&mut self, name: &str, shape: &[u32]) -> Result<Weight, HfError> {
        let err = |reason: String| HfError::Tensor { name: name.into(), reason };
        let &i = self.at.get(name).ok_or_else(|| err("missing from the checkpoint's safetensors files".into()))?;
        let (file, map) = &self.maps[i];
        let st = safetensors::SafeTensors::deserialize(map).map_err(|e| err(format!("{file}: {e}")))?;
        let view = st.tensor(name).map_err(|e| err(format!("{file}: {e}")))?;
        let want: Vec<usize> = shape.iter().map(|d| *d as usize).collect();
        if view.shape() != want.as_slice() {
            return Err(err(format!("has shape {:?}, the config implies {want:?}", view.shape())));
        }
        let bytes = view.data();
        let values: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => {
                bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            safetensors::Dtype::F16 => {
                bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            safetensors::Dtype::BF16 => {
                bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            other => return Err(err(format!("element type {other:?} is not read (F32, F16, BF16 are)"))),
        };
        Ok(Weight { dims: shape.to_vec(), values, q4: None })
    }
}
