//! Provisions ONNX Runtime from the official `onnxruntime` wheel (pip), never
//! from a build-time download.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

pub const VERSION: &str = "1.31.1";
const LIBRARY: &str = "libonnxruntime.so.1.31.1";

/// Ensures `target/onnxruntime/libonnxruntime.so.<VERSION>` exists; returns it.
pub fn provision() -> Result<PathBuf> {
    let dir = util::target().join("onnxruntime");
    let lib = dir.join(LIBRARY);
    if lib.is_file() {
        return Ok(lib);
    }
    let wheel = pip_download("onnxruntime", VERSION, &dir.join("wheel"))?;
    // A wheel is a zip file; Python (already required for pip) unpacks it.
    let script = format!(
        "import sys, zipfile\nz = zipfile.ZipFile(sys.argv[1])\nopen(sys.argv[2] + '.part', 'wb').write(z.read('onnxruntime/capi/{LIBRARY}'))"
    );
    let status = Command::new(python()).args(["-c", &script]).arg(&wheel).arg(&lib).status()?;
    if !status.success() {
        bail!("could not extract {LIBRARY} from {}", wheel.display());
    }
    let part = lib.with_file_name(format!("{LIBRARY}.part"));
    std::fs::rename(&part, &lib)?;
    println!("==> ONNX Runtime {VERSION} installed at {}", lib.display());
    Ok(lib)
}

/// Downloads the official wheel of `package==version` into `dest` with pip
/// (no dependencies, binary only) and returns its path.
pub fn pip_download(package: &str, version: &str, dest: &std::path::Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    println!("==> pip download {package}=={version} (official wheel)");
    let status = Command::new(python())
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest"])
        .arg(dest)
        .arg(format!("{package}=={version}"))
        .status()
        .context("cannot run python3 -m pip (is Python with pip installed?)")?;
    if !status.success() {
        bail!("pip could not download {package}=={version}; check access to the Python package index");
    }
    std::fs::read_dir(dest)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{package}-{version}-"))))
        .with_context(|| format!("pip reported success but left no {package} wheel"))
}

pub fn python() -> String {
    which("python3").unwrap_or_else(|| "python".into())
}

fn which(name: &str) -> Option<String> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file()).map(|p| p.display().to_string())
}
