//! Pinned Python packages installed with pip into folders under `target/`:
//! the official `openai` client and `jsonschema` (`target/python`, for the
//! server's real-client test), schemathesis (`target/schemathesis`, the
//! API fuzzer of the `api-fuzz` lane) and ONNX Runtime GenAI (`target/genai`, the peer
//! runtime of the interop lane and `cargo xtask bench --peer ort-genai`).

use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

pub const OPENAI_VERSION: &str = "3.57.0";
/// Validates structured outputs in the client test independently of the
/// server's grammar.
pub const JSONSCHEMA_VERSION: &str = "4.26.0";
pub const ORT_GENAI_VERSION: &str = "0.18.0";
/// The property-based API fuzzer of the `api-fuzz` lane.
pub const SCHEMATHESIS_VERSION: &str = "4.32.5";

/// Ensures `target/python` holds `openai==OPENAI_VERSION` and
/// `jsonschema==JSONSCHEMA_VERSION`; idempotent.
pub fn provision() -> Result<()> {
    install("python", &[&format!("openai=={OPENAI_VERSION}"), &format!("jsonschema=={JSONSCHEMA_VERSION}")])
}

/// Ensures `target/schemathesis` holds `schemathesis==SCHEMATHESIS_VERSION`;
/// idempotent.
pub fn provision_schemathesis() -> Result<()> {
    install("schemathesis", &[&format!("schemathesis=={SCHEMATHESIS_VERSION}")])
}

/// Ensures `target/genai` holds `onnxruntime-genai==ORT_GENAI_VERSION` with
/// the `onnxruntime` wheel the rest of the project uses; idempotent.
pub fn provision_ort_genai() -> Result<()> {
    install(
        "genai",
        &[&format!("onnxruntime-genai=={ORT_GENAI_VERSION}"), &format!("onnxruntime=={}", crate::ort::VERSION)],
    )
}

fn install(dir_name: &str, requirements: &[&str]) -> Result<()> {
    let dir = util::target().join(dir_name);
    let marker = dir.join(format!(".installed-{}", requirements.join("-")));
    if marker.is_file() {
        return Ok(());
    }
    println!("==> pip install {} into {}", requirements.join(" "), dir.display());
    let status = Command::new(crate::ort::python())
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-warn-conflicts",
            "--root-user-action=ignore",
            "--upgrade",
            "--target",
        ])
        .arg(&dir)
        .args(requirements)
        .status()
        .context("cannot run python3 -m pip (is Python with pip installed?)")?;
    if !status.success() {
        bail!("pip could not install {}; check access to the Python package index", requirements.join(" "));
    }
    std::fs::write(&marker, "")?;
    Ok(())
}
