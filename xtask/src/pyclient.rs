//! Installs the official Python `openai` client (pinned) with pip into
//! `target/python`, for the server's real-client test.

use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

pub const OPENAI_VERSION: &str = "3.57.0";

/// Ensures `target/python` holds `openai==OPENAI_VERSION`; idempotent.
pub fn provision() -> Result<()> {
    let dir = util::target().join("python");
    let marker = dir.join(format!(".openai-{OPENAI_VERSION}"));
    if marker.is_file() {
        return Ok(());
    }
    println!("==> pip install openai=={OPENAI_VERSION} into {}", dir.display());
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
        .arg(format!("openai=={OPENAI_VERSION}"))
        .status()
        .context("cannot run python3 -m pip (is Python with pip installed?)")?;
    if !status.success() {
        bail!("pip could not install openai=={OPENAI_VERSION}; check access to the Python package index");
    }
    std::fs::write(&marker, "")?;
    Ok(())
}
