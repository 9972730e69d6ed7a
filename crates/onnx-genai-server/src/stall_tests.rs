//! A client that stops reading its stream cannot slow the others (issue 16,
//! back-pressure): once its channel is full its turn is parked — not
//! stepped, keeping its KV and reservation — and after `stall_timeout` it is
//! cancelled and everything it held returns. Over loopback HTTP the kernel's
//! socket buffers absorb far more than the tiny model's 256-token context
//! before a silent client's channel fills, so the silent client here is a
//! command with a one-event channel nobody reads; the reader beside it is a
//! real HTTP request.

use std::time::{Duration, Instant};

use onnx_genai_engine::{FinishReason, GenerateRequest};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use crate::client::call;
use crate::death_tests::{engine, MODEL};
use crate::driver::{Command, DriverOptions, Event, Promise};
use crate::{start_with, RunningServer, ServerOptions};

/// Starts a 200-token turn whose client reads nothing (a one-event
/// channel nobody drains) and waits until the driver has parked it.
/// Returns that channel's receiver and the turn's release signal (kept
/// alive by the caller, so the turn is not taken as abandoned).
fn park_silent_turn(server: &RunningServer) -> (mpsc::Receiver<Event>, oneshot::Receiver<()>) {
    let mut request = GenerateRequest::text("Once upon a time");
    request.max_new_tokens = Some(200);
    let (silent, mut admitted, ended) = send_generate(server, request, 1);
    // Bounded, so a driver that never decides fails here instead of hanging.
    let deadline = Instant::now() + Duration::from_secs(20);
    let decided = loop {
        match admitted.try_recv() {
            Ok(decided) => break decided,
            Err(oneshot::error::TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "the silent request was never admitted nor refused");
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("the admission promise was dropped unresolved: {e}"),
        }
    };
    assert!(decided.is_ok(), "the silent request was not admitted");
    wait_for(|| server.gauges().parked == 1, "the silent client's turn was never parked");
    (silent, ended)
}

/// Sends `request` to the model's driver as a route would, its events on a
/// channel of `capacity`: the events' receiver, the admission decision's,
/// and the turn's release signal (kept alive by the caller, so the turn is
/// not taken as abandoned).
fn send_generate(
    server: &RunningServer,
    request: GenerateRequest,
    capacity: usize,
) -> (mpsc::Receiver<Event>, Decision, oneshot::Receiver<()>) {
    let (admission, admitted) = Promise::new();
    let (events, receiver) = mpsc::channel(capacity);
    let (released, ended) = oneshot::channel();
    let command = Command::Generate { request: Box::new(request), lease: None, admission, events, released };
    server.state.drivers[MODEL].send(command).unwrap();
    (receiver, admitted, ended)
}

/// The admission decision a route waits for.
type Decision = oneshot::Receiver<Result<u64, crate::error::ApiError>>;

/// Server options whose drivers cancel a turn its client has not read
/// from for `stall_timeout` (the rest default).
fn stalling_after(stall_timeout: Duration) -> ServerOptions {
    ServerOptions { driver: DriverOptions { stall_timeout, ..Default::default() }, ..Default::default() }
}

/// Waits (bounded) until `what` holds, failing with `never` otherwise.
fn wait_for(what: impl Fn() -> bool, never: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !what() {
        assert!(Instant::now() < deadline, "{never}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// B3 for a stalled client (issue 16, item 5, back-pressure): a non-reading client's turn is parked, not stepped — it makes
/// no more tokens than its channel and one step's backlog hold, while a
/// reading client beside it gets its whole answer — and is cancelled at
/// `stall_timeout`, releasing its reservation (A4) with nothing left
/// running or parked.
#[test]
fn a_client_that_stops_reading_parks_out_of_the_batch_then_is_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let stall_timeout = Duration::from_secs(3);
    let options = stalling_after(stall_timeout);
    let server = start_with(vec![engine(dir.path())], "127.0.0.1:0", options).unwrap();
    let baseline = server.gauges();
    let started = Instant::now();
    let (mut silent, _ended) = park_silent_turn(&server);
    // With only the parked turn left, the driver polls for commands but
    // steps nothing and counts no step: the load report's mean width and
    // ms/step come from these counters. (Found by cargo-mutants: `width >=
    // 0` survived when the reader below arrived within one poll.)
    let before = server.gauges();
    std::thread::sleep(Duration::from_millis(50));
    let after = server.gauges();
    assert_eq!(
        (after.steps, after.stepped, after.step_nanos),
        (before.steps, before.stepped, before.step_nanos),
        "an empty step was counted: {after:?}"
    );

    let body = json!({"model": MODEL, "prompt": "A reader", "max_tokens": 40, "temperature": 0});
    let reply = call(server.addr, "POST", "/v1/completions", &[], &body.to_string()).unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["usage"]["completion_tokens"], 40, "{}", reply.body);
    let g = server.gauges();
    assert!(
        started.elapsed() < stall_timeout && g.stalled == 0 && g.parked == 1,
        "the reader should finish while the silent turn is still parked: {g:?} after {:?}",
        started.elapsed()
    );
    // Parked, the silent turn was not stepped beside the reader: every
    // step so far advanced one turn, the reader's 40 tokens at least.
    assert_eq!(g.widest_step, 1, "{g:?}");
    assert!(g.steps >= 40 && g.stepped == g.steps, "steps and the turns they advanced: {g:?}");
    // Their time in the engine was counted, and is no more than the wall
    // time since the first of them could start.
    let engine = g.step_nanos - baseline.step_nanos;
    assert!(engine > 0 && u128::from(engine) <= started.elapsed().as_nanos(), "engine time {engine} ns: {g:?}");
    // The gauge is a running maximum a measurement in phases starts over.
    server.reset_widest_step();
    assert_eq!(server.gauges().widest_step, 0);

    wait_for(|| server.gauges().stalled == 1, "the parked turn was never cancelled");
    wait_for(|| server.gauges().running == 0, "the cancelled turn still runs");
    let g = server.gauges();
    assert_eq!((g.parked, g.reserved_bytes, g.leases), (0, baseline.reserved_bytes, 0), "{g:?}");

    // What the silent client would have read: a few tokens, then the end.
    let (mut deltas, mut result) = (0, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    while result.is_none() {
        assert!(Instant::now() < deadline, "the cancelled turn's end never arrived");
        match silent.try_recv() {
            Ok(Event::Delta(..)) => deltas += 1,
            Ok(Event::Finished(r)) => result = Some(r),
            Ok(Event::Failed(e)) => panic!("the cancelled turn failed: {}", e.message),
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    let result = result.unwrap();
    assert_eq!(result.finish_reason, FinishReason::Stopped);
    assert_eq!(result.token_ids.len(), deltas, "every token made was sent");
    assert!(
        (1..=3).contains(&deltas),
        "a parked turn makes no tokens: {deltas} made for a one-event channel (200 allowed)"
    );
    server.stop();
}

/// The tiny llama built into `dir`, on native-cpu (one thread), behind
/// `hook`.
pub(crate) fn hooked_engine(
    dir: &std::path::Path,
    hook: impl onnx_genai_test_support::Hook + 'static,
) -> onnx_genai_engine::Engine {
    let package = onnx_genai_test_support::build_into(MODEL, onnx_genai_test_support::Variant::Decomposed, dir);
    let inner = onnx_genai_engine::BackendKind::NativeCpu.load(&package, 1).unwrap();
    let model = std::sync::Arc::new(onnx_genai_test_support::Hooked::new(inner, hook));
    onnx_genai_engine::Engine::new(package, model).unwrap()
}

/// Counts the driver's requests to give back idle memory (everything else
/// passes to the real model).
#[derive(Default)]
struct CountReleases(std::sync::atomic::AtomicUsize);

impl onnx_genai_test_support::Hook for CountReleases {
    fn step(&self, _: &[onnx_genai_backend::Entry<'_>]) -> Result<(), onnx_genai_backend::BackendError> {
        Ok(())
    }
    fn release_idle_memory(&self, model_says: Option<Duration>) -> Option<Duration> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        model_says
    }
}

/// While every running turn is parked the driver steps nothing, yet it
/// keeps asking its model to give back the memory that ages out (native-cpu's
/// returned KV blocks past their linger): a client that stops reading must
/// not pin a past burst's KV until its stall timeout. (Without the ask in
/// the parked branch the driver is neither stepping nor idle there, and
/// nothing would ever be given back while the turn waits.)
#[test]
fn a_driver_whose_every_turn_is_parked_still_gives_back_idle_memory() {
    let dir = tempfile::tempdir().unwrap();
    let hook = std::sync::Arc::new(CountReleases::default());
    let engine = hooked_engine(dir.path(), hook.clone());
    let stall_timeout = Duration::from_secs(20);
    let options = stalling_after(stall_timeout);
    let server = start_with(vec![engine], "127.0.0.1:0", options).unwrap();
    let (_silent, _ended) = park_silent_turn(&server);
    let asks = || hook.0.load(std::sync::atomic::Ordering::SeqCst);
    let (before, steps) = (asks(), server.gauges().steps);
    std::thread::sleep(Duration::from_millis(200));
    let g = server.gauges();
    assert_eq!((g.parked, g.steps), (1, steps), "the turn should still be parked, nothing stepped: {g:?}");
    // The driver polls for commands every 2 ms while parked: dozens of asks.
    assert!(asks() >= before + 10, "{} asks to give back idle memory in 200 ms parked", asks() - before);
    server.stop();
}

/// Holds the first model step until opened; counts every step.
#[derive(Default)]
struct FirstStepGate {
    state: std::sync::Mutex<(bool, bool, usize)>,
    changed: std::sync::Condvar,
}

impl onnx_genai_test_support::Hook for FirstStepGate {
    fn step(&self, _: &[onnx_genai_backend::Entry<'_>]) -> Result<(), onnx_genai_backend::BackendError> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        g.2 += 1;
        if g.2 == 1 {
            g.0 = true;
            self.changed.notify_all();
            // Bounded: a test that failed before opening must not hang.
            let (held, _) = self
                .changed
                .wait_timeout_while(g, Duration::from_secs(20), |g| !g.1)
                .unwrap_or_else(|p| p.into_inner());
            drop(held);
        }
        Ok(())
    }
}

/// B4 for a client that leaves while its long prompt is read in chunks:
/// the turn leaves at the next step boundary, not once its prompt is read
/// and its first token finds nobody to send to — a 100-token prompt in
/// chunks of 4 is 25 steps of work for a client that is gone — and its
/// reservation returns.
#[test]
fn a_client_that_leaves_during_a_chunked_prefill_leaves_the_batch_at_the_next_step() {
    let dir = tempfile::tempdir().unwrap();
    let gate = std::sync::Arc::new(FirstStepGate::default());
    let engine = hooked_engine(dir.path(), gate.clone()).with_prefill_chunk(4);
    let server = start_with(vec![engine], "127.0.0.1:0", ServerOptions::default()).unwrap();
    let baseline = server.gauges();

    let mut request = GenerateRequest::new(onnx_genai_engine::Prompt::TokenIds((1..=100).collect()));
    request.max_new_tokens = Some(8);
    let (client, _admitted, _ended) = send_generate(&server, request, 64);
    let entered = || gate.state.lock().unwrap().0;
    wait_for(entered, "the prompt's first chunk never ran");
    // The client leaves while the first of 25 chunks runs.
    drop(client);
    {
        let mut g = gate.state.lock().unwrap();
        g.1 = true;
        gate.changed.notify_all();
    }
    wait_for(|| server.gauges().running == 0, "the turn of the client that left still runs");
    let steps = gate.state.lock().unwrap().2;
    assert!(steps <= 2, "{steps} model steps for a client that left during the first (25 to read its prompt)");
    wait_for(|| server.gauges().reserved_bytes == baseline.reserved_bytes, "the reservation was not returned");
    server.stop();
}

/// Threads of this process named as a model's driver: the drivers, and
/// any thread a driver spawns unnamed (Linux gives it its parent's name).
fn driver_threads() -> usize {
    let tasks = std::fs::read_dir("/proc/self/task").map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
    tasks
        .iter()
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("driver-")))
        .count()
}

/// Back-pressure without threads (issue 16, item 5): turns that end
/// before their clients read (48 of them, each client a one-event channel
/// nobody drains) leave their events with the driver — the `trailing`
/// gauge counts them — which delivers them as the client reads and drops
/// what is left at `stall_timeout` — no thread a turn (a spawned thread
/// each, before: clients that never read, n = 16 choices a request,
/// reached the OS's thread limit, whose spawn panic killed the model's
/// driver). The events still arrive, in order, once a client reads, and
/// the gauge returns to its baseline either way.
#[cfg(target_os = "linux")]
#[test]
fn ended_turns_whose_clients_do_not_read_cost_no_threads() {
    let dir = tempfile::tempdir().unwrap();
    let stall_timeout = Duration::from_secs(2);
    let options = stalling_after(stall_timeout);
    let server = start_with(vec![engine(dir.path())], "127.0.0.1:0", options).unwrap();
    let silent_turns = |count: usize| {
        let turns = server.gauges().turns;
        let mut silent = Vec::new();
        for i in 0..count {
            // One token: its delta fills the channel, and the end trails.
            let mut request = GenerateRequest::text(format!("Silent client {i}"));
            request.max_new_tokens = Some(1);
            let (events, _admitted, ended) = send_generate(&server, request, 1);
            silent.push((events, ended));
        }
        let ended = || {
            let g = server.gauges();
            (g.turns, g.running, g.waiting) == (turns + count as u64, 0, 0)
        };
        wait_for(ended, "the silent turns never ended");
        silent
    };
    let before = driver_threads();
    let mut silent = silent_turns(48);
    let grown = driver_threads().saturating_sub(before);
    assert!(grown < 16, "{grown} threads more for 48 ended turns whose clients do not read");
    assert_eq!(server.gauges().trailing, 48, "every ended turn's end trails its client");
    // Each client still gets its whole answer, in order, as it reads.
    for (events, _) in &mut silent {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut deltas = 0;
        loop {
            assert!(Instant::now() < deadline, "a trailing answer never completed");
            match events.try_recv() {
                Ok(Event::Delta(..)) => deltas += 1,
                Ok(Event::Finished(r)) => {
                    assert_eq!(r.token_ids.len(), deltas, "every token made was sent before the end");
                    break;
                }
                Ok(Event::Failed(e)) => panic!("a silent turn failed: {}", e.message),
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }
    wait_for(|| server.gauges().trailing == 0, "delivered answers still trail");
    // Clients that never read: what trails is dropped at the stall timeout.
    let never = silent_turns(4);
    let started = Instant::now();
    assert_eq!(server.gauges().trailing, 4);
    wait_for(|| server.gauges().trailing == 0, "undelivered events outlived the stall timeout");
    assert!(started.elapsed() * 2 >= stall_timeout, "dropped long before the stall timeout");
    drop(never);
    server.stop();
}
