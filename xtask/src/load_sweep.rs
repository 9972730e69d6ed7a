//! `cargo xtask load --package DIR`: one model served on loopback, driven by
//! 1, 2, 4, 8 and 16 concurrent streaming clients in turn (one run): the
//! aggregate generated tokens/s while every client streams (and over the
//! whole run), time to first token p50/p95, and the
//! G op/s the projections reach against this machine's measured peak for
//! the export's arithmetic (f32 FMAs, or VNNI or AMX int8 dot products: AMX
//! for steps wide enough to run on tiles) at the same thread count (after
//! one unmeasured warm-up round at the widest count, so the first point is
//! not a cold server's). With `--rounds N`
//! the whole sweep runs N times in turn and each column is the median of
//! the rounds (aggregate and ratio with their range): a ratio is taken
//! within its round, so minutes in which the VM's neighbours were busy
//! slow its numerator and denominator alike. Then two
//! interference checks (`load_interference`): how much
//! creating and closing sessions adds to other requests' latency, and how
//! much a client that stops reading its stream costs the others.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use onnx_genai_engine::{BackendKind, Engine, Scheduler};
use onnx_genai_native::kernels::tiled::AMX_MIN_ROWS;
use onnx_genai_server::client::Stream;
use serde_json::json;

use crate::load::percentile;
use crate::load_interference::{interference, INTERFERENCE_ROUNDS};
use crate::{ort, util};

pub struct Options {
    pub package: PathBuf,
    pub clients: Vec<usize>,
    pub max_tokens: u32,
    pub threads: usize,
    pub backend: String,
    /// How the model stores its KV cache (`model`, `f16`).
    pub kv_cache: String,
    /// Requests each client makes per client count.
    pub turns: usize,
    /// Times the whole sweep runs (each column: the median over them).
    pub rounds: usize,
    /// The sweep's requests' sampling temperature (0: greedy).
    pub temperature: f32,
}

/// Requests a client of a sweep makes one after another by default: with
/// several, a client's next prompt arrives while the others decode, as a
/// served conversation's do.
const SWEEP_TURNS: usize = 4;

/// The most requests a sweep's client makes (each count of a sweep runs
/// clients x turns requests of `--max-tokens`).
const MAX_SWEEP_TURNS: usize = 4;

/// `--sweep` and `--turns` as a sweep runs them: the client counts (each
/// positive) and the turns a client (the default where not given).
pub fn shape(sweep: &str, turns: Option<usize>) -> Result<(Vec<usize>, usize)> {
    let turns = turns.unwrap_or(SWEEP_TURNS);
    if !(1..=MAX_SWEEP_TURNS).contains(&turns) {
        bail!("--turns with --package takes 1 to {MAX_SWEEP_TURNS} requests a client, got {turns}");
    }
    match sweep.split(',').map(|c| c.trim().parse::<usize>()).collect::<Result<Vec<_>, _>>() {
        Ok(clients) if clients.iter().all(|c| *c > 0) => Ok((clients, turns)),
        _ => bail!("--sweep takes positive client counts separated by commas, got `{sweep}`"),
    }
}

/// One streamed completion.
#[derive(Clone, Debug, Default)]
pub(crate) struct Reply {
    /// Seconds to the first token.
    ttft: f64,
    /// Tokens generated (the usage the server reported).
    tokens: usize,
    /// Seconds the whole request took.
    pub(crate) secs: f64,
    /// When each event that carried text arrived.
    events: Vec<Instant>,
}

pub(crate) fn stream_one(
    addr: std::net::SocketAddr,
    model: &str,
    prompt: &str,
    max_tokens: u32,
    temperature: f32,
) -> Result<Reply> {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
        "stream": true, "stream_options": {"include_usage": true}});
    let t0 = Instant::now();
    let mut s = Stream::open(addr, "/v1/completions", &[], &body)?;
    if s.status != 200 {
        bail!("status {}", s.status);
    }
    let (mut tokens, mut events) = (0usize, Vec::new());
    while let Some(data) = s.next_data() {
        if data == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&data).unwrap_or_default();
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
        } else if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
            events.push(Instant::now());
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let ttft = events.first().map_or(secs, |e| e.duration_since(t0).as_secs_f64());
    Ok(Reply { ttft, tokens, secs, events })
}

/// Tokens per second while every client was streaming: from the moment the
/// last of them received its first token to the moment the first of them
/// received its last (`clients[c]`: client `c`'s replies in turn). A reply's
/// tokens count in the share of its text events that arrived inside that
/// window. Outside it fewer clients than the count run: at the start the
/// first prompts are still being read, and at the end clients whose answers
/// stopped early (an end-of-text before `max_tokens`) wait for the last
/// one. `None` when the window is empty (a client that received nothing,
/// or one that finished before another started).
fn concurrent_rate(clients: &[Vec<Reply>]) -> Option<f64> {
    let first = |c: &Vec<Reply>| c.iter().find_map(|r| r.events.first().copied());
    let last = |c: &Vec<Reply>| c.iter().rev().find_map(|r| r.events.last().copied());
    let start = clients.iter().map(first).collect::<Option<Vec<_>>>()?.into_iter().max()?;
    let end = clients.iter().map(last).collect::<Option<Vec<_>>>()?.into_iter().min()?;
    let secs = end.checked_duration_since(start)?.as_secs_f64();
    if secs <= 0.0 {
        return None;
    }
    // Events in (start, end]: n events over a span hold n - 1 intervals, so
    // the one at the window's opening is not counted.
    let tokens: f64 = clients
        .iter()
        .flatten()
        .filter(|r| !r.events.is_empty())
        .map(|r| {
            let inside = r.events.iter().filter(|e| **e > start && **e <= end).count();
            r.tokens as f64 * inside as f64 / r.events.len() as f64
        })
        .sum();
    Some(tokens / secs)
}

/// [`concurrent_rate`], or where there is no window (a client received no
/// text, or finished before another's first token) every token over the
/// run's `wall` seconds; with whether it was the window's rate, so a report
/// can say which it shows.
pub(crate) fn rate_or_whole_run(clients: &[Vec<Reply>], wall: f64) -> (f64, bool) {
    match concurrent_rate(clients) {
        Some(rate) => (rate, true),
        None => (whole_run_rate(clients, wall), false),
    }
}

/// Every token the clients received over the run's `wall` seconds (the
/// report's "overall" column, and the aggregate where there is no window).
fn whole_run_rate(clients: &[Vec<Reply>], wall: f64) -> f64 {
    clients.iter().flatten().map(|r| r.tokens).sum::<usize>() as f64 / wall
}

/// `clients` threads released together, each streaming `turns` requests in
/// turn (`prompt(client, turn)`): each client's replies.
fn run_clients(
    addr: std::net::SocketAddr,
    model: &str,
    clients: usize,
    turns: usize,
    max_tokens: u32,
    temperature: f32,
    prompt: fn(usize, usize) -> String,
) -> Result<Vec<Vec<Reply>>> {
    let barrier = Arc::new(Barrier::new(clients));
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let (barrier, model) = (barrier.clone(), model.to_string());
            std::thread::spawn(move || -> Result<Vec<Reply>> {
                barrier.wait();
                (0..turns).map(|t| stream_one(addr, &model, &prompt(c, t), max_tokens, temperature)).collect()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))?).collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Row {
    clients: usize,
    /// Aggregate tokens/s while every client streamed ([`concurrent_rate`]),
    /// or, where there was no such window (`windowed` false), `overall`.
    tokens_per_s: f64,
    /// Whether `tokens_per_s` is the window's rate: false where a client
    /// received no text or finished before another's first token.
    windowed: bool,
    /// All tokens over the whole run's wall time (the ramp-down included).
    overall: f64,
    ttft_p50: f64,
    ttft_p95: f64,
    per_client: f64,
    gflops: f64,
    widest: u64,
    /// Turns per model step, on average: below `clients` where requests
    /// start, end or prefill out of step with the others.
    mean_width: f64,
    /// Wall time per model step.
    step_ms: f64,
    /// Of that, the time in the engine (the model's pass and sampling).
    engine_ms: f64,
}

/// One client count, measured once: its clients stream their requests
/// together; the server's gauges give the steps it took.
fn measure(
    server: &onnx_genai_server::RunningServer,
    model: &str,
    clients: usize,
    opts: &Options,
    macs: u64,
) -> Result<Row> {
    server.reset_widest_step();
    let before = server.gauges();
    let started = Instant::now();
    let replies = run_clients(server.addr, model, clients, opts.turns, opts.max_tokens, opts.temperature, |c, t| {
        format!("Client {c} asks question {t}: tell me a story about")
    })?;
    let wall = started.elapsed().as_secs_f64();
    let after = server.gauges();
    let steps = after.steps.saturating_sub(before.steps).max(1) as f64;
    let all: Vec<&Reply> = replies.iter().flatten().collect();
    let overall = whole_run_rate(&replies, wall);
    let (tokens_per_s, windowed) = rate_or_whole_run(&replies, wall);
    let mut ttft: Vec<f64> = all.iter().map(|r| r.ttft * 1e3).collect();
    ttft.sort_by(f64::total_cmp);
    let per_client = all.iter().map(|r| r.tokens as f64 / r.secs).sum::<f64>() / all.len().max(1) as f64;
    Ok(Row {
        clients,
        tokens_per_s,
        windowed,
        overall,
        ttft_p50: percentile(&ttft, 0.5),
        ttft_p95: percentile(&ttft, 0.95),
        per_client,
        gflops: 2.0 * macs as f64 * tokens_per_s / 1e9,
        widest: after.widest_step,
        mean_width: after.stepped.saturating_sub(before.stepped) as f64 / steps,
        step_ms: wall * 1e3 / steps,
        engine_ms: after.step_nanos.saturating_sub(before.step_nanos) as f64 / 1e6 / steps,
    })
}

/// A client count over the rounds: each column's median, the aggregate's
/// and the ratio's range.
#[derive(Debug, PartialEq)]
struct Summary {
    /// The median of each column (the widest step: the widest of any round).
    row: Row,
    aggregate_range: (f64, f64),
    /// Aggregate tokens/s over the same round's first count (one client in
    /// the default sweep): median and range over the rounds.
    ratio: f64,
    ratio_range: (f64, f64),
    /// Rounds whose aggregate is the whole run's rate (no window where
    /// every client streamed): the report marks the cell.
    fallbacks: usize,
}

impl Summary {
    /// The aggregate's table cell: the median (with the rounds' range when
    /// there are several), marked where any round had no window where every
    /// client streamed and so counted its whole run instead.
    fn aggregate_cell(&self, rounds: usize) -> String {
        let mut cell = spread(format!("{:.1}", self.row.tokens_per_s), self.aggregate_range, 1, "", rounds);
        if self.fallbacks > 0 {
            cell += &format!(" † {} of {}", self.fallbacks, rounds.max(1));
        }
        cell
    }
}

/// A table cell's `value` with the rounds' range beside it (`digits`
/// decimals, `unit` after the upper end) when there are several rounds.
fn spread(value: String, (lo, hi): (f64, f64), digits: usize, unit: &str, rounds: usize) -> String {
    if rounds > 1 {
        format!("{value} ({lo:.digits$}–{hi:.digits$}{unit})")
    } else {
        value
    }
}

/// The median (the upper one of an even count, as the benches take it):
/// of the rounds, and of the interference check's rounds.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

pub(crate) fn range(v: &[f64]) -> (f64, f64) {
    v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(*x), hi.max(*x)))
}

/// Per client count (in sweep order), the rounds' medians; every round
/// holds the same counts in the same order.
fn summarize(rounds: &[Vec<Row>]) -> Vec<Summary> {
    let counts = rounds.first().map_or(0, Vec::len);
    (0..counts)
        .map(|i| {
            let column = |f: fn(&Row) -> f64| median(rounds.iter().map(|r| f(&r[i])).collect());
            let aggregates: Vec<f64> = rounds.iter().map(|r| r[i].tokens_per_s).collect();
            let ratios: Vec<f64> = rounds.iter().map(|r| r[i].tokens_per_s / r[0].tokens_per_s).collect();
            let row = Row {
                clients: rounds[0][i].clients,
                tokens_per_s: column(|r| r.tokens_per_s),
                windowed: rounds.iter().all(|r| r[i].windowed),
                overall: column(|r| r.overall),
                ttft_p50: column(|r| r.ttft_p50),
                ttft_p95: column(|r| r.ttft_p95),
                per_client: column(|r| r.per_client),
                gflops: column(|r| r.gflops),
                widest: rounds.iter().map(|r| r[i].widest).max().unwrap_or(0),
                mean_width: column(|r| r.mean_width),
                step_ms: column(|r| r.step_ms),
                engine_ms: column(|r| r.engine_ms),
            };
            let ratio_range = range(&ratios);
            let fallbacks = rounds.iter().filter(|r| !r[i].windowed).count();
            Summary { row, aggregate_range: range(&aggregates), ratio: median(ratios), ratio_range, fallbacks }
        })
        .collect()
}

pub fn run(opts: Options) -> Result<()> {
    let lib = ort::provision()?;
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    let kind: BackendKind = opts.backend.parse().map_err(anyhow::Error::msg)?;
    let kv: onnx_genai_engine::KvCache = opts.kv_cache.parse().map_err(anyhow::Error::msg)?;
    let engine = Engine::open_with(&opts.package, kind, opts.threads, kv)
        .with_context(|| format!("opening {}", opts.package.display()))?
        .with_scheduler(Scheduler::new(4 << 30))
        .with_prefill_chunk(256);
    let model = engine.package().manifest.name.clone();
    // Multiply-adds per generated token, for the GFLOP/s column.
    let plan = onnx_genai_native::compile_package(engine.package()).ok();
    let macs = plan.as_ref().map_or(0, |p| p.projection_macs());
    let isa = onnx_genai_native::kernels::isa::Isa::best();
    let int8 = plan.as_ref().is_some_and(|p| p.int8_projections());
    let peaks = Peaks::measure(isa, int8, opts.threads.max(1));
    let server = onnx_genai_server::start_with(vec![engine], "127.0.0.1:0", Default::default())?;
    let addr = server.addr;
    println!(
        "==> {model} on {} ({} threads, KV cache {kv}), max_tokens {}, temperature {}, peak {}",
        kind.name(),
        opts.threads,
        opts.max_tokens,
        opts.temperature,
        peaks.said()
    );
    // One unmeasured round at the widest client count first: the first
    // requests a fresh server answers fault in the KV blocks' pages and warm
    // every code path (a cold first point read one client's TTFT p95 at 435
    // ms against 16-33 ms warm and its aggregate at 195.3 against 286.1
    // tok/s, which inflated every "x one client" ratio after it).
    let widest = opts.clients.iter().copied().max().unwrap_or(1);
    run_clients(addr, &model, widest, 1, opts.max_tokens, opts.temperature, |c, _| {
        format!("Warm-up {c}: tell me a story about")
    })
    .context("the warm-up round")?;
    let mut rounds: Vec<Vec<Row>> = Vec::new();
    for round in 0..opts.rounds.max(1) {
        if opts.rounds > 1 {
            println!("round {} of {}", round + 1, opts.rounds);
        }
        let mut rows = Vec::new();
        for &clients in &opts.clients {
            let row = measure(&server, &model, clients, &opts, macs)?;
            println!(
                "{clients:>3} clients: {:>8.1} tok/s aggregate, {:>6.1} tok/s per client, TTFT p50 {:.0} ms p95 {:.0} ms",
                row.tokens_per_s, row.per_client, row.ttft_p50, row.ttft_p95
            );
            rows.push(row);
        }
        rounds.push(rows);
    }
    let summary = summarize(&rounds);
    let i = interference(&server, &model, opts.max_tokens)?;
    server.stop();
    let rounds_said = if opts.rounds > 1 {
        format!(
            " The sweep ran {} times in turn: each column is the median of the rounds, the aggregate's and the \
             ratio's range beside it (a ratio is taken within its round).",
            opts.rounds
        )
    } else {
        String::new()
    };
    let mut md = format!(
        "# Load: {model}\n\n{} on {} thread(s), KV cache `{kv}`, streaming `/v1/completions`, max_tokens {}, temperature {}, {} request(s) per \
         client; clients start together, after one unmeasured warm-up round at the widest count.{rounds_said} Aggregate \
         tok/s: the tokens that arrived while every client was streaming, over that time (from the last client's \
         first token to the first client's last: at the end, clients whose answers stopped early, at an end of \
         text, wait for the others, and fewer than the count run); overall tok/s: every token over the whole \
         run's wall time, that wait included. G op/s = 2 x projection multiply-adds per token ({:.1} M) x aggregate \
         tokens/s; the peak of the projections' arithmetic at {} thread(s): {} (% of peak: against the path a row's \
         mean step width runs). Mean \
         width: the turns a model step advanced on average (a newcomer's prompt chunk counts as one); ms/step: the \
         wall time over the model steps run; engine ms/step: of that, the time in the engine's steps (the model's pass \
         and sampling), the rest being the server's own work and waits.\n\n\
         | clients | aggregate tok/s | x one client | overall tok/s | per-client tok/s | TTFT p50 ms | TTFT p95 ms | G op/s | % of peak | widest step | mean width | ms/step | engine ms/step |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        kind.name(),
        opts.threads,
        opts.max_tokens,
        opts.temperature,
        opts.turns,
        macs as f64 / 1e6,
        opts.threads,
        peaks.said()
    );
    for s in &summary {
        let r = &s.row;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} | {:.0}% | {} | {:.1} | {:.2} | {:.2} |",
            r.clients,
            s.aggregate_cell(opts.rounds),
            spread(format!("{:.2}x", s.ratio), s.ratio_range, 2, "x", opts.rounds),
            r.overall,
            r.per_client,
            r.ttft_p50,
            r.ttft_p95,
            r.gflops,
            100.0 * r.gflops / (2.0 * peaks.at_width(r.mean_width) / 1e9),
            r.widest,
            r.mean_width,
            r.step_ms,
            r.engine_ms
        );
    }
    if summary.iter().any(|s| s.fallbacks > 0) {
        md += "\n† In that many rounds no time had every client streaming (a client received no text, or finished \
               before another's first token): those rounds' aggregate is the whole run's rate, as overall tok/s, and so are \
               the ratio to one client, the G op/s and the share of the peak taken from it.\n";
    }
    let _ = write!(
        md,
        "\nSession churn: a request's latency {:.1} ms alone, {:.1} ms while another client creates and closes \
         sessions in a loop ({:+.1} ms).\n\nA client that stops reading its stream (the server parked its turn \
         {:.1} s after it stopped, once the socket buffers between them were full): two reading clients make \
         {:.1} tok/s alone and {:.1} tok/s beside it (medians of {INTERFERENCE_ROUNDS} rounds), a change of \
         {:+.1}% (the median of each round's own change, range {:+.1}% to {:+.1}%; a round runs the pair alone and \
         beside it back to back, in alternating order; each run counted while both stream{}).\n\nKernels: {isa}.\n",
        i.alone_ms,
        i.churned_ms,
        i.churned_ms - i.alone_ms,
        i.parked_after_s,
        i.readers,
        i.beside,
        i.change.0,
        i.change.1 .0,
        i.change.1 .1,
        match i.fallbacks {
            0 => String::new(),
            n => format!("; {n} of {} runs had no such time and count their whole run", 2 * INTERFERENCE_ROUNDS),
        }
    );
    println!("\n{md}");
    let out = util::target().join("load");
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("sweep.md"), &md)?;
    println!("report: {}", out.join("sweep.md").display());
    Ok(())
}

/// The ceiling of an export's own arithmetic, in multiply-adds per second
/// at the thread count served: integer dot products for int8 activations
/// (`accuracy_level` 4) where this CPU has VNNI, else f32 FMAs — and, where
/// it has AMX, the tile products that steps of [`AMX_MIN_ROWS`] rows or
/// more run on (narrower steps stay on VNNI, so their share of a peak is
/// of VNNI's).
struct Peaks {
    narrow: (f64, &'static str),
    /// The AMX peak, for steps of at least `AMX_MIN_ROWS` rows.
    wide: Option<(f64, &'static str)>,
}

impl Peaks {
    fn measure(isa: onnx_genai_native::kernels::isa::Isa, int8: bool, threads: usize) -> Self {
        use onnx_genai_native::kernels::isa::{peak_int8_macs, peak_macs, Isa};
        let f32_fma = || (peak_macs(isa, threads), "f32 FMA");
        if !int8 {
            return Self { narrow: f32_fma(), wide: None };
        }
        let (vnni, amx) = if isa == Isa::Avx512Amx {
            (peak_int8_macs(Isa::Avx512Vnni, threads), peak_int8_macs(isa, threads))
        } else {
            (peak_int8_macs(isa, threads), None)
        };
        Self { narrow: vnni.map_or_else(f32_fma, |p| (p, "int8 VNNI")), wide: amx.map(|p| (p, "int8 AMX")) }
    }

    /// The peak of the path a step of `width` rows (a mean) runs.
    fn at_width(&self, width: f64) -> f64 {
        match self.wide {
            Some((peak, _)) if width >= AMX_MIN_ROWS as f64 => peak,
            _ => self.narrow.0,
        }
    }

    fn said(&self) -> String {
        let narrow = format!("{} {:.1} G op/s", self.narrow.1, 2.0 * self.narrow.0 / 1e9);
        match self.wide {
            Some((peak, kind)) => {
                format!(
                    "{narrow} below {AMX_MIN_ROWS} rows a step, {kind} {:.1} G op/s from {AMX_MIN_ROWS}",
                    2.0 * peak / 1e9
                )
            }
            None => narrow,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A sweep's arguments are checked before anything is built or served:
    /// turns outside 1..=4 and client counts that are not positive numbers
    /// are refused with the flag named; the defaults and a valid sweep pass.
    #[test]
    fn sweep_arguments_are_checked_before_the_run() {
        assert_eq!(shape("1,2,4,8,16", None).expect("the default sweep"), (vec![1, 2, 4, 8, 16], SWEEP_TURNS));
        assert_eq!(shape(" 1, 8 ", Some(1)).expect("spaces and one turn"), (vec![1, 8], 1));
        assert_eq!(shape("16", Some(MAX_SWEEP_TURNS)).expect("the most turns"), (vec![16], MAX_SWEEP_TURNS));
        for turns in [0, MAX_SWEEP_TURNS + 1, 9] {
            let err = shape("1,8", Some(turns)).expect_err("turns out of range").to_string();
            assert!(err.contains("--turns") && err.contains(&format!("got {turns}")), "{err}");
        }
        for sweep in ["", "1,,8", "0,8", "1,x", "-1"] {
            let err = shape(sweep, None).expect_err("a bad sweep").to_string();
            assert!(err.contains("--sweep") && err.contains(sweep), "{err}");
        }
    }

    /// A row's share of the peak is of the path its steps run: below
    /// `AMX_MIN_ROWS` rows a step the int8 projections stay on VNNI, from
    /// there on they run on AMX tiles (the report once held one client's
    /// VNNI steps against the AMX peak, 3.7 times VNNI's on the Intel Xeon
    /// it ran on); without AMX every width has the one peak.
    #[test]
    fn a_rows_peak_is_its_paths() {
        let amx = Peaks { narrow: (1e9, "int8 VNNI"), wide: Some((8e9, "int8 AMX")) };
        let below = AMX_MIN_ROWS as f64 - 0.1;
        assert_eq!(amx.at_width(1.0), 1e9);
        assert_eq!(amx.at_width(below), 1e9);
        assert_eq!(amx.at_width(AMX_MIN_ROWS as f64), 8e9);
        assert_eq!(amx.at_width(16.0), 8e9);
        let vnni = Peaks { narrow: (1e9, "int8 VNNI"), wide: None };
        assert_eq!(vnni.at_width(16.0), 1e9);
        assert!(amx.said().contains("int8 VNNI 2.0 G op/s") && amx.said().contains("int8 AMX 16.0 G op/s"));
    }

    fn row(clients: usize, tokens_per_s: f64, widest: u64) -> Row {
        Row {
            clients,
            tokens_per_s,
            windowed: true,
            overall: tokens_per_s * 0.9,
            ttft_p50: tokens_per_s / 10.0,
            ttft_p95: 0.0,
            per_client: 0.0,
            gflops: 0.0,
            widest,
            mean_width: clients as f64,
            step_ms: 1.0,
            engine_ms: 0.9,
        }
    }

    /// `--rounds`: each ratio is taken within its round (a busy round slows
    /// its one client and its eight alike), then the rounds' median; the
    /// aggregate is the median with its range; the widest step the widest.
    #[test]
    fn rounds_report_medians_of_per_round_ratios() {
        let rounds = vec![
            vec![row(1, 100.0, 1), row(8, 350.0, 8)],
            vec![row(1, 50.0, 1), row(8, 200.0, 7)],
            vec![row(1, 90.0, 1), row(8, 270.0, 8)],
        ];
        let s = summarize(&rounds);
        assert_eq!(s.len(), 2);
        assert_eq!(s[1].row.clients, 8);
        assert_eq!(s[1].row.tokens_per_s, 270.0, "median aggregate");
        assert_eq!(s[1].row.overall, 243.0, "median overall, its own column");
        assert_eq!(s[1].aggregate_range, (200.0, 350.0));
        // Ratios 3.5, 4.0, 3.0: median 3.5 — not 270 / 90 = 3.0 (medians
        // divided) nor 820 / 240.
        assert_eq!(s[1].ratio, 3.5);
        assert_eq!(s[1].ratio_range, (3.0, 4.0));
        assert_eq!(s[0].ratio, 1.0);
        assert_eq!(s[1].row.widest, 8);
        assert_eq!(s[1].row.ttft_p50, 27.0, "every other column: its median");
        // An even count of rounds: the upper middle one, as the benches'
        // medians.
        let two = summarize(&rounds[..2]);
        assert_eq!(two[1].row.tokens_per_s, 350.0);
        assert_eq!(two[1].ratio, 4.0);
    }

    /// Replies of `tokens` tokens each, one text event a token, the events
    /// `gap` ms apart from `from` ms after `t0`.
    fn replies(t0: Instant, from: u64, gap: u64, lengths: &[usize]) -> Vec<Reply> {
        let mut at = from;
        lengths
            .iter()
            .map(|&n| {
                let events = (0..n)
                    .map(|_| {
                        at += gap;
                        t0 + Duration::from_millis(at)
                    })
                    .collect();
                Reply { ttft: 0.0, tokens: n, secs: 0.0, events }
            })
            .collect()
    }

    /// The load targets' "aggregate with N concurrent clients" is counted
    /// only while all N stream: not while the first prompts are read, nor
    /// while clients whose answers ended early wait for the last one.
    #[test]
    fn the_aggregate_counts_the_time_every_client_streams() {
        let t0 = Instant::now();
        let both = vec![replies(t0, 0, 10, &[10, 10]), replies(t0, 55, 10, &[4])];
        // Window (65, 95]: the last first token is client 1's at 65 ms, the
        // first last token client 1's at 95. Client 0's events 70, 80, 90
        // and client 1's 75, 85, 95 lie inside: 6 tokens in 30 ms.
        let rate = concurrent_rate(&both).expect("a window");
        assert!((rate - 200.0).abs() < 1e-6, "{rate}");
        // A reply of 2 tokens sent as one event counts both where it lands.
        let mut merged = both.clone();
        merged[1][0].tokens = 8;
        let rate = concurrent_rate(&merged).expect("a window");
        assert!((rate - (3.0 + 3.0 * 2.0) / 0.030).abs() < 1e-6, "{rate}");
        // One client: its whole span, less its first token.
        let one = vec![replies(t0, 0, 10, &[10, 10])];
        assert!((concurrent_rate(&one).expect("a window") - 19.0 / 0.190).abs() < 1e-6);
        // A client that finished before another started: no window.
        assert!(concurrent_rate(&[replies(t0, 0, 10, &[3]), replies(t0, 100, 10, &[3])]).is_none());
        // A client that received nothing: no window.
        assert!(concurrent_rate(&[replies(t0, 0, 10, &[3]), vec![Reply::default()]]).is_none());
    }

    /// A round with no time every client streamed counts its whole run
    /// (`measure`'s fallback); the aggregate's cell says in how many rounds,
    /// so a whole-run rate is never read as the concurrent one.
    #[test]
    fn a_whole_run_aggregate_is_marked() {
        let whole = Row { windowed: false, ..row(8, 200.0, 8) };
        let rounds = vec![vec![row(1, 100.0, 1), whole], vec![row(1, 90.0, 1), row(8, 270.0, 8)]];
        let s = summarize(&rounds);
        assert_eq!((s[0].fallbacks, s[1].fallbacks), (0, 1));
        assert!(!s[1].row.windowed);
        assert_eq!(s[0].aggregate_cell(2), "100.0 (90.0–100.0)");
        assert_eq!(s[1].aggregate_cell(2), "270.0 (200.0–270.0) † 1 of 2");
        let one = summarize(&[vec![Row { windowed: false, ..row(1, 50.0, 1) }]]);
        assert_eq!(one[0].aggregate_cell(1), "50.0 † 1 of 1");
    }

    /// The aggregate is the window's rate where there is one, and says so;
    /// with none (a client finished before another's first token, or
    /// received no text) it is every token over the run's wall time.
    #[test]
    fn a_rate_without_a_window_is_the_whole_runs_and_flagged() {
        let t0 = Instant::now();
        let both = vec![replies(t0, 0, 10, &[10, 10]), replies(t0, 55, 10, &[4])];
        assert_eq!(rate_or_whole_run(&both, 1.0), (concurrent_rate(&both).expect("a window"), true));
        let apart = vec![replies(t0, 0, 10, &[3]), replies(t0, 100, 10, &[5])];
        assert_eq!(rate_or_whole_run(&apart, 0.5), (16.0, false));
        let silent = vec![replies(t0, 0, 10, &[3]), vec![Reply::default()]];
        assert_eq!(rate_or_whole_run(&silent, 0.25), (12.0, false));
    }

    /// One round is the plain sweep: its own values, a zero-width range.
    #[test]
    fn one_round_is_the_sweep_itself() {
        let s = summarize(&[vec![row(1, 120.0, 1), row(2, 200.0, 2)]]);
        assert_eq!(s[1].row, row(2, 200.0, 2));
        assert_eq!((s[1].ratio, s[1].ratio_range), (200.0 / 120.0, (200.0 / 120.0, 200.0 / 120.0)));
    }
}
