//! `cargo xtask load`: starts the server on loopback and drives a bounded
//! number of concurrent clients (half keep a session across their turns,
//! half are stateless), then reports throughput, latency percentiles, every
//! status seen, and whether the gauges (sessions, leases, reservations)
//! returned to their baseline.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use onnx_genai_engine::{BackendKind, Engine, Scheduler};
use onnx_genai_server::client::call;
use serde_json::json;

use crate::{ort, packages, util};

pub struct Options {
    pub clients: usize,
    pub turns: usize,
    pub max_tokens: u32,
    pub backend: String,
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn run(opts: Options) -> Result<()> {
    let lib = ort::provision()?;
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    let kind = BackendKind::parse(&opts.backend).with_context(|| format!("unknown backend `{}`", opts.backend))?;
    let built = packages::build_all(false)?;
    let model = "tiny-llama-gqa";
    let dir = built.iter().find(|b| b.name == model).context("tiny-llama-gqa is not built")?.dir.join("decomposed");
    let engine = Engine::open(&dir, kind, 1)?.with_scheduler(Scheduler::new(64 << 20));
    let server = onnx_genai_server::start(vec![engine], "127.0.0.1:0", opts.clients.max(1))?;
    let addr = server.addr;
    let baseline = server.gauges();
    println!(
        "==> {} clients x {} turns on {} ({}), max_tokens {}",
        opts.clients,
        opts.turns,
        model,
        kind.name(),
        opts.max_tokens
    );
    let barrier = Arc::new(Barrier::new(opts.clients));
    let started = Instant::now();
    let handles: Vec<_> = (0..opts.clients)
        .map(|c| {
            let barrier = barrier.clone();
            let (turns, max_tokens) = (opts.turns, opts.max_tokens);
            std::thread::spawn(move || -> Result<Vec<(u16, f64)>> {
                barrier.wait();
                let mut seen = Vec::with_capacity(turns);
                let open = || -> Result<String> {
                    let r = call(addr, "POST", "/v1/sessions", &[], &json!({"model": model}).to_string())?;
                    Ok(r.json()["id"].as_str().with_context(|| format!("no session id: {}", r.body))?.to_string())
                };
                let mut session = if c % 2 == 0 { Some(open()?) } else { None };
                for t in 0..turns {
                    // A conversation fills the 256-token context in about ten
                    // turns: session clients start a new one every five.
                    if t > 0 && t % 5 == 0 {
                        if let Some(s) = session.take() {
                            call(addr, "DELETE", &format!("/v1/sessions/{s}"), &[], "")?;
                            session = Some(open()?);
                        }
                    }
                    let body = json!({"model": model, "messages": [{"role": "user", "content": format!("turn {t} of client {c}")}], "max_tokens": max_tokens, "temperature": 0});
                    let headers: Vec<(&str, &str)> = session.as_deref().map(|s| vec![("x-session-id", s)]).unwrap_or_default();
                    let t0 = Instant::now();
                    let r = call(addr, "POST", "/v1/chat/completions", &headers, &body.to_string())?;
                    seen.push((r.status, t0.elapsed().as_secs_f64()));
                }
                if let Some(s) = session {
                    call(addr, "DELETE", &format!("/v1/sessions/{s}"), &[], "")?;
                }
                Ok(seen)
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??);
    }
    let wall = started.elapsed().as_secs_f64();
    // Releases may trail the responses (L9): poll with a bound.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = server.gauges();
    while (after.sessions, after.leases, after.reserved_bytes)
        != (baseline.sessions, baseline.leases, baseline.reserved_bytes)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(10));
        after = server.gauges();
    }
    server.stop();
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    for (s, _) in &all {
        *statuses.entry(*s).or_default() += 1;
    }
    let mut latencies: Vec<f64> = all.iter().map(|(_, l)| *l * 1e3).collect();
    latencies.sort_by(f64::total_cmp);
    let report = format!(
        "# Load check\n\n{} clients x {} turns ({} with sessions), max_tokens {}, backend {}\n\n\
         | requests | wall s | requests/s | p50 ms | p95 ms | p99 ms | statuses |\n|---:|---:|---:|---:|---:|---:|---|\n\
         | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:?} |\n\n\
         gauges at baseline {:?}, after the run {:?} (sessions, leases, reserved bytes)\n",
        opts.clients,
        opts.turns,
        opts.clients.div_ceil(2),
        opts.max_tokens,
        kind.name(),
        all.len(),
        wall,
        all.len() as f64 / wall,
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.95),
        percentile(&latencies, 0.99),
        statuses,
        (baseline.sessions, baseline.leases, baseline.reserved_bytes),
        (after.sessions, after.leases, after.reserved_bytes),
    );
    println!("{report}");
    let out = util::target().join("load");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("report.md"), &report)?;
    if statuses.keys().any(|s| *s != 200) {
        bail!("some requests failed: {statuses:?}");
    }
    if (after.sessions, after.leases, after.reserved_bytes)
        != (baseline.sessions, baseline.leases, baseline.reserved_bytes)
    {
        bail!("gauges did not return to baseline: {after:?} vs {baseline:?}");
    }
    Ok(())
}
