//! The reference backend: ONNX Runtime through the `ort` crate, loaded
//! dynamically from the official `onnxruntime` wheel's shared library (which
//! `cargo xtask ort` installs under `target/onnxruntime/`).

mod component;
mod decoder;
mod edge;
mod graph;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use component::{ComponentInput, OrtComponent};
pub use decoder::{OrtModel, OrtSequence};
pub use graph::OrtGraph;

/// This backend's name, as `--backend` takes it and errors report it.
pub const NAME: &str = "ort";

/// The ONNX Runtime release this crate targets (the `ort` crate's `api-31`).
pub const ORT_VERSION: &str = "1.31.1";

/// The library file name inside the wheel.
pub const LIBRARY_FILE: &str = "libonnxruntime.so.1.31.1";

#[derive(Clone, Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "ONNX Runtime {ORT_VERSION} is not installed at {}: run `cargo xtask ort` \
         (or set ORT_DYLIB_PATH to a libonnxruntime.so {ORT_VERSION})", path.display()
    )]
    Missing { path: PathBuf },
    #[error("cannot load ONNX Runtime from {}: {reason}; run `cargo xtask ort` to reinstall it", path.display())]
    Load { path: PathBuf, reason: String },
}

/// Where the library is looked for: `ORT_DYLIB_PATH` (the `ort` crate's own
/// variable, set by every xtask command), else this workspace's `target/`.
pub fn library_path() -> PathBuf {
    match std::env::var_os("ORT_DYLIB_PATH") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => default_library_path(),
    }
}

/// `target/onnxruntime/<LIBRARY_FILE>` of the workspace this crate was built in.
pub fn default_library_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/onnxruntime").join(LIBRARY_FILE)
}

static ENVIRONMENT: OnceLock<Result<ort::environment::Environment, RuntimeError>> = OnceLock::new();

/// The process-wide ONNX Runtime environment, loading the library on first use.
pub fn environment() -> Result<&'static ort::environment::Environment, RuntimeError> {
    ENVIRONMENT
        .get_or_init(|| {
            let path = library_path();
            if !path.is_file() {
                return Err(RuntimeError::Missing { path });
            }
            let path = path.canonicalize().unwrap_or(path);
            let load = |reason: String| RuntimeError::Load { path: path.clone(), reason };
            ort::init_from(&path)
                .map_err(|e| load(e.to_string()))?
                .with_name("onnx-genai")
                .build()
                .map_err(|e| load(e.to_string()))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Opens an ONNX Runtime session on the model at `path` with `intra_threads`
/// threads (0 lets ONNX Runtime choose).
pub(crate) fn open_session(
    path: &Path,
    intra_threads: usize,
) -> Result<ort::session::Session, onnx_genai_backend::BackendError> {
    open_session_logging(path, intra_threads, None)
}

/// [`open_session`] with the session's own log level (`None`: the
/// environment's).
pub(crate) fn open_session_logging(
    path: &Path,
    intra_threads: usize,
    log_level: Option<ort::logging::LogLevel>,
) -> Result<ort::session::Session, onnx_genai_backend::BackendError> {
    let load_err =
        |what: String, reason: String| onnx_genai_backend::BackendError::Load { backend: NAME, what, reason };
    let env = environment().map_err(|e| load_err("ONNX Runtime".into(), e.to_string()))?;
    let file = |e: &dyn std::fmt::Display| load_err(path.display().to_string(), e.to_string());
    let mut builder = ort::session::Session::builder(env).map_err(|e| file(&e))?;
    if intra_threads > 0 {
        builder = builder.with_intra_threads(intra_threads).map_err(|e| file(&e))?;
    }
    if let Some(level) = log_level {
        builder = builder.with_log_level(level).map_err(|e| file(&e))?;
    }
    builder.commit_from_file(path).map_err(|e| file(&e))
}
