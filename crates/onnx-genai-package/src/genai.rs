//! Import of ONNX Runtime GenAI packages: a directory with `genai_config.json`,
//! `model.onnx` and `tokenizer.json` becomes the same [`Manifest`] a native
//! package has. Its `%d` KV name templates become `{layer}` port templates.

use serde::Deserialize;

use crate::diagnostics::{Code, Diagnostic, Report};
use crate::manifest::{
    Architecture, Component, ElementType, Family, Generation, KvCache, Manifest, Port, Role, SamplingDefaults,
    TokenizerRef, FORMAT,
};
use crate::schema::{deserialize_closed, SchemaCodes, Tree};

pub const CONFIG_FILE: &str = "genai_config.json";

const CODES: SchemaCodes = SchemaCodes { unknown_key: Code::PKG102, bad_value: Code::PKG103 };

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenaiConfig {
    model: GenaiModel,
    #[serde(default)]
    search: Option<GenaiSearch>,
    /// Their runtime's own engine settings (batching, devices): known to
    /// the format, not read here.
    #[serde(default)]
    #[allow(dead_code)]
    engine: Option<Tree>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "expected a token id (a number) or a list of token ids")]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenaiModel {
    /// Signed, as their parser reads ids: a negative one is "none" (Olive
    /// writes -1 for a token the tokenizer lacks).
    #[serde(default)]
    bos_token_id: Option<i64>,
    context_length: u32,
    decoder: GenaiDecoder,
    eos_token_id: OneOrMany,
    // Not used for decoding (signed for the same reason).
    #[serde(default)]
    #[allow(dead_code)]
    pad_token_id: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    sep_token_id: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    decoder_start_token_id: Option<i64>,
    // Reasoning and tool-call markers some of their exports carry.
    #[serde(default)]
    #[allow(dead_code)]
    bot_token_id: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    eot_token_id: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    bor_token_id: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    eor_token_id: Option<i64>,
    #[serde(rename = "type")]
    model_type: String,
    vocab_size: u32,
    // Known to the format, not supported here: named so they are not "unknown".
    #[serde(default)]
    vision: Option<Tree>,
    #[serde(default)]
    speech: Option<Tree>,
    #[serde(default)]
    embedding: Option<Tree>,
    #[serde(default)]
    encoder: Option<Tree>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenaiDecoder {
    #[serde(default)]
    #[allow(dead_code)]
    session_options: Option<Tree>,
    #[serde(default)]
    #[allow(dead_code)]
    run_options: Option<Tree>,
    filename: String,
    head_size: u32,
    hidden_size: u32,
    num_attention_heads: u32,
    num_hidden_layers: u32,
    num_key_value_heads: u32,
    inputs: GenaiInputs,
    outputs: GenaiOutputs,
    #[serde(default)]
    pipeline: Option<Tree>,
    #[serde(default)]
    sliding_window: Option<Tree>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenaiInputs {
    #[serde(default)]
    input_ids: Option<String>,
    #[serde(default)]
    inputs_embeds: Option<String>,
    #[serde(default)]
    attention_mask: Option<String>,
    #[serde(default)]
    position_ids: Option<String>,
    #[serde(default)]
    past_key_names: Option<String>,
    #[serde(default)]
    past_value_names: Option<String>,
    #[serde(default)]
    past_sequence_length: Option<String>,
    #[serde(default)]
    current_sequence_length: Option<String>,
    #[serde(default)]
    total_sequence_length: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenaiOutputs {
    logits: String,
    #[serde(default)]
    present_key_names: Option<String>,
    #[serde(default)]
    present_value_names: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // all read for schema checking; the sampling ones and `max_length` used
struct GenaiSearch {
    #[serde(default)]
    diversity_penalty: Option<f64>,
    #[serde(default)]
    do_sample: Option<bool>,
    #[serde(default)]
    early_stopping: Option<bool>,
    #[serde(default)]
    length_penalty: Option<f64>,
    #[serde(default)]
    max_length: Option<u32>,
    #[serde(default)]
    min_length: Option<u32>,
    #[serde(default)]
    no_repeat_ngram_size: Option<u32>,
    #[serde(default)]
    num_beams: Option<u32>,
    #[serde(default)]
    num_return_sequences: Option<u32>,
    /// Their runtime then hands `GroupQueryAttention` one max-length
    /// buffer as both past and present; the graph is the same either way,
    /// and ONNX Runtime's kernel also accepts separate past and present,
    /// which is how the `ort` backend runs it (native-cpu keeps its own
    /// preallocated cache).
    #[serde(default)]
    past_present_share_buffer: Option<bool>,
    #[serde(default)]
    repetition_penalty: Option<f64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    top_p: Option<f64>,
    /// Prefill chunk length (their paged-attention exports).
    #[serde(default)]
    chunk_size: Option<u32>,
    /// Their runtime's seed for sampling (a request here brings its own).
    #[serde(default)]
    random_seed: Option<i64>,
    #[serde(default)]
    batch_size: Option<u32>,
}

/// ONNX Runtime GenAI's text decoder model types besides those named in
/// [`import`]'s match (`model_type.h` of its 0.x releases).
const TEXT_DECODER_TYPES: &[&str] = &[
    "decoder",
    "chatglm",
    "ernie4_5",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gptoss",
    "nemotron",
    "phi",
    "phimoe",
    "phi3",
    "phi3small",
];

/// Its model types whose `genai_config.json` describes a multimodal
/// pipeline (vision, speech) this runtime does not run.
const MULTIMODAL_TYPES: &[&str] = &["phi3v", "phi4mm", "gemma3", "qwen2_5_vl", "fara", "whisper"];

/// Where a port of an imported manifest came from, so diagnostics point at
/// the user's `genai_config.json` key rather than at a manifest they never wrote.
pub fn port_field(role: Role) -> &'static str {
    match role {
        Role::TokenIds => "model.decoder.inputs.input_ids",
        Role::InputsEmbeds => "model.decoder.inputs.inputs_embeds",
        Role::PositionIds => "model.decoder.inputs.position_ids",
        Role::AttentionMask => "model.decoder.inputs.attention_mask",
        Role::PastKey => "model.decoder.inputs.past_key_names",
        Role::PastValue => "model.decoder.inputs.past_value_names",
        Role::PresentKey => "model.decoder.outputs.present_key_names",
        Role::PresentValue => "model.decoder.outputs.present_value_names",
        Role::Logits => "model.decoder.outputs.logits",
    }
}

/// Reads `genai_config.json` text into a manifest, pushing diagnostics.
pub fn import(text: &str, report: &mut Report) -> Option<Manifest> {
    let tree: Tree = match serde_json::from_str(text) {
        Ok(t) => t,
        Err(e) => {
            report.push(Diagnostic::error(
                Code::PKG101,
                CONFIG_FILE,
                "",
                format!("not valid JSON: {e}"),
                "fix the JSON syntax at the line and column given",
            ));
            return None;
        }
    };
    let config: GenaiConfig = deserialize_closed(tree, CONFIG_FILE, &CODES, report)?;
    let m = config.model;
    let d = m.decoder;
    let unsupported = |field: &str, what: &str| {
        Diagnostic::error(
            Code::PKG105,
            CONFIG_FILE,
            field,
            format!("{what} is not supported by onnx-genai"),
            "remove it, or use a decoder-only text package",
        )
    };
    let mut ok = true;
    for (present, field, what) in [
        (m.vision.is_some(), "model.vision", "a vision encoder"),
        (m.speech.is_some(), "model.speech", "a speech encoder"),
        (m.embedding.is_some(), "model.embedding", "a separate embedding model"),
        (m.encoder.is_some(), "model.encoder", "an encoder-decoder model"),
        (d.pipeline.is_some(), "model.decoder.pipeline", "a multi-model decoder pipeline"),
        (d.sliding_window.is_some(), "model.decoder.sliding_window", "sliding-window attention"),
    ] {
        if present {
            report.push(unsupported(field, what));
            ok = false;
        }
    }
    // The type is a label here: what runs is decided by the graph (its
    // ports, then what each backend compiles). Every text decoder type of
    // their runtime is read as one; its multimodal types are refused.
    let family = match m.model_type.as_str() {
        "llama" | "mistral" | "qwen2" | "qwen3" | "smollm" | "smollm3" | "granite" | "olmo" => Family::Llama,
        "gpt2" => Family::Gpt2,
        t if TEXT_DECODER_TYPES.contains(&t) => Family::Decoder,
        t if MULTIMODAL_TYPES.contains(&t) => {
            report.push(unsupported("model.type", &format!("model type `{t}` (a multimodal pipeline)")));
            return None;
        }
        other => {
            report.push(Diagnostic::warning(
                Code::PKG109,
                CONFIG_FILE,
                "model.type",
                format!("model type `{other}` is not one ONNX Runtime GenAI lists; it is read as a text decoder"),
                "check the spelling; the graph decides what runs either way",
            ));
            Family::Decoder
        }
    };
    let bos_token_id = match m.bos_token_id {
        Some(id) if id >= 0 => match u32::try_from(id) {
            Ok(id) => Some(id),
            Err(_) => {
                report.push(Diagnostic::error(
                    Code::PKG103,
                    CONFIG_FILE,
                    "model.bos_token_id",
                    format!("bos_token_id {id} is past any vocabulary"),
                    "write the tokenizer's beginning-of-sequence id, or -1 for none",
                ));
                ok = false;
                None
            }
        },
        _ => None,
    };
    if let Some(search) = &config.search {
        let unapplied = [
            ("num_beams", search.num_beams.is_some_and(|n| n > 1), "beam search"),
            ("num_return_sequences", search.num_return_sequences.is_some_and(|n| n > 1), "several sequences a prompt"),
            ("min_length", search.min_length.is_some_and(|n| n > 0), "a minimum length"),
            ("no_repeat_ngram_size", search.no_repeat_ngram_size.is_some_and(|n| n > 0), "n-gram blocking"),
        ];
        for (key, set, what) in unapplied {
            if set {
                report.push(Diagnostic::warning(
                    Code::PKG108,
                    CONFIG_FILE,
                    format!("search.{key}"),
                    format!("{what} is not applied here: generation samples (or decodes greedily) one sequence"),
                    "expect other text than ONNX Runtime GenAI generates with these settings",
                ));
            }
        }
    }
    let mut ports = Vec::new();
    let mut bind = |role: Role, name: &Option<String>| {
        if let Some(name) = name {
            ports.push(Port { role, name: name.clone() });
        }
    };
    bind(Role::TokenIds, &d.inputs.input_ids);
    bind(Role::InputsEmbeds, &d.inputs.inputs_embeds);
    bind(Role::AttentionMask, &d.inputs.attention_mask);
    bind(Role::PositionIds, &d.inputs.position_ids);
    bind(Role::Logits, &Some(d.outputs.logits.clone()));
    for (role, template) in [
        (Role::PastKey, &d.inputs.past_key_names),
        (Role::PastValue, &d.inputs.past_value_names),
        (Role::PresentKey, &d.outputs.present_key_names),
        (Role::PresentValue, &d.outputs.present_value_names),
    ] {
        let Some(template) = template else { continue };
        if template.matches("%d").count() != 1 {
            report.push(Diagnostic::error(
                Code::PKG104,
                CONFIG_FILE,
                port_field(role),
                format!("KV name template `{template}` must contain `%d` exactly once"),
                "write the per-layer name with `%d` where the layer number goes, e.g. `past_key_values.%d.key`",
            ));
            ok = false;
            continue;
        }
        ports.push(Port { role, name: template.replace("%d", "{layer}") });
    }
    for (field, value) in [
        ("model.decoder.inputs.past_sequence_length", &d.inputs.past_sequence_length),
        ("model.decoder.inputs.current_sequence_length", &d.inputs.current_sequence_length),
        ("model.decoder.inputs.total_sequence_length", &d.inputs.total_sequence_length),
    ] {
        if value.is_some() {
            report.push(unsupported(field, "a sequence-length input"));
            ok = false;
        }
    }
    let has_kv = d.inputs.past_key_names.is_some();
    let max_len = config.search.as_ref().and_then(|s| s.max_length).unwrap_or(m.context_length);
    if max_len > m.context_length {
        // Harmless here (generation stops at the context length), but the
        // config promises lengths the model cannot reach.
        report.push(Diagnostic::warning(
            Code::PKG106,
            CONFIG_FILE,
            "search.max_length",
            format!(
                "max_length {max_len} is beyond the model's context_length {}; generation stops at the context length",
                m.context_length
            ),
            "lower search.max_length to at most model.context_length",
        ));
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        name: "genai-import".into(),
        version: "0.0.0".into(),
        architecture: Architecture {
            family,
            hidden_size: d.hidden_size,
            num_layers: d.num_hidden_layers,
            num_attention_heads: d.num_attention_heads,
            num_kv_heads: d.num_key_value_heads,
            head_dim: d.head_size,
            intermediate_size: None,
            vocab_size: m.vocab_size,
            max_sequence_length: m.context_length,
            rope_theta: None,
            norm_epsilon: None,
        },
        dtype: ElementType::F32,
        // The config does not say the KV element type; validation reads it
        // from the graph's past-key input.
        kv_cache: has_kv.then_some(KvCache { dtype: ElementType::F32, layers: None }),
        components: vec![Component { name: "decoder".into(), file: d.filename, ports }],
        workflow: None,
        tokenizer: TokenizerRef { file: "tokenizer.json".into() },
        chat_template: None,
        generation: Generation {
            bos_token_id,
            eos_token_ids: match m.eos_token_id {
                OneOrMany::One(id) => vec![id],
                OneOrMany::Many(ids) => ids,
            },
            max_new_tokens: max_len.min(256),
            sampling: sampling_defaults(config.search.as_ref()),
        },
    };
    ok.then_some(manifest)
}

/// A package without `tokenizer.json` whose `tokenizer_config.json` names a
/// tokenizer class: that class reads files this runtime does not (a
/// SentencePiece `tokenizer.model`, `vocab.json` + `merges.txt`), so the
/// error says which class and what to ship instead (beside the missing
/// file's own error).
fn check_tokenizer_class(tokenizer_file: &str, config: &serde_json::Value, report: &mut Report) {
    const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
    if let Some(class) = config["tokenizer_class"].as_str() {
        report.push(Diagnostic::error(
            Code::PKG107,
            TOKENIZER_CONFIG,
            "tokenizer_class",
            format!(
                "tokenizer_class `{class}` is not supported without {tokenizer_file}: this runtime reads Hugging Face's fast-tokenizer file only (not a SentencePiece tokenizer.model or vocab.json + merges.txt)"
            ),
            format!(
                "save the fast tokenizer into the package (`AutoTokenizer.from_pretrained(...).save_pretrained(dir)` writes {tokenizer_file})"
            ),
        ));
    }
}

/// `search` as sampling defaults, as ONNX Runtime GenAI reads it (see
/// [`SamplingDefaults::of_generation_config`]); without a `search` section
/// it decodes greedily. A key the section leaves out is left to the
/// server's defaults.
fn sampling_defaults(search: Option<&GenaiSearch>) -> SamplingDefaults {
    let Some(search) = search else {
        return SamplingDefaults { temperature: Some(0.0), ..Default::default() };
    };
    SamplingDefaults::of_generation_config(
        search.do_sample,
        search.temperature,
        search.top_k,
        search.top_p,
        search.repetition_penalty,
    )
}

/// What an ONNX Runtime GenAI package says outside `genai_config.json`:
/// its name is its directory's (two imported packages can be served
/// together), its chat template is `chat_template.jinja` or the
/// `chat_template` of `tokenizer_config.json` (Hugging Face's two places;
/// there a string, or a list of named templates of which `default` is
/// used). Returns where the template came from (file, field).
pub(crate) fn complete(
    root: &std::path::Path,
    m: &mut Manifest,
    report: &mut Report,
) -> Option<(&'static str, &'static str)> {
    const JINJA: &str = "chat_template.jinja";
    const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
    let dir = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    if let Some(name) = dir.file_name().map(|n| n.to_string_lossy().to_string()).filter(|n| !n.is_empty()) {
        m.name = name;
    }
    let exists = |file: &str| std::fs::symlink_metadata(root.join(file)).is_ok();
    let (no_tokenizer, jinja) = (!exists(&m.tokenizer.file), exists(JINJA));
    // Read once, and only when something needs it: the tokenizer class
    // (without tokenizer.json) or the template (without the .jinja).
    let config = if exists(TOKENIZER_CONFIG) && (no_tokenizer || !jinja) {
        crate::validate::read_text(root, TOKENIZER_CONFIG, report)
            .map(|text| serde_json::from_str::<serde_json::Value>(&text))
    } else {
        None
    };
    if let (true, Some(Ok(config))) = (no_tokenizer, &config) {
        check_tokenizer_class(&m.tokenizer.file, config, report);
    }
    if jinja {
        m.chat_template = crate::validate::read_text(root, JINJA, report);
        return Some((JINJA, ""));
    }
    match config? {
        Ok(config) => {
            let template = &config["chat_template"];
            m.chat_template = match template.as_array() {
                Some(named) => named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_string),
                None => template.as_str().map(str::to_string),
            };
        }
        Err(e) => report.push(Diagnostic::warning(
            Code::PKG101,
            TOKENIZER_CONFIG,
            "",
            format!("not valid JSON ({e}), so its chat template is not used"),
            "fix the JSON, or ship the template as chat_template.jinja",
        )),
    }
    Some((TOKENIZER_CONFIG, "chat_template"))
}
