//! `native-cuda` behind the model/sequence contract: a [`CudaModel`] owns
//! the plan's weights on the device and the buffers of its runs; a
//! [`CudaSequence`] is one conversation's KV cache on the device.

use std::sync::{Arc, Mutex};

use onnx_genai_backend::{downcast, BackendError, DecodeModel, Entry, Input, Sequence};
use onnx_genai_native::value::Value;
use onnx_genai_native::{compile_package_with, Plan, WeightForm};
use onnx_genai_package::{ElementType, Package};

use crate::device::Device;
use crate::error::CudaError;
use crate::kv::{SeqKv, KV_BLOCK};
use crate::runner::Runner;

pub const NAME: &str = "native-cuda";

/// Sequences one run advances together.
pub const MAX_BATCH: usize = 64;

pub struct CudaModel {
    device: Arc<Device>,
    plan: Arc<Plan>,
    runner: Mutex<Runner>,
    /// `kv_heads * head_dim` per layer.
    widths: Arc<Vec<usize>>,
}

impl CudaModel {
    /// Compiles the package's decoder (weights kept in row form) and loads
    /// it onto the first GPU. Without a driver or device this is
    /// [`BackendError::Unavailable`].
    pub fn load(package: &Package) -> Result<Self, BackendError> {
        // Probe first: on a machine without CUDA the answer should say so,
        // not that compiling the package took time for nothing.
        crate::device::probe().map_err(|e| e.into_backend("the device"))?;
        let plan = Arc::new(compile_package_with(package, WeightForm::Rows, 0).map_err(|e| match e {
            BackendError::Load { what, reason, .. } => BackendError::Load { backend: NAME, what, reason },
            other => other,
        })?);
        Self::from_plan(plan)
    }

    /// A model over an already compiled (row-form) plan.
    pub fn from_plan(plan: Arc<Plan>) -> Result<Self, BackendError> {
        let device = Arc::new(Device::open().map_err(|e| e.into_backend("the device"))?);
        let runner = Runner::new(device.clone(), plan.clone()).map_err(|e| e.into_backend("the plan"))?;
        let widths = Arc::new(plan.binding.layers.iter().map(|l| l.kv_heads * l.head_dim).collect());
        Ok(Self { device, plan, runner: Mutex::new(runner), widths })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The GPU's name and compute capability.
    pub fn device_name(&self) -> &str {
        &self.device.description
    }

    /// Bytes of projection weights resident on the device.
    pub fn weight_bytes(&self) -> usize {
        self.runner().weight_bytes()
    }

    /// Plan steps that ran on the host in the last run (shape arithmetic
    /// the plan did not fold).
    pub fn host_steps(&self) -> usize {
        self.runner().host_steps
    }

    /// Decode steps replayed from a captured CUDA graph so far.
    pub fn graph_replays(&self) -> u64 {
        self.runner().replays
    }

    /// Turns capturing and replaying decode steps as CUDA graphs on or off
    /// (on by default; off runs every step's launches one by one).
    pub fn set_graphs(&self, on: bool) {
        self.runner().use_graphs = on;
    }

    /// Nodes, edges and programmatic edges of the decode step captured for
    /// `batch` sequences (after a few decode steps of that width).
    pub fn graph_shape(&self, batch: usize) -> Option<(usize, usize, usize)> {
        self.runner().graph_shape(batch)
    }

    /// Turns programmatic dependent launch on or off (on by default where the
    /// device supports it, compute capability 9.0 and later): each kernel
    /// may then start (the 4-bit projections also request their first
    /// weights) while the one before it runs; it stays off where
    /// [`CudaModel::overlap_supported`] is false. Captured graphs are
    /// dropped, to be captured again with the new launches.
    pub fn set_overlap(&self, on: bool) {
        self.device.set_overlap(on);
        self.runner().drop_graphs();
    }

    /// Whether the device supports programmatic dependent launch (compute
    /// capability 9.0 and later), the default there.
    pub fn overlap_supported(&self) -> bool {
        self.device.overlap_supported()
    }

    /// Starts (or stops and clears) timing every step alone, by op (runs
    /// are then never captured as graphs).
    pub fn set_profiling(&self, on: bool) {
        self.runner().profile = on.then(Default::default);
    }

    /// Time and count of the steps run since profiling started, by op,
    /// largest first.
    pub fn profile(&self) -> Vec<(String, std::time::Duration, u64)> {
        let mut p: Vec<_> = self
            .runner()
            .profile
            .as_ref()
            .map(|m| m.iter().map(|(k, (d, n))| (k.clone(), *d, *n)).collect())
            .unwrap_or_default();
        p.sort_by_key(|e| std::cmp::Reverse(e.1));
        p
    }

    /// Starts (or stops) keeping every step's first output of the last run.
    pub fn set_tracing(&self, on: bool) {
        self.runner().trace = on.then(Vec::new);
    }

    /// Every step's first output in the last run (with tracing on).
    pub fn trace(&self) -> Vec<Value> {
        self.runner().trace.clone().unwrap_or_default()
    }

    fn runner(&self) -> std::sync::MutexGuard<'_, Runner> {
        self.runner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run_chunk(&self, chunk: &mut [Entry<'_>]) -> Result<(), BackendError> {
        let context = self.plan.binding.max_sequence_length;
        let run = |reason: String| BackendError::Run { backend: NAME, reason };
        if chunk.len() > 1 && !self.plan.batchable() {
            return Err(run("this plan runs one sequence at a time".into()));
        }
        let mut seqs: Vec<&mut CudaSequence> = Vec::with_capacity(chunk.len());
        let mut tokens: Vec<&[u32]> = Vec::with_capacity(chunk.len());
        let mut logits: Vec<&mut Vec<f32>> = Vec::with_capacity(chunk.len());
        for Entry { sequence, input, logits: out } in chunk.iter_mut() {
            let seq = downcast::<CudaSequence>(&mut **sequence, NAME)?;
            let Input::Tokens(t) = *input else {
                return Err(run("this decoder reads token ids; native-cuda does not take input embeddings".into()));
            };
            if t.is_empty() {
                return Err(run("forward needs at least one token".into()));
            }
            if seq.kv.len() + t.len() > context {
                return Err(BackendError::Capacity {
                    backend: NAME,
                    have: seq.kv.len(),
                    reason: format!("{} more exceed max_sequence_length {context}", t.len()),
                });
            }
            seqs.push(seq);
            tokens.push(t);
            logits.push(&mut **out);
        }
        let mut runner = self.runner();
        self.device.bind().map_err(|e| run(e.to_string()))?;
        for (seq, t) in seqs.iter_mut().zip(&tokens) {
            let need = seq.kv.len() + t.len();
            seq.kv.reserve(need).map_err(|e| run(format!("KV cache for {need} positions: {e}")))?;
        }
        let kvs: Vec<&SeqKv> = seqs.iter().map(|s| &s.kv).collect();
        runner.run(&kvs, &tokens, &mut logits).map_err(run)?;
        for (seq, t) in seqs.iter_mut().zip(&tokens) {
            let len = seq.kv.len() + t.len();
            seq.kv.set_len(len);
        }
        Ok(())
    }
}

impl DecodeModel for CudaModel {
    fn name(&self) -> &'static str {
        NAME
    }

    fn vocab_size(&self) -> usize {
        self.plan.binding.vocab_size
    }

    fn context_length(&self) -> usize {
        self.plan.binding.max_sequence_length
    }

    fn new_sequence(&self) -> Box<dyn Sequence> {
        Box::new(CudaSequence {
            kv: SeqKv::new(self.device.clone(), self.widths.clone(), self.plan.binding.max_sequence_length),
        })
    }

    fn step(&self, batch: &mut [Entry<'_>]) -> Result<(), BackendError> {
        onnx_genai_backend::step_in_chunks(batch, self.batch_width(), |chunk| self.run_chunk(chunk))
    }

    fn batch_width(&self) -> usize {
        if self.plan.batchable() {
            MAX_BATCH
        } else {
            1
        }
    }

    fn kv_granularity(&self) -> usize {
        KV_BLOCK
    }

    fn kv_bytes_per_token(&self) -> Option<u64> {
        // Every cache is f32 on the device (an f16 model's values are
        // rounded to f16 and stored wide), whatever the manifest declares.
        Some(self.plan.binding.kv_geometry(ElementType::F32).bytes_per_token())
    }

    /// Nothing kept: a sequence's device cache goes with it.
    fn release_idle_memory(&self) -> Option<std::time::Duration> {
        None
    }

    /// Nothing kept, as above.
    fn kept_memory_bytes(&self) -> u64 {
        0
    }
}

/// One sequence of a [`CudaModel`]: its KV cache on the device.
pub struct CudaSequence {
    kv: SeqKv,
}

impl Sequence for CudaSequence {
    fn kv_len(&self) -> usize {
        self.kv.len()
    }

    fn truncate(&mut self, len: usize) -> Result<(), BackendError> {
        self.kv.truncate(len);
        Ok(())
    }

    fn reset(&mut self) {
        self.kv.clear();
    }

    fn resident_bytes(&self) -> u64 {
        self.kv.resident_bytes()
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl From<CudaError> for BackendError {
    fn from(e: CudaError) -> Self {
        e.into_backend("the device")
    }
}
