//! The load's interference checks beside its sweep: the latency a short
//! request gains while sessions are created and closed, and what two
//! reading clients lose beside a client that stopped reading its stream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use onnx_genai_server::client::{call, Stream};
use serde_json::json;

use crate::load_sweep::{median, range, rate_or_whole_run, stream_one, Reply};

/// Rounds of the non-reader check (each runs the reader pair twice, alone
/// and beside the silent client, in alternating order: an even count, so
/// each order runs as often).
pub(crate) const INTERFERENCE_ROUNDS: usize = 6;

/// The non-reader's cost as the median of each round's own change (the
/// pair's rate beside the silent client against alone, in percent), and
/// the range of those changes. Each round's two runs are adjacent, so a
/// slow spell of the machine that covers one round moves both of its
/// runs; medians of each side over the rounds compare runs minutes apart.
fn paired_change(alone: &[f64], beside: &[f64]) -> (f64, (f64, f64)) {
    let changes: Vec<f64> = alone.iter().zip(beside).map(|(a, b)| 100.0 * (b / a - 1.0)).collect();
    let span = range(&changes);
    (median(changes), span)
}

/// What [`interference`] measured.
pub(crate) struct Interference {
    /// Median latency of a short request alone, and while sessions churn.
    pub(crate) alone_ms: f64,
    pub(crate) churned_ms: f64,
    /// Two reading clients' aggregate tokens/s alone, and beside a client
    /// that stopped reading (once its turn is parked): medians of the
    /// rounds.
    pub(crate) readers: f64,
    pub(crate) beside: f64,
    /// [`paired_change`] of the rounds: the median change and its range.
    pub(crate) change: (f64, (f64, f64)),
    /// How long after it stopped reading the server parked its turn
    /// (median of the rounds).
    pub(crate) parked_after_s: f64,
    /// Pair runs (of `2 * INTERFERENCE_ROUNDS`) with no time both readers
    /// streamed, counted over their whole run instead.
    pub(crate) fallbacks: usize,
}

/// Median latency of short requests alone and while sessions churn; the
/// aggregate tokens/s of two reading clients alone and next to a client
/// that stopped reading its stream.
pub(crate) fn interference(
    server: &onnx_genai_server::RunningServer,
    model: &str,
    max_tokens: u32,
) -> Result<Interference> {
    let addr = server.addr;
    let short = |n: usize| -> Result<f64> {
        let v: Vec<f64> = (0..n)
            .map(|i| stream_one(addr, model, &format!("Quick question {i}:"), 4, 0.0).map(|r| r.secs * 1e3))
            .collect::<Result<_>>()?;
        Ok(median(v))
    };
    let alone = short(9)?;
    let stop = Arc::new(AtomicBool::new(false));
    // Twenty sessions created and closed per second (a tight loop would
    // mostly measure the churning client's own CPU on a small machine).
    let churner = {
        let (stop, model) = (stop.clone(), model.to_string());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if let Ok(r) = call(addr, "POST", "/v1/sessions", &[], &json!({"model": model}).to_string()) {
                    if let Some(id) = r.json()["id"].as_str() {
                        let _ = call(addr, "DELETE", &format!("/v1/sessions/{id}"), &[], "");
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let churned = short(9)?;
    stop.store(true, Ordering::SeqCst);
    let _ = churner.join();
    // Counted as the sweep counts its aggregate: while both readers stream
    // (so a slow first token, the prompt's read, does not dilute either
    // side); where there is no such time, the pair's whole run.
    let pair = || -> Result<(f64, bool)> {
        let started = Instant::now();
        let hs: Vec<_> = (0..2)
            .map(|c| {
                let model = model.to_string();
                std::thread::spawn(move || {
                    // Four times the sweep's answers: a rate over a second
                    // or more, not a few hundred milliseconds of a noisy VM.
                    stream_one(addr, &model, &format!("Reader {c}: once upon a time"), 4 * max_tokens, 0.0)
                })
            })
            .collect();
        let replies: Vec<Vec<Reply>> = hs
            .into_iter()
            .map(|h| Ok(vec![h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??]))
            .collect::<Result<_>>()?;
        Ok(rate_or_whole_run(&replies, started.elapsed().as_secs_f64()))
    };
    // Rounds of the readers alone and beside a client that opens a long
    // stream and never reads it, the order alternating from round to
    // round; the cost is the median of the rounds' own changes. This check
    // compares two rates: one pair of runs on a small shared machine
    // differs by 10% on its own, and with every "alone" run first a slow
    // minute fell on one side only (two sweeps of one build read +1.8% and
    // -11.8%); with three rounds and medians of each side, runs of one
    // build on 2026-12-07 still read -15.1% to +11.5%.
    let body =
        json!({"model": model, "prompt": "A very long story:", "max_tokens": 4096, "temperature": 0, "stream": true});
    let wait_for = |what: &str, done: &dyn Fn(onnx_genai_server::Gauges) -> bool| -> Result<f64> {
        let since = Instant::now();
        while !done(server.gauges()) {
            if since.elapsed() > Duration::from_secs(120) {
                bail!("{what} within 120 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(since.elapsed().as_secs_f64())
    };
    let (mut alone_rates, mut beside_rates, mut noticed) = (Vec::new(), Vec::new(), Vec::new());
    let mut fallbacks = 0;
    for round in 0..INTERFERENCE_ROUNDS {
        for beside_silent in [round % 2 == 1, round % 2 == 0] {
            if !beside_silent {
                let (rate, windowed) = pair()?;
                alone_rates.push(rate);
                fallbacks += usize::from(!windowed);
                continue;
            }
            let silent = Stream::open(addr, "/v1/completions", &[], &body)?;
            // Until the socket buffers between it and the server fill, a
            // client that does not read is indistinguishable from one that
            // does; measure once the server has noticed (its turn parked).
            noticed.push(wait_for("the silent client's turn was not parked", &|g| g.parked > 0)?);
            let (rate, windowed) = pair()?;
            beside_rates.push(rate);
            fallbacks += usize::from(!windowed);
            drop(silent);
            wait_for("the silent client's turn did not end after it left", &|g| g.running == 0)?;
        }
    }
    let change = paired_change(&alone_rates, &beside_rates);
    let (readers, beside, noticed) = (median(alone_rates), median(beside_rates), median(noticed));
    Ok(Interference {
        alone_ms: alone,
        churned_ms: churned,
        readers,
        beside,
        change,
        parked_after_s: noticed,
        fallbacks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The non-reader's cost compares each round's two adjacent runs: a
    /// slow round that lowers both of its runs moves no change, where the
    /// medians of each side, taken apart, would read one (here +5 % from
    /// rounds that each lost or gained 5 %).
    #[test]
    fn the_non_reader_cost_is_the_median_of_paired_changes() {
        let (alone, beside) = ([100.0, 200.0, 100.0], [95.0, 190.0, 105.0]);
        let (change, (lo, hi)) = paired_change(&alone, &beside);
        assert!(
            (change + 5.0).abs() < 1e-9 && (lo + 5.0).abs() < 1e-9 && (hi - 5.0).abs() < 1e-9,
            "{change} {lo} {hi}"
        );
        assert!((median(beside.to_vec()) / median(alone.to_vec()) - 1.05).abs() < 1e-9);
    }
}
