//! `cargo xtask cuda-compile` (the `cuda-compile` lane, on any CPU machine):
//! NVRTC from the package index (`nvidia-cuda-nvrtc-cu12`, pinned, pip into
//! target/nvrtc) compiles native-cuda's kernel source for every
//! architecture CI names; any diagnostic, a warning included, fails, and
//! every kernel the crate loads must be in the output.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{ort, util};

const WHEEL: &str = "nvidia-cuda-nvrtc-cu12==12.9.86";
const LIBRARY: &str = "libnvrtc.so.12";

/// The real architectures CI compiles for (Ampere, Hopper), then the
/// virtual one whose PTX is checked for every kernel.
const ARCHS: [&str; 3] = ["sm_80", "sm_90", "compute_80"];

fn provision() -> Result<PathBuf> {
    let dir = util::target().join("nvrtc");
    let lib = dir.join("nvidia/cuda_nvrtc/lib").join(LIBRARY);
    if lib.is_file() {
        return Ok(lib);
    }
    println!("==> pip install {WHEEL} (official wheel) into {}", dir.display());
    let status = Command::new(ort::python())
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:", "--target"])
        .arg(&dir)
        .arg(WHEEL)
        .status()
        .context("cannot run python3 -m pip (is Python with pip installed?)")?;
    if !status.success() || !lib.is_file() {
        bail!("pip could not install {WHEEL}; check access to the Python package index");
    }
    Ok(lib)
}

pub fn run() -> Result<()> {
    let lib = provision()?;
    // SAFETY: loading NVRTC runs its initializers, which have no
    // preconditions. Loaded globally and kept for the process, so that
    // cudarc's own dlopen of the same soname finds this copy.
    let handle = unsafe {
        libloading::os::unix::Library::open(
            Some(&lib),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    }
    .with_context(|| format!("loading {}", lib.display()))?;
    std::mem::forget(handle);
    let kernels = onnx_genai_cuda::KERNELS;
    for arch in ARCHS {
        let compiled = onnx_genai_cuda::compile_kernels(arch).with_context(|| format!("compiling for {arch}"))?;
        if let Some(ptx) = &compiled.ptx {
            let missing: Vec<&str> =
                kernels.iter().copied().filter(|k| !ptx.contains(&format!(".entry {k}("))).collect();
            if !missing.is_empty() {
                bail!("the PTX for {arch} lacks kernels the crate loads: {}", missing.join(", "));
            }
        }
        println!("ok   {arch}: {} kernels compile without a diagnostic", kernels.len());
    }
    Ok(())
}
