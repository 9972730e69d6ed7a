//! Builds the shipped packages and checks them against their committed digests.

use std::path::PathBuf;

use anyhow::{bail, Result};
use onnx_genai_build::digest::{variants_digest, DIGEST_FILE};

use crate::util;

pub struct Built {
    pub name: String,
    pub dir: PathBuf,
    pub spec: onnx_genai_build::Spec,
}

pub fn build_all(bless: bool) -> Result<Vec<Built>> {
    let mut built = Vec::new();
    let mut drift = Vec::new();
    for spec_path in onnx_genai_build::spec_files(&util::root().join("packages"))? {
        let spec = onnx_genai_build::read_spec(&spec_path)?;
        let out = util::target().join("packages").join(&spec.name);
        if out.exists() {
            std::fs::remove_dir_all(&out)?;
        }
        onnx_genai_build::build_all_variants(&spec, &out)?;
        let digest = variants_digest(&out)?;
        let digest_path = spec_path.with_file_name(DIGEST_FILE);
        if bless {
            std::fs::write(&digest_path, &digest)?;
        } else if std::fs::read_to_string(&digest_path).ok().as_deref() != Some(digest.as_str()) {
            drift.push(spec.name.clone());
        }
        let decomposed = out.join(onnx_genai_build::Variant::Decomposed.name());
        let bytes: u64 = std::fs::read_dir(&decomposed)?.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum();
        println!("built {:<16} {:>9} bytes  {}", spec.name, bytes, out.display());
        built.push(Built { name: spec.name.clone(), dir: out, spec });
    }
    if !drift.is_empty() {
        bail!(
            "package bytes changed for {} (digest.txt differs). If the generator change is intended, \
             run `cargo xtask packages --bless` and commit the new digests.",
            drift.join(", ")
        );
    }
    Ok(built)
}
