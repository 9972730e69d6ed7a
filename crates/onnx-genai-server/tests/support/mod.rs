//! Test support: packages, a gate that holds a turn inside the backend, and
//! a small HTTP/1.1 client over a real loopback socket.

#![allow(dead_code)]

use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::time::{Duration, Instant};

use onnx_genai_backend::{BackendError, Entry};
use onnx_genai_engine::{BackendKind, Engine, Scheduler};
use onnx_genai_package::Package;
use onnx_genai_test_support::{Hook, Hooked};

/// A chat template that renders tools itself, as tool-calling models'
/// templates do (compactly: the tiny model's context is 256 tokens).
pub const TOOLS_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t.function.name }} {{ t.function.parameters.properties | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}<|im_start|>assistant\n";

pub use onnx_genai_test_support::build as package;

/// (closed, calls held so far, calls still let through while closed)
type GateState = (bool, usize, usize);

/// (when each call of `release_idle_memory` came, the answers to give
/// instead of the model's, in order)
type IdleScript = (Vec<Instant>, std::collections::VecDeque<Duration>);

/// Holds every backend call while closed, so a turn stays mid-flight (its
/// lease and reservation held) for as long as a test needs; records the
/// length of every prefill the model ran, in order; injects a [`Fault`]
/// while one is set; counts the server's requests to give back idle
/// memory, answering them from a script while it lasts.
#[derive(Clone, Default)]
pub struct Gate(
    Arc<(Mutex<GateState>, Condvar)>,
    Arc<Mutex<Vec<usize>>>,
    Arc<Mutex<Fault>>,
    Arc<Mutex<IdleScript>>,
    Arc<Mutex<usize>>,
);

/// What the gated backend does wrong.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    #[default]
    None,
    /// Every model step returns a backend error (after admission).
    StepFails,
    /// Every model step panics.
    StepPanics,
    /// Making a sequence (a session's or a request's) panics.
    SequencePanics,
    /// Giving back idle memory, or saying how much is kept, panics.
    ReleasePanics,
}

/// The longest a closed gate holds a model step.
const HELD_AT_MOST: Duration = Duration::from_secs(120);

impl Gate {
    /// While set, every model step fails with a backend error.
    pub fn failing(&self, on: bool) {
        self.fault(if on { Fault::StepFails } else { Fault::None });
    }
    pub fn fault(&self, fault: Fault) {
        *self.2.lock().unwrap() = fault;
    }
    fn current(&self) -> Fault {
        *self.2.lock().unwrap()
    }
    /// The next answers to the server's requests to give back idle memory
    /// ("ask again after this long"), in place of the model's own.
    pub fn idle_answers(&self, answers: &[Duration]) {
        self.3.lock().unwrap().1.extend(answers);
    }
    /// How many times the server asked the model to give back idle memory.
    pub fn idle_calls(&self) -> usize {
        self.3.lock().unwrap().0.len()
    }
    /// How many times saying what memory the model keeps panicked
    /// (under [`Fault::ReleasePanics`]).
    pub fn kept_panics(&self) -> usize {
        *self.4.lock().unwrap()
    }
    /// When each of those requests came.
    pub fn idle_call_times(&self) -> Vec<Instant> {
        self.3.lock().unwrap().0.clone()
    }
    /// The prompt lengths the model prefilled, in the order it ran them.
    pub fn prefills(&self) -> Vec<usize> {
        self.1.lock().unwrap().clone()
    }
    pub fn close(&self) {
        self.0 .0.lock().unwrap().0 = true;
    }
    /// While closed, lets the next `n` calls through before holding again.
    pub fn allow(&self, n: usize) {
        self.0 .0.lock().unwrap().2 = n;
    }
    /// While closed, lets one held call (or the next call) through.
    pub fn release_one(&self) {
        self.0 .0.lock().unwrap().2 += 1;
        self.0 .1.notify_all();
    }
    pub fn open(&self) {
        self.0 .0.lock().unwrap().0 = false;
        self.0 .1.notify_all();
    }
    /// Waits (bounded) until `n` calls have been held at the gate in total.
    pub fn wait_held(&self, n: usize) {
        let g = self.0 .0.lock().unwrap();
        let (g, waited) = self.0 .1.wait_timeout_while(g, Duration::from_secs(20), |g| g.1 < n).unwrap();
        drop(g);
        assert!(!waited.timed_out(), "no turn reached the gate");
    }
    fn pass(&self) {
        let mut g = self.0 .0.lock().unwrap();
        if g.0 && g.2 > 0 {
            g.2 -= 1;
            return;
        }
        if g.0 {
            g.1 += 1;
            self.0 .1.notify_all();
            // Bounded like every wait of the tests: a test that failed
            // before opening the gate must not leave the driver held.
            let (held, waited) = self.0 .1.wait_timeout_while(g, HELD_AT_MOST, |g| g.0 && g.2 == 0).unwrap();
            g = held;
            if waited.timed_out() {
                // Unlocked first: a panic holding the lock would poison it
                // and hide this message behind the next lock's.
                drop(g);
                panic!("the gate stayed closed for {HELD_AT_MOST:?}: the test never opened it");
            }
            if g.0 {
                // Let through by `release_one` while still closed.
                g.2 -= 1;
            }
        }
    }
}

impl Hook for Gate {
    fn new_sequence(&self) {
        if self.current() == Fault::SequencePanics {
            panic!("injected: the backend cannot make a sequence");
        }
    }
    fn step(&self, batch: &[Entry<'_>]) -> Result<(), BackendError> {
        self.pass();
        let prefills = batch.iter().map(|e| e.input.positions()).filter(|n| *n > 1);
        self.1.lock().unwrap().extend(prefills);
        match self.current() {
            Fault::StepFails => Err(BackendError::Run { backend: "gated", reason: "injected failure".into() }),
            Fault::StepPanics => panic!("injected: the backend panicked in a step"),
            Fault::None | Fault::SequencePanics | Fault::ReleasePanics => Ok(()),
        }
    }
    fn release_idle_memory(&self, model_says: Option<Duration>) -> Option<Duration> {
        let mut script = self.3.lock().unwrap();
        script.0.push(Instant::now());
        let answer = script.1.pop_front().or(model_says);
        drop(script);
        if self.current() == Fault::ReleasePanics {
            panic!("injected: the backend panicked giving back idle memory");
        }
        answer
    }
    fn kept_memory_bytes(&self, model_says: u64) -> u64 {
        if self.current() == Fault::ReleasePanics {
            *self.4.lock().unwrap() += 1;
            panic!("injected: the backend panicked saying what memory it keeps");
        }
        model_says
    }
}

/// The backend this test binary's engines run: `tests/native_cpu.rs`
/// compiles the HTTP test files again as modules of a crate of that name;
/// every other binary runs ONNX Runtime, the reference. (A compile-time
/// name, so no setting outside the source can change what a test ran on.)
pub fn backend() -> BackendKind {
    if env!("CARGO_CRATE_NAME") == "native_cpu" {
        BackendKind::NativeCpu
    } else {
        BackendKind::Ort
    }
}

/// How a package's KV is held on this binary's backend: reservations are
/// rounded up to its resident blocks (token-exact on ONNX Runtime,
/// 64-token blocks on native-cpu). Budgets of the tests are sized with it,
/// so a test means the same on both.
pub struct KvBlocks {
    granularity: u64,
    bytes_per_token: u64,
}

impl KvBlocks {
    /// Loads the backend once to read its block size.
    pub fn of(package: &Package) -> Self {
        let granularity = backend().load(package, 1).unwrap().kv_granularity().max(1) as u64;
        Self { granularity, bytes_per_token: package.kv_geometry().unwrap().bytes_per_token() }
    }

    /// The tokens of KV a reservation of `tokens` holds.
    pub fn tokens(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.granularity) * self.granularity
    }

    /// The bytes a reservation of `tokens` holds.
    pub fn bytes(&self, tokens: u64) -> u64 {
        self.tokens(tokens) * self.bytes_per_token
    }
}

/// An engine on this binary's real backend ([`backend`]) whose model steps
/// pass `gate`.
pub fn engine(package: &Package, gate: &Gate, scheduler: Scheduler) -> Engine {
    let inner = backend().load(package, 1).unwrap();
    let model = Arc::new(Hooked::new(inner, gate.clone()));
    Engine::new(package.clone(), model).unwrap().with_scheduler(scheduler)
}

pub use onnx_genai_server::client::{Reply, Stream};

pub fn call(addr: std::net::SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    onnx_genai_server::client::call(addr, method, path, headers, body).expect("loopback request")
}

pub fn post(addr: std::net::SocketAddr, path: &str, body: &serde_json::Value) -> Reply {
    call(addr, "POST", path, &[], &body.to_string())
}

pub fn stream(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> Stream {
    Stream::open(addr, path, headers, body).expect("loopback stream")
}

/// Polls `f` until it holds or `limit` passes (L9: releases may trail the
/// response).
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    f()
}

/// A greedy chat request body.
pub fn chat(model: &str, text: &str, max: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max, "temperature": 0})
}

/// Runs `f(0..n)` on `n` threads released together by a barrier.
pub fn together<T: Send + 'static>(n: usize, f: impl Fn(usize) -> T + Send + Sync + 'static) -> Vec<T> {
    let barrier = Arc::new(Barrier::new(n));
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let (b, f) = (barrier.clone(), f.clone());
            std::thread::spawn(move || {
                b.wait();
                f(i)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}
