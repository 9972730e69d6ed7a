//! One request type, one generate path: resolve the session and its carried
//! tokens, count tokens with the package tokenizer, admit against the KV byte
//! budget, signal `on_admitted`, run, release, report.
//!
//! Admission sits before the split between execution kinds, so no entry
//! point can bypass it (INVARIANTS A1). The reservation is an RAII guard
//! held for the whole run, so every exit releases it (A4).

mod chat;
mod request;
pub mod sampling;
mod workflow;

use std::collections::BTreeMap;
use std::path::Path;

pub use chat::ChatMessage;
use onnx_genai_backend::{BackendError, DecodeBackend};
use onnx_genai_package::{Package, PackageError};
use onnx_genai_scheduler::{Admission, AdmissionRequest};
pub use onnx_genai_scheduler::{AdmissionError, BudgetCap, ConversationId, Scheduler};
pub use request::{BoundTensor, ComponentOverride, GenerateRequest, Prompt, SessionId, TensorType};
use sampling::Sampler;
pub use sampling::Sampling;
use tokenizers::Tokenizer;
use workflow::WorkflowRuntime;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Package(#[from] PackageError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Refused by the KV byte budget, with the numbers (A2).
    #[error("scheduler admission failed: {0}")]
    Admission(#[from] AdmissionError),
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: String, reason: String },
    #[error("invalid request: {0}")]
    Request(String),
    #[error("invalid tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("unknown session {0} (create one first, or it was closed)")]
    UnknownSession(SessionId),
    #[error("chat template: {0}")]
    ChatTemplate(String),
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was produced (it is not part of the output).
    Eos,
    /// `max_new_tokens` (possibly clamped by the budget) were produced.
    Length,
    /// The token callback asked to stop.
    Stopped,
}

#[derive(Clone, Debug)]
pub struct GenerateResult {
    /// Tokens admission counted: carried from earlier turns plus new (A5).
    pub prompt_tokens: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// How the budget clamped `max_new_tokens`; `None` when it did not (A6).
    pub budget_cap: Option<BudgetCap>,
    pub session: Option<SessionId>,
}

/// One streamed token: its id and the text it completes (possibly empty while
/// a multi-byte character is still incomplete).
pub struct TokenEvent<'a> {
    pub token_id: u32,
    pub text_delta: &'a str,
}

/// What `on_admitted` is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub conversation: ConversationId,
    pub prompt_tokens: u64,
    pub max_new_tokens: u64,
    pub reserved_bytes: u64,
}

/// Whether generation goes on after a token callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// Makes a fresh decode backend (one per session, each with its own KV).
pub type BackendFactory = Box<dyn Fn() -> Result<Box<dyn DecodeBackend>, BackendError> + Send>;

struct Session {
    backend: Box<dyn DecodeBackend>,
    conversation: ConversationId,
    /// Every token of the conversation so far (prompts and generated); the
    /// backend's KV holds a prefix of them.
    tokens: Vec<u32>,
}

pub struct Engine {
    package: Package,
    tokenizer: Tokenizer,
    factory: BackendFactory,
    /// Runs requests that name no session.
    core: Box<dyn DecodeBackend>,
    scheduler: Scheduler,
    sessions: BTreeMap<SessionId, Session>,
    next_id: u64,
    /// Set for packages that declare workflow steps (no decode core).
    workflow: Option<WorkflowRuntime>,
}

impl Engine {
    /// Validates the package and opens it on `backend`, with an unlimited
    /// budget (see [`Engine::with_scheduler`]).
    pub fn open(dir: &Path, backend: BackendKind, threads: usize) -> Result<Self, EngineError> {
        let package = Package::open(dir)?;
        let factory_package = package.clone();
        let factory: BackendFactory = Box::new(move || backend.load(&factory_package, threads));
        Self::new(package, factory)
    }

    /// An engine over `package` whose backends `factory` makes.
    pub fn new(package: Package, factory: BackendFactory) -> Result<Self, EngineError> {
        let tokenizer = package.tokenizer().clone();
        let core = factory()?;
        let workflow = WorkflowRuntime::load(&package)?;
        Ok(Self {
            package,
            tokenizer,
            factory,
            core,
            scheduler: Scheduler::unlimited(),
            sessions: BTreeMap::new(),
            next_id: 1,
            workflow,
        })
    }

    /// Admits against `scheduler`'s budget (shared with every engine holding
    /// a clone of it).
    pub fn with_scheduler(mut self, scheduler: Scheduler) -> Self {
        self.scheduler = scheduler;
        self
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn package(&self) -> &Package {
        &self.package
    }

    pub fn backend_name(&self) -> &'static str {
        self.core.name()
    }

    /// Whether this engine interprets a declared workflow (no decode core).
    pub fn is_workflow(&self) -> bool {
        self.workflow.is_some()
    }

    /// Times a workflow's image encoder actually ran (cache misses).
    pub fn encoder_runs(&self) -> usize {
        self.workflow.as_ref().map_or(0, |w| w.encoder_runs)
    }

    /// `pixel_values` from an RGB8 image already resized to the size the
    /// package's workflow declares.
    pub fn pixel_values(&self, rgb: &[u8], width: u32, height: u32) -> Result<BoundTensor, EngineError> {
        let image = self.package.manifest.workflow.as_ref().and_then(|w| w.image.as_ref()).ok_or_else(|| {
            EngineError::Request(format!("package `{}` declares no image input", self.package.manifest.name))
        })?;
        workflow::pixel_values(rgb, width, height, image)
    }

    /// The token text a prompt marks an image with, if the package takes
    /// images.
    pub fn image_placeholder(&self) -> Option<&str> {
        Some(self.package.manifest.workflow.as_ref()?.image.as_ref()?.placeholder.as_str())
    }

    /// The image size the workflow's preprocessing expects.
    pub fn image_size(&self) -> Option<(u32, u32)> {
        let image = self.package.manifest.workflow.as_ref()?.image.as_ref()?;
        Some((image.preprocess.width, image.preprocess.height))
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

    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Opens a session with its own KV cache.
    pub fn create_session(&mut self) -> Result<SessionId, EngineError> {
        let backend = (self.factory)()?;
        let id = self.fresh_id();
        self.sessions.insert(SessionId(id), Session { backend, conversation: ConversationId(id), tokens: Vec::new() });
        Ok(SessionId(id))
    }

    /// Opens a session under a caller-chosen id (a server that mints its own
    /// ids); refused when the id is taken.
    pub fn open_session(&mut self, id: SessionId) -> Result<(), EngineError> {
        if self.sessions.contains_key(&id) {
            return Err(EngineError::Request(format!("{id} already exists")));
        }
        let backend = (self.factory)()?;
        // Keep engine-minted ids clear of caller-chosen ones.
        self.next_id = self.next_id.max(id.0 + 1);
        self.sessions.insert(id, Session { backend, conversation: ConversationId(id.0), tokens: Vec::new() });
        Ok(())
    }

    /// Closes a session and frees its KV cache.
    pub fn close_session(&mut self, id: SessionId) -> Result<(), EngineError> {
        self.sessions.remove(&id).map(drop).ok_or(EngineError::UnknownSession(id))
    }

    /// Tokens a session has carried so far.
    pub fn session_tokens(&self, id: SessionId) -> Result<&[u32], EngineError> {
        self.sessions.get(&id).map(|s| s.tokens.as_slice()).ok_or(EngineError::UnknownSession(id))
    }

    /// The new tokens of a prompt, counted with the one tokenizer the run
    /// encodes with (A7).
    fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<Vec<u32>>, EngineError> {
        let rows = match prompt {
            Prompt::Text(text) => vec![self.encode(text)?],
            Prompt::Chat(messages) => {
                let template = self.package.manifest.chat_template.as_deref().ok_or_else(|| {
                    EngineError::ChatTemplate(format!("package `{}` has no chat_template", self.package.manifest.name))
                })?;
                vec![self.encode(&chat::render(template, messages, &self.tokenizer, &self.package.manifest)?)?]
            }
            Prompt::TokenIds(ids) => vec![ids.clone()],
            Prompt::TokenRows(rows) => rows.clone(),
        };
        let vocab = self.core.vocab_size();
        for row in &rows {
            if let Some(bad) = row.iter().find(|id| **id as usize >= vocab) {
                return Err(EngineError::Request(format!("token id {bad} is outside the vocabulary of {vocab}")));
            }
        }
        if rows.iter().all(Vec::is_empty) {
            return Err(EngineError::Request("the prompt is empty".into()));
        }
        Ok(rows)
    }

    /// [`Engine::generate_with`] without an admission callback.
    pub fn generate(
        &mut self,
        request: &GenerateRequest,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<GenerateResult, EngineError> {
        self.generate_with(request, &mut |_| {}, on_token)
    }

    /// The one generate path. `on_admitted` fires exactly once, after the
    /// scheduler admitted the request and before any backend work; never
    /// for a refused request (A3).
    pub fn generate_with(
        &mut self,
        request: &GenerateRequest,
        on_admitted: &mut dyn FnMut(Admitted),
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<GenerateResult, EngineError> {
        // 1. Resolve the session and what it carries.
        let (conversation, carried) = match request.session {
            Some(id) => {
                let s = self.sessions.get(&id).ok_or(EngineError::UnknownSession(id))?;
                (s.conversation, s.tokens.len())
            }
            None => (ConversationId(self.fresh_id()), 0),
        };
        // 2. Count tokens: carried plus new, rows as `rows * longest` (A5, A7).
        request.check()?;
        let mut rows = self.prompt_ids(&request.prompt)?;
        if let Some(wf) = &self.workflow {
            if rows.len() != 1 {
                return Err(EngineError::Request(format!(
                    "a workflow runs one token row, the prompt has {}",
                    rows.len()
                )));
            }
            rows[0] = wf.expand(&rows[0], request)?;
        }
        let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
        let prompt_tokens = carried + rows.len() * longest;
        let m = &self.package.manifest;
        let context = m.architecture.max_sequence_length as usize;
        if prompt_tokens >= context {
            return Err(EngineError::Request(format!(
                "the prompt has {prompt_tokens} tokens ({carried} carried) but the context length is {context} ({}), \
                 leaving no room to generate: shorten the prompt, or raise the context length if the model supports it",
                self.package.context_length_key()
            )));
        }
        let requested = request.max_new_tokens.unwrap_or(m.generation.max_new_tokens) as usize;
        let max_new = requested.min(context - prompt_tokens);
        // 3. Admit. The guard lives until this function returns or unwinds.
        let admission = self.scheduler.admit(&AdmissionRequest {
            conversation,
            prompt_tokens: prompt_tokens as u64,
            max_new_tokens: max_new as u64,
            bytes_per_token: self.package.kv_geometry().map(|g| g.bytes_per_token()),
            wait_until: None,
        })?;
        // 4. Signal, after the decision and before any backend work.
        on_admitted(Admitted {
            conversation,
            prompt_tokens: prompt_tokens as u64,
            max_new_tokens: admission.max_new_tokens,
            reserved_bytes: admission.bytes(),
        });
        // 5. Run (the split between execution kinds comes after admission).
        let result = self.run(request, &admission, rows, on_token);
        // 6. Release: the guard drops here on success and on error alike.
        drop(admission);
        let mut result = result?;
        result.prompt_tokens = prompt_tokens;
        Ok(result)
    }

    /// Runs an admitted request: on the decode core, or through the
    /// workflow (which first refuses undeclared bindings).
    fn run(
        &mut self,
        request: &GenerateRequest,
        admission: &Admission,
        mut rows: Vec<Vec<u32>>,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<GenerateResult, EngineError> {
        match &self.workflow {
            Some(wf) => wf.check_bindings(request)?,
            None => {
                if let Some(t) = request.inputs.first() {
                    return Err(EngineError::Request(format!(
                        "`{}` is not an application input of package `{}`: it declares no workflow inputs",
                        t.name, self.package.manifest.name
                    )));
                }
                if let Some(o) = request.overrides.first() {
                    return Err(EngineError::Request(format!(
                        "component `{}` cannot be overridden: package `{}` runs on a decode core without a workflow",
                        o.component, self.package.manifest.name
                    )));
                }
            }
        }
        if rows.len() != 1 {
            return Err(EngineError::Request(format!(
                "a decode core runs one token row, the prompt has {}",
                rows.len()
            )));
        }
        let new = rows.remove(0);
        let max_new = admission.max_new_tokens as usize;
        let eos = self.package.manifest.generation.eos_token_ids.clone();
        let mut sampler = Sampler::new(request.sampling.clone());
        let (backend, history) = match request.session {
            Some(id) => {
                let s = self.sessions.get_mut(&id).ok_or(EngineError::UnknownSession(id))?;
                (&mut s.backend, Some(&mut s.tokens))
            }
            None => {
                self.core.reset();
                (&mut self.core, None)
            }
        };
        // A session's KV never holds more than its history (a turn that
        // unwound mid-way may have left extra positions behind).
        if let Some(h) = &history {
            backend.truncate(h.len())?;
        }
        // A continuing turn prefills only what its KV does not hold yet.
        let kept = backend.kv_len();
        let mut feed: Vec<u32> = history.as_ref().map(|h| h[kept.min(h.len())..].to_vec()).unwrap_or_default();
        let new_start = feed.len();
        feed.extend_from_slice(&new);
        let workflow = &mut self.workflow;
        let tokenizer = &self.tokenizer;
        let mut run = || -> Result<(Vec<u32>, FinishReason), EngineError> {
            let logits = match workflow.as_mut() {
                Some(wf) => wf.prefill(backend.as_mut(), request, &feed, new_start)?,
                None => backend.forward(&feed)?,
            };
            let mut step = |t: &[u32]| match workflow.as_mut() {
                Some(wf) => wf.step(backend.as_mut(), t),
                None => Ok(backend.forward(t)?),
            };
            decode_loop(logits, &mut step, tokenizer, max_new, &eos, &mut sampler, on_token)
        };
        let outcome = run();
        match outcome {
            Ok((generated, finish)) => {
                if let Some(h) = history {
                    h.extend_from_slice(&new);
                    h.extend_from_slice(&generated);
                }
                let text = self.decode(&generated)?;
                Ok(GenerateResult {
                    prompt_tokens: 0,
                    token_ids: generated,
                    text,
                    finish_reason: finish,
                    budget_cap: admission.budget_cap,
                    session: request.session,
                })
            }
            Err(e) => {
                // A failed turn leaves the session as it was before the turn.
                let backend = match request.session.and_then(|id| self.sessions.get_mut(&id)) {
                    Some(s) => &mut s.backend,
                    None => &mut self.core,
                };
                if let Err(t) = backend.truncate(kept) {
                    backend.reset();
                    return Err(t.into());
                }
                Err(e)
            }
        }
    }
}

/// Runs tokens through the model and returns the last position's logits.
type Step<'a> = dyn FnMut(&[u32]) -> Result<Vec<f32>, EngineError> + 'a;

/// From the prefill's `logits`, sample up to `max_new` tokens, running each
/// through `step`.
fn decode_loop(
    mut logits: Vec<f32>,
    step: &mut Step<'_>,
    tokenizer: &Tokenizer,
    max_new: usize,
    eos: &[u32],
    sampler: &mut Sampler,
    on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
) -> Result<(Vec<u32>, FinishReason), EngineError> {
    let mut generated = Vec::new();
    let mut emitted = String::new();
    let mut finish = FinishReason::Length;
    let decode = |ids: &[u32]| {
        tokenizer.decode(ids, true).map_err(|e| EngineError::Tokenizer { path: "decode".into(), reason: e.to_string() })
    };
    while generated.len() < max_new {
        let token = sampler.pick(&logits);
        if eos.contains(&token) {
            finish = FinishReason::Eos;
            break;
        }
        generated.push(token);
        let text = decode(&generated)?;
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
            logits = step(&[token])?;
        }
    }
    Ok((generated, finish))
}
