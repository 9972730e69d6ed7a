//! `cargo xtask bench --real`: prefill and decode tokens/s of native-cpu and
//! ONNX Runtime on every export of the real models, side by side in one
//! run; this machine's streaming read bandwidth and the roofline bound it
//! puts on decoding (bandwidth / bytes read per token); and the error of
//! the 4-bit export against f32.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::{Context as _, Result};
use onnx_genai_backend::Decoder;
use onnx_genai_engine::BackendKind;
use onnx_genai_package::{ElementType, Package};

use crate::{ort, real, util};

pub(crate) const PREFILL: usize = 128;
/// Prefills a round times, taking the median (the upper, as decode's
/// steps): one prefill of a tiny package is half a millisecond, and a
/// round that met one of this VM's stalls (about 9 ms, now and then) read
/// as a tenth of the others' rate — on the peers' side as on ours (the
/// peer scripts are given this count).
pub(crate) const PREFILL_REPEATS: usize = 5;
pub(crate) const CONTEXT: usize = 64;

/// `(min, median)` of `v`.
pub(crate) fn min_median(v: Vec<f64>) -> (f64, f64) {
    let rates = Rates::of(v);
    (rates.min, rates.median)
}

/// Read rates (bytes/s) over a probe's passes.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Rates {
    min: f64,
    median: f64,
    /// The fastest pass: what the rooflines divide, because a ceiling is
    /// the most the machine was seen to do — on a VM whose neighbours come
    /// and go, a median pass sits below what a decoder catches in a quiet
    /// moment, and a decode then read as above its roofline though every
    /// byte was counted (f16, 2026-12-05: 106 % of a median re-read rate).
    best: f64,
}

impl Rates {
    fn of(mut rates: Vec<f64>) -> Self {
        rates.sort_by(f64::total_cmp);
        Rates { min: rates[0], median: rates[rates.len() / 2], best: rates[rates.len() - 1] }
    }
}

/// Streaming read bandwidth (bytes/s) over `passes`: `threads` threads at
/// once, each summing its own part of a buffer of `bytes`, `reps` times
/// per pass. Run at the backends' thread count over 512 MiB, it is the
/// bound a decoder that reads every weight once per token cannot beat;
/// over a few MiB (read again and again) it is the rate of data the
/// last-level cache holds, reported beside it.
fn read_bandwidth(threads: usize, bytes: usize, reps: usize, passes: usize) -> Rates {
    let threads = threads.max(1);
    let words = bytes / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let part = words.div_ceil(threads);
    let mut rates = Vec::new();
    for _ in 0..passes {
        let t = Instant::now();
        std::thread::scope(|scope| {
            for slice in buffer.chunks(part) {
                scope.spawn(move || {
                    // Eight independent sums keep the loop bound by memory,
                    // not by the add latency.
                    let mut acc = [0u64; 8];
                    for _ in 0..reps {
                        for (line, c) in slice.chunks_exact(8).enumerate() {
                            prefetch_ahead(slice, line);
                            for (a, v) in acc.iter_mut().zip(c) {
                                *a = a.wrapping_add(*v);
                            }
                        }
                    }
                    std::hint::black_box(acc);
                });
            }
        });
        rates.push((words * 8 * reps) as f64 / t.elapsed().as_secs_f64());
    }
    Rates::of(rates)
}

/// Lines (of 8 words) the probe fetches ahead of the one it reads.
const PREFETCH_LINES: usize = 64;

/// Asks for line `line + PREFETCH_LINES` of `slice` into L2, as the native
/// kernels fetch the weights they read next: without it one thread's probe
/// is bound by the misses the core keeps in flight on its own, below what
/// a fetching decoder streams (one thread re-read 101 MB at 14.9 GB/s while
/// the int4 export's decode streamed them at 21).
#[inline(always)]
fn prefetch_ahead(slice: &[u64], line: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let ahead = slice.as_ptr().wrapping_add((line + PREFETCH_LINES) * 8);
        // SAFETY: a prefetch is a hint: it never faults, whatever the
        // address, and reads nothing the program sees.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(ahead.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, line);
}

/// The rate (bytes/s, the fastest of 5 passes) at which `threads` threads
/// re-read a buffer of `bytes`, as a decoder re-reads its weights step
/// after step: from memory when they exceed the last-level cache, from the
/// cache when they fit (on a virtual machine whose cache is shared with
/// others, partly either). Each pass reads about 2 GB.
fn working_set_bandwidth(threads: usize, bytes: f64) -> f64 {
    let bytes = (bytes as usize).max(threads.max(1) * 64);
    let reps = ((2usize << 30) / bytes).max(1);
    read_bandwidth(threads, bytes, reps, 5).best
}

/// A decoding rate above this share of the roofline means the byte count
/// or the bandwidth is wrong (a weight read from cache, a table counted
/// that is not read), so the report flags it instead of trusting it.
const ROOFLINE_LIMIT: f64 = 1.0;

#[derive(Clone, Copy, Debug)]
pub(crate) struct Speed {
    /// Prefill tokens/s `(min, median)` and decode tokens/s `(min, median)`.
    pub prefill: (f64, f64),
    pub decode: (f64, f64),
}

impl Speed {
    /// The (min, median) of each round's rates: the min is the slowest
    /// round.
    pub(crate) fn of(prefill: Vec<f64>, decode: Vec<f64>) -> Self {
        Speed { prefill: min_median(prefill), decode: min_median(decode) }
    }
}

pub(crate) fn measure(b: &mut Decoder, rounds: usize, steps: usize) -> Result<Speed> {
    warm_up(b, steps)?;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (p, d) = round(b, steps)?;
        prefill.push(p);
        decode.push(d);
    }
    Ok(Speed::of(prefill, decode))
}

/// The prompt every runtime is fed: ids `(i * 7919 + 13) mod vocab`.
fn prompt(b: &Decoder) -> Vec<u32> {
    let vocab = b.vocab_size() as u32;
    (0..PREFILL as u32).map(|i| (i * 7919 + 13) % vocab).collect()
}

/// One round untimed before the timed ones, as the peer scripts do: every
/// buffer grown to its size first (a short warm-up left that to the first
/// timed prefill, which then ran at a tenth of the others' rate on the
/// tiny packages, and so did a whole round's decode now and then).
pub(crate) fn warm_up(b: &mut Decoder, steps: usize) -> Result<()> {
    round(b, steps).map(|_| ())
}

/// One round: prefill tokens/s of the whole prompt from an empty cache
/// (the median of `PREFILL_REPEATS`), and decode tokens/s (1 / the median
/// step) of `steps` greedy steps after a `CONTEXT`-token context.
pub(crate) fn round(b: &mut Decoder, steps: usize) -> Result<(f64, f64)> {
    let prompt = prompt(b);
    let mut prefills = Vec::with_capacity(PREFILL_REPEATS);
    for _ in 0..PREFILL_REPEATS {
        b.reset();
        let t = Instant::now();
        b.forward(&prompt)?;
        prefills.push(t.elapsed().as_secs_f64());
    }
    let prefill = PREFILL as f64 / min_median(prefills).1;
    b.reset();
    let mut logits = b.forward(&prompt[..CONTEXT])?;
    let mut per_step = Vec::new();
    for _ in 0..steps {
        let next = onnx_genai_engine::sampling::argmax(&logits);
        let t = Instant::now();
        logits = b.forward(&[next])?;
        per_step.push(t.elapsed().as_secs_f64());
    }
    Ok((prefill, 1.0 / min_median(per_step).1))
}

/// Bytes a decode step reads: every weight once, except tables that are
/// only gathered from (an embedding reads one row per token; a table the
/// output projection also multiplies by, as a tied one, is read whole
/// once), plus the KV cache at `CONTEXT`.
fn bytes_per_token(package: &Package) -> Result<f64> {
    let (_, path) = package.decoder()?;
    let model = onnx_genai_onnx::read_model(path).with_context(|| format!("reading {}", path.display()))?;
    let graph = &model.graph;
    let gathered_only = |name: &str| {
        let mut uses = graph.nodes.iter().flat_map(|n| n.inputs.iter().enumerate().map(move |(i, x)| (n, i, x)));
        let mut any = false;
        let only = uses.all(|(node, slot, input)| {
            if input != name {
                return true;
            }
            any = true;
            // Gather's table is input 0; GatherBlockQuantized's data, scales
            // and zero points are inputs 0, 2 and 3 (1 is the indices).
            matches!((node.op_type.as_str(), slot), ("Gather", 0) | ("GatherBlockQuantized", 0 | 2 | 3))
        });
        any && only
    };
    let weights: f64 = graph
        .initializers
        .iter()
        .map(|t| {
            let bytes = t.raw.len() as f64;
            let rows = t.dims.first().copied().unwrap_or(1).max(1) as f64;
            if gathered_only(&t.name) {
                bytes / rows
            } else {
                bytes
            }
        })
        .sum();
    let kv = package.kv_geometry().map(|g| g.bytes_per_token()).unwrap_or(0) * CONTEXT as u64;
    Ok(weights + kv as f64)
}

/// Bytes a native-cpu decode step reads: the projection weights as its
/// plan packed them (narrowed where exact: the int4 export's f32 output
/// projection is 8-bit there, its Q4_1 sides f16), plus the KV cache at
/// `CONTEXT` — the rest (norm weights, one embedding row) is below 0.1 %.
/// ONNX Runtime reads the package's bytes ([`bytes_per_token`]); each
/// backend's roofline is its own.
fn native_bytes_per_token(package: &Package) -> Result<f64> {
    let plan = onnx_genai_native::compile_package(package)?;
    let kv = package.kv_geometry().map(|g| g.bytes_per_token()).unwrap_or(0) * CONTEXT as u64;
    Ok((plan.projection_bytes() + kv) as f64)
}

/// A share of the roofline as the report prints it: flagged above
/// [`ROOFLINE_LIMIT`].
fn share(of_roofline: f64) -> String {
    if of_roofline > ROOFLINE_LIMIT {
        format!("{:.0}% ⚠ above: roofline model wrong here", 100.0 * of_roofline)
    } else {
        format!("{:.0}%", 100.0 * of_roofline)
    }
}

/// Largest |logit difference| of `b` against `a` over greedy decoding
/// driven by `a`, and how many of the greedy choices agree.
fn logit_error(a: &mut Decoder, b: &mut Decoder, prompt: &[u32], steps: usize) -> Result<(f32, usize)> {
    a.reset();
    b.reset();
    let (mut la, mut lb) = (a.forward(prompt)?, b.forward(prompt)?);
    let (mut worst, mut agree) = (0f32, 0);
    for _ in 0..steps {
        worst = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(worst, f32::max);
        let next = onnx_genai_engine::sampling::argmax(&la);
        agree += usize::from(next == onnx_genai_engine::sampling::argmax(&lb));
        la = a.forward(&[next])?;
        lb = b.forward(&[next])?;
    }
    Ok((worst, agree))
}

pub fn run(threads: usize, rounds: usize, steps: usize) -> Result<()> {
    let lib = ort::provision()?;
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    // The memory roofline: a buffer larger than the last-level cache.
    let memory = read_bandwidth(threads, 512 << 20, 1, 5);
    // 4 MiB per thread, well inside any last-level cache these machines have.
    let cached = read_bandwidth(threads, threads.max(1) * (4 << 20), 64, 5).best;
    println!(
        "streaming read bandwidth ({threads} threads): min {:.1} GB/s, median {:.1} GB/s, best {:.1} GB/s; cache-resident {:.1} GB/s",
        memory.min / 1e9,
        memory.median / 1e9,
        memory.best / 1e9,
        cached / 1e9
    );
    let mut md = format!(
        "# Real-model benchmark\n\n{threads} thread(s) per backend, both backends in this run; prefill of {PREFILL} \
         tokens, decode of {steps} steps after a {CONTEXT}-token context, {rounds} rounds (min / median tokens/s). \
         Streaming read bandwidth (each thread fetching 4 KiB ahead into L2, as the kernels fetch their next \
         weights), {threads} thread(s) at once over 512 MiB, 5 passes: min {:.1} / median {:.1} / \
         best {:.1} GB/s (cache-resident, 4 MiB per thread: {:.1} GB/s, best pass). Every roofline divides a \
         probe's fastest pass: a ceiling is the most the machine was seen to do. Bytes a decode step reads: every weight once, a \
         gathered-only table one row, KV at context {CONTEXT}, for each backend its own (ONNX Runtime reads the \
         package's weights, native-cpu its plan's packed ones, narrowed where that is exact). Memory roofline = \
         the 512 MiB bandwidth / those bytes; cache roofline = the cache-resident bandwidth / the same bytes (the \
         ceiling were every weight in the last-level cache). Roofline = the bandwidth at which the same threads \
         re-read a buffer of exactly those bytes again and again, as decoding re-reads its weights (from memory \
         when they exceed the last-level cache, from the cache when they fit), / those bytes: the bound that \
         holds on this machine whatever its cache; a rate above 100 % of it is flagged: the byte count is then \
         wrong. Above 100 % of the memory roofline, weights were served from the cache.\n\n\
         | export | bytes/token ORT / native | re-read GB/s ORT / native | roofline tok/s ORT / native | \
         memory roofline tok/s ORT / native | cache roofline tok/s ORT / native | \
         ORT decode tok/s | native decode tok/s | decode ratio | % roofline ORT / native | \
         % memory roofline ORT / native | ORT prefill tok/s | native prefill tok/s | prefill ratio |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        memory.min / 1e9,
        memory.median / 1e9,
        memory.best / 1e9,
        cached / 1e9
    );
    for model in real::models()? {
        let dirs = real::ensure_built(&model)?;
        for (export, dir) in &dirs {
            let package = Package::open(dir)?;
            let per_token = bytes_per_token(&package)?;
            let native_per_token = native_bytes_per_token(&package)?;
            let (reread, native_reread) =
                (working_set_bandwidth(threads, per_token), working_set_bandwidth(threads, native_per_token));
            let (roofline, native_roofline) = (reread / per_token, native_reread / native_per_token);
            let mut speeds = Vec::new();
            for kind in [BackendKind::Ort, BackendKind::NativeCpu] {
                let mut b =
                    kind.decoder(&package, threads).with_context(|| format!("{} on {}", kind.name(), dir.display()))?;
                speeds.push(measure(&mut b, rounds, steps)?);
            }
            let (o, n) = (&speeds[0], &speeds[1]);
            let name = model.package(export);
            println!(
                "{name:<28} decode ort {:>6.1} native {:>6.1} tok/s ({:.2}x); prefill ort {:>6.0} native {:>6.0} tok/s ({:.2}x); roofline ort {:.1} native {:.1}",
                o.decode.1, n.decode.1, n.decode.1 / o.decode.1, o.prefill.1, n.prefill.1, n.prefill.1 / o.prefill.1, roofline, native_roofline
            );
            let _ = writeln!(
                md,
                "| {name} | {:.0} / {:.0} MB | {:.1} / {:.1} | {roofline:.1} / {native_roofline:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2}x | {} / {} | {:.0}% / {:.0}% | {:.0} / {:.0} | {:.0} / {:.0} | {:.2}x |",
                per_token / 1e6,
                native_per_token / 1e6,
                reread / 1e9,
                native_reread / 1e9,
                memory.best / per_token,
                memory.best / native_per_token,
                cached / per_token,
                cached / native_per_token,
                o.decode.0,
                o.decode.1,
                n.decode.0,
                n.decode.1,
                n.decode.1 / o.decode.1,
                share(o.decode.1 / roofline),
                share(n.decode.1 / native_roofline),
                100.0 * o.decode.1 / (memory.best / per_token),
                100.0 * n.decode.1 / (memory.best / native_per_token),
                o.prefill.0,
                o.prefill.1,
                n.prefill.0,
                n.prefill.1,
                n.prefill.1 / o.prefill.1
            );
        }
        // The 4-bit export against f32, both on ONNX Runtime.
        let f32_dir = dirs
            .iter()
            .find(|(e, _)| e.dtype == ElementType::F32 && e.variant == onnx_genai_build::Variant::Decomposed);
        let int4_dir = dirs.iter().find(|(e, _)| e.variant == onnx_genai_build::Variant::Contrib);
        if let (Some((_, f)), Some((int4, q))) = (f32_dir, int4_dir) {
            let (pf, pq) = (Package::open(f)?, Package::open(q)?);
            let mut a = BackendKind::Ort.decoder(&pf, threads)?;
            let mut b = BackendKind::Ort.decoder(&pq, threads)?;
            let _ = writeln!(md, "\n4-bit export ({}) against f32, ONNX Runtime, 32 greedy steps driven by f32:\n\n| prompt | max abs logit error | greedy agreement |\n|---|---:|---:|", model.package(int4));
            for p in &model.prompts {
                let ids = pf
                    .tokenizer()
                    .encode(p.text.as_str(), false)
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .get_ids()
                    .to_vec();
                let (worst, agree) = logit_error(&mut a, &mut b, &ids, 32)?;
                println!("int4 vs f32 on `{}`: max |d| {worst:.2e}, greedy agreement {agree}/32", p.name);
                let _ = writeln!(md, "| {} | {worst:.2e} | {agree}/32 |", p.name);
            }
        }
    }
    let dir = util::target().join("bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("real.md"), &md)?;
    println!("\n{md}\nreport: {}", dir.join("real.md").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bench row reports each series' slowest round and its median,
    /// prefill and decode each from its own rounds (watched red with the
    /// series swapped).
    #[test]
    fn a_speed_is_each_series_min_and_median() {
        let speed = Speed::of(vec![300.0, 100.0, 200.0], vec![5.0, 4.0, 6.0]);
        assert_eq!(speed.prefill, (100.0, 200.0));
        assert_eq!(speed.decode, (4.0, 5.0));
    }

    /// Pins issue 15's "a roofline that holds" on a noisy VM: the rooflines
    /// divide a probe's fastest pass (a ceiling), with its slowest and
    /// median beside it for the report.
    #[test]
    fn a_probe_reports_its_fastest_pass_as_the_ceiling() {
        let rates = Rates::of(vec![31.3e9, 28.1e9, 34.8e9, 30.1e9, 29.0e9]);
        assert_eq!(rates, Rates { min: 28.1e9, median: 30.1e9, best: 34.8e9 });
    }
}
