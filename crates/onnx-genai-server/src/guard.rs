//! What every request passes before a route sees it: a request id (logged
//! and returned as `x-request-id`), the Host check that keeps a loopback
//! server out of reach of DNS rebinding, the API key, the JSON content
//! type, and the per-request timeout; then one log line and one count per
//! answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tracing::Instrument;

use crate::error::ApiError;
use crate::AppState;

/// Who may call, from where, and for how long.
#[derive(Clone, Debug)]
pub struct HttpOptions {
    /// Required as `Authorization: Bearer <key>` on every route but
    /// `/health`.
    pub api_key: Option<String>,
    /// Host names (without port) requests may be addressed to. Empty: any,
    /// unless the server listens on a loopback address, where `localhost`,
    /// `127.0.0.1` and `::1` are always allowed and nothing else is unless
    /// listed.
    pub allowed_hosts: Vec<String>,
    /// How long a client may take to send a request's head, and how long a
    /// keep-alive connection may sit idle between requests.
    pub header_timeout: Duration,
    /// How long a request may take until its response starts (a stream's
    /// body is then bounded by the stall timeout and `max_tokens`).
    pub request_timeout: Duration,
    /// Connections served at once; one more is answered 503.
    pub max_connections: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            api_key: None,
            allowed_hosts: Vec::new(),
            header_timeout: Duration::from_secs(15),
            request_timeout: Duration::from_secs(600),
            max_connections: 512,
        }
    }
}

/// The Host names a server on `bound` accepts (`None`: any).
pub(crate) fn host_policy(bound: std::net::SocketAddr, listed: &[String]) -> Option<Vec<String>> {
    let mut hosts: Vec<String> = listed.iter().map(|h| h.to_ascii_lowercase()).collect();
    if bound.ip().is_loopback() {
        hosts.extend(["localhost", "127.0.0.1", "::1"].map(String::from));
    } else if hosts.is_empty() {
        return None;
    }
    Some(hosts)
}

/// The route a path belongs to, as a bounded label (ids are not labels).
pub(crate) fn route_of(path: &str) -> &'static str {
    match path {
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/v1/models" => "/v1/models",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/sessions" => "/v1/sessions",
        p if p.starts_with("/v1/sessions/") => "/v1/sessions/{id}",
        _ => "other",
    }
}

/// The host part of a Host header: without port, brackets or case.
fn host_name(value: &str) -> String {
    let v = value.trim();
    let name = if let Some(rest) = v.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else {
        match v.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => v,
        }
    };
    name.to_ascii_lowercase()
}

/// Compares without an early exit, so the time taken does not tell how
/// much of a guessed key was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Refuses a request that may not reach the routes.
fn check(state: &AppState, method: &Method, route: &str, headers: &HeaderMap) -> Result<(), ApiError> {
    if let Some(allowed) = &state.hosts {
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).map(host_name);
        if !host.as_ref().is_some_and(|h| allowed.iter().any(|a| a == h)) {
            return Err(ApiError::forbidden(format!(
                "requests to this server must be addressed to {} (Host was {}); start it with --allowed-host to add a name",
                allowed.join(", "),
                host.as_deref().unwrap_or("missing")
            )));
        }
    }
    if let Some(key) = &state.http.api_key {
        if route != "/health" {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().split_once(' '))
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, token)| token.trim());
            if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
                return Err(ApiError::unauthorized(if given.is_some() {
                    "Incorrect API key provided."
                } else {
                    "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
                }));
            }
        }
    }
    if method == Method::POST {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(ApiError::unsupported_media("send the body as JSON with `Content-Type: application/json`"));
        }
    }
    Ok(())
}

/// The middleware: checks, the timeout, the request id, the log line and
/// the count.
pub async fn gate(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = format!("req-{}", crate::sessions::random_hex());
    let route = route_of(request.uri().path());
    let method = request.method().clone();
    let span = tracing::info_span!("request", request_id = %id, %method, route);
    let limit = state.http.request_timeout;
    let mut response = async {
        if let Err(e) = check(&state, &method, route, request.headers()) {
            return e.into_response();
        }
        match tokio::time::timeout(limit, next.run(request)).await {
            Ok(r) => r,
            Err(_) => ApiError::timeout(format!(
                "the request did not get its answer within the server's request timeout ({} s); ask for fewer \
                 tokens or stream the response",
                limit.as_secs_f64()
            ))
            .into_response(),
        }
    }
    .instrument(span.clone())
    .await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", v);
    }
    let status = response.status().as_u16();
    state.metrics.request(route, status);
    span.in_scope(|| {
        tracing::info!(status, elapsed_ms = started.elapsed().as_secs_f64() * 1e3, "answered");
    });
    response
}

#[cfg(test)]
mod tests {
    use super::{host_name, host_policy, route_of, same_secret};

    /// A Host header names a host with or without a port, IPv6 in brackets.
    #[test]
    fn host_names_drop_port_brackets_and_case() {
        assert_eq!(host_name("LocalHost:8080"), "localhost");
        assert_eq!(host_name("127.0.0.1"), "127.0.0.1");
        assert_eq!(host_name("[::1]:80"), "::1");
        assert_eq!(host_name("evil.example:8080"), "evil.example");
    }

    /// A loopback server accepts only loopback names unless told more; a
    /// public one accepts any Host unless given a list.
    #[test]
    fn loopback_servers_check_the_host() {
        let lo: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
        let public: std::net::SocketAddr = "0.0.0.0:1".parse().unwrap();
        let lo_hosts = host_policy(lo, &[]).unwrap();
        assert!(lo_hosts.contains(&"localhost".to_string()) && !lo_hosts.contains(&"evil.example".to_string()));
        assert!(host_policy(lo, &["Box.lan".into()]).unwrap().contains(&"box.lan".to_string()));
        assert!(host_policy(public, &[]).is_none());
        assert_eq!(host_policy(public, &["a.example".into()]).unwrap(), vec!["a.example".to_string()]);
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"sk-abc", b"sk-abc"));
        assert!(!same_secret(b"sk-abd", b"sk-abc"));
        assert!(!same_secret(b"sk-ab", b"sk-abc"));
    }

    /// Session ids never become metric labels.
    #[test]
    fn routes_are_bounded_labels() {
        assert_eq!(route_of("/v1/sessions/sess-123"), "/v1/sessions/{id}");
        assert_eq!(route_of("/anything/else"), "other");
    }
}
