//! `native-cuda`: the plan the native compiler produces (lowering, folding,
//! fusion and KV binding are shared with native-cpu), run on an NVIDIA GPU.
//! CUDA is loaded at run time ([`cudarc`] with dynamic loading), so this
//! crate builds and its model reports a typed "unavailable" error on
//! machines without a driver or device. Kernels are CUDA C
//! (`kernels/*.cu`), compiled at load by NVRTC for the device's architecture
//! and cached by source digest; f32 products (and the prefill of f16 and
//! 4-bit weights, widened first) run on cuBLAS. See ARCHITECTURE.md.

mod device;
mod error;
mod kv;
mod model;
mod runner;
mod weights;

pub use device::{compile_kernels, copy_bandwidth, kernel_source, overlap_supported, probe, Compiled, KERNELS};
pub use error::CudaError;
pub use model::{CudaModel, CudaSequence, NAME};
