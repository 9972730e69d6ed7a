//! `cargo xtask bench`: end-to-end decode speed of native-cpu against ONNX
//! Runtime, measured side by side in one run on the same package, variant
//! and thread count, reported as min/median and as a ratio of medians; and
//! time per token at context 64 vs 1024 (what the in-place KV cache buys).
//! Kernel-level benchmarks are criterion (`cargo bench -p onnx-genai-native`).

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::{Context as _, Result};
use onnx_genai_backend::Decoder;
use onnx_genai_engine::BackendKind;

use crate::{ort, util};

pub struct Options {
    pub threads: usize,
    pub rounds: usize,
    pub steps: usize,
    pub package: Option<String>,
}

/// Seconds per decode step: `rounds` rounds of `steps` greedy steps after a
/// prefill of `context` tokens; one median per round.
fn decode_times(b: &mut Decoder, context: usize, steps: usize, rounds: usize) -> Result<Vec<f64>> {
    let vocab = b.vocab_size() as u32;
    let prompt: Vec<u32> = (0..context as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut per_round = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        b.reset();
        let mut logits = b.forward(&prompt)?;
        let mut times = Vec::with_capacity(steps);
        for _ in 0..steps {
            let next = onnx_genai_engine::sampling::argmax(&logits);
            let t = Instant::now();
            logits = b.forward(&[next])?;
            times.push(t.elapsed().as_secs_f64());
        }
        per_round.push(median(&mut times));
    }
    Ok(per_round)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

struct Row {
    package: String,
    variant: &'static str,
    /// (min, median) seconds per token at context 64, per backend.
    ort64: (f64, f64),
    native64: (f64, f64),
    ort1024: f64,
    native1024: f64,
}

pub fn run(opts: Options) -> Result<()> {
    let lib = ort::provision()?;
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    let mut rows = Vec::new();
    for spec_path in onnx_genai_build::spec_files(&util::root().join("packages"))? {
        let mut spec = onnx_genai_build::read_spec(&spec_path)?;
        // Workflow (vision-language) packages have no decode core to race.
        if opts.package.as_ref().is_some_and(|p| *p != spec.name) || spec.vision.is_some() {
            continue;
        }
        // Room for the 1024-token context run.
        spec.max_sequence_length = 2048;
        // Only the export forms this family is built as (a gpt2 has no
        // `genai` form).
        for variant in spec.variants() {
            let dir = util::target().join("bench").join(&spec.name).join(variant.name());
            onnx_genai_build::build_variant(&spec, variant, &dir)?;
            let package = onnx_genai_package::Package::open(&dir)?;
            let measure = |kind: BackendKind| -> Result<(Vec<f64>, Vec<f64>)> {
                let mut b = kind
                    .decoder(&package, opts.threads)
                    .with_context(|| format!("{} on {}", kind.name(), spec.name))?;
                // Warm-up: first-run allocations and lazy initialisation.
                decode_times(&mut b, 8, 4, 1)?;
                let at64 = decode_times(&mut b, 64, opts.steps, opts.rounds)?;
                let at1024 = decode_times(&mut b, 1024, opts.steps.min(32), opts.rounds.min(3))?;
                Ok((at64, at1024))
            };
            let (ort64, ort1024) = measure(BackendKind::Ort)?;
            let (nat64, nat1024) = measure(BackendKind::NativeCpu)?;
            let row = Row {
                package: spec.name.clone(),
                variant: variant.name(),
                ort64: (min(&ort64), median(&mut ort64.clone())),
                native64: (min(&nat64), median(&mut nat64.clone())),
                ort1024: median(&mut ort1024.clone()),
                native1024: median(&mut nat1024.clone()),
            };
            println!(
                "{:<16} {:<10} ort {:>8.0} tok/s  native-cpu {:>8.0} tok/s  ratio {:.2}x",
                row.package,
                row.variant,
                1.0 / row.ort64.1,
                1.0 / row.native64.1,
                row.ort64.1 / row.native64.1
            );
            rows.push(row);
        }
    }
    let table = render(&rows, &opts);
    println!("\n{table}");
    let dir = util::target().join("bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("report.md"), &table)?;
    println!("report: {}", dir.join("report.md").display());
    Ok(())
}

fn render(rows: &[Row], opts: &Options) -> String {
    let mut s = format!(
        "# Decode benchmark\n\n{} thread(s) per backend, both backends measured in this run. Context 64: {} rounds x {} \
         decode steps; context 1024: {} rounds x {} steps. Times are seconds per decode step (one median per round; \
         min and median over rounds); speedup = ONNX Runtime median / native-cpu median.\n\n\
         | package | variant | ORT ms/token (min / median) | native-cpu ms/token (min / median) | native tok/s | speedup | \
         ORT ms/token ctx 64 -> 1024 | native ms/token ctx 64 -> 1024 |\n|---|---|---:|---:|---:|---:|---:|---:|\n",
        opts.threads,
        opts.rounds,
        opts.steps,
        opts.rounds.min(3),
        opts.steps.min(32)
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} / {:.3} | {:.3} / {:.3} | {:.0} | {:.2}x | {:.3} -> {:.3} | {:.3} -> {:.3} |",
            r.package,
            r.variant,
            r.ort64.0 * 1e3,
            r.ort64.1 * 1e3,
            r.native64.0 * 1e3,
            r.native64.1 * 1e3,
            1.0 / r.native64.1,
            r.ort64.1 / r.native64.1,
            r.ort64.1 * 1e3,
            r.ort1024 * 1e3,
            r.native64.1 * 1e3,
            r.native1024 * 1e3
        );
    }
    s
}
