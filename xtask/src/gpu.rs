//! native-cuda on a machine with an NVIDIA GPU.
//!
//! `cargo xtask gpu-trace`: every tiny package, every variant, run step by
//! step on native-cuda and on native-cpu over the same (row-form) plan; the
//! first step whose output parts from the CPU's names the kernel at fault.
//!
//! `cargo xtask bench --backend native-cuda`: decode (batch 1 and 16) and
//! prefill tokens/s of every export of a SmolLM2-shaped package (random
//! weights, SmolLM2-135M's exact shapes), beside ONNX Runtime on this
//! machine's CPU and the HBM roofline (weight bytes per step over the
//! device's measured copy bandwidth).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use onnx_genai_backend::{DecodeModel, Entry, Input, Sequence};
use onnx_genai_build::Variant;
use onnx_genai_cuda::CudaModel;
use onnx_genai_native::value::{DType, Value};
use onnx_genai_native::{compile_package_with, NativeModel, WeightForm};
use onnx_genai_package::Package;

use crate::{packages, util};

fn floats(v: &Value) -> Vec<f32> {
    match v.dtype() {
        DType::F32 => v.as_f32().map(<[f32]>::to_vec).unwrap_or_default(),
        DType::F16 => v.as_f16().map(|h| h.iter().map(|x| x.to_f32()).collect()).unwrap_or_default(),
        DType::I64 => v.as_i64().map(|h| h.iter().map(|x| *x as f32).collect()).unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// Whether a difference is within 1e-3 of the step's own scale (NaN never
/// is): f32 sums in another order part by ~1e-6 of it.
fn agrees(d: f32, scale: f32) -> bool {
    d <= 1e-3 * scale.max(1.0)
}

/// Largest |a - b| and largest |b|.
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    if a.len() != b.len() {
        return (f32::INFINITY, 0.0);
    }
    a.iter().zip(b).fold((0.0f32, 0.0f32), |(d, m), (x, y)| {
        let e = if x.is_nan() != y.is_nan() { f32::INFINITY } else { (x - y).abs() };
        (d.max(e), m.max(y.abs()))
    })
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32)
}

/// One forward on a fresh-or-continuing sequence, returning the logits.
fn forward(model: &dyn DecodeModel, seq: &mut dyn Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut logits = Vec::new();
    let mut batch = [Entry { sequence: seq, input: Input::Tokens(tokens), logits: &mut logits }];
    model.step(&mut batch)?;
    Ok(logits)
}

pub fn trace() -> Result<()> {
    let device = onnx_genai_cuda::probe().context("native-cuda needs a GPU")?;
    println!("==> native-cuda on {device}: step-by-step against native-cpu (same row-form plan)");
    let built = packages::build_all(false)?;
    let mut failures = 0;
    let mut table = Vec::new();
    for b in &built {
        if b.spec.vision.is_some() {
            continue;
        }
        for variant in b.spec.variants() {
            let dir = b.dir.join(variant.name());
            let label = format!("{}/{}", b.name, variant.name());
            match trace_one(&dir) {
                Ok(line) => {
                    if line.contains("DIVERGES") {
                        failures += 1;
                    }
                    println!("{label:<32} {line}");
                    table.push(format!("| {label} | {line} |"));
                }
                Err(e) => {
                    failures += 1;
                    println!("{label:<32} ERROR {e:#}");
                    table.push(format!("| {label} | ERROR {e:#} |"));
                }
            }
        }
    }
    if failures > 0 {
        bail!("{failures} package variant(s) part from native-cpu on native-cuda");
    }
    Ok(())
}

fn trace_one(dir: &Path) -> Result<String> {
    let package = Package::open(dir)?;
    let plan = Arc::new(compile_package_with(&package, WeightForm::Rows, 0)?);
    let cpu = NativeModel::from_plan(plan.clone(), 1)?;
    let gpu = CudaModel::from_plan(plan.clone())?;
    cpu.set_tracing(true);
    gpu.set_tracing(true);
    let names: Vec<String> = plan.steps().map(|s| format!("{} ({})", s.name, s.op.name())).collect();
    let vocab = cpu.vocab_size() as u32;
    let prompt: Vec<u32> = (0..7).map(|i| (3 + 11 * i) % vocab).collect();
    let (mut cs, mut gs) = (cpu.new_sequence(), gpu.new_sequence());
    let mut input = prompt;
    let mut worst = 0.0f32;
    for round in 0..4 {
        let cl = forward(&cpu, cs.as_mut(), &input)?;
        let gl = forward(&gpu, gs.as_mut(), &input)?;
        let (ct, gt) = (cpu.trace(), gpu.trace());
        for (i, (c, g)) in ct.iter().zip(&gt).enumerate() {
            let (c, g) = (floats(c), floats(g));
            let (d, m) = diff(&g, &c);
            if !agrees(d, m) {
                return Ok(format!(
                    "DIVERGES at run {round} step {i} {}: max |diff| {d:.3e} (scale {m:.3e}), {} vs {} values",
                    names.get(i).map_or("?", String::as_str),
                    g.len(),
                    c.len()
                ));
            }
        }
        let (d, _) = diff(&gl, &cl);
        worst = worst.max(d);
        input = vec![argmax(&cl)];
    }
    let host_steps = gpu.host_steps();
    // Then without tracing: decode steps replay a captured graph (from the
    // third on) and must still agree with the CPU at every step.
    cpu.set_tracing(false);
    gpu.set_tracing(false);
    let (mut cs, mut gs) = (cpu.new_sequence(), gpu.new_sequence());
    let mut input: Vec<u32> = (0..5).map(|i| (7 + 13 * i) % vocab).collect();
    let mut graph_worst = 0.0f32;
    for step in 0..12 {
        let cl = forward(&cpu, cs.as_mut(), &input)?;
        let gl = forward(&gpu, gs.as_mut(), &input)?;
        let (d, m) = diff(&gl, &cl);
        if !agrees(d, m) {
            return Ok(format!(
                "DIVERGES at graph-mode step {step} ({} replays so far): max logit |diff| {d:.3e}",
                gpu.graph_replays()
            ));
        }
        graph_worst = graph_worst.max(d);
        input = vec![argmax(&cl)];
    }
    let replays = gpu.graph_replays();
    if replays == 0 && host_steps == 0 {
        return Ok("DIVERGES: no decode step was replayed from a CUDA graph".into());
    }
    Ok(format!(
        "ok: {} steps agree over a 7-token prefill and 3 decode steps (max logit diff {worst:.2e}); \
         {replays} graph replays in 11 decode steps agree (max {graph_worst:.2e}); {host_steps} host step(s)",
        names.len(),
    ))
}

/// Exports of the SmolLM2-shaped bench package.
const BENCH_VARIANTS: [Variant; 4] = [Variant::Contrib, Variant::Genai, Variant::Decomposed, Variant::Opset23];

fn build_shaped() -> Result<PathBuf> {
    let spec_path = util::root().join("packages/smollm2-shaped/bench.yaml");
    let spec = onnx_genai_build::read_spec(&spec_path)?;
    let out = util::target().join("packages").join(&spec.name);
    for v in BENCH_VARIANTS {
        let dir = out.join(v.name());
        if !dir.join("model.onnx").is_file() {
            let t = Instant::now();
            onnx_genai_build::build_variant(&spec, v, &dir)?;
            println!("built {} {} in {:.1}s", spec.name, v.name(), t.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}

struct Timing {
    min: f64,
    median: f64,
}

fn timing(mut samples: Vec<f64>) -> Timing {
    samples.sort_by(f64::total_cmp);
    Timing { min: samples[0], median: samples[samples.len() / 2] }
}

/// Seconds per decode step with `batch` sequences (after a 16-token
/// prefill each), min and median over rounds.
fn decode(model: &dyn DecodeModel, batch: usize, steps: usize, rounds: usize) -> Result<Timing> {
    let mut samples = Vec::new();
    let prompt: Vec<u32> = (1..=16).collect();
    let token = [7u32];
    for _ in 0..rounds {
        let mut seqs: Vec<Box<dyn Sequence>> = (0..batch).map(|_| model.new_sequence()).collect();
        let mut logits: Vec<Vec<f32>> = vec![Vec::new(); batch];
        let mut entries: Vec<Entry> = seqs
            .iter_mut()
            .zip(logits.iter_mut())
            .map(|(s, l)| Entry { sequence: s.as_mut(), input: Input::Tokens(&prompt), logits: l })
            .collect();
        model.step(&mut entries)?;
        let t = Instant::now();
        for _ in 0..steps {
            for e in entries.iter_mut() {
                e.input = Input::Tokens(&token);
            }
            model.step(&mut entries)?;
        }
        samples.push(t.elapsed().as_secs_f64() / steps as f64);
    }
    Ok(timing(samples))
}

/// Seconds for one prefill of `len` tokens.
fn prefill(model: &dyn DecodeModel, len: usize, rounds: usize) -> Result<Timing> {
    let prompt: Vec<u32> = (0..len as u32).map(|i| 1 + i % 1000).collect();
    let mut samples = Vec::new();
    for _ in 0..rounds {
        let mut seq = model.new_sequence();
        let t = Instant::now();
        forward(model, seq.as_mut(), &prompt)?;
        samples.push(t.elapsed().as_secs_f64());
    }
    Ok(timing(samples))
}

pub fn bench(rounds: usize, steps: usize, cpu_threads: usize) -> Result<()> {
    let device = onnx_genai_cuda::probe().context("native-cuda needs a GPU")?;
    let lib = crate::ort::provision()?;
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    let dir = build_shaped()?;
    let bandwidth = onnx_genai_cuda::copy_bandwidth().context("measuring the device's copy bandwidth")?;
    let rounds = rounds.max(1);
    let mut out = format!(
        "# native-cuda bench\n\n{device}; copy bandwidth {:.0} GB/s (device-to-device, read + write); \
         SmolLM2-shaped package (random weights, SmolLM2-135M's shapes); {rounds} rounds, min / median; \
         ONNX Runtime on this machine's CPU with {cpu_threads} threads.\n\n\
         Decode replays CUDA graphs; \"serial\" columns launch each kernel after the one before has finished, \
         the others with programmatic dependent launch ({}).\n\n\
         | export | weights MB | decode b1 eager tok/s | decode b1 serial tok/s | decode b16 serial tok/s | decode b1 tok/s | \
         decode b16 tok/s (aggregate) | b16 / b1 | prefill 128 tok/s | roofline b1 tok/s | ORT CPU decode tok/s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        bandwidth / 1e9,
        if onnx_genai_cuda::overlap_supported()? { "on" } else { "not supported by this device: off" },
    );
    for v in BENCH_VARIANTS {
        let package = Package::open(&dir.join(v.name()))?;
        let model = CudaModel::load(&package)?;
        let weights = model.weight_bytes() as f64;
        model.set_graphs(false);
        let eager = decode(&model, 1, steps, rounds)?;
        model.set_graphs(true);
        // Programmatic dependent launch off, then on (the default where
        // the device has it), measured side by side.
        let overlap = model.overlap_supported();
        model.set_overlap(false);
        let b1_serial = decode(&model, 1, steps, rounds)?;
        let b16_serial = decode(&model, 16, steps, rounds)?;
        model.set_overlap(overlap);
        let b1 = decode(&model, 1, steps, rounds)?;
        let b16 = decode(&model, 16, steps, rounds)?;
        model.set_graphs(false);
        let b16_eager = decode(&model, 16, steps, rounds)?;
        model.set_graphs(true);
        for batch in [1, 16] {
            if let Some((nodes, edges, programmatic)) = model.graph_shape(batch) {
                println!("{} b{batch} graph: {nodes} nodes, {edges} edges, {programmatic} programmatic", v.name());
            }
        }
        println!("{} b16 eager: {:.0} / {:.0} tok/s", v.name(), 16.0 / b16_eager.min, 16.0 / b16_eager.median);
        let pre = prefill(&model, 128, rounds)?;
        println!("{}: {} decode steps replayed from CUDA graphs", v.name(), model.graph_replays());
        for batch in [1, 16] {
            model.set_profiling(true);
            let profiled_steps = 8;
            decode(&model, batch, profiled_steps, 1)?;
            let ops: Vec<String> = model
                .profile()
                .iter()
                .take(8)
                .map(|(op, d, n)| {
                    format!(
                        "{op} x{} {:.0}us",
                        n / (profiled_steps as u64 + 1),
                        d.as_secs_f64() * 1e6 / (profiled_steps + 1) as f64
                    )
                })
                .collect();
            println!("{} b{batch} per step (each step alone, synchronized): {}", v.name(), ops.join(", "));
            model.set_profiling(false);
        }
        drop(model);
        let ort = onnx_genai_engine::BackendKind::Ort.load(&package, cpu_threads)?;
        let ort_b1 = decode(ort.as_ref(), 1, steps.min(32), 1)?;
        let line = format!(
            "| {} | {:.1} | {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.1}x | {:.0} / {:.0} | {:.0} | {:.1} |",
            v.name(),
            weights / 1e6,
            1.0 / eager.median,
            1.0 / b1_serial.min,
            1.0 / b1_serial.median,
            16.0 / b16_serial.min,
            16.0 / b16_serial.median,
            1.0 / b1.min,
            1.0 / b1.median,
            16.0 / b16.min,
            16.0 / b16.median,
            (16.0 / b16.median) / (1.0 / b1.median),
            128.0 / pre.min,
            128.0 / pre.median,
            bandwidth / weights,
            1.0 / ort_b1.median,
        );
        println!("{line}");
        out.push_str(&line);
        out.push('\n');
    }
    let path = util::target().join("bench/cuda.md");
    std::fs::create_dir_all(path.parent().context("bench path")?)?;
    std::fs::write(&path, &out)?;
    println!("{out}\nwritten to {}", path.display());
    Ok(())
}
