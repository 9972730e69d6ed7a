//! What every request passes before a route sees it: a request id (logged
//! and returned as `x-request-id`), the Host check that keeps a loopback
//! server out of reach of DNS rebinding, the API key, the JSON content
//! type, and the per-request timeout; then one log line and one count per
//! answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tracing::Instrument;

use crate::error::ApiError;
use crate::sessions::Owner;
use crate::AppState;

/// Who may call, from where, and for how long.
#[derive(Clone, Debug)]
pub struct HttpOptions {
    /// Keys one of which is required as `Authorization: Bearer <key>` on
    /// every route but `/health` (none: no key needed). Each key is one
    /// client: sessions belong to the key that created them.
    pub api_keys: Vec<String>,
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
            api_keys: Vec::new(),
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

/// The peer address of a request's connection (set by the accept loop).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer(pub std::net::SocketAddr);

/// Refuses a request that may not reach the routes; else says who sent it:
/// the API key it used (by position, never the key itself), or without
/// keys its IP address.
fn check(
    state: &AppState,
    method: &Method,
    route: &str,
    headers: &HeaderMap,
    peer: Option<Peer>,
) -> Result<Owner, ApiError> {
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
    let mut owner = Owner(match peer {
        Some(Peer(addr)) => format!("ip-{}", addr.ip()),
        None => "local".into(),
    });
    let keys = &state.http.api_keys;
    if !keys.is_empty() && route != "/health" {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        // Every key is compared, so the time taken does not tell which
        // matched either.
        let matched =
            given.and_then(|g| {
                keys.iter().enumerate().fold(None, |found, (i, key)| {
                    if same_secret(g.as_bytes(), key.as_bytes()) {
                        Some(i)
                    } else {
                        found
                    }
                })
            });
        match matched {
            Some(i) => owner = Owner(format!("key-{i}")),
            None => {
                return Err(ApiError::unauthorized(if given.is_some() {
                    "Incorrect API key provided."
                } else {
                    "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
                }))
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
    Ok(owner)
}

/// The middleware: checks, the timeout, the request id, the log line and
/// the count.
pub async fn gate(State(state): State<Arc<AppState>>, mut request: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = format!("req-{}", crate::sessions::random_hex());
    // The route's pattern (`/v1/sessions/{id}`), never the path: ids must
    // not become metric labels. Unrouted paths share one label.
    let route = request.extensions().get::<MatchedPath>().map_or("other", MatchedPath::as_str).to_string();
    let method = request.method().clone();
    let span = tracing::info_span!("request", request_id = %id, %method, route = %route);
    let limit = state.http.request_timeout;
    let mut response = async {
        let peer = request.extensions().get::<Peer>().copied();
        match check(&state, &method, &route, request.headers(), peer) {
            Ok(owner) => {
                request.extensions_mut().insert(owner);
            }
            Err(e) => return e.into_response(),
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
    state.metrics.request(&route, status);
    span.in_scope(|| {
        tracing::info!(status, elapsed_ms = started.elapsed().as_secs_f64() * 1e3, "answered");
    });
    response
}

#[cfg(test)]
mod tests {
    use super::{host_name, host_policy, same_secret};

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
}
