//! `native-cpu`: a compiled plan plus one sequence's state, behind the one
//! decode-backend trait.

use std::sync::Arc;

use onnx_genai_backend::{BackendError, DecodeBackend};
use onnx_genai_package::Package;

use crate::compile::{compile, Binding};
use crate::plan::{Plan, State};

pub const NAME: &str = "native-cpu";

pub struct NativeDecoder {
    plan: Arc<Plan>,
    state: State,
    /// Workers for large kernels; `None` for one thread. Steps always run on
    /// the caller's thread (handing a whole step to a pool costs a context
    /// switch per token), and only products big enough to pay for it enter
    /// the pool.
    pool: Option<rayon::ThreadPool>,
    capacity: usize,
}

/// Reads the package's decoder and compiles it.
pub fn compile_package(package: &Package) -> Result<Plan, BackendError> {
    let load = |what: String, reason: String| BackendError::Load { backend: NAME, what, reason };
    let (binding, path) = Binding::from_package(package).map_err(|e| load("the decoder".into(), e.to_string()))?;
    let model = onnx_genai_onnx::read_model(&path).map_err(|e| load(path.display().to_string(), e.to_string()))?;
    compile(&model, &binding).map_err(|e| load(path.display().to_string(), e.to_string()))
}

impl NativeDecoder {
    /// Compiles the package's decoder and runs it on `threads` threads
    /// (0: one per core; 1: on the calling thread).
    pub fn load(package: &Package, threads: usize) -> Result<Self, BackendError> {
        Self::from_plan(Arc::new(compile_package(package)?), threads)
    }

    /// A new sequence over an already compiled plan.
    pub fn from_plan(plan: Arc<Plan>, threads: usize) -> Result<Self, BackendError> {
        let pool = if threads == 1 {
            None
        } else {
            Some(rayon::ThreadPoolBuilder::new().num_threads(threads).build().map_err(|e| BackendError::Load {
                backend: NAME,
                what: "the thread pool".into(),
                reason: e.to_string(),
            })?)
        };
        let capacity = plan.binding.max_sequence_length;
        let state = plan.new_state(capacity);
        Ok(Self { plan, state, pool, capacity })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Bytes of this sequence's KV cache (allocated once, at capacity).
    pub fn kv_bytes(&self) -> usize {
        self.state.kv_bytes()
    }
}

impl DecodeBackend for NativeDecoder {
    fn name(&self) -> &'static str {
        NAME
    }

    fn vocab_size(&self) -> usize {
        self.plan.binding.vocab_size
    }

    fn kv_len(&self) -> usize {
        self.state.len()
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, BackendError> {
        if tokens.is_empty() {
            return Err(BackendError::Run { backend: NAME, reason: "forward needs at least one token".into() });
        }
        if self.state.len() + tokens.len() > self.capacity {
            return Err(BackendError::Capacity {
                backend: NAME,
                have: self.state.len(),
                reason: format!("{} more exceed max_sequence_length {}", tokens.len(), self.capacity),
            });
        }
        let (plan, state) = (&self.plan, &mut self.state);
        let result = plan.run(state, tokens, self.pool.as_ref());
        result.map_err(|e| BackendError::Run { backend: NAME, reason: e.to_string() })
    }

    fn truncate(&mut self, len: usize) -> Result<(), BackendError> {
        self.state.truncate(len);
        Ok(())
    }

    fn reset(&mut self) {
        self.state.truncate(0);
    }
}
