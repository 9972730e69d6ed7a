//! The conformance harness: parity of native backends against ONNX Runtime
//! (the reference), golden outputs, and reports. Suites are data under
//! `conformance/`; `tests/conformance.rs` (libtest-mimic) and
//! `cargo xtask conformance` both run them through this library.

pub mod batch;
pub mod cases;
pub mod check;
pub mod golden;
pub mod mutants;
pub mod onnx_node;
pub mod parity;
pub mod random;
pub mod real;
pub mod report;
pub mod run;
pub mod tolerance;

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("suite {}: {reason}", path.display())]
    Suite { path: std::path::PathBuf, reason: String },
    #[error("package: {0}")]
    Build(String),
    #[error(transparent)]
    Load(#[from] onnx_genai_backend::BackendError),
    #[error("backend: {0}")]
    Backend(String),
}
