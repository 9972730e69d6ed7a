//! Per-file SHA-256 digests of a package, committed next to its spec so a
//! generator change that alters bytes fails until deliberately re-blessed.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::BuildError;

pub const DIGEST_FILE: &str = "digest.txt";

/// `<file>  <sha256>` lines for every regular file in `dir`, sorted by name.
pub fn package_digest(dir: &Path) -> Result<String, BuildError> {
    let io = |source| BuildError::Io { path: dir.into(), source };
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut out = String::new();
    for name in names {
        let bytes = std::fs::read(dir.join(&name)).map_err(io)?;
        let hash = Sha256::digest(&bytes);
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        out.push_str(&format!("{name}  {hex}\n"));
    }
    Ok(out)
}

/// The digest of a package built with every variant it has (`<variant>/<file>
/// <sha256>` lines, variants in [`crate::Variant::ALL`] order).
pub fn variants_digest(dir: &Path) -> Result<String, BuildError> {
    let mut out = String::new();
    for variant in crate::Variant::ALL {
        let sub = dir.join(variant.name());
        if !sub.is_dir() {
            continue;
        }
        for line in package_digest(&sub)?.lines() {
            out.push_str(&format!("{}/{line}\n", variant.name()));
        }
    }
    Ok(out)
}
