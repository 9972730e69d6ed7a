//! `GET /metrics`: the server's state in Prometheus' (OpenMetrics) text
//! format. Counters and histograms are updated where things happen;
//! gauges are read from the live [`Gauges`] at each scrape, so they can
//! never drift from what admission and the registry hold.

use std::sync::atomic::AtomicI64;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::Gauges;

type Labels = Vec<(&'static str, String)>;

/// The media type of the OpenMetrics text exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    refused_connections: Counter,
    tokens: Counter,
    time_to_first_token: Histogram,
    inter_token: Histogram,
    connections: Gauge,
    sessions: Gauge,
    leases: Gauge,
    queue_depth: Gauge,
    running: Gauge,
    parked: Gauge,
    trailing: Gauge,
    kv_reserved: Gauge,
    kv_idle: Gauge,
    kv_kept: Gauge,
    models_down: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("onnx_genai");
        let requests = Family::<Labels, Counter>::default();
        registry.register("http_requests", "HTTP requests answered, by route and status", requests.clone());
        let refused_connections = Counter::default();
        registry.register(
            "refused_connections",
            "Connections answered 503 because the connection limit was reached",
            refused_connections.clone(),
        );
        let tokens = Counter::default();
        registry.register("generated_tokens", "Tokens generated and handed to clients", tokens.clone());
        // 1 ms to about 33 s: a token on a fast model up to a long queue wait.
        let time_to_first_token = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "time_to_first_token_seconds",
            "From a generation request's arrival to its first token",
            time_to_first_token.clone(),
        );
        let inter_token = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        registry.register("inter_token_seconds", "Between consecutive tokens of one request", inter_token.clone());
        let gauge = |registry: &mut Registry, name: &str, help: &str| {
            let g = Gauge::<i64, AtomicI64>::default();
            registry.register(name, help, g.clone());
            g
        };
        let connections = gauge(&mut registry, "open_connections", "HTTP connections open now");
        let sessions = gauge(&mut registry, "sessions", "Sessions bound now");
        let leases = gauge(&mut registry, "session_leases", "Sessions running a turn now");
        let queue_depth = gauge(&mut registry, "queue_depth", "Requests waiting in line for KV room");
        let running = gauge(&mut registry, "running_turns", "Turns running on the models now");
        let parked = gauge(
            &mut registry,
            "parked_turns",
            "Turns waiting for their client to read their stream (not stepped meanwhile)",
        );
        let trailing = gauge(
            &mut registry,
            "trailing_turns",
            "Ended turns whose client has not yet read every event (sent as it reads, until the stall timeout)",
        );
        let kv_reserved = gauge(
            &mut registry,
            "kv_reserved_bytes",
            "KV cache bytes admission has reserved (running turns and idle sessions)",
        );
        let kv_idle = gauge(&mut registry, "kv_idle_session_bytes", "KV cache bytes idle sessions keep resident");
        let kv_kept = gauge(
            &mut registry,
            "kv_kept_bytes",
            "KV cache bytes the models keep for reuse outside every sequence and outside the KV budget",
        );
        let models_down = gauge(&mut registry, "models_down", "Models whose driver died (they answer 503)");
        Self {
            registry,
            requests,
            refused_connections,
            tokens,
            time_to_first_token,
            inter_token,
            connections,
            sessions,
            leases,
            queue_depth,
            running,
            parked,
            trailing,
            kv_reserved,
            kv_idle,
            kv_kept,
            models_down,
        }
    }

    pub fn request(&self, route: &str, status: u16) {
        self.requests.get_or_create(&vec![("route", route.to_string()), ("status", status.to_string())]).inc();
    }

    pub fn connection_refused(&self) {
        self.refused_connections.inc();
    }

    /// Counts the connection as open until the guard drops.
    pub fn connection_opened(&self) -> OpenConnection<'_> {
        self.connections.inc();
        OpenConnection(&self.connections)
    }

    /// A clock for one generation request, started at its arrival.
    pub fn token_clock(self: &Arc<Self>) -> TokenClock {
        TokenClock { metrics: self.clone(), arrived: Instant::now(), last: None }
    }

    /// The exposition, with the gauges read from `now`.
    pub fn render(&self, now: &Gauges) -> String {
        let set = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set(&self.sessions, now.sessions as u64);
        set(&self.leases, now.leases as u64);
        set(&self.queue_depth, now.waiting);
        set(&self.running, now.running);
        set(&self.parked, now.parked);
        set(&self.trailing, now.trailing);
        set(&self.kv_reserved, now.reserved_bytes);
        set(&self.kv_idle, now.idle_kv_bytes);
        set(&self.kv_kept, now.kept_bytes);
        set(&self.models_down, now.models_down as u64);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

pub struct OpenConnection<'a>(&'a Gauge);

impl Drop for OpenConnection<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Observes time to first token and the gaps between tokens of one request.
pub struct TokenClock {
    metrics: Arc<Metrics>,
    arrived: Instant,
    last: Option<Instant>,
}

impl TokenClock {
    pub fn token(&mut self) {
        let now = Instant::now();
        let since = |t: Instant| now.duration_since(t).as_secs_f64();
        match self.last {
            None => self.metrics.time_to_first_token.observe(since(self.arrived)),
            Some(t) => self.metrics.inter_token.observe(since(t)),
        }
        self.metrics.tokens.inc();
        self.last = Some(now);
    }
}
