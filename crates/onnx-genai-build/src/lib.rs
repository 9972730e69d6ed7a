//! Model compilation, front half: an architecture spec becomes a package —
//! deterministic weights, an ONNX decoder graph with KV-cache I/O, a
//! byte-level BPE `tokenizer.json`, and `package.yaml`.

pub mod digest;
pub mod genai_config;
pub mod gguf;
pub mod graph;
pub mod hf;
pub mod pretrained;
pub mod rng;
pub mod spec;
pub mod tokenizer;

use std::path::{Path, PathBuf};

pub use graph::Variant;
use onnx_genai_package::manifest::{
    ApplicationInput, Architecture, Component, Generation, ImageInput, KvCache, Manifest, Port, PortRef, Preprocess,
    Role, TokenizerRef, Workflow, WorkflowStep, FORMAT,
};
pub use spec::Spec;

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("invalid spec {origin}: {reason}")]
    Spec { origin: String, reason: String },
    #[error("cannot build the tokenizer: {0}")]
    Tokenizer(String),
    #[error("GGUF: {0}")]
    Gguf(#[from] gguf::GgufError),
    #[error("cannot write {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Onnx(#[from] onnx_genai_onnx::OnnxError),
}

pub const MODEL_FILE: &str = "model.onnx";
pub const VISION_FILE: &str = "vision.onnx";
pub const EMBED_FILE: &str = "embed.onnx";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Exports whose weights pass this many bytes keep them in `<file>.data`
/// (ONNX external data), as ONNX Runtime GenAI's builder does.
pub const EXTERNAL_DATA_OVER: usize = 100 << 20;
/// Initializers smaller than this stay inside the model file.
pub const EXTERNAL_TENSOR_MIN: usize = 1024;

/// The `<packages_dir>/<name>/spec.yaml` files, sorted by package name.
pub fn spec_files(packages_dir: &Path) -> Result<Vec<PathBuf>, BuildError> {
    let io = |source| BuildError::Io { path: packages_dir.into(), source };
    let mut specs: Vec<PathBuf> = std::fs::read_dir(packages_dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path().join("spec.yaml")))
        .filter(|p| p.is_file())
        .collect();
    specs.sort();
    Ok(specs)
}

/// Reads and checks a `spec.yaml`.
pub fn read_spec(path: &Path) -> Result<Spec, BuildError> {
    let text = std::fs::read_to_string(path).map_err(|source| BuildError::Io { path: path.into(), source })?;
    Spec::parse(&text, &path.display().to_string())
}

/// Builds the decomposed package for `spec` into `out` (created if needed;
/// files in it are overwritten).
pub fn build_package(spec: &Spec, out: &Path) -> Result<(), BuildError> {
    build_variant(spec, Variant::Decomposed, out)
}

/// Builds every export variant of `spec` into `out/<variant>/`.
pub fn build_all_variants(spec: &Spec, out: &Path) -> Result<(), BuildError> {
    for variant in spec.variants() {
        build_variant(spec, variant, &out.join(variant.name()))?;
    }
    Ok(())
}

/// Builds the package for `spec` in the given export form into `out`.
pub fn build_variant(spec: &Spec, variant: Variant, out: &Path) -> Result<(), BuildError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BuildError::Io { path, source }
    };
    // Every source of a spec (a spec file, a Hugging Face checkpoint, a
    // GGUF) is checked here too, before a size from it allocates.
    spec.check(&spec.name)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    if let Some(why) = spec.refusal(variant) {
        return Err(BuildError::Spec {
            origin: spec.name.clone(),
            reason: format!(
                "not built as `{}`: {why}; it is built as {:?}",
                variant.name(),
                spec.variants().iter().map(|v| v.name()).collect::<Vec<_>>()
            ),
        });
    }
    let models = match graph::vision::build(spec) {
        Some(vl) => vec![(MODEL_FILE, vl.decoder), (VISION_FILE, vl.vision), (EMBED_FILE, vl.embed)],
        None => vec![(MODEL_FILE, graph::build_decoder(spec, variant)?)],
    };
    for (file, model) in models {
        let model_path = out.join(file);
        let data_path = out.join(format!("{file}.data"));
        let weight_bytes: usize = model.graph.initializers.iter().map(|t| t.raw.len()).sum();
        // ONNX Runtime GenAI's builder always keeps weights in `model.onnx.data`.
        if weight_bytes > EXTERNAL_DATA_OVER || variant == Variant::Genai {
            onnx_genai_onnx::write_model_external(&model_path, &model, EXTERNAL_TENSOR_MIN)?;
        } else {
            std::fs::write(&model_path, onnx_genai_onnx::encode(&model)).map_err(io(&model_path))?;
            remove_if_present(&data_path)?;
        }
    }
    let json = match &spec.pretrained {
        Some(p) => p.tokenizer_json.clone(),
        None => {
            let tokenizer = tokenizer::build_with(spec.vocab_size, spec.extra_specials())?;
            tokenizer.to_string(true).map_err(|e| BuildError::Tokenizer(e.to_string()))?
        }
    };
    let tok_path = out.join(TOKENIZER_FILE);
    std::fs::write(&tok_path, json).map_err(io(&tok_path))?;
    // The genai export is in ONNX Runtime GenAI's layout only: it loads
    // through the `genai_config.json` import, as their packages do.
    let manifest_path = out.join(onnx_genai_package::MANIFEST_FILE);
    let tok_config_path = out.join(genai_config::TOKENIZER_CONFIG_FILE);
    if variant == Variant::Genai {
        remove_if_present(&manifest_path)?;
        std::fs::write(&tok_config_path, genai_config::tokenizer_config(spec)).map_err(io(&tok_config_path))?;
    } else {
        std::fs::write(&manifest_path, manifest(spec).to_yaml()).map_err(io(&manifest_path))?;
        remove_if_present(&tok_config_path)?;
    }
    // The contrib export is ONNX Runtime GenAI's own op set: its runtime
    // loads the package unchanged from this file.
    let genai_path = out.join(onnx_genai_package::genai::CONFIG_FILE);
    if variant.contrib_ops() {
        std::fs::write(&genai_path, genai_config::genai_config(spec, variant)).map_err(io(&genai_path))?;
    } else {
        remove_if_present(&genai_path)?;
    }
    Ok(())
}

fn remove_if_present(path: &Path) -> Result<(), BuildError> {
    if path.exists() {
        std::fs::remove_file(path).map_err(|source| BuildError::Io { path: path.into(), source })?;
    }
    Ok(())
}

/// The manifest describing what [`build_package`] writes.
pub fn manifest(spec: &Spec) -> Manifest {
    use graph::names;
    let eos = spec.eos_token_id();
    let first = if spec.vision.is_some() {
        (Role::InputsEmbeds, names::INPUTS_EMBEDS)
    } else {
        (Role::TokenIds, names::INPUT_IDS)
    };
    let ports = [
        first,
        (Role::AttentionMask, names::ATTENTION_MASK),
        (Role::PositionIds, names::POSITION_IDS),
        (Role::PastKey, names::PAST_KEY),
        (Role::PastValue, names::PAST_VALUE),
        (Role::Logits, names::LOGITS),
        (Role::PresentKey, names::PRESENT_KEY),
        (Role::PresentValue, names::PRESENT_VALUE),
    ]
    .into_iter()
    .map(|(role, name)| Port { role, name: name.into() })
    .collect();
    Manifest {
        format: FORMAT.into(),
        name: spec.name.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        architecture: Architecture {
            family: spec.family,
            hidden_size: spec.hidden_size,
            num_layers: spec.num_layers,
            num_attention_heads: spec.num_attention_heads,
            num_kv_heads: spec.kv_heads(),
            head_dim: spec.head_dim(),
            intermediate_size: Some(spec.intermediate_size),
            vocab_size: spec.vocab_size,
            max_sequence_length: spec.max_sequence_length,
            rope_theta: spec.rope_theta,
            norm_epsilon: Some(spec.norm_epsilon),
        },
        dtype: spec.dtype,
        kv_cache: Some(KvCache { dtype: spec.dtype, layers: None }),
        components: {
            let mut c = vec![Component { name: "decoder".into(), file: MODEL_FILE.into(), ports }];
            if spec.vision.is_some() {
                c.push(Component { name: "vision".into(), file: VISION_FILE.into(), ports: Vec::new() });
                c.push(Component {
                    name: "embed".into(),
                    file: EMBED_FILE.into(),
                    ports: vec![
                        Port { role: Role::TokenIds, name: names::INPUT_IDS.into() },
                        Port { role: Role::InputsEmbeds, name: names::INPUTS_EMBEDS.into() },
                    ],
                });
            }
            c
        },
        workflow: spec.vision.as_ref().map(|v| Workflow {
            application_inputs: vec![ApplicationInput {
                name: names::PIXEL_VALUES.into(),
                component: "vision".into(),
                port: names::PIXEL_VALUES.into(),
            }],
            steps: vec![
                WorkflowStep { component: "vision".into(), overridable: true },
                WorkflowStep { component: "embed".into(), overridable: false },
                WorkflowStep { component: "decoder".into(), overridable: false },
            ],
            image: Some(ImageInput {
                placeholder: tokenizer::IMAGE_TOKEN.into(),
                tokens: v.tokens_per_image(),
                features: PortRef { component: "vision".into(), port: names::IMAGE_EMBEDS.into() },
                preprocess: Preprocess { width: v.image_size, height: v.image_size, mean: [0.5; 3], std: [0.5; 3] },
            }),
        }),
        tokenizer: TokenizerRef { file: TOKENIZER_FILE.into() },
        chat_template: match &spec.pretrained {
            Some(p) => p.chat_template.clone(),
            None => Some(tokenizer::CHAT_TEMPLATE.into()),
        },
        generation: match &spec.pretrained {
            Some(p) => Generation {
                bos_token_id: p.bos_token_id,
                eos_token_ids: p.eos_token_ids.clone(),
                max_new_tokens: p.max_new_tokens.unwrap_or(64),
                sampling: p.sampling.clone(),
            },
            None => Generation {
                bos_token_id: Some(eos),
                eos_token_ids: vec![eos],
                max_new_tokens: 32,
                sampling: Default::default(),
            },
        },
    }
}
