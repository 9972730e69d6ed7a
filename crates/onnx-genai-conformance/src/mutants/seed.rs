//! Seeds the mutation runs' target directory with the dependencies the
//! main build already compiled, so a battery does not compile (and store)
//! every third-party crate a second time: on a CI machine that second copy
//! is minutes of build and gigabytes of disk.
//!
//! Only third-party units are seeded: their libraries (`lib*.rlib`,
//! `.rmeta`, `.so`), fingerprints and build-script output. The workspace's
//! own crates and every test executable are left out and always rebuilt
//! from the scratch tree, so cargo cannot take a main-tree artifact for a
//! mutant's. The libraries are hard links (no bytes copied): rustc replaces
//! an output by renaming a new file over it, so a rebuild here never writes
//! through into the main build. What cargo or a build script rewrites in
//! place — fingerprints, dep-info files, build-script output — is copied,
//! with its modification time kept so that cargo still sees it as fresh.

use std::path::Path;

/// What seeding did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Seeded {
    pub linked: usize,
    pub copied: usize,
    /// Why seeding gave up (nothing is left half-seeded; cargo builds it all).
    pub skipped: Option<String>,
}

/// Whether a `.fingerprint` or `build` entry (`onnx-genai-engine-<hash>`)
/// or a library's crate name (`onnx_genai_engine`) is the workspace's.
fn is_workspace_unit(name: &str) -> bool {
    let name = name.replace('_', "-");
    name.starts_with("onnx-genai") || name.starts_with("xtask")
}

/// The crate and hash stem of a third-party library in `deps/`
/// (`libserde-1a.rlib` → `serde-1a`); `None` for anything else.
fn third_party_library(file: &str) -> Option<&str> {
    let (stem, ext) = file.rsplit_once('.')?;
    let stem = stem.strip_prefix("lib")?;
    (matches!(ext, "rlib" | "rmeta" | "so") && !is_workspace_unit(stem)).then_some(stem)
}

/// Seeds the profile directory `to` (e.g. `target/mutants/target/debug`)
/// from `from` (`target/debug`). Does nothing when `to` exists already (a
/// later run reuses its own build) or `from` does not.
pub fn seed_target(from: &Path, to: &Path) -> Result<Seeded, String> {
    let mut done = Seeded::default();
    if to.exists() || !from.is_dir() {
        return Ok(done);
    }
    let deps = from.join("deps");
    if deps.is_dir() {
        std::fs::create_dir_all(to.join("deps")).map_err(|e| e.to_string())?;
        for entry in read_dir(&deps)? {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(stem) = third_party_library(&name) else { continue };
            if let Err(e) = std::fs::hard_link(entry.path(), to.join("deps").join(&name)) {
                // Another file system (or no hard links): copying would
                // cost the disk this module exists to save.
                let _ = std::fs::remove_dir_all(to);
                return Ok(Seeded { skipped: Some(format!("cannot hard-link {name}: {e}")), ..Seeded::default() });
            }
            done.linked += 1;
            let dep_info = format!("{stem}.d");
            if deps.join(&dep_info).is_file() && !to.join("deps").join(&dep_info).exists() {
                copy_keeping_time(&deps.join(&dep_info), &to.join("deps").join(&dep_info))?;
                done.copied += 1;
            }
        }
    }
    for dir in [".fingerprint", "build"] {
        let Ok(entries) = read_dir(&from.join(dir)) else { continue };
        for entry in entries {
            let name = entry.file_name();
            if is_workspace_unit(&name.to_string_lossy()) {
                continue;
            }
            done.copied += copy_tree(&entry.path(), &to.join(dir).join(&name))?;
        }
    }
    Ok(done)
}

fn read_dir(dir: &Path) -> Result<Vec<std::fs::DirEntry>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(entries.flatten().collect())
}

/// Copies a file or a directory tree; returns the files copied.
fn copy_tree(from: &Path, to: &Path) -> Result<usize, String> {
    let kind = std::fs::symlink_metadata(from).map_err(|e| format!("{}: {e}", from.display()))?;
    if kind.is_dir() {
        std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
        let mut n = 0;
        for entry in read_dir(from)? {
            n += copy_tree(&entry.path(), &to.join(entry.file_name()))?;
        }
        Ok(n)
    } else if kind.is_file() {
        copy_keeping_time(from, to)?;
        Ok(1)
    } else {
        Ok(0)
    }
}

fn copy_keeping_time(from: &Path, to: &Path) -> Result<(), String> {
    let fail = |e: std::io::Error| format!("seeding {}: {e}", to.display());
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent).map_err(fail)?;
    }
    std::fs::copy(from, to).map_err(fail)?;
    let modified = std::fs::metadata(from).and_then(|m| m.modified()).map_err(fail)?;
    // (Read-only is enough to set the time of a file one owns, and a build
    // script may have left its output read-only.)
    std::fs::File::open(to).and_then(|f| f.set_modified(modified)).map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// Third-party artifacts are hard links to the main build's, their
    /// fingerprints and build output are copies with the same modification
    /// time, the workspace's own units are left out, and a directory that
    /// exists already is left alone.
    #[cfg(unix)]
    #[test]
    fn seeds_third_party_units_and_never_the_workspace() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("debug"), dir.path().join("mutants/debug"));
        write(&from.join("deps/libserde-1a.rlib"), "rlib");
        write(&from.join("deps/serde-1a.d"), "dep-info");
        write(&from.join("deps/libonnx_genai_engine-2b.rlib"), "workspace rlib");
        write(&from.join("deps/admission-6f"), "a workspace test executable");
        write(&from.join("deps/admission-6f.d"), "its dep-info");
        write(&from.join(".fingerprint/serde-1a/lib-serde"), "hash");
        write(&from.join(".fingerprint/onnx-genai-engine-2b/lib-onnx_genai_engine"), "hash");
        write(&from.join("build/ring-3c/out/lib.a"), "objects");
        write(&from.join("build/onnx-genai-cuda-4d/output"), "cargo:rerun");
        write(&from.join("incremental/onnx_genai_engine-5e/s"), "cache");
        let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        std::fs::File::options()
            .write(true)
            .open(from.join("build/ring-3c/out/lib.a"))
            .unwrap()
            .set_modified(old)
            .unwrap();

        let seeded = seed_target(&from, &to).unwrap();
        assert_eq!(seeded, Seeded { linked: 1, copied: 3, skipped: None });
        let (a, b) = (
            std::fs::metadata(from.join("deps/libserde-1a.rlib")).unwrap(),
            std::fs::metadata(to.join("deps/libserde-1a.rlib")).unwrap(),
        );
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()), "an artifact is a hard link");
        let d = std::fs::metadata(to.join("deps/serde-1a.d")).unwrap();
        assert_ne!(d.ino(), std::fs::metadata(from.join("deps/serde-1a.d")).unwrap().ino(), "dep-info is a copy");
        assert_eq!(std::fs::read_to_string(to.join(".fingerprint/serde-1a/lib-serde")).unwrap(), "hash");
        assert_eq!(std::fs::metadata(to.join("build/ring-3c/out/lib.a")).unwrap().modified().unwrap(), old);
        assert!(!to.join(".fingerprint/onnx-genai-engine-2b").exists());
        for left_out in ["deps/libonnx_genai_engine-2b.rlib", "deps/admission-6f", "deps/admission-6f.d"] {
            assert!(!to.join(left_out).exists(), "{left_out} was seeded");
        }
        assert!(!to.join("build/onnx-genai-cuda-4d").exists());
        assert!(!to.join("incremental").exists());
        assert_eq!(seed_target(&from, &to).unwrap(), Seeded::default(), "an existing directory is reused as it is");
    }
}
