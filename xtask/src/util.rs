use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (xtask lives one level below it).
/// The repository root: where this binary was built from, or, for a binary
/// carried to another machine (the GPU check), the current directory when
/// it is a checkout of this repository.
pub fn root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default();
    let is_checkout = |p: &Path| p.join("conformance/lanes.yaml").is_file();
    if is_checkout(&built) {
        return built;
    }
    match std::env::current_dir() {
        Ok(dir) if is_checkout(&dir) => dir,
        _ => built,
    }
}

pub fn target() -> PathBuf {
    root().join("target")
}

/// The commit HEAD names (`unknown` outside a git checkout).
pub fn commit() -> String {
    Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}
