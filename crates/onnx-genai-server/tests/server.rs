//! The server over real HTTP on loopback, with real concurrency: threads
//! released together on a barrier. A gate inside the backend holds a turn
//! mid-flight when a test needs a busy session. Each test names the
//! invariants it pins (../shared/docs/INVARIANTS.md).

mod support;

use std::sync::Arc;
use std::time::Duration;

use onnx_genai_engine::Scheduler;
use onnx_genai_server::{start, RunningServer};
use serde_json::json;
use support::{call, chat, engine, eventually, package, post, stream, together, Gate};

fn serve(names: &[&str], gate: &Gate, budget: u64, max_sessions: usize) -> (Vec<tempfile::TempDir>, RunningServer) {
    let mut dirs = Vec::new();
    let mut engines = Vec::new();
    let scheduler = Scheduler::new(budget);
    for n in names {
        let (dir, p) = package(n);
        engines.push(engine(&p, gate, scheduler.clone()));
        dirs.push(dir);
    }
    (dirs, start(engines, "127.0.0.1:0", max_sessions).unwrap())
}

fn session(s: &RunningServer, model: &str) -> String {
    let r = post(s.addr, "/v1/sessions", &json!({"model": model}));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["id"].as_str().unwrap().to_string()
}

fn turn(s: &RunningServer, model: &str, sid: Option<&str>, text: &str, max: u32) -> support::Reply {
    let headers: Vec<(&str, &str)> = sid.map(|id| vec![("x-session-id", id)]).unwrap_or_default();
    call(s.addr, "POST", "/v1/chat/completions", &headers, &chat(model, text, max).to_string())
}

/// Runs `n` copies of `f` released together; returns their results.
const M: &str = "tiny-llama-gqa";

/// Pins L1, L2, L8, L9: while one turn holds a session, N overlapping turns
/// on it are all refused with 409 `conflict_error` naming the session and
/// are charged no admission; the holder then succeeds, the conversation is
/// intact (its next turn counts every earlier token), the lease is released
/// (polled), and distinct sessions and stateless requests are never refused;
/// a turn refused at admission and one whose model step fails both release
/// the session (L2).
#[test]
fn overlapping_turns_on_one_session_conflict() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 16);
    let s = Arc::new(s);
    let sid = session(&s, M);
    gate.close();
    let holder = {
        let (s, sid) = (s.clone(), sid.clone());
        std::thread::spawn(move || turn(&s, M, Some(&sid), "Hello there", 6))
    };
    gate.wait_held(1);
    let admitted = s.gauges().admitted;
    let n = 8;
    let replies = {
        let (s, sid) = (s.clone(), sid.clone());
        together(n, move |_| turn(&s, M, Some(&sid), "me too", 4))
    };
    for r in &replies {
        assert_eq!(r.status, 409, "{}", r.body);
        assert_eq!(r.error_type(), "conflict_error");
        assert!(r.json()["error"]["message"].as_str().unwrap().contains(&sid));
    }
    assert_eq!(s.gauges().admitted, admitted, "a refused turn was charged an admission");
    gate.open();
    let first = holder.join().unwrap();
    assert_eq!(first.status, 200, "{}", first.body);
    let used = first.json()["usage"]["total_tokens"].as_u64().unwrap();
    assert!(eventually(Duration::from_secs(5), || s.gauges().leases == 0), "lease not released");
    let next = turn(&s, M, Some(&sid), "again", 3);
    assert_eq!(next.status, 200, "{}", next.body);
    assert!(next.json()["usage"]["prompt_tokens"].as_u64().unwrap() > used, "the next turn carries the conversation");

    // Distinct sessions never refuse each other; stateless requests take no lease.
    let ids: Vec<String> = (0..4).map(|_| session(&s, M)).collect();
    let ids = Arc::new(ids);
    let replies = {
        let (s, ids) = (s.clone(), ids.clone());
        together(8, move |i| if i < 4 { turn(&s, M, Some(&ids[i]), "hi", 4) } else { turn(&s, M, None, "hi", 4) })
    };
    assert!(replies.iter().all(|r| r.status == 200), "{:?}", replies.iter().map(|r| r.status).collect::<Vec<_>>());
    assert!(
        eventually(Duration::from_secs(5), || {
            let g = s.gauges();
            g.leases == 0 && g.reserved_bytes == g.idle_kv_bytes
        }),
        "at rest the reservation is the idle KV (B2): {:?}",
        s.gauges()
    );

    // A turn that fails still releases the session (L2): the next turn is
    // not refused as overlapping.
    let too_long = turn(&s, M, Some(&sid), &"word ".repeat(200), 4);
    assert_eq!(too_long.status, 400, "{}", too_long.body);
    assert!(eventually(Duration::from_secs(5), || s.gauges().leases == 0));
    assert_eq!(turn(&s, M, Some(&sid), "after the failure", 2).status, 200);

    // So does one whose model step fails after it was admitted: a 500,
    // then the session takes its next turn.
    gate.failing(true);
    let failed = turn(&s, M, Some(&sid), "this step fails", 4);
    gate.failing(false);
    assert_eq!(failed.status, 500, "{}", failed.body);
    assert!(eventually(Duration::from_secs(5), || s.gauges().leases == 0), "a failed turn kept its lease");
    assert_eq!(turn(&s, M, Some(&sid), "after the backend failure", 2).status, 200);

    // Streamed, the headers are out when the step fails: the failure is
    // the stream's last event, then [DONE] — the stream does not just stop.
    let mut body = chat(M, "this streamed step fails", 4);
    body["stream"] = json!(true);
    gate.failing(true);
    let mut sse = stream(s.addr, "/v1/chat/completions", &[("x-session-id", &sid)], &body);
    let events: Vec<String> = std::iter::from_fn(|| sse.next_data()).collect();
    gate.failing(false);
    assert_eq!(sse.status, 200);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    assert!(events.iter().any(|e| e.contains("\"error\"")), "no error event: {events:?}");
    assert!(eventually(Duration::from_secs(5), || s.gauges().leases == 0), "a failed stream kept its lease");
}

/// Pins L4: a DELETE racing a live turn is refused and the session
/// survives; racing DELETEs of an idle session unbind it exactly once; the
/// session gauge moves by exactly one per insert and close (L7).
#[test]
fn close_is_one_decision() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 16);
    let s = Arc::new(s);
    let base = s.gauges().sessions;
    let sid = session(&s, M);
    assert_eq!(s.gauges().sessions, base + 1);
    gate.close();
    let holder = {
        let (s, sid) = (s.clone(), sid.clone());
        std::thread::spawn(move || turn(&s, M, Some(&sid), "Hello", 4))
    };
    gate.wait_held(1);
    assert_eq!(s.gauges().sessions, base + 1, "a session mid-turn is still bound");
    let del = call(s.addr, "DELETE", &format!("/v1/sessions/{sid}"), &[], "");
    assert_eq!(del.status, 409, "{}", del.body);
    gate.open();
    assert_eq!(holder.join().unwrap().status, 200);
    assert!(eventually(Duration::from_secs(5), || s.gauges().leases == 0));
    let replies = {
        let (s, sid) = (s.clone(), sid.clone());
        together(4, move |_| call(s.addr, "DELETE", &format!("/v1/sessions/{sid}"), &[], "").status)
    };
    assert_eq!(replies.iter().filter(|c| **c == 200).count(), 1, "{replies:?}");
    assert_eq!(replies.iter().filter(|c| **c == 404).count(), 3, "{replies:?}");
    assert_eq!(s.gauges().sessions, base);
    assert_eq!(turn(&s, M, Some(&sid), "x", 2).status, 404);
}

/// Pins L5 and L6: eviction takes the least recently used idle session and
/// never one mid-turn; when every session is busy a new one is refused with
/// 429 `resource_limit_error` (and `Retry-After`), and after a release the
/// next insert evicts instead of growing.
#[test]
fn eviction_skips_busy_sessions_and_capacity_is_strict() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 2);
    let s = Arc::new(s);
    let (a, b) = (session(&s, M), session(&s, M));
    // Use b after a, so a would be the LRU victim if it were idle.
    assert_eq!(turn(&s, M, Some(&b), "b", 2).status, 200);
    gate.close();
    let busy = {
        let (s, a) = (s.clone(), a.clone());
        std::thread::spawn(move || turn(&s, M, Some(&a), "a", 3))
    };
    gate.wait_held(1);
    let c = session(&s, M);
    assert_eq!(s.gauges().sessions, 2);
    let gone = turn(&s, M, Some(&b), "b again", 2);
    assert_eq!(gone.status, 404, "b (idle) was evicted: {}", gone.body);
    // Now a (busy) and c (idle): make c busy too. Its turn queues behind
    // a's on the model's one driver, but its lease is taken first (L1).
    let busy_c = {
        let (s, c) = (s.clone(), c.clone());
        std::thread::spawn(move || turn(&s, M, Some(&c), "c", 3))
    };
    assert!(eventually(Duration::from_secs(10), || s.gauges().leases == 2));
    let full = post(s.addr, "/v1/sessions", &json!({"model": M}));
    assert_eq!(full.status, 429, "{}", full.body);
    assert_eq!(full.error_type(), "resource_limit_error");
    assert_eq!(full.header("retry-after"), Some("1"), "a transient refusal says when to retry");
    gate.open();
    assert_eq!(busy.join().unwrap().status, 200, "the busy session was not evicted under its turn");
    assert_eq!(busy_c.join().unwrap().status, 200);
    assert!(eventually(Duration::from_secs(5), || s.gauges().leases == 0));
    let _d2 = session(&s, M);
    assert_eq!(s.gauges().sessions, 2, "after a release the insert evicts rather than grows");
}

/// Pins L3: two models whose sessions have identical placements (worker 0,
/// engine session 1) never conflict; a session used on a model that does
/// not own it is refused with 409.
#[test]
fn sessions_are_model_qualified() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M, "tiny-gpt2"], &gate, u64::MAX, 8);
    let s = Arc::new(s);
    let (a, b) = (session(&s, M), session(&s, "tiny-gpt2"));
    gate.close();
    let holder = {
        let (s, a) = (s.clone(), a.clone());
        std::thread::spawn(move || turn(&s, M, Some(&a), "hold", 3))
    };
    gate.wait_held(1);
    // tiny-gpt2's driver shares the gate, so its turn is admitted (no
    // conflict) and then waits at the gate too.
    let other = {
        let (s, b) = (s.clone(), b.clone());
        std::thread::spawn(move || turn(&s, "tiny-gpt2", Some(&b), "other", 3))
    };
    gate.wait_held(2);
    let wrong = turn(&s, "tiny-gpt2", Some(&a), "wrong model", 2);
    assert_eq!(wrong.status, 409, "{}", wrong.body);
    assert!(wrong.body.contains("belongs to model"));
    gate.open();
    assert_eq!(holder.join().unwrap().status, 200);
    assert_eq!(other.join().unwrap().status, 200);
}

/// Pins L2, L9 and A4: a client that disconnects mid-stream stops its turn;
/// the lease and the KV reservation are released (polled with a bound) and
/// the session takes the next turn. And the gauges (L7): a client that
/// left is not counted as one that stalled, and turns that ran one at a
/// time never made a step wider than one.
#[test]
fn a_disconnect_mid_stream_releases_lease_and_reservation() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX / 2, 8);
    let sid = session(&s, M);
    let mut body = chat(M, "Tell me a long story", 200);
    body["stream"] = json!(true);
    let mut sse = stream(s.addr, "/v1/chat/completions", &[("x-session-id", &sid)], &body);
    assert_eq!(sse.status, 200);
    assert!(sse.next_data().is_some());
    drop(sse);
    assert!(eventually(Duration::from_secs(10), || {
        let g = s.gauges();
        g.leases == 0 && g.reserved_bytes == g.idle_kv_bytes
    }));
    assert_eq!(turn(&s, M, Some(&sid), "still there?", 2).status, 200);
    let g = s.gauges();
    assert_eq!((g.stalled, g.widest_step), (0, 1), "{g:?}");
}

/// Pins B1 at the server, and where the extra choices of `n` > 1 go: a
/// request arriving while another runs joins its model steps (one step
/// advances the first and both choices of the second: `widest_step` ≥ 3),
/// its second choice answers on its own channel, and the running request
/// keeps exactly its one choice and all its tokens. The first is held at
/// the gate and let through one step at a time until the driver has taken
/// the second, so the two surely overlap.
#[test]
fn a_request_joining_a_running_one_steps_with_it_and_keeps_its_choices() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX / 2, 8);
    let s = Arc::new(s);
    gate.close();
    gate.allow(2);
    let first = {
        let s = s.clone();
        std::thread::spawn(move || {
            post(
                s.addr,
                "/v1/completions",
                &json!({"model": M, "prompt": "A reader", "max_tokens": 40, "temperature": 0}),
            )
        })
    };
    gate.wait_held(1);
    let second = {
        let s = s.clone();
        let body = json!({"model": M, "prompt": "Two ways", "max_tokens": 3, "n": 2, "temperature": 0.8, "seed": 1});
        std::thread::spawn(move || post(s.addr, "/v1/completions", &body))
    };
    let mut held = 1;
    while !eventually(Duration::from_millis(200), || s.gauges().running >= 2) {
        assert!(held < 30, "the second request never joined the first: {:?}", s.gauges());
        gate.release_one();
        held += 1;
        gate.wait_held(held);
    }
    gate.open();
    let (first, second) = (first.join().unwrap(), second.join().unwrap());
    assert_eq!((first.status, second.status), (200, 200), "{}\n{}", first.body, second.body);
    let (first, second) = (first.json(), second.json());
    assert_eq!(first["choices"].as_array().map(Vec::len), Some(1), "{first}");
    assert_eq!(first["usage"]["completion_tokens"], 40, "{first}");
    assert_eq!(second["choices"].as_array().map(Vec::len), Some(2), "{second}");
    assert!(s.gauges().widest_step >= 3, "the second request's choices never stepped with the first: {:?}", s.gauges());
}

/// Pins L2 for answers cut short by a stop string: the answer never
/// outruns the turn's lease. The model step after the stop text is held at the gate, so the turn still holds
/// its session when the route sees the stop (the stop string is the
/// text of the fewest greedy tokens that have any). The answer (JSON or stream)
/// must wait until the engine let go; once it arrives the session is free
/// and the client's next turn on it succeeds.
#[test]
fn a_stop_string_answer_comes_after_the_session_is_free() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX / 2, 8);
    // The fewest greedy tokens whose text is not blank, and that text.
    let (tokens, stop) = (1..=8)
        .find_map(|k| {
            let r = turn(&s, M, None, "Tell me a story", k);
            assert_eq!(r.status, 200, "{}", r.body);
            let text = r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
            (!text.trim().is_empty()).then_some((k as usize, text))
        })
        .expect("eight greedy tokens with no text");
    for streamed in [false, true] {
        let sid = session(&s, M);
        let mut body = chat(M, "Tell me a story", 64);
        body["stop"] = json!([stop]);
        body["stream"] = json!(streamed);
        gate.close();
        // The steps up to the one that yields the stop text pass (the
        // prefill yields the first token); the next step holds.
        gate.allow(tokens);
        let (tx, rx) = std::sync::mpsc::channel();
        let (addr, id) = (s.addr, sid.clone());
        let client = std::thread::spawn(move || {
            let r = call(addr, "POST", "/v1/chat/completions", &[("x-session-id", &id)], &body.to_string());
            let _ = tx.send(r);
        });
        gate.wait_held(if streamed { 2 } else { 1 });
        let early = rx.recv_timeout(Duration::from_millis(300));
        assert!(early.is_err(), "streamed {streamed}: answered while the turn still held the session: {early:?}");
        assert_eq!(s.gauges().leases, 1);
        gate.open();
        let r = rx.recv_timeout(Duration::from_secs(20)).expect("no answer after the gate opened");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(s.gauges().leases, 0, "streamed {streamed}: the answer came before the lease was released");
        client.join().unwrap();
        if streamed {
            assert!(r.body.contains("\"finish_reason\":\"stop\""), "{}", r.body);
        } else {
            assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");
        }
        assert_eq!(turn(&s, M, Some(&sid), "and then?", 2).status, 200);
    }
}

/// Pins A9 (with A2): the route waits for admission before any header; a
/// request that never fits the budget is 400, one that does not fit now is
/// 429 `resource_limit_error` with a stable message and `Retry-After`; a
/// good request is 200 — never a 500. (A model's driver runs its turns one
/// at a time, so the budget binds across models sharing it.)
#[test]
fn the_admission_promise_decides_the_status() {
    let gate = Gate::default();
    let ((dir, p), (other_dir, other)) = (package(M), package("tiny-gpt2"));
    let (kv, other_kv) = (support::KvBlocks::of(&p), support::KvBlocks::of(&other));
    let count = |package: &onnx_genai_package::Package, text: &str| {
        package.tokenizer().encode(text, false).unwrap().len() as u64
    };
    // 60 tokens of `M`, and at least what a short request on the other
    // model holds (one 64-token block of it on native-cpu), so that one
    // fits an empty budget and waits only behind the holder.
    let budget = kv.bytes(60).max(other_kv.bytes(8));
    // Inside the context, beyond the whole budget on either model.
    let mut huge = String::new();
    while kv.bytes(count(&p, &huge)) <= budget || other_kv.bytes(count(&other, &huge)) <= budget {
        huge.push_str("word ");
    }
    drop((dir, other_dir));
    let (_d, s) = serve(&[M, "tiny-gpt2"], &gate, budget, 8);
    let s = Arc::new(s);
    let never = turn(&s, M, None, &huge, 4);
    assert_eq!(never.status, 400, "{}", never.body);
    assert!(never.body.contains("more than the server's whole budget"), "{}", never.body);
    gate.close();
    let holder = {
        let s = s.clone();
        std::thread::spawn(move || turn(&s, M, None, "hold the budget", 40))
    };
    gate.wait_held(1);
    let later = turn(&s, "tiny-gpt2", None, "wait", 4);
    assert_eq!(later.status, 429, "{}", later.body);
    assert_eq!(later.error_type(), "resource_limit_error");
    assert_eq!(later.header("retry-after"), Some("1"), "a transient refusal says when to retry");
    // Streaming too: the status comes from the admission decision, not a
    // 200 followed by an error event.
    let mut body = chat("tiny-gpt2", "wait", 4);
    body["stream"] = json!(true);
    assert_eq!(stream(s.addr, "/v1/chat/completions", &[], &body).status, 429);
    let mut never_stream = chat("tiny-gpt2", &huge, 4);
    never_stream["stream"] = json!(true);
    assert_eq!(stream(s.addr, "/v1/chat/completions", &[], &never_stream).status, 400);
    gate.open();
    assert_eq!(holder.join().unwrap().status, 200);
    assert!(eventually(Duration::from_secs(5), || {
        let g = s.gauges();
        g.reserved_bytes == g.idle_kv_bytes
    }));
    let ok = turn(&s, M, None, "now it fits", 4);
    assert_eq!(ok.status, 200, "{}", ok.body);
}

/// Bad input: each error in OpenAI's shape with the right status and a
/// message that says what to fix; no internal text. Routes the server does
/// not serve, a method a route does not take and a path id that is not
/// text are errors in the same shape (axum answered them with an empty or
/// a plain-text body).
#[test]
fn bad_requests_get_openai_errors() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 8);
    type Case<'a> = (String, &'a [(&'a str, &'a str)], u16, &'a str);
    let cases: Vec<Case> = vec![
        ("{not json".into(), &[], 400, "not valid JSON"),
        (chat("nope", "hi", 2).to_string(), &[], 404, "no model `nope`"),
        (
            json!({"model": M, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}).to_string(),
            &[],
            400,
            "temperature must be between 0 and 2",
        ),
        (
            json!({"model": M, "messages": [{"role": "user", "content": "hi"}], "n": 17}).to_string(),
            &[],
            400,
            "n is 1 to 16 choices, got 17",
        ),
        (
            json!({"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).to_string(),
            &[],
            400,
            "max_tokens must be at least 1",
        ),
        (
            json!({"model": M, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]})
                .to_string(),
            &[],
            400,
            "at most 4 stop sequences, got 5",
        ),
        (
            json!({"model": M, "messages": [{"role": "user", "content": "hi"}], "stop": "x".repeat(300)}).to_string(),
            &[],
            400,
            "a stop sequence is at most 256 characters",
        ),
        (json!({"model": M}).to_string(), &[], 400, "missing field `messages`"),
        (chat(M, "hi", 2).to_string(), &[("x-session-id", "sess_unknown")], 404, "no session `sess_unknown`"),
        (
            format!("{{\"model\": \"{M}\", \"pad\": \"{}\"}}", "x".repeat(2 << 20)),
            &[],
            413,
            "larger than 1048576 bytes",
        ),
    ];
    for (body, headers, status, want) in cases {
        let r = call(s.addr, "POST", "/v1/chat/completions", headers, &body);
        assert_eq!(r.status, status, "{want}: {}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap_or_default().to_string();
        assert!(msg.contains(want), "expected `{want}` in {msg} ({})", r.body);
        assert!(!msg.contains("panicked") && !msg.contains("src/"), "internal text leaked: {msg}");
    }
    assert_eq!(call(s.addr, "DELETE", "/v1/sessions/sess_nope", &[], "").status, 404);
    for (method, path, status, want) in [
        ("POST", "/v1/nope", 404, "no such route"),
        ("GET", "/v1/chat/completions", 405, "does not take that method"),
        ("DELETE", "/v1/sessions/%FF", 400, "session id in the path is not valid"),
    ] {
        let r = call(s.addr, method, path, &[], "");
        assert_eq!(r.status, status, "{method} {path}: {}", r.body);
        let error = &r.json()["error"];
        let msg = error["message"].as_str().unwrap_or_default();
        assert!(msg.contains(want) && error["type"].is_string(), "{method} {path}: {}", r.body);
    }
}

/// The OpenAI wire format: models, chat (JSON and SSE with usage), text
/// completions.
#[test]
fn wire_format() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 8);
    let models = call(s.addr, "GET", "/v1/models", &[], "");
    assert_eq!(models.json()["data"][0]["id"], M);
    let r = turn(&s, M, None, "Hello", 5).json();
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r["usage"]["completion_tokens"], 5);
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    let mut body = chat(M, "Hello", 5);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let mut sse = stream(s.addr, "/v1/chat/completions", &[], &body);
    let mut events = Vec::new();
    while let Some(d) = sse.next_data() {
        events.push(d);
    }
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<serde_json::Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, r["choices"][0]["message"]["content"].as_str().unwrap(), "stream and JSON agree");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 5);
    let text =
        post(s.addr, "/v1/completions", &json!({"model": M, "prompt": "Once upon", "max_tokens": 3, "temperature": 0}));
    assert_eq!(text.json()["object"], "text_completion");
    assert_eq!(call(s.addr, "GET", "/health", &[], "").status, 200);
}

/// Issue 19, nothing silently ignored: every field of both endpoints'
/// tables behaves as its table says over HTTP — a served field with its
/// example is answered 200; a field served only at its default is answered
/// 200 at the default and 400 naming it otherwise; a refused field is 400
/// naming it; a field OpenAI does not define is 400 naming it; a value of
/// the wrong type is 400 naming its field (nested: `messages[0].content`).
#[test]
fn every_request_field_is_served_or_refused_by_name() {
    use onnx_genai_server::fields::{self, Support};
    let (_d, mut p) = package(M);
    // Tools described in a system message overflow the tiny model's
    // 256-token context: a template that renders them compactly.
    p.manifest.chat_template = Some(support::TOOLS_TEMPLATE.into());
    let s = start(vec![engine(&p, &Gate::default(), Scheduler::new(u64::MAX))], "127.0.0.1:0", 8).unwrap();
    let endpoints = [
        ("/v1/chat/completions", fields::chat(), json!({"model": M, "messages": [{"role": "user", "content": "hi"}]})),
        ("/v1/completions", fields::completions(), json!({"model": M, "prompt": "hi"})),
    ];
    for (path, table, base) in endpoints {
        let send = |name: &str, value: serde_json::Value| {
            let mut body = base.clone();
            body["max_tokens"] = json!(2);
            body[name] = value;
            call(s.addr, "POST", path, &[], &body.to_string())
        };
        let refused = |r: &support::Reply, name: &str| {
            assert_eq!(r.status, 400, "{path} {name}: {}", r.body);
            assert_eq!(r.json()["error"]["param"], name, "{path}: {}", r.body);
        };
        for f in &table {
            let example: serde_json::Value = serde_json::from_str(f.example).unwrap();
            match f.support {
                Support::Served if base.get(f.name).is_some() || f.name == "max_tokens" => {}
                Support::Served if matches!(f.name, "top_logprobs" | "stream_options") => {
                    // Served only beside `logprobs: true` and `stream: true`
                    // (OpenAI's rules).
                    refused(&send(f.name, example.clone()), f.name);
                    let mut body = base.clone();
                    body["max_tokens"] = json!(2);
                    let beside = if f.name == "top_logprobs" { "logprobs" } else { "stream" };
                    body[beside] = json!(true);
                    body[f.name] = example;
                    let r = call(s.addr, "POST", path, &[], &body.to_string());
                    assert_eq!(r.status, 200, "{path} {}: {}", f.name, r.body);
                }
                Support::Served => {
                    let r = send(f.name, example);
                    assert_eq!(r.status, 200, "{path} {}: {}", f.name, r.body);
                }
                Support::DefaultOnly(default) => {
                    let r = send(f.name, serde_json::from_str(default).unwrap());
                    assert_eq!(r.status, 200, "{path} {} at its default: {}", f.name, r.body);
                    refused(&send(f.name, example), f.name);
                }
                Support::Refused => refused(&send(f.name, example), f.name),
            }
            // `null` means "not given" for every known field.
            if base.get(f.name).is_none() && f.name != "max_tokens" {
                let r = send(f.name, serde_json::Value::Null);
                assert_eq!(r.status, 200, "{path} {}: null: {}", f.name, r.body);
            }
        }
        let unknown = send("temprature", json!(0.5));
        refused(&unknown, "temprature");
        assert!(unknown.body.contains("unrecognized request argument"), "{}", unknown.body);
        // A value of the wrong type is refused naming its field too.
        refused(&send("temperature", json!("hot")), "temperature");
        refused(&send("seed", json!("7")), "seed");
        // OpenAI's seed is an int64: -1 is one, 2^64 - 1 is not.
        assert_eq!(send("seed", json!(-1)).status, 200);
        refused(&send("seed", json!(u64::MAX)), "seed");
        // stream_options takes OpenAI's keys only.
        let mut body = base.clone();
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true, "bogus": 1});
        refused(&call(s.addr, "POST", path, &[], &body.to_string()), "stream_options.bogus");
        // OpenAI's include_obfuscation: served as false, refused as true.
        body["stream_options"] = json!({"include_usage": true, "include_obfuscation": false});
        assert_eq!(call(s.addr, "POST", path, &[], &body.to_string()).status, 200);
        body["stream_options"] = json!({"include_obfuscation": true});
        refused(&call(s.addr, "POST", path, &[], &body.to_string()), "stream_options.include_obfuscation");
    }
    let r = call(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &json!({"model": M, "messages": [{"role": "user", "content": 5}]}).to_string(),
    );
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("messages[0].content")), "{}", r.body);
}

/// Issue 19: without a seed, each request samples its own way (the seed no
/// longer defaults to 0); with one, the same request gives the same text.
#[test]
fn requests_without_a_seed_sample_differently() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 8);
    let body = |seed: Option<u64>| {
        let mut b = json!({"model": M, "prompt": "Once upon", "max_tokens": 12, "temperature": 1.5});
        if let Some(seed) = seed {
            b["seed"] = json!(seed);
        }
        b
    };
    let text = |b: &serde_json::Value| {
        let r = post(s.addr, "/v1/completions", b);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    assert_eq!(text(&body(Some(11))), text(&body(Some(11))), "a seed reproduces");
    let unseeded: std::collections::BTreeSet<String> = (0..4).map(|_| text(&body(None))).collect();
    assert!(unseeded.len() > 1, "four unseeded requests gave one text: {unseeded:?}");
}

/// Issue 19's sampling adjustments over HTTP: `logit_bias` +100 makes a
/// greedy decode repeat the biased token and -100 bans the token greedy
/// picks; the penalties and vLLM's extensions are served; and bad values
/// (a bias id outside the vocabulary, a key that is no id, a bias or
/// penalty out of range) are 400s naming the field that leave the session
/// free (nothing was leased or reserved).
#[test]
fn sampling_adjustments_shape_the_output_and_bad_ones_are_refused() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 8);
    let (_p, package) = package(M);
    // A merged (multi-byte) token, so its text is no accident of bytes.
    let id = 300u32;
    let repeated = package.tokenizer().decode(&[id; 12], false).unwrap();
    assert!(repeated.chars().count() > 12, "token {id} is a merge: {repeated:?}");
    let complete = |extra: serde_json::Value| {
        let mut body = json!({"model": M, "prompt": "Once upon", "max_tokens": 12, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post(s.addr, "/v1/completions", &body)
    };
    let text = |r: support::Reply| {
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let greedy = text(complete(json!({})));
    assert_eq!(text(complete(json!({"logit_bias": {id.to_string(): 100}}))), repeated);
    let first = package.tokenizer().encode(greedy.as_str(), false).unwrap().get_ids()[0];
    let banned = text(complete(json!({"logit_bias": {first.to_string(): -100}})));
    assert_ne!(banned, greedy, "banning token {first} left the greedy text");
    // Each served adjustment has an effect. Greedy text here repeats no
    // token, so the penalties show by rewarding repeats (negative presence
    // and frequency penalties, a repetition penalty below 1): the first
    // token comes back. At a high temperature this seed samples away from
    // greedy, unless top_k 1 or min_p 1 leaves only the likeliest token.
    for extra in [json!({"presence_penalty": -2}), json!({"frequency_penalty": -2}), json!({"repetition_penalty": 0.3})]
    {
        assert_ne!(text(complete(extra.clone())), greedy, "{extra} changed nothing");
    }
    assert_ne!(text(complete(json!({"temperature": 1.5, "seed": 3}))), greedy);
    for extra in [json!({"top_k": 1}), json!({"min_p": 1.0}), json!({"top_k": 1, "min_p": 0.5}), json!({"top_p": 0})] {
        let mut sampled = json!({"temperature": 1.5, "seed": 3});
        sampled.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        assert_eq!(text(complete(sampled)), greedy, "{extra} left more than the likeliest token");
    }
    assert_eq!(
        text(complete(json!({"temperature": 1.5, "seed": 3, "top_k": -1}))),
        text(complete(json!({"temperature": 1.5, "seed": 3})))
    );
    let sid = session(&s, M);
    for (extra, param, want) in [
        (json!({"logit_bias": {"99999": 1}}), "logit_bias", "outside the model's vocabulary of 384 tokens"),
        (json!({"logit_bias": {"the": 1}}), "logit_bias", "keys are token ids"),
        (json!({"logit_bias": {"1": 101}}), "logit_bias", "between -100 and 100"),
        (json!({"presence_penalty": 2.5}), "presence_penalty", "between -2 and 2"),
        (json!({"frequency_penalty": -3}), "frequency_penalty", "between -2 and 2"),
        (json!({"repetition_penalty": 0}), "repetition_penalty", "> 0"),
        (json!({"min_p": 1.5}), "min_p", "[0, 1]"),
        (json!({"top_p": 1.5}), "top_p", "[0, 1]"),
        (json!({"top_k": -2}), "top_k", "-1 (every token) or at least 1"),
        (json!({"logit_bias": {"1": 1, "01": 2}}), "logit_bias", "names token 1 twice"),
    ] {
        let mut body = json!({"model": M, "prompt": "hi", "max_tokens": 2});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let r = call(s.addr, "POST", "/v1/completions", &[("x-session-id", &sid)], &body.to_string());
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
        assert!(r.body.contains(want), "expected `{want}`: {}", r.body);
    }
    // The session took no lease from any of them: a turn on it runs.
    assert_eq!(turn(&s, M, Some(&sid), "after the refusals", 2).status, 200);
}

/// Issue 19: a stop string that spans two tokens never leaks its first part
/// into a stream — the text that could begin a stop string is held back
/// until the next token decides — and what was held back goes out when it
/// turns out not to be one.
#[test]
fn a_stop_string_split_across_tokens_does_not_leak_into_the_stream() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 8);
    let deltas = |stop: Option<&str>| {
        let mut body = chat(M, "Tell me a story", 24);
        body["stream"] = json!(true);
        if let Some(stop) = stop {
            body["stop"] = json!([stop]);
        }
        let mut sse = stream(s.addr, "/v1/chat/completions", &[], &body);
        let mut out = Vec::new();
        while let Some(d) = sse.next_data() {
            if d == "[DONE]" {
                break;
            }
            let v: serde_json::Value = serde_json::from_str(&d).unwrap();
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                out.push(c.to_string());
            }
        }
        out
    };
    let greedy = deltas(None);
    let full: String = greedy.concat();
    // A stop string made of the last character of one token and the first
    // of the next.
    let (k, _) = greedy
        .windows(2)
        .enumerate()
        .find(|(_, w)| !w[0].is_empty() && !w[1].is_empty())
        .expect("two non-empty tokens in a row");
    let stop: String = greedy[k].chars().last().into_iter().chain(greedy[k + 1].chars().next()).collect();
    let expected = &full[..full.find(&stop).unwrap()];
    let streamed: String = deltas(Some(&stop)).concat();
    assert_eq!(streamed, expected, "stop {stop:?} over tokens {:?} {:?}", greedy[k], greedy[k + 1]);
    // A prefix of a stop string that never completes is sent in the end.
    let unfinished = format!("{stop}\u{1F980}never");
    assert_eq!(deltas(Some(&unfinished)).concat(), full, "held-back text was lost");
}

/// Issue 19: an answer a stop string ends still has `finish_reason: stop`
/// and `usage` — the prompt tokens admission counted and the tokens
/// generated until the stop — as JSON and, when asked for, as the stream's
/// last chunk.
#[test]
fn a_stop_string_answer_has_usage() {
    let gate = Gate::default();
    let (_d, s) = serve(&[M], &gate, u64::MAX, 8);
    let full = post(s.addr, "/v1/chat/completions", &chat(M, "Tell me a story", 12));
    assert_eq!(full.status, 200, "{}", full.body);
    let text = full.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let prompt_tokens = full.json()["usage"]["prompt_tokens"].clone();
    // A stop string from the middle of the greedy text.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "{text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut body = chat(M, "Tell me a story", 12);
    body["stop"] = json!([stop]);
    let cut = post(s.addr, "/v1/chat/completions", &body);
    assert_eq!(cut.status, 200, "{}", cut.body);
    let v = cut.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{}", cut.body);
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "{}", cut.body);
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    assert!((1..12).contains(&completion), "{}", cut.body);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let mut sse = stream(s.addr, "/v1/chat/completions", &[], &body);
    let mut last_usage = serde_json::Value::Null;
    while let Some(d) = sse.next_data() {
        if d == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(&d).unwrap();
        if !chunk["usage"].is_null() {
            last_usage = chunk["usage"].clone();
        }
    }
    assert_eq!(last_usage, v["usage"], "the stream's usage agrees with the JSON answer's");
}
