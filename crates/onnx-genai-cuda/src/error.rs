use onnx_genai_backend::BackendError;

use crate::model::NAME;

/// What can go wrong with the device.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver, device or library on this machine.
    #[error("{0}")]
    Unavailable(String),
    /// NVRTC rejected (or warned about) the kernel source.
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// The plan holds something this backend does not run.
    #[error("{0}")]
    Unsupported(String),
}

impl CudaError {
    pub(crate) fn into_backend(self, what: &str) -> BackendError {
        match self {
            CudaError::Unavailable(reason) => BackendError::Unavailable { backend: NAME, reason },
            other => BackendError::Load { backend: NAME, what: what.into(), reason: other.to_string() },
        }
    }
}
