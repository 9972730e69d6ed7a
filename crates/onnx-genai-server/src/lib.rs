//! The OpenAI-compatible HTTP server. One driver thread per model owns its
//! engine; routes reach it through channels. Sessions are bound to
//! model-qualified placements and taken by lease for each turn. See
//! `../shared/docs/INVARIANTS.md` (A9, L1–L9) and ARCHITECTURE.md.

mod answer;
mod api;
mod backlog;
pub mod client;
#[cfg(test)]
mod death_tests;
mod driver;
mod error;
pub mod fields;
mod guard;
mod listen;
mod logprobs;
mod messages;
mod metrics;
mod openapi;
mod routes;
mod sessions;
#[cfg(test)]
mod stall_tests;
mod tool_calls;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post};
use axum::Router;
use onnx_genai_engine::Engine;

pub use driver::{Driver, DriverOptions};
pub use error::ApiError;
pub use guard::HttpOptions;
pub use routes::SESSION_HEADER;
use sessions::Registry;

/// Largest request body accepted (413 beyond it).
pub const BODY_LIMIT: usize = 1 << 20;

pub struct AppState {
    drivers: BTreeMap<String, Driver>,
    registry: Arc<Registry>,
    http: HttpOptions,
    /// The Host names requests may name (`None`: any).
    hosts: Option<Vec<String>>,
    metrics: Arc<metrics::Metrics>,
    max_choices: usize,
}

impl AppState {
    fn gauges(&self) -> Gauges {
        let mut g = Gauges {
            sessions: self.registry.active(),
            leases: self.registry.leased(),
            reserved_bytes: 0,
            admitted: 0,
            turns: 0,
            running: 0,
            stalled: 0,
            parked: 0,
            trailing: 0,
            widest_step: 0,
            steps: 0,
            stepped: 0,
            step_nanos: 0,
            waiting: 0,
            idle_kv_bytes: 0,
            kept_bytes: 0,
            models_down: 0,
        };
        // Each budget once: the models of one server share one (the CLI's),
        // and summed per model its reservations counted once per model.
        let mut budgets: Vec<&onnx_genai_engine::Scheduler> = Vec::new();
        for d in self.drivers.values() {
            if !budgets.iter().any(|b| b.shares_budget_with(&d.scheduler)) {
                budgets.push(&d.scheduler);
            }
        }
        g.reserved_bytes = budgets.iter().map(|b| b.reserved_bytes()).sum();
        for d in self.drivers.values() {
            g.admitted += d.counters.admitted.load(Ordering::SeqCst);
            g.turns += d.counters.turns.load(Ordering::SeqCst);
            g.running += d.counters.running.load(Ordering::SeqCst);
            g.stalled += d.counters.stalled.load(Ordering::SeqCst);
            g.parked += d.counters.parked.load(Ordering::SeqCst);
            g.trailing += d.counters.trailing.load(Ordering::SeqCst);
            g.widest_step = g.widest_step.max(d.counters.widest_step.load(Ordering::SeqCst));
            g.steps += d.counters.steps.load(Ordering::SeqCst);
            g.stepped += d.counters.stepped.load(Ordering::SeqCst);
            g.step_nanos += d.counters.step_nanos.load(Ordering::SeqCst);
            g.waiting += d.counters.waiting.load(Ordering::SeqCst);
            g.idle_kv_bytes += d.counters.idle_kv_bytes.load(Ordering::SeqCst);
            g.kept_bytes += d.counters.kept_bytes.load(Ordering::SeqCst);
            g.models_down += usize::from(!d.alive());
        }
        g
    }
}

/// How a server runs: sessions, the models' drivers, and HTTP.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Sessions bound at once (beyond it the least recently used idle one
    /// is evicted).
    pub max_sessions: usize,
    /// Choices (`n`) one request may ask for: 1 to the engine's
    /// `MAX_CHOICES`.
    pub max_choices: usize,
    pub driver: DriverOptions,
    pub http: HttpOptions,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            max_sessions: 64,
            max_choices: onnx_genai_engine::MAX_CHOICES,
            driver: DriverOptions::default(),
            http: HttpOptions::default(),
        }
    }
}

/// The server's gauges and counters, read live. Counters (`admitted`,
/// `turns`, `stalled` and those marked a count) only grow, and
/// `widest_step` until it is reset; what is held for work in flight
/// (leases, reservations of running turns, `running`, `parked`,
/// `trailing`, `waiting`) returns to its baseline when the server is idle, while
/// `sessions`, `idle_kv_bytes`, `kept_bytes` and `models_down` describe
/// what stays between requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gauges {
    pub sessions: usize,
    pub leases: usize,
    pub reserved_bytes: u64,
    pub admitted: u64,
    pub turns: u64,
    /// Turns running on the models now.
    pub running: u64,
    /// Turns cancelled because their client stopped reading.
    pub stalled: u64,
    /// Turns parked now, waiting for their client to read (not stepped).
    pub parked: u64,
    /// Ended turns whose clients have not yet read every event: the
    /// drivers send the rest as they read, until `stall_timeout`.
    pub trailing: u64,
    /// The most turns one model step has advanced.
    pub widest_step: u64,
    /// Model steps run so far (a count: it only grows).
    pub steps: u64,
    /// The turns those steps advanced, summed (a count): the mean batch
    /// width over an interval is its growth over that of `steps`.
    pub stepped: u64,
    /// Nanoseconds those steps spent in the engine — the model's pass and
    /// sampling — summed (a count): over an interval, its growth over that
    /// of `steps` is what a step costs the engine, the rest of a step's
    /// wall time the driver's own work and waits.
    pub step_nanos: u64,
    /// Requests waiting in line for KV room.
    pub waiting: u64,
    /// KV bytes idle sessions keep (reserved for them at rest, B2).
    pub idle_kv_bytes: u64,
    /// Bytes the models keep for reuse outside their sequences (returned
    /// KV blocks), which the budget does not count: up to each model's
    /// standing keep at rest, more for a while after a burst.
    pub kept_bytes: u64,
    /// Models whose driver died (they answer 503, `/health` is red).
    pub models_down: usize,
}

/// A server bound to a socket, running on its own runtime thread.
pub struct RunningServer {
    pub addr: SocketAddr,
    state: Arc<AppState>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RunningServer {
    pub fn gauges(&self) -> Gauges {
        self.state.gauges()
    }

    /// Starts [`Gauges::widest_step`] over from 0 on every model: it is a
    /// running maximum, so a measurement in phases (the load sweep, after
    /// its warm-up round) reads each phase's own widest step.
    pub fn reset_widest_step(&self) {
        for d in self.state.drivers.values() {
            d.counters.widest_step.store(0, Ordering::SeqCst);
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Blocks until the server stops (it stops on [`RunningServer::stop`]).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    pub fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("two packages are both named `{0}`; serve each model once")]
    DuplicateModel(String),
    #[error("nothing to serve: give at least one package")]
    NoModels,
    #[error("--max-choices is 1 to 16 (the engine's MAX_CHOICES), got {0}")]
    MaxChoices(usize),
    #[error("cannot listen on {addr}: {reason}")]
    Bind { addr: String, reason: String },
}

/// Every route: the router is built from this list, and `/openapi.json`
/// documents exactly it.
pub const ROUTES: [(&str, &str); 8] = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/sessions"),
    ("DELETE", "/v1/sessions/{id}"),
];

/// The handler of a route of [`ROUTES`].
fn handler(method: &str, path: &str) -> axum::routing::MethodRouter<Arc<AppState>> {
    match (method, path) {
        ("GET", "/health") => get(routes::health),
        ("GET", "/metrics") => get(routes::metrics),
        ("GET", "/openapi.json") => get(routes::openapi),
        ("GET", "/v1/models") => get(routes::models),
        ("POST", "/v1/chat/completions") => post(routes::chat_completions),
        ("POST", "/v1/completions") => post(routes::completions),
        ("POST", "/v1/sessions") => post(routes::create_session),
        ("DELETE", "/v1/sessions/{id}") => delete(routes::delete_session),
        // A route listed without a handler is a programming error the
        // first test run shows; it answers 404 meanwhile.
        _ => axum::routing::any(|| async { axum::http::StatusCode::NOT_FOUND }),
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    ROUTES
        .iter()
        .fold(Router::new(), |router, (method, path)| router.route(path, handler(method, path)))
        .fallback(|| async { ApiError::unknown_url() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard::gate))
        .with_state(state)
}

/// Starts serving `engines` (model name = package name) on `addr`
/// (`127.0.0.1:0` picks a free port) with at most `max_sessions` sessions.
pub fn start(engines: Vec<Engine>, addr: &str, max_sessions: usize) -> Result<RunningServer, ServeError> {
    start_with(engines, addr, ServerOptions { max_sessions, ..ServerOptions::default() })
}

/// [`start`] with every limit: drivers' queues and slow clients, HTTP
/// timeouts, connections, the API key and the Host names.
pub fn start_with(engines: Vec<Engine>, addr: &str, options: ServerOptions) -> Result<RunningServer, ServeError> {
    if engines.is_empty() {
        return Err(ServeError::NoModels);
    }
    if !(1..=onnx_genai_engine::MAX_CHOICES).contains(&options.max_choices) {
        return Err(ServeError::MaxChoices(options.max_choices));
    }
    let bind_err = |reason: String| ServeError::Bind { addr: addr.into(), reason };
    let listener = std::net::TcpListener::bind(addr).map_err(|e| bind_err(e.to_string()))?;
    listener.set_nonblocking(true).map_err(|e| bind_err(e.to_string()))?;
    let local = listener.local_addr().map_err(|e| bind_err(e.to_string()))?;
    let mut drivers = BTreeMap::new();
    let peers = driver::Peers::default();
    for engine in engines {
        let name = engine.package().manifest.name.clone();
        if drivers.contains_key(&name) {
            return Err(ServeError::DuplicateModel(name));
        }
        drivers.insert(name.clone(), Driver::spawn(name, engine, options.driver, peers.clone()));
    }
    // (Set once, here, before any request can reach a driver.)
    let _ = peers.set(drivers.values().map(Driver::peer).collect());
    let hosts = guard::host_policy(local, &options.http.allowed_hosts);
    let metrics = Arc::new(metrics::Metrics::new());
    let http = options.http;
    let (max_connections, header_timeout) = (http.max_connections, http.header_timeout);
    let state = Arc::new(AppState {
        drivers,
        registry: Registry::new(options.max_sessions.max(1)),
        http,
        hosts,
        metrics: metrics.clone(),
        max_choices: options.max_choices,
    });
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(state.clone());
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| bind_err(e.to_string()))?;
    let thread = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
                let shutdown = async {
                    let _ = rx.await;
                };
                listen::serve(listener, app, max_connections, header_timeout, metrics, shutdown).await;
            })
        })
        .map_err(|e| bind_err(e.to_string()))?;
    Ok(RunningServer { addr: local, state, shutdown: Some(tx), thread: Some(thread) })
}
