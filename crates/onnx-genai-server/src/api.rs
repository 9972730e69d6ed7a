//! The OpenAI wire format: request bodies (every field checked against
//! `fields.rs`: served, or refused naming it) and response bodies.

use serde::Deserialize;
use serde_json::{json, Value};

use onnx_genai_engine::sampling::MAX_TOP_LOGPROBS;
use onnx_genai_engine::{ResponseFormat, MAX_CHOICES, RESERVED_TEMPLATE_VARS};
use onnx_genai_package::manifest::SamplingDefaults;

use crate::error::ApiError;

/// A message as OpenAI sends it; a key it does not define is refused
/// (nothing is silently ignored, in a message either).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    /// A participant's name: handed to the template (which may ignore it).
    #[serde(default)]
    pub name: Option<String>,
    /// `null` in an assistant message that only calls tools.
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Option<Vec<WireToolCall>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// Fields OpenAI's assistant messages carry, which a client sends back
    /// with its history (the Python client's `model_dump()` writes them as
    /// `null`): accepted empty, refused with a value (none is read).
    #[serde(default)]
    pub refusal: Option<Value>,
    #[serde(default)]
    pub audio: Option<Value>,
    #[serde(default)]
    pub function_call: Option<Value>,
    #[serde(default)]
    pub annotations: Option<Value>,
}

/// A call in an assistant message the client sends back.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: WireFunctionCall,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireFunctionCall {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

/// Message content: a string, or OpenAI's list of typed parts (text and
/// images).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub image_url: Option<ImageUrl>,
    /// Keys no served part type has (refused naming the part, after its
    /// type: an unsupported type is named as such).
    #[serde(flatten)]
    pub other: std::collections::BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageUrl {
    pub url: String,
    /// OpenAI's resolution hint: the image is resized to the package's
    /// size whatever it says.
    #[serde(default)]
    pub detail: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// OpenAI's random padding of stream events against side channels:
    /// served only as `false` (this server pads nothing).
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

/// Fields shared by chat and text completions (read apart from each
/// endpoint's own, so an error names its field: see [`parse_turn`]).
#[derive(Debug, Default, Deserialize)]
pub struct Sampling {
    pub model: String,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// OpenAI's is an int64: negative seeds (some clients send -1) are
    /// seeds like any other.
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// The end user, for the log.
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string, as OpenAI's clients send it) to bias.
    #[serde(default)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Extensions as vLLM serves them (`top_k` -1, as 0, keeps every token).
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Choices of the prompt (1 to `MAX_CHOICES`).
    #[serde(default)]
    pub n: Option<u32>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Read by [`response_format`], which names what is wrong in it.
    #[serde(default)]
    pub response_format: Option<Value>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    /// Read by [`ChatRequest::tool_use`], which names what is wrong.
    #[serde(default)]
    pub tools: Option<Value>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Read by [`ChatRequest::template_vars`].
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
    #[serde(skip)]
    pub common: Sampling,
}

/// The most extra chat-template variables a request may set.
pub const MAX_TEMPLATE_VARS: usize = 32;

impl ChatRequest {
    /// `chat_template_kwargs`: an object of at most [`MAX_TEMPLATE_VARS`]
    /// variables, none of those the renderer sets.
    pub fn template_vars(&self) -> Result<serde_json::Map<String, Value>, ApiError> {
        match &self.chat_template_kwargs {
            None | Some(Value::Null) => Ok(Default::default()),
            Some(Value::Object(vars)) if vars.len() > MAX_TEMPLATE_VARS => Err(ApiError::param(
                "chat_template_kwargs",
                format!("at most {MAX_TEMPLATE_VARS} variables, got {}", vars.len()),
            )),
            Some(Value::Object(vars)) => match vars.keys().find(|k| RESERVED_TEMPLATE_VARS.contains(&k.as_str())) {
                Some(name) => Err(ApiError::param(
                    "chat_template_kwargs",
                    format!("`{name}` is set by the server from the request; leave it out"),
                )),
                None => Ok(vars.clone()),
            },
            Some(_) => Err(ApiError::param("chat_template_kwargs", "an object of template variables")),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: String,
    /// Alternatives per token (0 to 5): each token's log-probability too.
    #[serde(default)]
    pub logprobs: Option<u32>,
    #[serde(skip)]
    pub common: Sampling,
}

#[derive(Debug, Deserialize)]
pub struct SessionRequest {
    pub model: String,
}

/// Parses a JSON body into `T`, refusing any field `fields` does not serve,
/// with an OpenAI-shaped error naming the field.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8], fields: &[crate::fields::Field]) -> Result<T, ApiError> {
    typed(checked(body, fields)?)
}

/// A completion request: its own fields and the shared [`Sampling`] ones,
/// each read from its part of the body.
pub fn parse_turn<T: serde::de::DeserializeOwned + SharesSampling>(
    body: &[u8],
    fields: &[crate::fields::Field],
) -> Result<T, ApiError> {
    let mut value = checked(body, fields)?;
    let mut shared = serde_json::Map::new();
    if let Some(object) = value.as_object_mut() {
        for name in crate::fields::common().iter().map(|f| f.name) {
            if let Some(v) = object.remove(name) {
                shared.insert(name.to_string(), v);
            }
        }
    }
    let sampling: Sampling = typed(Value::Object(shared))?;
    let mut request: T = typed(value)?;
    *request.sampling_mut() = sampling;
    Ok(request)
}

/// Requests that carry the shared sampling fields.
pub trait SharesSampling {
    fn sampling_mut(&mut self) -> &mut Sampling;
}

impl SharesSampling for ChatRequest {
    fn sampling_mut(&mut self) -> &mut Sampling {
        &mut self.common
    }
}

impl SharesSampling for CompletionRequest {
    fn sampling_mut(&mut self) -> &mut Sampling {
        &mut self.common
    }
}

/// The body as JSON, every field checked against `fields`, `null`s dropped.
fn checked(body: &[u8], fields: &[crate::fields::Field]) -> Result<Value, ApiError> {
    let mut value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
    crate::fields::check(&value, fields)?;
    // A top-level `null` means "not given" (some clients send every field).
    if let Some(object) = value.as_object_mut() {
        object.retain(|_, v| !v.is_null());
    }
    Ok(value)
}

/// `value` as `T`; an error names the field at fault (`messages[0].content`),
/// as a refused field's does.
fn typed<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = format!("invalid request body: {}", e.inner());
        if path == "." {
            ApiError::invalid(message)
        } else {
            ApiError::param(&path, format!("{path}: {message}"))
        }
    })
}

impl Sampling {
    /// Validated sampling options.
    pub fn check(&self) -> Result<(), ApiError> {
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::param("temperature", format!("temperature must be between 0 and 2, got {t}")));
            }
        }
        if let Some(p) = self.top_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(ApiError::param("top_p", format!("top_p must be in [0, 1], got {p}")));
            }
        }
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::param("stream_options", "stream_options is only allowed when stream is true"));
        }
        if self.stream_options.as_ref().is_some_and(|o| o.include_obfuscation == Some(true)) {
            return Err(ApiError::param(
                "stream_options.include_obfuscation",
                "this server does not pad stream events: send include_obfuscation false or leave it out",
            ));
        }
        if let Err(message) = self.engine_sampling(&SamplingDefaults::default(), || 0)?.check() {
            // The engine's messages start with the field's name.
            let field = ["min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"]
                .into_iter()
                .find(|f| message.starts_with(f))
                .unwrap_or("sampling");
            return Err(ApiError::param(field, message));
        }
        if self.max_new_tokens() == Some(0) {
            return Err(ApiError::param("max_tokens", "max_tokens must be at least 1"));
        }
        if let Some(n) = self.n.filter(|n| !(1..=MAX_CHOICES as u32).contains(n)) {
            return Err(ApiError::param("n", format!("n is 1 to {MAX_CHOICES} choices, got {n}")));
        }
        // Every stop string is matched against the text after every token:
        // the list and each string are bounded (OpenAI allows 4).
        if let Some(Stop::Many(v)) = &self.stop {
            if v.len() > MAX_STOPS {
                return Err(ApiError::param("stop", format!("at most {MAX_STOPS} stop sequences, got {}", v.len())));
            }
        }
        if let Some(long) = self.stops().iter().find(|s| s.chars().count() > MAX_STOP_CHARS) {
            return Err(ApiError::param(
                "stop",
                format!("a stop sequence is at most {MAX_STOP_CHARS} characters, got {}", long.chars().count()),
            ));
        }
        Ok(())
    }

    /// `logit_bias` as (token id, bias): each key a decimal token id, named
    /// once (`"1"` and `"01"` are one token). The biases' range is the
    /// engine's check.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else { return Ok(Vec::new()) };
        if map.len() > MAX_LOGIT_BIAS {
            return Err(ApiError::param(
                "logit_bias",
                format!("at most {MAX_LOGIT_BIAS} biased tokens, got {}", map.len()),
            ));
        }
        let mut ids = std::collections::BTreeMap::new();
        for (key, bias) in map {
            let id: u32 = key
                .parse()
                .map_err(|_| ApiError::param("logit_bias", format!("logit_bias keys are token ids, got {key:?}")))?;
            if ids.insert(id, *bias).is_some() {
                return Err(ApiError::param("logit_bias", format!("logit_bias names token {id} twice")));
            }
        }
        Ok(ids.into_iter().collect())
    }

    /// vLLM's `top_k`: -1 (or 0) keeps every token.
    fn top_k(&self) -> Result<usize, ApiError> {
        match self.top_k.unwrap_or(0) {
            -1 | 0 => Ok(0),
            k if k > 0 => usize::try_from(k).map_err(|_| ApiError::param("top_k", format!("top_k {k} is too large"))),
            k => Err(ApiError::param("top_k", format!("top_k must be -1 (every token) or at least 1, got {k}"))),
        }
    }

    /// The engine's sampling options for this request: what it leaves
    /// unset from the package's `defaults`, else OpenAI's (`seed` drawn
    /// when absent: each such request samples its own way, as OpenAI does).
    pub fn engine_sampling(
        &self,
        defaults: &SamplingDefaults,
        seed: impl FnOnce() -> u64,
    ) -> Result<onnx_genai_engine::Sampling, ApiError> {
        Ok(onnx_genai_engine::Sampling {
            temperature: self.temperature.or(defaults.temperature).unwrap_or(1.0),
            top_k: match self.top_k {
                Some(_) => self.top_k()?,
                None => defaults.top_k.unwrap_or(0) as usize,
            },
            top_p: self.top_p.or(defaults.top_p).unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            // (The same bits: -1 is 2^64 - 1.)
            seed: self.seed.map_or_else(seed, |s| s as u64),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.or(defaults.repetition_penalty).unwrap_or(1.0),
            logit_bias: self.logit_bias()?,
        })
    }

    /// Choices asked for (checked by [`Sampling::check`]).
    pub fn choices(&self) -> usize {
        self.n.unwrap_or(1) as usize
    }

    pub fn max_new_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    pub fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
    }
}

/// OpenAI's `response_format` as the engine's: `text`, `json_object`, or
/// `json_schema` with a `name` and a `schema` object (`strict` either way:
/// every format other than text is enforced token by token).
pub fn response_format(value: Option<&Value>) -> Result<ResponseFormat, ApiError> {
    let Some(value) = value else { return Ok(ResponseFormat::Text) };
    let bad = |m: String| ApiError::param("response_format", m);
    let kind = value
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("response_format needs a `type`: \"text\", \"json_object\" or \"json_schema\"".into()))?;
    match kind {
        "text" => Ok(ResponseFormat::Text),
        "json_object" => Ok(ResponseFormat::JsonObject),
        "json_schema" => {
            let spec = value.get("json_schema").and_then(Value::as_object).ok_or_else(|| {
                bad("a `json_schema` response format needs a `json_schema` object with a `name` and a `schema`".into())
            })?;
            let name = spec.get("name").and_then(Value::as_str).unwrap_or_default();
            let name_ok = (1..=64).contains(&name.len())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !name_ok {
                return Err(bad(format!(
                    "json_schema.name must be 1 to 64 letters, digits, `_` or `-`, got {:?}",
                    spec.get("name").unwrap_or(&Value::Null)
                )));
            }
            if let Some(strict) = spec.get("strict").filter(|v| !v.is_null() && !v.is_boolean()) {
                return Err(bad(format!("json_schema.strict must be true or false, got {strict}")));
            }
            match spec.get("schema") {
                Some(schema) if schema.is_object() => Ok(ResponseFormat::JsonSchema(schema.clone())),
                other => Err(bad(format!(
                    "json_schema.schema must be a JSON Schema object, got {}",
                    other.unwrap_or(&Value::Null)
                ))),
            }
        }
        other => Err(bad(format!("response_format type `{other}` is not text, json_object or json_schema"))),
    }
}

impl ChatRequest {
    /// Alternatives per token when `logprobs` is on (`top_logprobs`, 0 to
    /// 20, only with `logprobs: true`, as OpenAI has it).
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, None) => Ok(None),
            (false, Some(_)) => Err(ApiError::param("top_logprobs", "top_logprobs needs `logprobs: true`")),
            (true, top) => match top.unwrap_or(0) as usize {
                k if k <= MAX_TOP_LOGPROBS => Ok(Some(k)),
                k => Err(ApiError::param("top_logprobs", format!("top_logprobs is 0 to {MAX_TOP_LOGPROBS}, got {k}"))),
            },
        }
    }
}

impl CompletionRequest {
    /// Alternatives per token (`logprobs`, 0 to 5, as OpenAI has it).
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match self.logprobs.map(|k| k as usize) {
            Some(k) if k > MAX_COMPLETION_LOGPROBS => {
                Err(ApiError::param("logprobs", format!("logprobs is 0 to {MAX_COMPLETION_LOGPROBS}, got {k}")))
            }
            k => Ok(k),
        }
    }
}

/// Alternatives a completions token may report (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

/// Stop sequences a request may give (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// Characters in one stop sequence.
pub const MAX_STOP_CHARS: usize = 256;
/// Tokens one request may bias (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
