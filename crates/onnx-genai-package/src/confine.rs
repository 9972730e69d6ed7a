//! Resolving manifest paths inside the package directory and nowhere else.

use std::path::{Component, Path, PathBuf};

use crate::diagnostics::{Code, Diagnostic};

/// Resolves `relative` (as written in `file` at `field`) under `root`.
///
/// Refuses absolute paths and `..`, and — when the target exists — any path
/// whose canonical form (symlinks followed) leaves the canonical root.
pub fn resolve(root: &Path, relative: &str, file: &str, field: &str) -> Result<PathBuf, Diagnostic> {
    let rel = Path::new(relative);
    let escapes = relative.is_empty()
        || rel.is_absolute()
        || rel.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir));
    if escapes {
        return Err(Diagnostic::error(
            Code::PKG010,
            file,
            field,
            format!("path `{relative}` is not a plain relative path inside the package"),
            "use a path relative to the package directory, without `..` or a leading `/`",
        ));
    }
    let joined = root.join(rel);
    match (joined.canonicalize(), root.canonicalize()) {
        (Ok(target), Ok(root_canon)) if !target.starts_with(&root_canon) => Err(Diagnostic::error(
            Code::PKG011,
            file,
            field,
            format!("`{relative}` resolves outside the package (a symlink leaves the directory)"),
            "copy the file into the package instead of linking to it",
        )),
        // Reading a FIFO or a device would block or stream forever.
        (Ok(target), Ok(_)) if !target.is_file() => Err(Diagnostic::error(
            Code::PKG013,
            file,
            field,
            format!("`{relative}` is not a regular file (a FIFO, device or directory)"),
            "put the file itself in the package",
        )),
        (Ok(_), Ok(_)) => Ok(joined),
        _ if std::fs::symlink_metadata(&joined).is_ok() => Err(Diagnostic::error(
            Code::PKG011,
            file,
            field,
            format!("`{relative}` is a dangling symlink"),
            "replace the link with the file it should point to",
        )),
        _ => Err(Diagnostic::error(
            Code::PKG012,
            file,
            field,
            format!("`{relative}` does not exist"),
            "add the file to the package or fix the path",
        )),
    }
}
