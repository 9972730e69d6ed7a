//! The HTTP routes. A turn: parse and check the body, find the model, take
//! the session's lease (L1), send the command to the model's driver, wait
//! for the admission promise before any header (A9), then answer as JSON or
//! as an SSE stream.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use onnx_genai_engine::{Chat, EngineError, FinishReason, GenerateRequest, Prompt, ResponseFormat, TokenLogprob};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{self, ChatRequest, CompletionRequest, SessionRequest};
use crate::driver::{Command, Driver, Event, Promise};
use crate::error::{ApiError, SESSION_GONE};
use crate::fields;
use crate::logprobs::{self, Scored};
use crate::messages::{self, SentImage};
use crate::metrics::TokenClock;
use crate::sessions::{mint_id, Owner, Placement};
use crate::tool_calls::{self, ToolUse};
use crate::AppState;

/// The header a turn names its session with.
pub const SESSION_HEADER: &str = "x-session-id";

/// 200 `ok` while every model's driver runs; 503 naming the models whose
/// driver died (a supervisor or load balancer restarts the server).
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    let down: Vec<&str> = state.drivers.values().filter(|d| !d.alive()).map(|d| d.model.as_str()).collect();
    // Their sessions died with them: unbind the ids too.
    for model in &down {
        state.registry.purge_model(model);
    }
    if down.is_empty() {
        return Json(json!({"status": "ok"})).into_response();
    }
    (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unhealthy", "models_down": down}))).into_response()
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state.metrics.render(&state.gauges());
    ([(axum::http::header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response()
}

/// The OpenAPI document of every route (`openapi.rs`).
pub async fn openapi(State(state): State<Arc<AppState>>) -> Json<Value> {
    let models: Vec<&str> = state.drivers.keys().map(String::as_str).collect();
    Json(crate::openapi::document(&models))
}

pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let data: Vec<Value> = state
        .drivers
        .keys()
        .map(|name| json!({"id": name, "object": "model", "created": 0, "owned_by": "onnx-genai"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// A model's driver, if it is served and alive (a dead one answers 503).
fn driver<'a>(state: &'a AppState, model: &str) -> Result<&'a Driver, ApiError> {
    let driver = state.drivers.get(model).ok_or_else(|| {
        let known: Vec<&str> = state.drivers.keys().map(String::as_str).collect();
        ApiError::not_found("model_not_found", format!("no model `{model}` (served: {})", known.join(", ")))
    })?;
    if !driver.alive() {
        state.registry.purge_model(model);
        return Err(driver.down());
    }
    Ok(driver)
}

/// The request body, or an OpenAI-shaped error (413 past the size limit).
fn body_of(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(format!("the request body is larger than {} bytes", crate::BODY_LIMIT))
        } else {
            ApiError::invalid(format!("cannot read the request body: {e}"))
        }
    })
}

pub async fn create_session(
    State(state): State<Arc<AppState>>,
    Extension(owner): Extension<Owner>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: SessionRequest = api::parse(&body_of(body)?, &fields::sessions())?;
    let driver = driver(&state, &req.model)?.clone();
    let (slot, evicted) = state.registry.reserve(&owner)?;
    if let Some(victim) = evicted {
        if let Some(d) = state.drivers.get(&victim.model) {
            let _ = d.send(Command::CloseSession { id: victim.engine });
        }
    }
    let engine = driver.mint_session();
    let id = mint_id();
    let placement = Placement { model: req.model.clone(), worker: 0, engine };
    state.registry.bind(slot, &id, placement, owner)?;
    // Queued before any turn can name the session, so the driver opens it first.
    driver.send(Command::OpenSession { id: engine })?;
    Ok(Json(json!({"id": id, "object": "session", "model": req.model})))
}

pub async fn delete_session(
    State(state): State<Arc<AppState>>,
    Extension(owner): Extension<Owner>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let placement = state.registry.close(&id, &owner)?;
    if let Some(d) = state.drivers.get(&placement.model) {
        let _ = d.send(Command::CloseSession { id: placement.engine });
    }
    Ok(Json(json!({"id": id, "object": "session.deleted", "deleted": true})))
}

/// Which wire format a turn answers in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

/// What a route asks of the answer beyond the prompt and sampling.
struct Answer {
    kind: Kind,
    format: ResponseFormat,
    /// Alternatives per token when logprobs are asked for.
    logprobs: Option<usize>,
    /// What the turn does with tool calls, when it offers tools.
    tools: Option<ToolUse>,
    /// Images the messages send, decoded before the lease.
    images: Vec<SentImage>,
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(owner): Extension<Owner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let turn = async {
        let req: ChatRequest = api::parse_turn(&body_of(body)?, &fields::chat())?;
        let mut format = api::response_format(req.response_format.as_ref())?;
        let logprobs = req.logprobs()?;
        let (tools, tool_use) = tool_calls::read(&req)?;
        if let Some(call) = tool_use.as_ref().and_then(ToolUse::format) {
            if format != ResponseFormat::Text {
                return Err(ApiError::param(
                    "response_format",
                    "a required tool call is JSON of its own: drop response_format, or set tool_choice to \"auto\"",
                ));
            }
            format = call;
        }
        let (messages, images) = messages::read(req.messages)?;
        let answer = Answer { kind: Kind::Chat, format, logprobs, tools: tool_use, images };
        run_turn(&state, &owner, &headers, Prompt::Chat(Chat { messages, tools }), answer, req.common).await
    };
    turn.await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    Extension(owner): Extension<Owner>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let turn = async {
        let req: CompletionRequest = api::parse_turn(&body_of(body)?, &fields::completions())?;
        if req.prompt.is_empty() {
            return Err(ApiError::param("prompt", "prompt must not be empty"));
        }
        let logprobs = req.logprobs()?;
        let answer =
            Answer { kind: Kind::Text, format: ResponseFormat::Text, logprobs, tools: None, images: Vec::new() };
        run_turn(&state, &owner, &headers, Prompt::Text(req.prompt), answer, req.common).await
    };
    turn.await.unwrap_or_else(IntoResponse::into_response)
}

async fn run_turn(
    state: &AppState,
    owner: &Owner,
    headers: &HeaderMap,
    prompt: Prompt,
    answer: Answer,
    opts: api::Sampling,
) -> Result<Response, ApiError> {
    let Answer { kind, format, logprobs, tools, images } = answer;
    opts.check()?;
    if let Some(user) = &opts.user {
        // Escaped and bounded: a client's string must not forge log lines.
        let user: String = user.chars().take(256).collect();
        tracing::info!(user = ?user, "end user");
    }
    let clock = state.metrics.token_clock();
    let driver = driver(state, &opts.model)?;
    // Without a seed, each request samples its own way (OpenAI's
    // behaviour); with one, the same request gives the same text. Checked
    // before the lease: a refused request holds nothing.
    let sampling = opts.engine_sampling(crate::sessions::random_u64)?;
    sampling.check_vocabulary(driver.prompter.vocab_size()).map_err(|m| ApiError::param("logit_bias", m))?;
    // A schema the grammar compiler refuses is refused here, before the
    // lease; compiling here also builds the model's shared compiler off the
    // driver (the engine compiles the format again when it admits).
    // Logprobs read the token table, built on first use: build it here too,
    // off the async workers.
    if format != ResponseFormat::Text || logprobs.is_some() {
        let (prompter, format) = (driver.prompter.clone(), format.clone());
        let from_tools = tools.as_ref().is_some_and(|t| t.required.is_some());
        tokio::task::spawn_blocking(move || {
            prompter.token_piece(0);
            prompter.constraint(&format).map(drop)
        })
        .await
        .map_err(|_| ApiError::internal())?
        .map_err(|e| match e {
            // The grammar is the required call's: the tools' schemas are at fault.
            EngineError::ResponseFormat(m) if from_tools => {
                ApiError::param("tools", format!("a tool's parameters cannot be compiled into a grammar: {m}"))
            }
            e => crate::error::from_engine(&e),
        })?;
    }
    // Images decode here, off the async workers and before the lease: one
    // that does not is refused naming its part, with nothing held.
    let mut inputs = Vec::with_capacity(images.len());
    for image in images {
        let prompter = driver.prompter.clone();
        let SentImage { param, encoded } = image;
        let decoded = tokio::task::spawn_blocking(move || prompter.image(&encoded))
            .await
            .map_err(|_| ApiError::internal())?
            .map_err(|e| ApiError::param(&param, e.to_string()))?;
        inputs.push(decoded);
    }
    // L1: the lease comes before anything queues; L8: no session, no lease.
    let session_id = match headers.get(SESSION_HEADER) {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| ApiError::invalid("the X-Session-Id header is not text"))?.to_string()),
    };
    let lease = match &session_id {
        None => None,
        Some(id) => Some(state.registry.lease(&opts.model, id, owner)?),
    };
    // Tokenize (and render the chat template) here, off the model's driver.
    let prompter = driver.prompter.clone();
    let prompt = tokio::task::spawn_blocking(move || prompter.tokenized(prompt))
        .await
        .map_err(|_| ApiError::internal())?
        .map_err(|e| crate::error::from_engine(&e))?;
    let mut request = GenerateRequest::new(prompt);
    let engine_session = lease.as_ref().map(|l| l.placement.engine);
    request.session = engine_session;
    request.max_new_tokens = opts.max_new_tokens();
    request.sampling = sampling;
    request.response_format = format;
    request.logprobs = logprobs;
    request.inputs = inputs;
    let (admission, admitted) = Promise::new();
    let (events, rx) = mpsc::channel(16);
    let (released, ended) = tokio::sync::oneshot::channel();
    driver.send(Command::Generate { request: Box::new(request), lease, admission, events, released })?;
    // A9: no header before the engine decided.
    let decided = admitted.await.map_err(|_| ApiError::internal())?;
    if let (Err(e), Some(id)) = (&decided, &session_id) {
        if e.code == Some(SESSION_GONE) {
            // The engine has no such session (its opening failed): unbind
            // the id too, so the registry does not keep a session that
            // cannot take a turn. Its lease is gone with the refusal.
            let _ = state.registry.close(id, owner);
        }
    }
    let prompt_tokens = decided?;
    let reply = Reply {
        model: opts.model.clone(),
        kind,
        prompt_tokens,
        stops: opts.stops(),
        id: format!("{}-{}", kind.prefix(), crate::sessions::random_hex()),
        scorer: logprobs.map(|_| driver.prompter.clone()),
        tools,
    };
    let session = engine_session.map(|id| {
        Box::new(SessionCut {
            driver: driver.clone(),
            id,
            prompter: driver.prompter.clone(),
            history: prompt_tokens as usize,
        })
    });
    let turn = Turn { rx, ended, clock, ends: Vec::new(), session };
    if opts.stream {
        let include_usage = opts.stream_options.as_ref().is_some_and(|o| o.include_usage);
        Ok(Sse::new(stream_events(reply, turn, include_usage)).into_response())
    } else {
        collect(reply, turn).await.map(|v| Json(v).into_response())
    }
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        }
    }
}

struct Reply {
    id: String,
    model: String,
    kind: Kind,
    /// What admission counted, for the `usage` of an answer a stop string
    /// ends (the engine's own result never comes for a turn cut short).
    prompt_tokens: u64,
    stops: Vec<String>,
    /// Shapes token log-probabilities, when the request asked for them.
    scorer: Option<Arc<onnx_genai_engine::Prompter>>,
    tools: Option<ToolUse>,
}

impl Reply {
    /// A token's log-probability with where its own text starts in the
    /// answer: at the end of its text delta when the delta ends with it (a
    /// delta may also carry bytes held back from earlier tokens that ended
    /// inside a character), else where the delta starts.
    fn scored(&self, before: usize, delta: &str, logprob: TokenLogprob) -> Scored {
        let own = self.scorer.as_ref().map(|p| p.token_piece(logprob.token).0).unwrap_or_default();
        let offset = if !own.is_empty() && delta.ends_with(&own) { before + delta.len() - own.len() } else { before };
        Scored { logprob, offset }
    }

    /// The calls in an answer, when the turn offers tools and it makes any.
    fn calls(&self, text: &str) -> Option<onnx_genai_engine::tools::Calls> {
        self.tools.as_ref()?.calls(text)
    }

    /// How much of the answer so far a stream may send: not what may still
    /// become a stop string, nor a tool call.
    fn sendable(&self, text: &str) -> usize {
        let ready = text.len() - undecided_tail(text, &self.stops);
        self.tools.as_ref().map_or(ready, |t| ready.min(t.sendable(text)))
    }

    /// The `logprobs` value of a choice: `null` when not asked for.
    fn logprobs(&self, scored: &[Scored]) -> Value {
        match (&self.scorer, self.kind) {
            (None, _) => Value::Null,
            (Some(p), Kind::Chat) => logprobs::chat(p, scored),
            (Some(p), Kind::Text) => logprobs::completion(p, scored),
        }
    }
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Eos | FinishReason::Stopped => "stop",
    }
}

/// Cuts `text` at the first stop string; `true` when one was found.
fn apply_stops(text: &mut String, stops: &[String]) -> bool {
    let cut = stops.iter().filter_map(|s| text.find(s.as_str())).min();
    if let Some(at) = cut {
        text.truncate(at);
        return true;
    }
    false
}

/// A running turn as its route sees it.
struct Turn {
    rx: mpsc::Receiver<Event>,
    /// Resolves when the driver no longer holds anything for the turn.
    ended: tokio::sync::oneshot::Receiver<()>,
    clock: TokenClock,
    /// Where each generated token's text ends in the answer (`None` while
    /// its bytes are part of a character a later token completes).
    ends: Vec<Option<usize>>,
    /// The session whose history a stop string's cut must reach.
    session: Option<Box<SessionCut>>,
}

/// What cutting a session's history needs.
struct SessionCut {
    driver: Driver,
    id: onnx_genai_engine::SessionId,
    prompter: Arc<onnx_genai_engine::Prompter>,
    /// The session's tokens when the turn's generation began.
    history: usize,
}

impl Turn {
    /// Notes a generated token: its delta, and the answer's length after it.
    fn took(&mut self, delta: &str, len: usize) {
        self.clock.token();
        self.ends.push((!delta.is_empty()).then_some(len));
    }

    /// Stops the generation early (a stop string cut the answer to `text`)
    /// and waits until its lease and reservation are released, so the
    /// answer never outruns them (issue 20: the session is free when the
    /// client hears the end). A session's history is then cut where the
    /// client's text ends: the tokens whose text lies wholly within it,
    /// then the rest of it encoded (issue 19) — sent to the driver before
    /// the answer goes out, so it precedes the client's next turn.
    async fn stop(self, text: &str) {
        drop(self.rx);
        let _ = self.ended.await;
        let Some(cut) = self.session else { return };
        let whole = self.ends.iter().rposition(|end| end.is_some_and(|end| end <= text.len())).map_or(0, |i| i + 1);
        let said = self.ends[..whole].iter().rev().find_map(|end| *end).unwrap_or(0);
        match cut.prompter.encode_plain(&text[said..]) {
            Ok(tail) => {
                let _ = cut.driver.send(Command::TrimSession { id: cut.id, keep: cut.history + whole, tail });
            }
            Err(e) => tracing::warn!("cannot encode the end of a cut answer: {e}"),
        }
    }
}

async fn collect(reply: Reply, mut turn: Turn) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut tokens = 0;
    let mut scored = Vec::new();
    while let Some(event) = turn.rx.recv().await {
        match event {
            Event::Delta(d, logprob) => {
                tokens += 1;
                scored.extend(logprob.map(|logprob| reply.scored(text.len(), &d, logprob)));
                text.push_str(&d);
                turn.took(&d, text.len());
                if apply_stops(&mut text, &reply.stops) {
                    turn.stop(&text).await;
                    let usage = api::usage(reply.prompt_tokens as usize, tokens);
                    // The tokens whose text the client gets.
                    let kept = logprobs::take_before(&mut scored, text.len());
                    return Ok(body(&reply, &text, "stop", Some(usage), reply.logprobs(&kept)));
                }
            }
            Event::Finished(result) => {
                let usage = api::usage(result.prompt_tokens, result.token_ids.len());
                let logprobs = reply.logprobs(&scored);
                return Ok(body(&reply, &text, finish_reason(result.finish_reason), Some(usage), logprobs));
            }
            Event::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal())
}

fn body(reply: &Reply, text: &str, finish: &str, usage: Option<Value>, logprobs: Value) -> Value {
    let choice = match reply.kind {
        Kind::Chat => {
            let (message, finish) = match reply.calls(text) {
                None => (json!({"role": "assistant", "content": text}), finish),
                Some(c) => {
                    let said = format!("{}{}", &text[..c.before], &text[c.after..]);
                    let content = if said.trim().is_empty() { Value::Null } else { json!(said) };
                    let calls = tool_calls::wire_calls(&c.calls);
                    (json!({"role": "assistant", "content": content, "tool_calls": calls}), "tool_calls")
                }
            };
            json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish})
        }
        Kind::Text => json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}),
    };
    let object = if reply.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
    json!({"id": reply.id, "object": object, "created": api::now(), "model": reply.model, "choices": [choice], "usage": usage})
}

fn chunk(reply: &Reply, delta: Option<&str>, finish: Option<&str>, first: bool) -> Value {
    scored_chunk(reply, delta, finish, first, &[])
}

/// A chunk carrying the log-probabilities of the tokens whose text it
/// sends (when the request asked for them).
fn scored_chunk(reply: &Reply, delta: Option<&str>, finish: Option<&str>, first: bool, scored: &[Scored]) -> Value {
    let d = match delta {
        Some(t) => json!({"content": t}),
        None => json!({}),
    };
    delta_chunk(reply, d, delta, finish, first, scored)
}

/// A chunk with a chat `delta` object (`text` for completions).
fn delta_chunk(
    reply: &Reply,
    mut d: Value,
    text: Option<&str>,
    finish: Option<&str>,
    first: bool,
    scored: &[Scored],
) -> Value {
    let logprobs = if scored.is_empty() { Value::Null } else { reply.logprobs(scored) };
    let choice = match reply.kind {
        Kind::Chat => {
            if first {
                d["role"] = json!("assistant");
            }
            json!({"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish})
        }
        Kind::Text => json!({"index": 0, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": logprobs}),
    };
    let object = if reply.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
    json!({"id": reply.id, "object": object, "created": api::now(), "model": reply.model, "choices": [choice]})
}

enum StreamState {
    /// `text` is everything generated (`tokens` tokens); its first `sent`
    /// bytes went out.
    Open {
        turn: Turn,
        text: String,
        tokens: usize,
        sent: usize,
        first: bool,
        /// Log-probabilities of tokens whose text has not gone out.
        scored: Vec<Scored>,
    },
    Done,
}

/// Bytes at the end of `text` that could begin a stop string: held back
/// from a stream until the next tokens decide, so a stop string split
/// across tokens never leaks its first part.
fn undecided_tail(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|stop| {
            stop.char_indices().skip(1).map(|(i, _)| &stop[..i]).filter(|prefix| text.ends_with(prefix)).map(str::len)
        })
        .max()
        .unwrap_or(0)
}

/// A stream's last chunks once the answer is whole: the text not sent yet
/// (held back as a possible stop string or tool call, and no longer), the
/// tool calls it makes, and the finish reason.
fn closing(reply: &Reply, text: &str, sent: usize, first: bool, scored: &[Scored], finish: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let calls = reply.calls(text);
    let sent = sent.min(text.len());
    let rest = match &calls {
        Some(c) => format!("{}{}", &text[sent.min(c.before)..c.before], &text[c.after..]),
        None => text[sent..].to_string(),
    };
    let mut first = first;
    if !rest.is_empty() || !scored.is_empty() {
        out.push(scored_chunk(reply, Some(&rest), None, first, scored));
        first = false;
    }
    let finish = match calls {
        None => finish,
        Some(c) => {
            for delta in tool_calls::call_deltas(&c.calls) {
                out.push(delta_chunk(reply, delta, None, None, first, &[]));
                first = false;
            }
            "tool_calls"
        }
    };
    out.push(chunk(reply, None, Some(finish), first));
    out
}

/// The stream's last chunk when the client asked for usage.
fn usage_chunk(reply: &Reply, prompt: usize, completion: usize) -> Value {
    let mut u = chunk(reply, None, None, false);
    u["choices"] = json!([]);
    u["usage"] = api::usage(prompt, completion);
    u
}

fn stream_events(reply: Reply, turn: Turn, include_usage: bool) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let reply = Arc::new(reply);
    let start = StreamState::Open { turn, text: String::new(), tokens: 0, sent: 0, first: true, scored: Vec::new() };
    stream::unfold(start, move |state| {
        let reply = reply.clone();
        async move {
            let StreamState::Open { mut turn, mut text, tokens, sent, first, mut scored } = state else { return None };
            let data = |v: Value| SseEvent::default().data(v.to_string());
            let done = SseEvent::default().data("[DONE]");
            match turn.rx.recv().await {
                Some(Event::Delta(d, logprob)) => {
                    let tokens = tokens + 1;
                    scored.extend(logprob.map(|logprob| reply.scored(text.len(), &d, logprob)));
                    text.push_str(&d);
                    turn.took(&d, text.len());
                    if apply_stops(&mut text, &reply.stops) {
                        turn.stop(&text).await;
                        let kept = logprobs::take_before(&mut scored, text.len());
                        let mut events: Vec<_> = closing(&reply, &text, sent, first, &kept, "stop")
                            .into_iter()
                            .map(|v| Ok(data(v)))
                            .collect();
                        if include_usage {
                            events.push(Ok(data(usage_chunk(&reply, reply.prompt_tokens as usize, tokens))));
                        }
                        events.push(Ok(done));
                        return Some((stream::iter(events), StreamState::Done));
                    }
                    let ready = reply.sendable(&text);
                    if ready <= sent {
                        // All of it may yet be a stop string: nothing to send.
                        let open = StreamState::Open { turn, text, tokens, sent, first, scored };
                        return Some((stream::iter(Vec::new()), open));
                    }
                    let piece = text[sent..ready].to_string();
                    let carried = logprobs::take_before(&mut scored, ready);
                    Some((
                        stream::iter(vec![Ok(data(scored_chunk(&reply, Some(&piece), None, first, &carried)))]),
                        StreamState::Open { turn, text, tokens, sent: ready, first: false, scored },
                    ))
                }
                Some(Event::Finished(result)) => {
                    let finish = finish_reason(result.finish_reason);
                    let mut events: Vec<_> =
                        closing(&reply, &text, sent, first, &scored, finish).into_iter().map(|v| Ok(data(v))).collect();
                    if include_usage {
                        events.push(Ok(data(usage_chunk(&reply, result.prompt_tokens, result.token_ids.len()))));
                    }
                    events.push(Ok(done));
                    Some((stream::iter(events), StreamState::Done))
                }
                Some(Event::Failed(e)) => Some((stream::iter(vec![Ok(data(e.body())), Ok(done)]), StreamState::Done)),
                None => None,
            }
        }
    })
    .flat_map(|s| s)
}

#[cfg(test)]
mod tests {
    use super::apply_stops;

    /// Issue 19: a stream holds back exactly the end of the text that could
    /// still become a stop string.
    #[test]
    fn the_undecided_tail_is_the_longest_stop_prefix_at_the_end() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(super::undecided_tail("hello E", &stops), 1);
        assert_eq!(super::undecided_tail("hello EN", &stops), 2);
        assert_eq!(super::undecided_tail("hello\n", &stops), 1);
        assert_eq!(super::undecided_tail("hello", &stops), 0);
        assert_eq!(super::undecided_tail("héé", &["éé!".to_string()]), 4, "whole characters");
    }

    fn tool_reply() -> super::Reply {
        let tool = onnx_genai_engine::tools::Tool {
            name: "now".into(),
            description: None,
            parameters: serde_json::json!({"type": "object"}),
        };
        super::Reply {
            id: "chatcmpl-1".into(),
            model: "m".into(),
            kind: super::Kind::Chat,
            prompt_tokens: 1,
            stops: Vec::new(),
            scorer: None,
            tools: Some(crate::tool_calls::ToolUse { tools: vec![tool], required: None, parallel: true }),
        }
    }

    /// Issue 19, tools (`auto`): an answer with calls is its text around
    /// them plus `tool_calls`, finished `tool_calls`, as one JSON body and
    /// as a stream's closing chunks (the text before the call was sent
    /// already: only the text after it follows, then the call's two
    /// deltas); an answer whose block is no call is all text.
    #[test]
    fn a_free_answer_with_a_call_closes_with_it() {
        let reply = tool_reply();
        let text = "Sure.<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call> ok";
        let body = super::body(&reply, text, "stop", None, serde_json::Value::Null);
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], "Sure. ok");
        assert_eq!(choice["message"]["tool_calls"][0]["function"]["name"], "now");
        assert_eq!(choice["message"]["tool_calls"][0]["function"]["arguments"], "{}");

        assert_eq!(reply.sendable(text), 5, "text up to the call streams");
        let chunks = super::closing(&reply, text, 5, false, &[], "stop");
        let deltas: Vec<_> = chunks.iter().map(|c| c["choices"][0]["delta"].clone()).collect();
        assert_eq!(deltas[0]["content"], " ok");
        assert_eq!(deltas[1]["tool_calls"][0]["function"]["name"], "now");
        assert_eq!(deltas[2]["tool_calls"][0]["function"]["arguments"], "{}");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(chunks.len(), 4);

        let not_a_call = "Sure.<tool_call>{\"name\": \"later\"}</tool_call>";
        let body = super::body(&reply, not_a_call, "stop", None, serde_json::Value::Null);
        assert_eq!(body["choices"][0]["message"]["content"], not_a_call);
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        let chunks = super::closing(&reply, not_a_call, 5, false, &[], "stop");
        assert_eq!(chunks[0]["choices"][0]["delta"]["content"], &not_a_call[5..], "the held text goes out as text");
    }

    /// `stop` cuts at the earliest stop string, and only when one occurs.
    #[test]
    fn stop_strings_cut_at_the_earliest_match() {
        let mut t = "one two. three\nfour".to_string();
        assert!(apply_stops(&mut t, &["\n".into(), ".".into()]));
        assert_eq!(t, "one two");
        let mut u = "no stops here".to_string();
        assert!(!apply_stops(&mut u, &["###".into()]));
        assert_eq!(u, "no stops here");
    }
}
