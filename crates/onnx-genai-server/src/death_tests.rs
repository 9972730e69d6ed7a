//! A driver that dies (a panic outside the guards around the engine) takes
//! nothing with it: its model answers 503 and `/health` turns red, while
//! the leases, reservations and sessions it held are released (issue 20:
//! "a supervised driver whose death turns /health red and answers 503").
//! The death is injected with the test-only `Command::Die`; everything
//! else is the real server on loopback.

use std::path::Path;
use std::time::{Duration, Instant};

use onnx_genai_engine::{BackendKind, Engine};
use serde_json::json;

use crate::client::call;
use crate::driver::Command;
use crate::{start_with, ServerOptions};

pub(crate) const MODEL: &str = "tiny-llama-gqa";

/// The tiny llama built into `dir`, on native-cpu (one thread).
pub(crate) fn engine(dir: &Path) -> Engine {
    onnx_genai_test_support::build_into(MODEL, onnx_genai_test_support::Variant::Decomposed, dir);
    Engine::open(dir, BackendKind::NativeCpu, 1).unwrap()
}

#[test]
fn a_dead_driver_answers_503_turns_health_red_and_holds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_with(vec![engine(dir.path())], "127.0.0.1:0", ServerOptions::default()).unwrap();
    let turn = |headers: &[(&str, &str)]| {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
        call(server.addr, "POST", "/v1/chat/completions", headers, &body.to_string()).unwrap()
    };
    let baseline = server.gauges();
    assert_eq!(turn(&[]).status, 200);
    let made = call(server.addr, "POST", "/v1/sessions", &[], &json!({"model": MODEL}).to_string()).unwrap();
    let id = made.json()["id"].as_str().unwrap().to_string();
    assert_eq!(turn(&[(crate::SESSION_HEADER, &id)]).status, 200);
    // The driver publishes what idle sessions keep after the turn (L9).
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.gauges().idle_kv_bytes == 0 {
        assert!(Instant::now() < deadline, "the idle session keeps no KV: {:?}", server.gauges());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(call(server.addr, "GET", "/health", &[], "").unwrap().status, 200);

    server.state.drivers[MODEL].send(Command::Die).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.state.drivers[MODEL].alive() {
        assert!(Instant::now() < deadline, "the driver did not die");
        std::thread::sleep(Duration::from_millis(5));
    }

    let health = call(server.addr, "GET", "/health", &[], "").unwrap();
    assert_eq!(health.status, 503, "{}", health.body);
    assert_eq!(health.json()["models_down"], json!([MODEL]));
    for reply in [turn(&[]), turn(&[(crate::SESSION_HEADER, &id)])] {
        assert_eq!(reply.status, 503, "{}", reply.body);
        assert!(reply.body.contains("is down"), "{}", reply.body);
    }
    let refused = call(server.addr, "POST", "/v1/sessions", &[], &json!({"model": MODEL}).to_string()).unwrap();
    assert_eq!(refused.status, 503, "{}", refused.body);
    // What the dead driver's engine held went with it, its sessions too.
    let g = server.gauges();
    assert_eq!((g.sessions, g.leases, g.running, g.waiting), (0, 0, 0, 0), "{g:?}");
    assert_eq!((g.reserved_bytes, g.idle_kv_bytes), (0, 0), "{g:?}");
    let gone = call(server.addr, "DELETE", &format!("/v1/sessions/{id}"), &[], "").unwrap();
    assert_eq!(gone.status, 404, "a dead model's session is gone: {}", gone.body);
    assert_eq!(g.models_down, 1);
    assert_eq!(baseline.models_down, 0);
    let metrics = call(server.addr, "GET", "/metrics", &[], "").unwrap();
    assert!(metrics.body.contains("models_down 1"), "{}", metrics.body);
    server.stop();
}

/// Model steps of at least 2 ms: a 200-token answer outlives the test's
/// command to die.
struct Slow;

impl onnx_genai_test_support::Hook for Slow {
    fn step(&self, _: &[onnx_genai_backend::Entry<'_>]) -> Result<(), onnx_genai_backend::BackendError> {
        std::thread::sleep(Duration::from_millis(2));
        Ok(())
    }
}

/// A stream whose driver dies mid-answer ends as a failed stream does: an
/// error event in OpenAI's shape, then `[DONE]` — before, the stream just
/// stopped, and a client could not tell a cut answer from a whole one.
#[test]
fn a_stream_whose_driver_dies_ends_with_an_error_and_done() {
    let dir = tempfile::tempdir().unwrap();
    let engine = crate::stall_tests::hooked_engine(dir.path(), Slow);
    let server = start_with(vec![engine], "127.0.0.1:0", ServerOptions::default()).unwrap();
    let body = json!({"model": MODEL, "prompt": "Once", "max_tokens": 200, "stream": true});
    let mut stream = crate::client::Stream::open(server.addr, "/v1/completions", &[], &body).unwrap();
    let first = stream.next_data();
    assert!(first.as_deref().is_some_and(|d| d.contains("\"choices\"")), "the stream started: {first:?}");
    server.state.drivers[MODEL].send(Command::Die).unwrap();
    let rest: Vec<String> = std::iter::from_fn(|| stream.next_data()).collect();
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    let error: serde_json::Value = serde_json::from_str(&rest[rest.len() - 2]).unwrap();
    assert_eq!(error["error"]["type"], "server_error", "{rest:?}");
    server.stop();
}
