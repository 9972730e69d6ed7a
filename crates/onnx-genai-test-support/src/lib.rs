//! What the workspace's tests share, written once: a package built from
//! one of the repository's specs (`packages/NAME/spec.yaml`) into a temp
//! dir, and [`Hooked`], the one pass-through model wrapper that probes,
//! gates and injected faults are written against.
//!
//! Test code: a spec that does not parse or build is a broken checkout,
//! so these helpers panic with the path and the error instead of
//! returning them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use onnx_genai_backend::{BackendError, DecodeModel, Entry, Sequence};
use onnx_genai_build::Spec;
pub use onnx_genai_build::Variant;
use onnx_genai_package::Package;

/// The workspace root (where `packages/` and `conformance/` live).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `packages/NAME/spec.yaml`.
pub fn spec_path(name: &str) -> PathBuf {
    root().join("packages").join(name).join("spec.yaml")
}

/// The names of the shipped packages (`packages/*/spec.yaml`), sorted
/// (`spec_files` sorts the paths, whose folder names these are).
pub fn shipped() -> Vec<String> {
    let dir = root().join("packages");
    let specs = onnx_genai_build::spec_files(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let names: Vec<String> =
        specs.iter().filter_map(|p| Some(p.parent()?.file_name()?.to_string_lossy().into_owned())).collect();
    assert!(!names.is_empty(), "no package specs under {}", dir.display());
    names
}

/// The parsed spec of the shipped package `name`.
pub fn spec(name: &str) -> Spec {
    let path = spec_path(name);
    onnx_genai_build::read_spec(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Builds `name`'s `variant` export into `dir` and opens it (validated).
pub fn build_into(name: &str, variant: Variant, dir: &Path) -> Package {
    onnx_genai_build::build_variant(&spec(name), variant, dir)
        .unwrap_or_else(|e| panic!("building {name} ({variant:?}) into {}: {e}", dir.display()));
    Package::open(dir).unwrap_or_else(|e| panic!("the built {name} ({variant:?}) does not open: {e}"))
}

/// `name`'s `variant` export in a fresh temp dir (removed when the
/// returned dir drops, so keep it alive as long as the package is used).
pub fn build_variant(name: &str, variant: Variant) -> (tempfile::TempDir, Package) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("no temp dir: {e}"));
    let package = build_into(name, variant, dir.path());
    (dir, package)
}

/// `name` in this repository's own layout (the decomposed export) in a
/// fresh temp dir.
pub fn build(name: &str) -> (tempfile::TempDir, Package) {
    build_variant(name, Variant::Decomposed)
}

/// What a [`Hooked`] model lets a test see and change: called before the
/// wrapped model makes a sequence or runs a step, and after it answers
/// about its idle memory. Everything else is forwarded untouched.
pub trait Hook: Send + Sync {
    /// Before [`DecodeModel::new_sequence`] (a panic here is the backend's
    /// panic).
    fn new_sequence(&self) {}

    /// Before [`DecodeModel::step`] sees `batch`; an error is returned as
    /// the step's and the wrapped model never runs it.
    fn step(&self, batch: &[Entry<'_>]) -> Result<(), BackendError>;

    /// After [`DecodeModel::release_idle_memory`] gave back what it would:
    /// what the caller is told (by default what the model said).
    fn release_idle_memory(&self, model_says: Option<std::time::Duration>) -> Option<std::time::Duration> {
        model_says
    }

    /// After [`DecodeModel::kept_memory_bytes`]: what the caller is told
    /// (by default what the model said).
    fn kept_memory_bytes(&self, model_says: u64) -> u64 {
        model_says
    }
}

/// A hook shared with the test that reads it.
impl<H: Hook + ?Sized> Hook for Arc<H> {
    fn new_sequence(&self) {
        (**self).new_sequence()
    }
    fn step(&self, batch: &[Entry<'_>]) -> Result<(), BackendError> {
        (**self).step(batch)
    }
    fn release_idle_memory(&self, model_says: Option<std::time::Duration>) -> Option<std::time::Duration> {
        (**self).release_idle_memory(model_says)
    }
    fn kept_memory_bytes(&self, model_says: u64) -> u64 {
        (**self).kept_memory_bytes(model_says)
    }
}

/// A real model behind a [`Hook`]. Every method of [`DecodeModel`] is
/// forwarded: a wrapper that answered for the model (batch width 1,
/// token-exact KV) would change how the engine batches and reserves, and
/// the test would measure something else (the trait has no defaults for
/// them, so a wrapper cannot forget one).
pub struct Hooked<H> {
    inner: Arc<dyn DecodeModel>,
    hook: H,
}

impl<H: Hook> Hooked<H> {
    pub fn new(inner: Arc<dyn DecodeModel>, hook: H) -> Self {
        Self { inner, hook }
    }

    pub fn hook(&self) -> &H {
        &self.hook
    }
}

impl<H: Hook> DecodeModel for Hooked<H> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn context_length(&self) -> usize {
        self.inner.context_length()
    }
    fn new_sequence(&self) -> Box<dyn Sequence> {
        self.hook.new_sequence();
        self.inner.new_sequence()
    }
    fn step(&self, batch: &mut [Entry<'_>]) -> Result<(), BackendError> {
        self.hook.step(batch)?;
        self.inner.step(batch)
    }
    fn batch_width(&self) -> usize {
        self.inner.batch_width()
    }
    fn kv_granularity(&self) -> usize {
        self.inner.kv_granularity()
    }

    fn kv_bytes_per_token(&self) -> Option<u64> {
        self.inner.kv_bytes_per_token()
    }

    fn release_idle_memory(&self) -> Option<std::time::Duration> {
        self.hook.release_idle_memory(self.inner.release_idle_memory())
    }

    fn kept_memory_bytes(&self) -> u64 {
        self.hook.kept_memory_bytes(self.inner.kept_memory_bytes())
    }
}

/// A `[rows, cols]` matrix as `[cols, rows]`: the builder's `[inputs,
/// outputs]` projections in a Hugging Face checkpoint's `[outputs,
/// inputs]` layout (and back).
pub fn transposed(dims: &[usize], values: &[f32]) -> (Vec<usize>, Vec<f32>) {
    let w = onnx_genai_build::pretrained::Weight {
        dims: dims.iter().map(|d| *d as u32).collect(),
        values: values.to_vec(),
        q4: None,
    };
    let t = onnx_genai_build::pretrained::transpose(w);
    (t.dims.iter().map(|d| *d as usize).collect(), t.values)
}

/// Writes f32 tensors (name, dims, values) as a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, dims, _), data)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, dims.clone(), data)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}
