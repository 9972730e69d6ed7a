//! The HTTP routes. A turn: parse and check the body, find the model, take
//! the session's lease (L1), send the command to the model's driver, wait
//! for the admission promise before any header (A9), then answer as JSON or
//! as an SSE stream.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::Json;
use onnx_genai_engine::{Chat, EngineError, GenerateRequest, Prompt, ResponseFormat};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::answer::{collect, stream_events, Kind, Reply, SessionCut, Turn};
use crate::api::{self, ChatRequest, CompletionRequest, SessionRequest};
use crate::driver::{Command, Driver, Promise};
use crate::error::{ApiError, SESSION_GONE};
use crate::fields;
use crate::messages::{self, SentImage};
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
    Json(crate::openapi::document(&crate::openapi::Served { models: &models, max_choices: state.max_choices }))
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
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Json<Value>, ApiError> {
    // (Axum's own rejection is plain text, not OpenAI's error shape.)
    let Path(id) = id.map_err(|e| ApiError::param("id", format!("the session id in the path is not valid: {e}")))?;
    let placement = state.registry.close(&id, &owner)?;
    if let Some(d) = state.drivers.get(&placement.model) {
        let _ = d.send(Command::CloseSession { id: placement.engine });
    }
    Ok(Json(json!({"id": id, "object": "session.deleted", "deleted": true})))
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
        // A response format's grammar leaves no room for a call: with
        // tools the model may call, the calls could never be made (the
        // answer was always text, silently).
        if let (Some(tool_use), false) = (&tool_use, format == ResponseFormat::Text) {
            let why = match tool_use.format() {
                Some(_) => "a required tool call is JSON of its own: drop response_format",
                None => "its grammar leaves the model no way to call the tools: drop response_format, or the tools",
            };
            return Err(ApiError::param("response_format", why));
        }
        if let Some(call) = tool_use.as_ref().and_then(ToolUse::format) {
            format = call;
        }
        let template_vars = req.template_vars()?;
        let (messages, images) = messages::read(req.messages)?;
        let answer = Answer { kind: Kind::Chat, format, logprobs, tools: tool_use, images };
        let chat = Chat { messages, tools, template_vars, ..Chat::default() };
        run_turn(&state, &owner, &headers, Prompt::Chat(chat), answer, req.common).await
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
    let sampling = opts.engine_sampling(driver.prompter.sampling_defaults(), crate::sessions::random_u64)?;
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
    let n = opts.choices();
    if n > state.max_choices {
        return Err(ApiError::param("n", format!("this server serves at most {} choices, got {n}", state.max_choices)));
    }
    if n > 1 && session_id.is_some() {
        return Err(ApiError::param("n", "n > 1 cannot continue a session: a session carries one history"));
    }
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
    request.n = n;
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
        n,
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
