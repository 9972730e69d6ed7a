//! Continuous batching in the server over real HTTP on loopback: requests
//! join a model's running batch between steps, wait in line for KV room
//! first come first served, and leave when their client does. Pins B4 and
//! B5 of ../shared/docs/INVARIANTS.md (B1–B3 are pinned in the engine's
//! tests/batching.rs).

mod support;

use std::sync::Arc;
use std::time::Duration;

use onnx_genai_engine::Scheduler;
use onnx_genai_server::{start_with, DriverOptions, RunningServer, ServerOptions};
use serde_json::json;
use support::{call, engine, eventually, package, Gate, KvBlocks};

/// The model that holds the budget (its turns held at a closed gate) and
/// the model whose waiting line the tests watch; they share one budget.
/// The holder has the larger KV per token, so that on native-cpu (KV in
/// 64-token blocks) its one block leaves room for a two-block request of
/// `M` in the whole budget.
const HOLD: &str = "tiny-gpt2";
const M: &str = "tiny-llama-gqa";
/// The holder's request: its prompt and new tokens.
const HOLD_PROMPT: &str = "hold";
const HOLD_NEW: u32 = 46;

/// Two models on one budget, served: `HOLD` (through `hold`) and `M`
/// (through `line`), on the KV that the holder's request and 16 `M` tokens
/// hold on this backend ([`KvBlocks`]); requests wait in line up to 20 s.
struct SharedBudget {
    _dirs: Vec<tempfile::TempDir>,
    server: RunningServer,
    /// A prompt of `M` too long for the room beside the holder's request
    /// (with its 2 new tokens), and its token count: the prefill the line
    /// records.
    too_long: (String, usize),
    /// `M`'s token count of a text.
    count: Box<dyn Fn(&str) -> usize>,
    /// The budget's bytes.
    budget: u64,
    /// The bytes a request of `M` for a text and 2 new tokens reserves.
    needs: Box<dyn Fn(&str) -> u64>,
}

fn serve(hold: &Gate, line: &Gate) -> SharedBudget {
    let (hold_dir, hp) = package(HOLD);
    let (dir, p) = package(M);
    let (held, line_kv) = (KvBlocks::of(&hp), KvBlocks::of(&p));
    let room = line_kv.tokens(16);
    // Exactly what the holder reserves: its prompt and HOLD_NEW tokens.
    let holder_tokens = hp.tokenizer().encode(HOLD_PROMPT, false).unwrap().get_ids().len() as u64 + HOLD_NEW as u64;
    let budget = held.bytes(holder_tokens) + line_kv.bytes(room);
    let scheduler = Scheduler::new(budget);
    let engines = vec![engine(&hp, hold, scheduler.clone()), engine(&p, line, scheduler)];
    let driver = DriverOptions { admission_wait: Duration::from_secs(20), ..DriverOptions::default() };
    let server =
        start_with(engines, "127.0.0.1:0", ServerOptions { max_sessions: 8, driver, ..Default::default() }).unwrap();
    let tokenizer = p.tokenizer().clone();
    let count = move |text: &str| tokenizer.encode(text, false).unwrap().get_ids().len();
    let mut too_long = String::new();
    while (count(&too_long) + 2) as u64 <= room {
        too_long.push_str("word ");
    }
    let tokens = count(&too_long);
    let counted = count.clone();
    let needs = move |text: &str| line_kv.bytes(counted(text) as u64 + 2);
    SharedBudget {
        _dirs: vec![hold_dir, dir],
        server,
        too_long: (too_long, tokens),
        count: Box::new(count),
        budget,
        needs: Box::new(needs),
    }
}

fn completion(model: &str, prompt: &str, max: u32) -> serde_json::Value {
    json!({"model": model, "prompt": prompt, "max_tokens": max, "temperature": 0})
}

fn post(s: &RunningServer, model: &str, prompt: &str, max: u32) -> support::Reply {
    call(s.addr, "POST", "/v1/completions", &[], &completion(model, prompt, max).to_string())
}

/// Starts a turn on `HOLD` that keeps its whole share of the budget
/// until `hold` opens.
fn hold_budget(s: &Arc<RunningServer>, hold: &Gate) -> std::thread::JoinHandle<support::Reply> {
    hold.close();
    let t = {
        let s = s.clone();
        std::thread::spawn(move || post(&s, HOLD, HOLD_PROMPT, HOLD_NEW))
    };
    hold.wait_held(1);
    t
}

/// An idle driver asks its model to give back the memory it keeps past
/// its standing keep (native-cpu's returned KV blocks), asks again after
/// as long as the model says, and stops asking once the model says nothing
/// more is kept; going idle after a request, it asks once more. A driver
/// that never asked would hold a past burst's KV for the server's life,
/// one that kept asking would spin.
#[test]
fn an_idle_driver_asks_its_model_to_release_memory_until_nothing_is_kept() {
    let (_dir, p) = package(M);
    let gate = Gate::default();
    gate.idle_answers(&[Duration::from_millis(30); 3]);
    let scheduler = Scheduler::new(KvBlocks::of(&p).bytes(1024));
    let server = start_with(vec![engine(&p, &gate, scheduler)], "127.0.0.1:0", ServerOptions::default()).unwrap();
    let settled = |calls: usize| {
        eventually(Duration::from_secs(10), || gate.idle_calls() >= calls) && {
            std::thread::sleep(Duration::from_millis(200));
            gate.idle_calls() == calls
        }
    };
    assert!(settled(4), "{} requests, not the three the script asked again for and one more", gate.idle_calls());
    let times = gate.idle_call_times();
    for (i, pair) in times.windows(2).enumerate() {
        let waited = pair[1].duration_since(pair[0]);
        assert!(
            waited >= Duration::from_millis(29),
            "asked again {waited:?} after request {i}, not the 30 ms the model said"
        );
    }
    assert_eq!(post(&server, M, "Hello", 2).status, 200);
    assert!(settled(5), "{} requests after going idle again, not one more", gate.idle_calls());
}

/// [`Lines`] shared with the test that reads them.
struct Forward(std::sync::Arc<Lines>);

impl tracing::Subscriber for Forward {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        self.0.enabled(m)
    }
    fn new_span(&self, a: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        self.0.new_span(a)
    }
    fn record(&self, i: &tracing::span::Id, r: &tracing::span::Record<'_>) {
        self.0.record(i, r)
    }
    fn record_follows_from(&self, a: &tracing::span::Id, b: &tracing::span::Id) {
        self.0.record_follows_from(a, b)
    }
    fn event(&self, e: &tracing::Event<'_>) {
        self.0.event(e)
    }
    fn enter(&self, i: &tracing::span::Id) {
        self.0.enter(i)
    }
    fn exit(&self, i: &tracing::span::Id) {
        self.0.exit(i)
    }
}

/// The messages of the process's log events that contain `needle`
/// (a subscriber of this test binary's own: the server logs through
/// `tracing`, and only this test installs one).
#[derive(Default)]
struct Lines {
    needle: &'static str,
    seen: std::sync::Mutex<Vec<String>>,
}

impl tracing::Subscriber for Lines {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        if message.0.contains(self.needle) {
            self.seen.lock().unwrap().push(message.0);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// A backend that panics giving back idle memory, or saying how much it
/// keeps, does not take its model's driver with it: the panics are logged
/// (the first giving back taken as nothing kept, the second leaving the
/// gauge as it was; the reading of what it keeps, asked after every step
/// and release, logged once however often it panics), and a request is
/// served while both still panic.
#[test]
fn a_panic_giving_back_idle_memory_leaves_the_driver_serving() {
    let lines = std::sync::Arc::new(Lines { needle: "reading the memory", ..Lines::default() });
    tracing::subscriber::set_global_default(Forward(lines.clone())).expect("no other test of this binary logs");
    let (_dir, p) = package(M);
    let gate = Gate::default();
    gate.fault(support::Fault::ReleasePanics);
    let scheduler = Scheduler::new(KvBlocks::of(&p).bytes(1024));
    let server = start_with(vec![engine(&p, &gate, scheduler)], "127.0.0.1:0", ServerOptions::default()).unwrap();
    assert!(eventually(Duration::from_secs(10), || gate.idle_calls() >= 1), "the idle driver never asked");
    let r = post(&server, M, "Hello", 2);
    assert_eq!(r.status, 200, "{}", r.body);
    // Each idle release and each step's end asked (and panicked).
    assert!(eventually(Duration::from_secs(10), || gate.kept_panics() >= 3), "{}", gate.kept_panics());
    let seen = lines.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{} panics reading the kept memory logged {seen:?}", gate.kept_panics());
    gate.fault(support::Fault::None);
    let r = post(&server, M, "Hello", 2);
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Pins B5: a large request waiting for room is not overtaken by a small
/// one that arrives after it, although the small one would fit at once;
/// both run once the bytes they need are free, in arrival order.
#[test]
fn batching_serves_the_waiting_line_first_come_first_served() {
    let (hold, line) = (Gate::default(), Gate::default());
    let SharedBudget { _dirs, server, too_long: (large_text, large), count, .. } = serve(&hold, &line);
    let s = Arc::new(server);
    let small_text = "hi there";
    let small = count(small_text);
    assert!(large > small && small > 1, "{large} {small}");
    let h = hold_budget(&s, &hold);
    let l = {
        let s = s.clone();
        std::thread::spawn(move || post(&s, M, &large_text, 2))
    };
    assert!(
        eventually(Duration::from_secs(10), || s.gauges().waiting == 1),
        "the large request waits: {:?}",
        s.gauges()
    );
    let sm = {
        let s = s.clone();
        std::thread::spawn(move || post(&s, M, small_text, 2))
    };
    // The small one fits the free room but must not pass the large one.
    assert!(eventually(Duration::from_secs(10), || s.gauges().waiting == 2), "the small one queues: {:?}", s.gauges());
    assert!(line.prefills().is_empty(), "something ran before the budget freed: {:?}", line.prefills());
    hold.open();
    for (name, t) in [("holder", h), ("large", l), ("small", sm)] {
        let r = t.join().unwrap();
        assert_eq!(r.status, 200, "{name}: {}", r.body);
    }
    let order = line.prefills();
    let at = |n: usize| order.iter().position(|x| *x == n).unwrap_or_else(|| panic!("no prefill of {n}: {order:?}"));
    assert!(at(large) < at(small), "the line ran in the order {order:?}");
}

/// Pins A9's other side: a request larger than the whole KV budget is
/// refused at once (400, naming the budget) — retrying cannot help, so it
/// never waits out the line's 20 s — and nothing is left waiting.
#[test]
fn batching_refuses_at_once_a_request_that_can_never_fit() {
    let (hold, line) = (Gate::default(), Gate::default());
    let shared = serve(&hold, &line);
    let (s, count) = (&shared.server, &shared.count);
    // Within the context (256) but more than the whole budget holds.
    let mut huge = String::new();
    while count(&huge) < 220 {
        huge.push_str("word ");
    }
    let started = std::time::Instant::now();
    let r = post(s, M, &huge, 2);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("whole budget"), "{}", r.body);
    assert!(started.elapsed() < Duration::from_secs(10), "refused only after {:?} in line", started.elapsed());
    assert_eq!(s.gauges().waiting, 0, "{:?}", s.gauges());
    assert!(line.prefills().is_empty(), "{:?}", line.prefills());
}

/// Pins B4: a request whose client leaves while it waits in line is never
/// admitted and never prefilled.
#[test]
fn batching_drops_a_request_cancelled_while_queued() {
    use std::io::Write;
    let (hold, line) = (Gate::default(), Gate::default());
    let SharedBudget { _dirs, server, too_long: (gone_text, gone), .. } = serve(&hold, &line);
    let s = Arc::new(server);
    let h = hold_budget(&s, &hold);
    let admitted = s.gauges().admitted;
    // A raw client: sends its request, then hangs up while it waits.
    let body = completion(M, &gone_text, 2).to_string();
    let mut client = std::net::TcpStream::connect(s.addr).unwrap();
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    assert!(eventually(Duration::from_secs(10), || s.gauges().waiting == 1), "the request waits in line");
    drop(client);
    std::thread::sleep(Duration::from_millis(50));
    hold.open();
    assert_eq!(h.join().unwrap().status, 200);
    assert!(eventually(Duration::from_secs(10), || s.gauges().waiting == 0), "the line empties");
    assert_eq!(s.gauges().admitted, admitted, "the cancelled request was admitted");
    assert!(!line.prefills().contains(&gone), "the cancelled request was prefilled: {:?}", line.prefills());
}

/// Pins B5 across the models of one budget: a request to one model that
/// waits for room held by another model's idle session is admitted once
/// that model gives way (its least recently used idle session's KV
/// spilled, the history kept for the session's next turn), not refused
/// when its 20 s in line run out: a model spills its own idle sessions for
/// its own requests, and the waiting driver asks the others to.
#[test]
fn batching_across_models_an_idle_session_gives_way_to_a_waiting_request() {
    let (hold, line) = (Gate::default(), Gate::default());
    let shared = serve(&hold, &line);
    let SharedBudget { server: s, count, budget, needs, .. } = &shared;
    let budget = *budget;
    let made = call(s.addr, "POST", "/v1/sessions", &[], &json!({"model": HOLD}).to_string());
    assert_eq!(made.status, 200, "{}", made.body);
    let id = made.json()["id"].as_str().unwrap().to_string();
    let session = [(onnx_genai_server::SESSION_HEADER, id.as_str())];
    let body = completion(HOLD, HOLD_PROMPT, HOLD_NEW).to_string();
    let held = call(s.addr, "POST", "/v1/completions", &session, &body);
    assert_eq!(held.status, 200, "{}", held.body);
    assert!(
        eventually(Duration::from_secs(10), || s.gauges().idle_kv_bytes > 0),
        "the idle session keeps its KV: {:?}",
        s.gauges()
    );
    // The idle session is all the shared budget holds, counted once (not
    // once a model); a request of `M` too large to fit beside it.
    let g = s.gauges();
    assert_eq!(g.reserved_bytes, g.idle_kv_bytes, "{g:?}");
    let room = budget.saturating_sub(g.reserved_bytes);
    let mut large_text = String::new();
    while needs(&large_text) <= room {
        large_text.push_str("word ");
    }
    assert!(needs(&large_text) <= budget, "{} bytes do not fit the whole budget of {budget}", needs(&large_text));
    let large = count(&large_text);
    let started = std::time::Instant::now();
    let r = post(s, M, &large_text, 2);
    assert_eq!(r.status, 200, "after {:?}: {}", started.elapsed(), r.body);
    assert!(started.elapsed() < Duration::from_secs(10), "admitted only after {:?}", started.elapsed());
    assert!(line.prefills().contains(&large), "{:?}", line.prefills());
    assert!(
        eventually(Duration::from_secs(10), || s.gauges().idle_kv_bytes == 0),
        "the idle session still holds its KV: {:?}",
        s.gauges()
    );
    // The session lost its KV, not its history: its next turn runs.
    let next = call(s.addr, "POST", "/v1/completions", &session, &completion(HOLD, " more", 2).to_string());
    assert_eq!(next.status, 200, "{}", next.body);
}
