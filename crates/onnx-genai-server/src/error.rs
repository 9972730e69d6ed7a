//! Errors in OpenAI's body shape: `{"error": {"message", "type", "param",
//! "code"}}`, with the status that says what went wrong. Messages say what
//! to fix; internal details stay in the server log.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (transient refusals).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: message.into(), param: None, code: None, retry_after: None }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn param(param: &str, message: impl Into<String>) -> Self {
        Self { param: Some(param.into()), ..Self::invalid(message) }
    }

    pub fn not_found(kind_code: &'static str, message: impl Into<String>) -> Self {
        Self { code: Some(kind_code), ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message) }
    }

    /// An overlapping turn, a busy session, a session of another model.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict_error", message)
    }

    /// Transient: retry after a moment.
    pub fn busy(message: impl Into<String>) -> Self {
        Self { retry_after: Some(1), ..Self::new(StatusCode::TOO_MANY_REQUESTS, "resource_limit_error", message) }
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message)
    }

    /// No or a wrong API key (OpenAI's `invalid_api_key`).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self { code: Some("invalid_api_key"), ..Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message) }
    }

    /// A request this server must not answer (a foreign Host name).
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", message)
    }

    pub fn unsupported_media(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_request_error", message)
    }

    /// The request outlived the server's request timeout.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout_error", message)
    }

    /// Transient refusal before any request is read (connection limit).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self { retry_after: Some(1), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message) }
    }

    /// A path the server does not serve (OpenAI's shape; axum's own 404
    /// has an empty body).
    pub fn unknown_url() -> Self {
        Self::not_found("unknown_url", "no such route: see GET /openapi.json for the ones served")
    }

    /// A served path asked with a method it does not take.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "this route does not take that method: see GET /openapi.json",
        )
    }

    /// A failure inside the server; the client sees no internal text.
    pub fn internal() -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "the server failed to generate; see its log")
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        response
    }
}

/// The code of a turn on a session the engine does not have.
pub const SESSION_GONE: &str = "session_not_found";

/// Maps an engine error to what the client may see.
pub fn from_engine(err: &onnx_genai_engine::EngineError) -> ApiError {
    use onnx_genai_engine::{AdmissionError, EngineError};
    match err {
        EngineError::Admission(AdmissionError::Deferred { .. } | AdmissionError::TimedOut { .. }) => {
            ApiError::busy("the server's KV cache budget is full; retry the request shortly")
        }
        EngineError::Admission(AdmissionError::NeverFits { needed_bytes, budget_bytes, .. }) => {
            ApiError::invalid(format!(
                "the request needs at least {needed_bytes} bytes of KV cache, more than the server's whole budget of \
             {budget_bytes}; shorten the prompt (or, with n above 1, ask for fewer choices: each holds its own KV)"
            ))
        }
        EngineError::Admission(AdmissionError::Invalid(m)) | EngineError::Request(m) => ApiError::invalid(m.clone()),
        EngineError::Tensor { .. }
        | EngineError::ChatTemplate(_)
        | EngineError::Tokenizer { .. }
        | EngineError::Image(_) => ApiError::invalid(err.to_string()),
        EngineError::ResponseFormat(m) => {
            ApiError::param("response_format", format!("the response format cannot be used: {m}"))
        }
        EngineError::Constrained(m) => ApiError::param(
            "response_format",
            format!("the response format's grammar failed while generating: {m}; simplify the schema"),
        ),
        EngineError::UnknownSession(_) => ApiError::not_found(SESSION_GONE, "the session is gone; create a new one"),
        EngineError::SessionBusy(_) => ApiError::conflict("the session is running another turn"),
        EngineError::Package(_) | EngineError::Backend(_) | EngineError::Panicked { .. } => {
            tracing::error!("generation failed: {err}");
            ApiError::internal()
        }
    }
}
