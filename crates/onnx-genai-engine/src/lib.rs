//! One request type, one generate path: tokenize, run the decode backend with
//! its KV cache carried between steps, sample, stream, report.
//!
//! (Scheduler admission and sessions join this path in later work; see
//! ARCHITECTURE.md.)

mod chat;
pub mod sampling;

use std::path::Path;

pub use chat::ChatMessage;
use onnx_genai_backend::{BackendError, DecodeBackend};
use onnx_genai_package::{Package, PackageError};
use sampling::Sampler;
pub use sampling::Sampling;
use tokenizers::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Package(#[from] PackageError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: String, reason: String },
    #[error("invalid request: {0}")]
    Request(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
}

/// What the request's prompt is.
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    /// Rendered with the package's chat template (generation prompt added).
    Chat(Vec<ChatMessage>),
    TokenIds(Vec<u32>),
}

/// The one request type.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// `None`: the package's `generation.max_new_tokens`.
    pub max_new_tokens: Option<u32>,
    pub sampling: Sampling,
}

impl GenerateRequest {
    pub fn text(prompt: impl Into<String>) -> Self {
        Self { prompt: Prompt::Text(prompt.into()), max_new_tokens: None, sampling: Sampling::default() }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was produced (it is not part of the output).
    Eos,
    /// `max_new_tokens` were produced.
    Length,
    /// The token callback asked to stop.
    Stopped,
}

#[derive(Clone, Debug)]
pub struct GenerateResult {
    pub prompt_tokens: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
}

/// One streamed token: its id and the text it completes (possibly empty while
/// a multi-byte character is still incomplete).
pub struct TokenEvent<'a> {
    pub token_id: u32,
    pub text_delta: &'a str,
}

/// Whether generation goes on after a token callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

pub struct Engine {
    package: Package,
    tokenizer: Tokenizer,
    backend: Box<dyn DecodeBackend>,
}

/// Which decode backend an engine runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// ONNX Runtime, the reference.
    Ort,
    /// The native compiler's CPU plan.
    NativeCpu,
}

impl BackendKind {
    pub const ALL: [BackendKind; 2] = [BackendKind::Ort, BackendKind::NativeCpu];

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Ort => "ort",
            BackendKind::NativeCpu => onnx_genai_native::NAME,
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Opens this backend on `package` with `threads` threads (0: the
    /// backend decides).
    pub fn load(self, package: &Package, threads: usize) -> Result<Box<dyn DecodeBackend>, BackendError> {
        Ok(match self {
            BackendKind::Ort => Box::new(onnx_genai_ort::OrtDecoder::load(package, threads)?),
            BackendKind::NativeCpu => Box::new(onnx_genai_native::NativeDecoder::load(package, threads)?),
        })
    }
}

impl Engine {
    /// Validates the package and opens it on `backend`.
    pub fn open(dir: &Path, backend: BackendKind, threads: usize) -> Result<Self, EngineError> {
        let package = Package::open(dir)?;
        let backend = backend.load(&package, threads)?;
        Self::new(package, backend)
    }

    pub fn new(package: Package, backend: Box<dyn DecodeBackend>) -> Result<Self, EngineError> {
        let tokenizer = package.tokenizer().clone();
        Ok(Self { package, tokenizer, backend })
    }

    pub fn package(&self) -> &Package {
        &self.package
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Encodes text with the package tokenizer (special tokens are parsed).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EngineError::Tokenizer { path: "encode".into(), reason: e.to_string() })
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| EngineError::Tokenizer { path: "decode".into(), reason: e.to_string() })
    }

    fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        let ids = match prompt {
            Prompt::Text(text) => self.encode(text)?,
            Prompt::Chat(messages) => {
                let template = self.package.manifest.chat_template.as_deref().ok_or_else(|| {
                    EngineError::ChatTemplate(format!("package `{}` has no chat_template", self.package.manifest.name))
                })?;
                let rendered = chat::render(template, messages, &self.tokenizer, &self.package.manifest)?;
                self.encode(&rendered)?
            }
            Prompt::TokenIds(ids) => ids.clone(),
        };
        let vocab = self.backend.vocab_size();
        if let Some(bad) = ids.iter().find(|id| **id as usize >= vocab) {
            return Err(EngineError::Request(format!("token id {bad} is outside the vocabulary of {vocab}")));
        }
        if ids.is_empty() {
            return Err(EngineError::Request("the prompt is empty".into()));
        }
        Ok(ids)
    }

    /// Generates for `request`, calling `on_token` for each new token.
    pub fn generate(
        &mut self,
        request: &GenerateRequest,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<GenerateResult, EngineError> {
        request.sampling.check().map_err(EngineError::Request)?;
        let m = &self.package.manifest;
        let max_new = request.max_new_tokens.unwrap_or(m.generation.max_new_tokens) as usize;
        if max_new == 0 {
            return Err(EngineError::Request("max_new_tokens must be at least 1".into()));
        }
        let prompt = self.prompt_ids(&request.prompt)?;
        let context = m.architecture.max_sequence_length as usize;
        if prompt.len() >= context {
            return Err(EngineError::Request(format!(
                "the prompt has {} tokens; the context holds {context}, leaving no room to generate",
                prompt.len()
            )));
        }
        let max_new = max_new.min(context - prompt.len());
        let eos = m.generation.eos_token_ids.clone();
        let mut sampler = Sampler::new(request.sampling.clone());
        self.backend.reset();
        let mut logits = self.backend.forward(&prompt)?;
        let mut generated = Vec::new();
        let mut emitted = String::new();
        let mut finish = FinishReason::Length;
        while generated.len() < max_new {
            let token = sampler.pick(&logits);
            if eos.contains(&token) {
                finish = FinishReason::Eos;
                break;
            }
            generated.push(token);
            let text = self.decode(&generated)?;
            // Hold back a trailing incomplete UTF-8 sequence until it completes.
            let delta = if text.ends_with('\u{FFFD}') || !text.starts_with(&emitted) {
                String::new()
            } else {
                text[emitted.len()..].to_string()
            };
            emitted.push_str(&delta);
            if on_token(TokenEvent { token_id: token, text_delta: &delta }) == Flow::Stop {
                finish = FinishReason::Stopped;
                break;
            }
            if generated.len() < max_new {
                logits = self.backend.forward(&[token])?;
            }
        }
        let text = self.decode(&generated)?;
        Ok(GenerateResult { prompt_tokens: prompt.len(), token_ids: generated, text, finish_reason: finish })
    }
}
