//! `cargo xtask bench --peer ort-genai`: prefill and decode tokens/s of ONNX
//! Runtime GenAI (the pinned Python package, driven by
//! `tests/python/ort_genai.py`) and of our native-cpu on the same contrib
//! package and thread count, in one run, as ratios.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use onnx_genai_build::Variant;
use onnx_genai_engine::BackendKind;
use onnx_genai_package::Package;

use crate::bench_real::{measure, min_median, Speed, CONTEXT, PREFILL};
use crate::{ort, pyclient, real, util};

fn ort_genai(dir: &Path, threads: usize, rounds: usize, steps: usize) -> Result<Speed> {
    let script = util::root().join("crates/onnx-genai-conformance/tests/python/ort_genai.py");
    let out = Command::new(ort::python())
        .arg(script)
        .args(["bench", &dir.display().to_string()])
        .args([threads, PREFILL, CONTEXT, steps, rounds].map(|n| n.to_string()))
        .env("PYTHONPATH", util::target().join("genai"))
        .output()
        .context("cannot run python3")?;
    if !out.status.success() {
        bail!("onnxruntime-genai bench failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let series =
        |k: &str| -> Vec<f64> { json[k].as_array().into_iter().flatten().filter_map(|v| v.as_f64()).collect() };
    Ok(Speed { prefill: min_median(series("prefill")), decode: min_median(series("decode")) })
}

/// The packages raced, built fresh under `target/bench/peer/`: the tiny
/// llama's contrib export and its genai export (ONNX Runtime GenAI's own
/// form, `accuracy_level` 4), and every real model's contrib and genai
/// exports.
fn packages() -> Result<Vec<(String, PathBuf)>> {
    let out = util::target().join("bench/peer");
    let mut list = Vec::new();
    let spec = onnx_genai_build::read_spec(&util::root().join("packages/tiny-llama-gqa/spec.yaml"))?;
    for variant in [Variant::Contrib, Variant::Genai] {
        let dir = out.join(format!("tiny-llama-gqa-{}", variant.name()));
        onnx_genai_build::build_variant(&spec, variant, &dir)?;
        list.push((format!("tiny-llama-gqa ({})", variant.name()), dir));
    }
    for model in real::models()? {
        real::fetch(&model)?;
        let base = model.load_spec(&util::target())?;
        for export in model.exports.iter().chain(&model.bench_exports).filter(|e| e.variant.contrib_ops()) {
            let dir = out.join(model.package(export));
            model.build(&base, export, &dir)?;
            list.push((model.package(export), dir));
        }
    }
    Ok(list)
}

pub fn run(peer: &str, threads: usize, rounds: usize, steps: usize) -> Result<()> {
    if peer != "ort-genai" {
        bail!("unknown peer `{peer}` (ort-genai)");
    }
    let lib = ort::provision()?;
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    pyclient::provision_ort_genai()?;
    let mut md = format!(
        "# native-cpu against ONNX Runtime GenAI {}\n\n{threads} thread(s) each, same package, one run; prefill of \
         {PREFILL} tokens, decode of {steps} steps after a {CONTEXT}-token context, {rounds} rounds (min / median \
         tokens/s); ratio = native median / ORT GenAI median.\n\n\
         | package | ORT GenAI decode | native decode | decode ratio | ORT GenAI prefill | native prefill | prefill ratio |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        pyclient::ORT_GENAI_VERSION
    );
    for (name, dir) in packages()? {
        let theirs = ort_genai(&dir, threads, rounds, steps)?;
        let package = Package::open(&dir)?;
        let mut b = BackendKind::NativeCpu.decoder(&package, threads)?;
        let ours = measure(&mut b, rounds, steps)?;
        println!(
            "{name:<28} decode ort-genai {:>8.1} native {:>8.1} tok/s ({:.2}x); prefill ort-genai {:>8.0} native {:>8.0} tok/s ({:.2}x)",
            theirs.decode.1,
            ours.decode.1,
            ours.decode.1 / theirs.decode.1,
            theirs.prefill.1,
            ours.prefill.1,
            ours.prefill.1 / theirs.prefill.1
        );
        let _ = writeln!(
            md,
            "| {name} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2}x | {:.0} / {:.0} | {:.0} / {:.0} | {:.2}x |",
            theirs.decode.0,
            theirs.decode.1,
            ours.decode.0,
            ours.decode.1,
            ours.decode.1 / theirs.decode.1,
            theirs.prefill.0,
            theirs.prefill.1,
            ours.prefill.0,
            ours.prefill.1,
            ours.prefill.1 / theirs.prefill.1
        );
    }
    let path = util::target().join("bench/peer.md");
    std::fs::write(&path, &md)?;
    println!("\n{md}\nreport: {}", path.display());
    Ok(())
}
