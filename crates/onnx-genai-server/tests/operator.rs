//! The operator's basics and connection-level faults over real loopback
//! HTTP: the API key, the JSON content type, the Host check, header and
//! idle timeouts, the connection limit, the request timeout and
//! `/metrics`. After each fault the gauges return to their baseline and
//! the next request succeeds (issue 20; INVARIANTS L2, L9, A2).

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use onnx_genai_engine::Scheduler;
use onnx_genai_server::{start_with, Gauges, HttpOptions, RunningServer, ServerOptions};
use serde_json::json;
use support::{call, chat, engine, eventually, package, Gate};

const M: &str = "tiny-llama-gqa";

fn serve(gate: &Gate, http: HttpOptions) -> (tempfile::TempDir, RunningServer) {
    let (dir, p) = package(M);
    let engines = vec![engine(&p, gate, Scheduler::new(u64::MAX))];
    let options = ServerOptions { http, ..ServerOptions::default() };
    (dir, start_with(engines, "127.0.0.1:0", options).unwrap())
}

fn chat_body(max: u32) -> String {
    chat(M, "hello", max).to_string()
}

fn idle(s: &RunningServer) -> bool {
    let g: Gauges = s.gauges();
    g.leases == 0 && g.reserved_bytes == 0 && g.running == 0 && g.waiting == 0
}

/// Reads until the server closes the connection; `None` if it is still
/// open after `limit`.
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> Option<String> {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&got).into_owned()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return None,
            // A reset is a close too.
            Err(_) => return Some(String::from_utf8_lossy(&got).into_owned()),
        }
    }
}

/// With `--api-key`, every route but `/health` wants `Authorization:
/// Bearer <key>`: none or a wrong one gets 401 in OpenAI's shape
/// (`invalid_api_key`) and reaches no model.
#[test]
fn the_api_key_guards_every_route_but_health() {
    let gate = Gate::default();
    let http = HttpOptions { api_keys: vec!["sk-local-test".into()], ..HttpOptions::default() };
    let (_dir, s) = serve(&gate, http);
    for auth in [None, Some("Bearer sk-wrong"), Some("Basic sk-local-test"), Some("Bearer sk-local-tes")] {
        let headers: Vec<(&str, &str)> = auth.map(|a| vec![("authorization", a)]).unwrap_or_default();
        let r = call(s.addr, "POST", "/v1/chat/completions", &headers, &chat_body(2));
        assert_eq!(r.status, 401, "{auth:?}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "invalid_api_key", "{}", r.body);
        assert_eq!(r.error_type(), "invalid_request_error");
        assert_eq!(call(s.addr, "GET", "/v1/models", &headers, "").status, 401);
        assert_eq!(call(s.addr, "GET", "/metrics", &headers, "").status, 401);
    }
    assert_eq!(s.gauges().turns, 0, "a refused request reached the model");
    assert_eq!(call(s.addr, "GET", "/health", &[], "").status, 200);
    let ok = call(s.addr, "POST", "/v1/chat/completions", &[("authorization", "Bearer sk-local-test")], &chat_body(2));
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert!(ok.header("x-request-id").is_some_and(|id| id.starts_with("req-")));
    s.stop();
}

/// Sessions belong to the client that created them (here: its API key).
/// To another key the id names nothing — its turn and its DELETE get 404
/// — and a client that opens session after session at the limit evicts its
/// own idle sessions, never the one another client keeps, however long
/// that one has been idle (issue 20: a session id is a capability; no
/// eviction aimed at another client's session).
#[test]
fn sessions_belong_to_the_client_that_created_them() {
    let gate = Gate::default();
    let http = HttpOptions { api_keys: vec!["sk-a".into(), "sk-b".into()], ..HttpOptions::default() };
    let (dir, p) = package(M);
    let engines = vec![engine(&p, &gate, Scheduler::new(u64::MAX))];
    let options = ServerOptions { http, max_sessions: 3, ..ServerOptions::default() };
    let s = start_with(engines, "127.0.0.1:0", options).unwrap();
    let (a, b) = ([("authorization", "Bearer sk-a")], [("authorization", "Bearer sk-b")]);
    let create = |who: &[(&str, &str)]| {
        let r = call(s.addr, "POST", "/v1/sessions", who, &json!({"model": M}).to_string());
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["id"].as_str().unwrap().to_string()
    };
    let turn = |who: &[(&str, &str)], id: &str| {
        let headers: Vec<(&str, &str)> = who.iter().copied().chain([("x-session-id", id)]).collect();
        call(s.addr, "POST", "/v1/chat/completions", &headers, &chat_body(2))
    };
    let theirs = create(&b);
    assert_eq!(turn(&b, &theirs).status, 200);
    let stolen = turn(&a, &theirs);
    assert_eq!(stolen.status, 404, "{}", stolen.body);
    assert_eq!(call(s.addr, "DELETE", &format!("/v1/sessions/{theirs}"), &a, "").status, 404);
    let mine: Vec<String> = (0..6).map(|_| create(&a)).collect();
    assert_eq!(s.gauges().sessions, 3);
    let kept = turn(&b, &theirs);
    assert_eq!(kept.status, 200, "another client's sessions pushed this one out: {}", kept.body);
    assert_eq!(turn(&a, &mine[5]).status, 200);
    assert_eq!(turn(&a, &mine[0]).status, 404, "the creator's own oldest session made the room");
    assert_eq!(call(s.addr, "DELETE", &format!("/v1/sessions/{theirs}"), &b, "").status, 200);
    s.stop();
    drop(dir);
}

/// A POST body must be declared JSON (415 otherwise); parameters such as
/// a charset are fine.
#[test]
fn post_bodies_must_be_declared_json() {
    let gate = Gate::default();
    let (_dir, s) = serve(&gate, HttpOptions::default());
    for ct in ["text/plain", "application/x-www-form-urlencoded", ""] {
        let r = call(s.addr, "POST", "/v1/chat/completions", &[("content-type", ct)], &chat_body(2));
        assert_eq!(r.status, 415, "{ct:?}: {}", r.body);
        assert_eq!(r.error_type(), "invalid_request_error");
    }
    let r = call(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json; charset=utf-8")],
        &chat_body(2),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.gauges().turns, 1);
    s.stop();
}

/// A server on loopback answers only requests addressed to a loopback
/// name: a page on another origin that rebinds its DNS name to 127.0.0.1
/// sends its own Host and is refused (403) before any model work.
#[test]
fn a_loopback_server_refuses_foreign_host_names() {
    let gate = Gate::default();
    let http = HttpOptions { allowed_hosts: vec!["gpu-box.lan".into()], ..HttpOptions::default() };
    let (_dir, s) = serve(&gate, http);
    let port = s.addr.port();
    for host in ["evil.example".to_string(), format!("attacker.test:{port}"), String::new()] {
        let r = call(s.addr, "POST", "/v1/chat/completions", &[("host", &host)], &chat_body(2));
        assert_eq!(r.status, 403, "{host:?}: {}", r.body);
        assert_eq!(r.error_type(), "permission_error");
    }
    assert_eq!(s.gauges().turns, 0, "a refused request reached the model");
    for host in
        [format!("localhost:{port}"), format!("127.0.0.1:{port}"), format!("[::1]:{port}"), "GPU-box.lan".into()]
    {
        let r = call(s.addr, "POST", "/v1/chat/completions", &[("host", &host)], &chat_body(1));
        assert_eq!(r.status, 200, "{host:?}: {}", r.body);
    }
    s.stop();
}

/// Slowloris: a client that sends half a request head is disconnected
/// after the header timeout, and so is a keep-alive connection left idle;
/// neither holds the server.
#[test]
fn half_sent_heads_and_idle_connections_are_closed() {
    let gate = Gate::default();
    let http = HttpOptions { header_timeout: Duration::from_millis(400), ..HttpOptions::default() };
    let (_dir, s) = serve(&gate, http);
    let mut slow = TcpStream::connect(s.addr).unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-ty").unwrap();
    assert!(read_until_closed(&mut slow, Duration::from_secs(10)).is_some(), "a half-sent head kept its connection");

    let mut keep = TcpStream::connect(s.addr).unwrap();
    keep.write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n").unwrap();
    let answer =
        read_until_closed(&mut keep, Duration::from_secs(10)).expect("an idle keep-alive connection stayed open");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(call(s.addr, "GET", "/health", &[], "").status, 200);
    s.stop();
}

/// Past `max_connections`, a new connection gets 503 with Retry-After in
/// OpenAI's error shape and never reaches the router; when connections
/// close, new ones are served again.
#[test]
fn connections_past_the_limit_are_refused_and_room_comes_back() {
    let gate = Gate::default();
    let http = HttpOptions { max_connections: 2, header_timeout: Duration::from_secs(30), ..HttpOptions::default() };
    let (_dir, s) = serve(&gate, http);
    let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(s.addr).unwrap()).collect();
    // The accept loop takes connections in order; wait until both count.
    let metrics = || call(s.addr, "GET", "/metrics", &[], "");
    assert!(eventually(Duration::from_secs(10), || {
        let r = metrics();
        r.status == 503 && r.body.contains("connections open")
    }));
    let r = call(s.addr, "POST", "/v1/chat/completions", &[], &chat_body(2));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.error_type(), "server_error");
    assert_eq!(s.gauges().turns, 0);
    drop(held);
    assert!(eventually(Duration::from_secs(10), || metrics().status == 200), "room did not come back");
    let text = metrics().body;
    assert!(metric(&text, "onnx_genai_refused_connections_total", "").is_some_and(|v| v >= 2.0), "{text}");
    assert_eq!(call(s.addr, "POST", "/v1/chat/completions", &[], &chat_body(2)).status, 200);
    s.stop();
}

/// A request that has no answer within the request timeout gets 504; its
/// turn is cancelled and its reservation released (nothing left behind),
/// and the next request is served.
#[test]
fn the_request_timeout_answers_504_and_leaves_nothing_behind() {
    let gate = Gate::default();
    let http = HttpOptions { request_timeout: Duration::from_millis(300), ..HttpOptions::default() };
    let (_dir, s) = serve(&gate, http);
    gate.close();
    // The gate holds the turn for good: only the timeout can answer.
    let r = call(s.addr, "POST", "/v1/chat/completions", &[], &chat_body(8));
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(r.error_type(), "timeout_error");
    gate.open();
    assert!(eventually(Duration::from_secs(10), || idle(&s)), "left behind: {:?}", s.gauges());
    let next = call(s.addr, "POST", "/v1/chat/completions", &[], &chat_body(2));
    assert_eq!(next.status, 200, "{}", next.body);
    assert!(eventually(Duration::from_secs(10), || idle(&s)), "left behind: {:?}", s.gauges());
    s.stop();
}

/// The value of `name{labels}` in an exposition (`labels` as written
/// between the braces, or empty for none).
fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() { name.to_string() } else { format!("{name}{{{labels}}}") };
    text.lines()
        .find_map(|l| l.strip_prefix(&key).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

/// `GET /metrics` counts answers by route and status, the tokens clients
/// got, time to first token and inter-token gaps (one per token after the
/// first), and reads sessions, KV reservations and the KV the model keeps
/// for reuse live (native-cpu keeps the blocks its turns gave back; ONNX
/// Runtime keeps none).
#[test]
fn metrics_count_requests_tokens_latencies_and_live_gauges() {
    let gate = Gate::default();
    let (_dir, s) = serve(&gate, HttpOptions::default());
    let mut tokens = 0.0;
    for _ in 0..2 {
        let r = call(s.addr, "POST", "/v1/chat/completions", &[], &chat_body(4));
        assert_eq!(r.status, 200, "{}", r.body);
        tokens += r.json()["usage"]["completion_tokens"].as_f64().unwrap();
    }
    assert_eq!(call(s.addr, "POST", "/v1/chat/completions", &[], "{").status, 400);
    let session = call(s.addr, "POST", "/v1/sessions", &[], &json!({"model": M}).to_string());
    assert_eq!(session.status, 200);
    assert_eq!(call(s.addr, "DELETE", "/v1/sessions/sess_nope", &[], "").status, 404);
    assert_eq!(call(s.addr, "GET", "/nowhere/sess_x", &[], "").status, 404);
    // Counters settle after the answer (L9); scrape once they have.
    assert!(eventually(Duration::from_secs(10), || idle(&s)), "{:?}", s.gauges());
    let r = call(s.addr, "GET", "/metrics", &[], "");
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").is_some_and(|c| c.starts_with("application/openmetrics-text")));
    let t = &r.body;
    let requests = |route: &str, status: u16| {
        metric(t, "onnx_genai_http_requests_total", &format!("route=\"{route}\",status=\"{status}\""))
    };
    assert_eq!(requests("/v1/chat/completions", 200), Some(2.0), "{t}");
    assert_eq!(requests("/v1/chat/completions", 400), Some(1.0), "{t}");
    assert_eq!(requests("/v1/sessions", 200), Some(1.0), "{t}");
    // Ids never become labels: routes count under their patterns.
    assert_eq!(requests("/v1/sessions/{id}", 404), Some(1.0), "{t}");
    assert_eq!(requests("other", 404), Some(1.0), "{t}");
    assert!(!t.contains("sess_nope") && !t.contains("sess_x"), "{t}");
    assert_eq!(metric(t, "onnx_genai_generated_tokens_total", ""), Some(tokens), "{t}");
    assert_eq!(metric(t, "onnx_genai_time_to_first_token_seconds_count", ""), Some(2.0), "{t}");
    assert_eq!(metric(t, "onnx_genai_inter_token_seconds_count", ""), Some(tokens - 2.0), "{t}");
    assert_eq!(metric(t, "onnx_genai_sessions", ""), Some(1.0), "{t}");
    let reserved = metric(t, "onnx_genai_kv_reserved_bytes", "").unwrap();
    assert_eq!(reserved, s.gauges().reserved_bytes as f64, "{t}");
    assert_eq!(metric(t, "onnx_genai_running_turns", ""), Some(0.0), "{t}");
    let kept = metric(t, "onnx_genai_kv_kept_bytes", "");
    assert_eq!(kept, Some(s.gauges().kept_bytes as f64), "{t}");
    let keeps = support::backend() == onnx_genai_engine::BackendKind::NativeCpu;
    assert_eq!(kept.is_some_and(|k| k > 0.0), keeps, "{t}");
    assert!(metric(t, "onnx_genai_open_connections", "").is_some_and(|v| v >= 1.0), "{t}");
    s.stop();
}
