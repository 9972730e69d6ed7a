//! The one place a decode backend is chosen by name: the engine, the CLI,
//! the conformance harness and the benchmarks all go through
//! [`BackendKind`].

use std::sync::Arc;

use onnx_genai_backend::{BackendError, DecodeModel, Decoder, KvCache};
use onnx_genai_package::Package;

/// Which decode backend runs a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    /// ONNX Runtime, the reference.
    Ort,
    /// The native compiler's CPU plan.
    NativeCpu,
    /// The native compiler's plan on an NVIDIA GPU.
    NativeCuda,
}

impl BackendKind {
    pub const ALL: [BackendKind; 3] = [BackendKind::Ort, BackendKind::NativeCpu, BackendKind::NativeCuda];

    pub const fn name(self) -> &'static str {
        match self {
            BackendKind::Ort => onnx_genai_ort::NAME,
            BackendKind::NativeCpu => onnx_genai_native::NAME,
            BackendKind::NativeCuda => onnx_genai_cuda::NAME,
        }
    }

    /// Whether this backend can run on this machine (native-cuda needs a
    /// CUDA driver and device).
    pub fn available(self) -> bool {
        match self {
            BackendKind::NativeCuda => onnx_genai_cuda::probe().is_ok(),
            _ => true,
        }
    }

    /// The backends that can run here, in [`BackendKind::ALL`] order.
    pub fn available_here() -> Vec<BackendKind> {
        Self::ALL.into_iter().filter(|k| k.available()).collect()
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }

    /// The names [`BackendKind::parse`] accepts, for messages.
    pub fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// Whether this backend compares against the reference (everything but
    /// the reference itself).
    pub fn is_native(self) -> bool {
        self != BackendKind::Ort
    }

    /// Loads (and compiles) `package` on this backend with `threads`
    /// threads (0: the backend decides). The model is shared by every
    /// sequence made from it.
    pub fn load(self, package: &Package, threads: usize) -> Result<Arc<dyn DecodeModel>, BackendError> {
        self.load_with(package, threads, KvCache::Model)
    }

    /// [`BackendKind::load`] with the KV cache stored as `kv` says. Only
    /// native-cpu stores a cache in another type than the model declares;
    /// asked of another backend, that is `BackendError::Unavailable` (an f16
    /// cache for a package that declares one changes nothing: allowed).
    pub fn load_with(
        self,
        package: &Package,
        threads: usize,
        kv: KvCache,
    ) -> Result<Arc<dyn DecodeModel>, BackendError> {
        let declared_f16 = package.kv_geometry().is_some_and(|g| g.dtype == onnx_genai_package::ElementType::F16);
        if kv == KvCache::F16 && !declared_f16 && self != BackendKind::NativeCpu {
            return Err(BackendError::Unavailable {
                backend: self.name(),
                reason: format!(
                    "stores its KV cache as the model declares; a `{kv}` cache is {}'s only (use --kv-cache model)",
                    onnx_genai_native::NAME
                ),
            });
        }
        Ok(match self {
            BackendKind::Ort => Arc::new(onnx_genai_ort::OrtModel::load(package, threads)?),
            BackendKind::NativeCpu => Arc::new(onnx_genai_native::NativeModel::load_with(package, threads, kv)?),
            BackendKind::NativeCuda => Arc::new(onnx_genai_cuda::CudaModel::load(package)?),
        })
    }

    /// [`BackendKind::load`] and one sequence on it.
    pub fn decoder(self, package: &Package, threads: usize) -> Result<Decoder, BackendError> {
        Ok(Decoder::new(self.load(package, threads)?))
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s).ok_or_else(|| format!("unknown backend `{s}` (known: {})", Self::names()))
    }
}
