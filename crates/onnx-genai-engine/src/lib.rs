//! One request type, one generate path: resolve the session and its carried
//! tokens, count tokens with the package tokenizer, admit against the KV byte
//! budget, signal `on_admitted`, run, release, report.
//!
//! Admission sits before the split between execution kinds, so no entry
//! point can bypass it (INVARIANTS A1). The reservation is an RAII guard
//! held by the admitted [`Turn`], so every exit releases it (A4).
//!
//! The path is step-wise so that one model can serve many requests at once:
//! [`Engine::admit`] turns a request into a [`Turn`], [`Engine::step`]
//! advances any number of turns by one batched model step (prefill chunks
//! and decode tokens together), and [`Engine::finish`] ends one.
//! [`Engine::generate_with`] is those three for a single request.

mod backends;
mod chat;
mod constraint;
mod detok;
mod request;
pub mod sampling;
mod template;
pub mod tools;
mod turn;
mod workflow;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub use backends::BackendKind;
pub use chat::{render_chat_template, Chat, ChatMessage, Prompter};
pub use constraint::{Constraint, ResponseFormat};
pub use onnx_genai_backend::KvCache;
use onnx_genai_backend::{BackendError, DecodeModel, Sequence};
use onnx_genai_package::{Package, PackageError};
pub use onnx_genai_scheduler::{AdmissionError, BudgetCap, ConversationId, Scheduler};
pub use request::{BoundTensor, ComponentOverride, GenerateRequest, Prompt, SessionId, TensorType, MAX_CHOICES};
pub use sampling::{Sampling, TokenLogprob};
pub use template::RESERVED as RESERVED_TEMPLATE_VARS;
use tokenizers::Tokenizer;
pub use turn::{Turn, TurnState};
use workflow::WorkflowRuntime;

/// The bit every conversation id of a request without a session carries,
/// so that it never equals a session's (a server mints its session ids
/// from 1, the engine its own from the same count as these): the server's
/// driver finds the first choice of a request of `n` choices by its
/// conversation, to hand it the choices forked from it, and a stateless
/// request numbered like a running session once drew that session's turn
/// (its choices then streamed on the other client's channel).
pub const STATELESS_CONVERSATIONS: u64 = 1 << 63;

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
    #[error("{0} is running another turn")]
    SessionBusy(SessionId),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The request's response format cannot be compiled into a grammar.
    #[error("response_format: {0}")]
    ResponseFormat(String),
    /// The response format's grammar failed in a running turn: a schema
    /// that compiled can still dead-end (a pattern no token can spell, the
    /// parser's limits), so this is the request's, like `ResponseFormat`.
    #[error("constrained decoding failed: {0}")]
    Constrained(String),
    /// An image the request sends cannot be used (not PNG or JPEG, does not
    /// decode, or the package takes no images).
    #[error("image: {0}")]
    Image(String),
    /// The backend panicked while running this request's sequence.
    #[error("the {backend} backend failed while running this request")]
    Panicked { backend: &'static str },
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
    /// One per generated token when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprob>,
    /// Which of the request's `n` choices this is.
    pub choice: usize,
}

/// One streamed token: its id and the text it completes (possibly empty while
/// a multi-byte character is still incomplete).
pub struct TokenEvent<'a> {
    pub token_id: u32,
    pub text_delta: &'a str,
    /// When the request asked for logprobs.
    pub logprob: Option<&'a TokenLogprob>,
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

struct Session {
    /// `None` while a turn holds it.
    sequence: Option<Box<dyn Sequence>>,
    conversation: ConversationId,
    /// Every token of the conversation so far (prompts and generated); the
    /// sequence's KV holds a prefix of them.
    tokens: Vec<u32>,
    /// Where the last finished turn's generated tokens begin in `tokens`.
    turn_start: usize,
    /// While idle: the reservation covering the KV its sequence keeps (B2),
    /// which its next turn takes over.
    idle: Option<onnx_genai_scheduler::Admission>,
    /// When a turn last ended on it (for spilling the least recently used
    /// idle KV under budget pressure).
    last_used: u64,
}

pub struct Engine {
    package: Package,
    tokenizer: Tokenizer,
    prompter: Arc<Prompter>,
    model: Arc<dyn DecodeModel>,
    /// Finished sequences of requests without a session, kept for reuse.
    spare: Vec<Box<dyn Sequence>>,
    scheduler: Scheduler,
    sessions: BTreeMap<SessionId, Session>,
    next_id: u64,
    /// Set for packages that declare workflow steps (no decode core).
    workflow: Option<WorkflowRuntime>,
    /// Longest prompt piece one step feeds a sequence (0: all of it), so a
    /// long prefill shares steps with running decodes instead of stalling
    /// them.
    prefill_chunk: usize,
    /// Counts finished turns (orders idle sessions by last use).
    clock: u64,
    /// Choices made by the last steps (a request's `n` > 1), for the
    /// caller to run: [`Engine::take_forked`].
    forked: Vec<Turn>,
}

impl Engine {
    /// Validates the package and opens it on `backend`, with an unlimited
    /// budget (see [`Engine::with_scheduler`]).
    pub fn open(dir: &Path, backend: BackendKind, threads: usize) -> Result<Self, EngineError> {
        Self::open_with(dir, backend, threads, KvCache::Model)
    }

    /// [`Engine::open`] with the model's KV cache stored as `kv` says
    /// (admission then counts the bytes it stores).
    pub fn open_with(dir: &Path, backend: BackendKind, threads: usize, kv: KvCache) -> Result<Self, EngineError> {
        let package = Package::open(dir)?;
        let model = backend.load_with(&package, threads, kv)?;
        Self::assemble(package, model, threads)
    }

    /// An engine over `package` running on `model` (loaded from it); a
    /// workflow's other components get ONNX Runtime's default threads.
    pub fn new(package: Package, model: Arc<dyn DecodeModel>) -> Result<Self, EngineError> {
        Self::assemble(package, model, 0)
    }

    /// [`Engine::new`], a workflow's other components (vision encoder,
    /// embedding table: stateless, on ONNX Runtime whatever the decoder
    /// runs on) on `component_threads` threads (0: ONNX Runtime decides).
    fn assemble(package: Package, model: Arc<dyn DecodeModel>, component_threads: usize) -> Result<Self, EngineError> {
        let tokenizer = package.tokenizer().clone();
        let workflow = WorkflowRuntime::load(&package, component_threads)?;
        let prompter = Arc::new(Prompter::new(package.clone()).with_vocab_size(model.vocab_size()));
        Ok(Self {
            package,
            tokenizer,
            prompter,
            model,
            spare: Vec::new(),
            scheduler: Scheduler::unlimited(),
            sessions: BTreeMap::new(),
            next_id: 1,
            workflow,
            prefill_chunk: 0,
            clock: 0,
            forked: Vec::new(),
        })
    }

    /// Admits against `scheduler`'s budget (shared with every engine holding
    /// a clone of it). Idle sessions give up their KV (their history stays),
    /// since the new budget never reserved it.
    pub fn with_scheduler(mut self, scheduler: Scheduler) -> Self {
        self.scheduler = scheduler;
        while self.spill_idle(None) {}
        self
    }

    /// Feeds prompts at most `tokens` positions per step (0: whole).
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens;
        self
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn package(&self) -> &Package {
        &self.package
    }

    pub fn model(&self) -> &Arc<dyn DecodeModel> {
        &self.model
    }

    /// The engine's tokenizer and chat template, shareable with other
    /// threads (a server tokenizes there, off the model's driver).
    pub fn prompter(&self) -> Arc<Prompter> {
        self.prompter.clone()
    }

    pub fn backend_name(&self) -> &'static str {
        self.model.name()
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
    /// package's workflow declares (`Prompter::image` decodes and resizes
    /// an encoded one first).
    pub fn pixel_values(&self, rgb: &[u8], width: u32, height: u32) -> Result<BoundTensor, EngineError> {
        let image = self.package.manifest.workflow.as_ref().and_then(|w| w.image.as_ref()).ok_or_else(|| {
            EngineError::Request(format!("package `{}` declares no image input", self.package.manifest.name))
        })?;
        workflow::pixel_values(rgb, width, height, image)
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
        onnx_genai_package::decode(&self.tokenizer, ids, true)
            .map_err(|reason| EngineError::Tokenizer { path: "decode".into(), reason })
    }

    /// A fresh id for a session the engine opens itself, or (with
    /// [`STATELESS_CONVERSATIONS`] set) for a request without a session.
    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Opens a session: a new sequence of the shared model (no KV memory
    /// until its first turn).
    pub fn create_session(&mut self) -> Result<SessionId, EngineError> {
        let id = SessionId(self.fresh_id());
        self.open_session(id)?;
        Ok(id)
    }

    /// Opens a session under a caller-chosen id (a server that mints its own
    /// ids); refused when the id is taken.
    pub fn open_session(&mut self, id: SessionId) -> Result<(), EngineError> {
        if self.sessions.contains_key(&id) {
            return Err(EngineError::Request(format!("{id} already exists")));
        }
        let sequence = self.model.new_sequence();
        // Keep engine-minted ids clear of caller-chosen ones.
        self.next_id = self.next_id.max(id.0 + 1);
        let session = Session {
            sequence: Some(sequence),
            conversation: ConversationId(id.0),
            tokens: Vec::new(),
            turn_start: 0,
            idle: None,
            last_used: 0,
        };
        self.sessions.insert(id, session);
        Ok(())
    }

    /// Closes a session and frees its KV cache (at once, or when the turn
    /// holding it ends).
    pub fn close_session(&mut self, id: SessionId) -> Result<(), EngineError> {
        self.sessions.remove(&id).map(drop).ok_or(EngineError::UnknownSession(id))
    }

    /// Cuts an idle session's last turn to its first `generated` tokens
    /// and then `tail`: what a server does when a stop string ends a turn
    /// inside the generated text, so the next turn continues from the text
    /// the client got, not from tokens it never saw. `start` is where that
    /// turn's generated tokens begin (its prompt tokens, as admission
    /// counted them): a cut meant for an earlier turn — another turn ended
    /// on the session since — is refused and changes nothing. The KV past
    /// the cut is dropped and its bytes released.
    pub fn trim_session(
        &mut self,
        id: SessionId,
        start: usize,
        generated: usize,
        tail: &[u32],
    ) -> Result<(), EngineError> {
        let vocab = self.prompter.vocab_size();
        let s = self.sessions.get_mut(&id).ok_or(EngineError::UnknownSession(id))?;
        let Some(seq) = s.sequence.as_mut() else { return Err(EngineError::SessionBusy(id)) };
        if start != s.turn_start {
            return Err(EngineError::Request(format!(
                "the cut is for a turn that began at token {start}, but the session's last turn began at {}",
                s.turn_start
            )));
        }
        let keep = start.saturating_add(generated);
        if keep > s.tokens.len() {
            return Err(EngineError::Request(format!(
                "cannot keep {keep} tokens of a session that has {}",
                s.tokens.len()
            )));
        }
        if let Some(bad) = tail.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Request(format!("token {bad} is outside the vocabulary of {vocab}")));
        }
        // A sequence that cannot truncate drops its KV: the history stays,
        // the next turn prefills it.
        if seq.kv_len() > keep && seq.truncate(keep).is_err() {
            seq.reset();
        }
        s.tokens.truncate(keep);
        s.tokens.extend_from_slice(tail);
        let bytes = seq.resident_bytes();
        if let Some(idle) = s.idle.as_mut() {
            idle.shrink_to(bytes);
        }
        Ok(())
    }

    /// Tokens a session has carried so far.
    pub fn session_tokens(&self, id: SessionId) -> Result<&[u32], EngineError> {
        self.sessions.get(&id).map(|s| s.tokens.as_slice()).ok_or(EngineError::UnknownSession(id))
    }

    /// KV bytes resident for every sequence this engine holds outside a
    /// running turn: idle sessions and kept spares. At rest the scheduler
    /// reserves exactly this much for the engine (B2).
    pub fn idle_kv_bytes(&self) -> u64 {
        let sessions: u64 =
            self.sessions.values().filter_map(|s| s.sequence.as_ref()).map(|s| s.resident_bytes()).sum();
        sessions + self.spare.iter().map(|s| s.resident_bytes()).sum::<u64>()
    }

    /// Frees the KV of this engine's least recently used idle session (its
    /// history stays, to be prefilled again by its next turn), giving its
    /// bytes back to the budget; whether there was one. A server calls it
    /// when a request to another model on the same budget waits for room:
    /// an engine spills its own idle sessions for its own requests, not for
    /// another engine's.
    pub fn give_way(&mut self) -> bool {
        self.spill_idle(None)
    }

    /// Frees the KV of the least recently used idle session other than
    /// `keep` (its history stays: its next turn prefills it again) and
    /// releases what it held. Returns whether there was one to free.
    fn spill_idle(&mut self, keep: Option<SessionId>) -> bool {
        let victim = self
            .sessions
            .iter()
            .filter(|(id, s)| Some(**id) != keep && s.idle.as_ref().is_some_and(|a| a.bytes() > 0))
            .min_by_key(|(_, s)| s.last_used)
            .map(|(id, _)| *id);
        let Some(id) = victim else { return false };
        if let Some(s) = self.sessions.get_mut(&id) {
            if let Some(seq) = s.sequence.as_mut() {
                seq.reset();
            }
            s.idle = None;
        }
        true
    }

    /// The new tokens of a prompt, counted with the one tokenizer the run
    /// encodes with (A7).
    fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<Vec<u32>>, EngineError> {
        let rows = self.prompter.rows(prompt)?;
        let vocab = self.model.vocab_size();
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

    /// The one generate path for one request: [`Engine::admit`], then
    /// [`Engine::step`] until the turn is done, then [`Engine::finish`].
    /// `on_admitted` fires exactly once, after the scheduler admitted the
    /// request and before any backend work; never for a refused request
    /// (A3).
    pub fn generate_with(
        &mut self,
        request: &GenerateRequest,
        on_admitted: &mut dyn FnMut(Admitted),
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<GenerateResult, EngineError> {
        if request.n != 1 {
            return Err(EngineError::Request(format!(
                "this path returns one choice; ask for n = {} with generate_choices",
                request.n
            )));
        }
        let mut results = self.generate_choices(request, on_admitted, &mut |_, event| on_token(event))?;
        results.pop().ok_or_else(|| EngineError::Request("the turn ended without a result".into()))
    }

    /// The generate path for all `request.n` choices: admit once (for all
    /// of them), step every running choice together — the first prefills
    /// the prompt, the others start from a copy of its KV — and end each.
    /// `on_token(choice, event)`. Results are in choice order; when any
    /// choice fails, every one is ended (and released) and the first error
    /// returned.
    pub fn generate_choices(
        &mut self,
        request: &GenerateRequest,
        on_admitted: &mut dyn FnMut(Admitted),
        on_token: &mut dyn FnMut(usize, TokenEvent<'_>) -> Flow,
    ) -> Result<Vec<GenerateResult>, EngineError> {
        let mut turns = vec![self.admit(request, on_admitted)?];
        loop {
            let mut running: Vec<&mut Turn> = turns.iter_mut().filter(|t| t.state() == TurnState::Running).collect();
            if running.is_empty() {
                break;
            }
            let choices: Vec<usize> = running.iter().map(|t| t.choice()).collect();
            self.step(&mut running, &mut |i, event| on_token(choices[i], event));
            turns.extend(self.take_forked());
        }
        turns.sort_by_key(Turn::choice);
        let mut results = Vec::with_capacity(turns.len());
        let mut failed = None;
        for turn in turns {
            match self.finish(turn) {
                Ok(r) => results.push(r),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        failed.map_or(Ok(results), Err)
    }

    /// The choices the last steps made (a request's `n` > 1: each copies
    /// its first choice's KV once the prompt has run); the caller runs and
    /// ends them like any turn.
    pub fn take_forked(&mut self) -> Vec<Turn> {
        std::mem::take(&mut self.forked)
    }
}
