//! `native-cpu` behind the model/sequence contract: a [`NativeModel`] owns
//! the compiled plan, its thread pool and buffers, and the pool of KV
//! blocks; a [`NativeSequence`] is one conversation's blocks and length.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use onnx_genai_backend::{downcast, BackendError, DecodeModel, Entry, Input, KvCache, Sequence};
use onnx_genai_package::{ElementType, KvGeometry, Package};
use smallvec::SmallVec;

use crate::compile::{compile_with, Binding, WeightForm};
use crate::kernels::Runtime;
use crate::kv::{KvLayout, KvPool, SeqKv};
use crate::plan::{Plan, Workspace};
use crate::pool::{threads_or_cores, ThreadPool};

pub const NAME: &str = "native-cpu";

/// Sequences one run of the plan advances together; larger batches run in
/// chunks of this many.
pub const MAX_BATCH: usize = 64;

/// Returned KV blocks a model keeps for reuse for good.
const KEEP_IDLE_KV_BYTES: usize = 64 << 20;

/// How long a model keeps returned KV blocks past [`KEEP_IDLE_KV_BYTES`]
/// unused before it frees them: longer than a busy server goes between one
/// request's end and the next one's growth, so a steady load reuses its
/// blocks instead of faulting in new ones.
const KV_LINGER: std::time::Duration = std::time::Duration::from_secs(10);

/// The pool and buffers one run at a time works with.
struct Runner {
    runtime: Runtime,
    workspace: Workspace,
}

pub struct NativeModel {
    plan: Arc<Plan>,
    runner: Mutex<Runner>,
    kv: Arc<KvPool>,
    /// The cache as stored (`KvCache::F16` may narrow an f32 model's).
    kv_geometry: KvGeometry,
}

/// Reads the package's decoder and compiles it, one thread per core.
pub fn compile_package(package: &Package) -> Result<Plan, BackendError> {
    compile_package_with(package, WeightForm::Tiled, 0)
}

/// [`compile_package`] with the projection weights in `form`, narrowing
/// them on `threads` threads (0: one per core) of a pool made for the
/// compile.
pub fn compile_package_with(package: &Package, form: WeightForm, threads: usize) -> Result<Plan, BackendError> {
    // Row-form weights are never narrowed: no threads to start for them.
    let pool = match form {
        WeightForm::Rows => ThreadPool::serial(),
        WeightForm::Tiled => ThreadPool::new(threads_or_cores(threads), Duration::ZERO).map_err(pool_error)?,
    };
    compile_on(package, form, &pool)
}

/// [`compile_package_with`] on an existing pool.
fn compile_on(package: &Package, form: WeightForm, pool: &ThreadPool) -> Result<Plan, BackendError> {
    let load = |what: String, reason: String| BackendError::Load { backend: NAME, what, reason };
    let (binding, path) = Binding::from_package(package).map_err(|e| load("the decoder".into(), e.to_string()))?;
    let model = onnx_genai_onnx::read_model(&path).map_err(|e| load(path.display().to_string(), e.to_string()))?;
    compile_with(&model, &binding, form, pool).map_err(|e| load(path.display().to_string(), e.to_string()))
}

/// The most f32 values one of attention's scratch buffers may take (1
/// GiB): a model of 8 KV heads, each shared by 8 query heads, width 128,
/// over 131,072 positions needs 6.4 million at most. A geometry asking more is refused
/// at load whatever the machine would lend (an allocation the OS grants
/// lazily would otherwise fail only when touched).
const MAX_ATTENTION_SCRATCH: usize = 1 << 28;

fn pool_error(e: std::io::Error) -> BackendError {
    BackendError::Load { backend: NAME, what: "the thread pool".into(), reason: e.to_string() }
}

impl NativeModel {
    /// Compiles the package's decoder and runs it on `threads` threads
    /// (0: one per core; 1: on the calling thread).
    pub fn load(package: &Package, threads: usize) -> Result<Self, BackendError> {
        Self::load_with(package, threads, KvCache::Model)
    }

    /// [`NativeModel::load`], its KV cache stored as `kv` says. The
    /// compile narrows the weights on the pool the model then runs on.
    pub fn load_with(package: &Package, threads: usize, kv: KvCache) -> Result<Self, BackendError> {
        let runtime = Runtime::new(threads_or_cores(threads)).map_err(pool_error)?;
        let plan = Arc::new(compile_on(package, WeightForm::Tiled, &runtime.pool)?);
        Self::with_runtime(plan, runtime, kv)
    }

    /// A model over an already compiled plan.
    pub fn from_plan(plan: Arc<Plan>, threads: usize) -> Result<Self, BackendError> {
        Self::from_plan_with(plan, threads, KvCache::Model)
    }

    /// [`NativeModel::from_plan`], its KV cache stored as `kv` says. (The
    /// plan is the same either way: attention reads either element type.)
    pub fn from_plan_with(plan: Arc<Plan>, threads: usize, kv: KvCache) -> Result<Self, BackendError> {
        let runtime = Runtime::new(threads_or_cores(threads)).map_err(pool_error)?;
        Self::with_runtime(plan, runtime, kv)
    }

    fn with_runtime(plan: Arc<Plan>, mut runtime: Runtime, kv: KvCache) -> Result<Self, BackendError> {
        // Attention keeps a score row per query head of a KV group (of at
        // most one part's positions) and the results of a row's parts;
        // sized for the whole context now, so no decode step grows them.
        let min_kv_heads = plan.binding.layers.iter().map(|l| l.kv_heads).min().unwrap_or(1).max(1);
        let n_rep = plan.binding.heads.div_ceil(min_kv_heads);
        let positions = plan.binding.max_sequence_length;
        let widest =
            |f: fn(&onnx_genai_package::KvPorts) -> usize| plan.binding.layers.iter().map(f).max().unwrap_or(0);
        let head_dim = widest(|l| l.head_dim);
        // The manifest's geometry sizes these: what it asks is checked and
        // allocated fallibly, so an absurd one is a load error, not an
        // abort.
        let unaffordable = |floats: Option<usize>| BackendError::Load {
            backend: NAME,
            what: "attention's scratch".into(),
            reason: format!(
                "{n_rep} query heads a KV head, {head_dim} wide, over {positions} positions need {} f32 values \
                 in one buffer, past the {MAX_ATTENTION_SCRATCH} it may take or the memory there is; \
                 lower the manifest's max_sequence_length (or num_attention_heads)",
                floats.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string())
            ),
        };
        let scores = n_rep.checked_mul(positions.min(crate::kernels::attention::PART_POSITIONS));
        let (row_parts, step_parts) =
            crate::kernels::attention::part_buffers(n_rep, head_dim, widest(|l| l.kv_heads), positions)
                .ok_or_else(|| unaffordable(None))?;
        let scores = scores.ok_or_else(|| unaffordable(None))?;
        let reserve = |buffer: &mut Vec<f32>, floats: usize| {
            if floats > MAX_ATTENTION_SCRATCH {
                return Err(unaffordable(Some(floats)));
            }
            buffer.try_reserve(floats).map_err(|_| unaffordable(Some(floats)))
        };
        for t in 0..runtime.scratch.len() {
            let scratch = runtime.scratch.get_mut(t);
            reserve(&mut scratch.b, scores)?;
            reserve(&mut scratch.c, row_parts)?;
        }
        reserve(runtime.attention_parts.get_mut().unwrap_or_else(|p| p.into_inner()), step_parts)?;
        let f16 = plan.binding.kv_f16 || kv == KvCache::F16;
        let layers: Vec<(usize, usize)> = plan.binding.layers.iter().map(|l| (l.kv_heads, l.head_dim)).collect();
        let kv_geometry = plan.binding.kv_geometry(if f16 { ElementType::F16 } else { ElementType::F32 });
        let kv = KvPool::new(KvLayout::new(&layers, f16), KEEP_IDLE_KV_BYTES, KV_LINGER);
        let workspace = plan.workspace();
        Ok(Self { plan, runner: Mutex::new(Runner { runtime, workspace }), kv, kv_geometry })
    }

    /// The model keeping up to `keep_bytes` of returned KV blocks for
    /// good and any more for `linger` after their return, instead of
    /// [`KEEP_IDLE_KV_BYTES`] and [`KV_LINGER`] (a test's model, whose
    /// blocks must age out in its time).
    #[cfg(test)]
    fn with_kv_keep(mut self, keep_bytes: usize, linger: std::time::Duration) -> Self {
        self.kv = KvPool::new(self.kv.layout().clone(), keep_bytes, linger);
        self
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Threads a run uses.
    pub fn threads(&self) -> usize {
        self.runner().runtime.pool.threads()
    }

    fn runner(&self) -> std::sync::MutexGuard<'_, Runner> {
        // A panic inside a run leaves the buffers in an unknown state, but
        // every run rewrites what it reads, so they stay usable.
        self.runner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the kernels of `isa` from now on (below the best this CPU has:
    /// to compare instruction-set paths on a whole model); `Unavailable`
    /// when this CPU lacks it.
    pub fn set_isa(&self, isa: crate::kernels::isa::Isa) -> Result<(), BackendError> {
        if !isa.available() {
            return Err(BackendError::Unavailable {
                backend: NAME,
                reason: format!("this CPU has no {isa} kernels (best: {})", crate::kernels::isa::Isa::best()),
            });
        }
        self.runner().runtime.isa = isa;
        Ok(())
    }

    /// Starts (or stops) adding each step's wall time to a per-step profile.
    pub fn set_profiling(&self, on: bool) {
        self.runner().workspace.profile = on.then(Vec::new);
    }

    /// Starts (or stops) keeping every step's first output of the last run.
    pub fn set_tracing(&self, on: bool) {
        self.runner().workspace.trace = on.then(Vec::new);
    }

    /// Every step's first output in the last run (with tracing on).
    pub fn trace(&self) -> Vec<crate::value::Value> {
        self.runner().workspace.trace.clone().unwrap_or_default()
    }

    /// The per-step wall times gathered so far, indexed like
    /// [`Plan::step_ops`].
    pub fn profile(&self) -> Vec<std::time::Duration> {
        self.runner().workspace.profile.clone().unwrap_or_default()
    }

    /// Runs one chunk of at most [`MAX_BATCH`] entries in one pass.
    fn run_chunk(&self, chunk: &mut [Entry<'_>]) -> Result<(), BackendError> {
        let context = self.plan.binding.max_sequence_length;
        let mut kvs: SmallVec<[&mut SeqKv; 16]> = SmallVec::new();
        let mut tokens: SmallVec<[&[u32]; 16]> = SmallVec::new();
        let mut logits: SmallVec<[&mut Vec<f32>; 16]> = SmallVec::new();
        for Entry { sequence, input, logits: out } in chunk.iter_mut() {
            let seq = downcast::<NativeSequence>(&mut **sequence, NAME)?;
            let Input::Tokens(t) = *input else {
                return Err(BackendError::Run {
                    backend: NAME,
                    reason: "this decoder reads token ids; native-cpu does not take input embeddings".into(),
                });
            };
            if t.is_empty() {
                return Err(BackendError::Run { backend: NAME, reason: "forward needs at least one token".into() });
            }
            if seq.kv.len() + t.len() > context {
                return Err(BackendError::Capacity {
                    backend: NAME,
                    have: seq.kv.len(),
                    reason: format!("{} more exceed max_sequence_length {context}", t.len()),
                });
            }
            kvs.push(&mut seq.kv);
            tokens.push(t);
            logits.push(&mut **out);
        }
        let pasts: SmallVec<[usize; 16]> = kvs.iter().map(|kv| kv.len()).collect();
        for (kv, t) in kvs.iter_mut().zip(&tokens) {
            kv.reserve(kv.len() + t.len());
        }
        let mut runner = self.runner();
        let Runner { runtime, workspace } = &mut *runner;
        let result = self.plan.run(workspace, runtime.ctx(), &mut kvs, &tokens, &mut logits);
        runtime.even_out_scratch();
        if let Err(e) = result {
            // Give back what the failed step reserved.
            for (kv, past) in kvs.iter_mut().zip(pasts) {
                kv.truncate(past);
            }
            return Err(BackendError::Run { backend: NAME, reason: e.to_string() });
        }
        Ok(())
    }
}

impl DecodeModel for NativeModel {
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
        Box::new(NativeSequence { kv: SeqKv::new(self.kv.clone(), self.plan.binding.max_sequence_length) })
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
        crate::kv::BLOCK_TOKENS
    }

    fn kv_bytes_per_token(&self) -> Option<u64> {
        (!self.kv_geometry.layers.is_empty()).then(|| self.kv_geometry.bytes_per_token())
    }

    fn release_idle_memory(&self) -> Option<std::time::Duration> {
        self.kv.release_expired()
    }

    fn kept_memory_bytes(&self) -> u64 {
        self.kv.idle_bytes() as u64
    }
}

/// One sequence of a [`NativeModel`]: its KV blocks and length.
#[derive(Debug)]
pub struct NativeSequence {
    kv: SeqKv,
}

impl Sequence for NativeSequence {
    fn kv_len(&self) -> usize {
        self.kv.len()
    }

    fn truncate(&mut self, len: usize) -> Result<(), BackendError> {
        self.kv.truncate(len);
        Ok(())
    }

    fn reset(&mut self) {
        self.kv.truncate(0);
    }

    fn resident_bytes(&self) -> u64 {
        self.kv.resident_bytes() as u64
    }

    fn fork(&self) -> Result<Option<Box<dyn Sequence>>, BackendError> {
        Ok(Some(Box::new(NativeSequence { kv: self.kv.fork() })))
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use onnx_genai_backend::{BackendError, DecodeModel, Entry, Input};
    use onnx_genai_build::Variant;

    use super::NativeModel;

    /// The model's side of the idle release the server's driver relies on:
    /// a dropped sequence's blocks are what `kept_memory_bytes` reports
    /// (the server's kept-bytes gauge), and `release_idle_memory` says how
    /// long until they age out and, once they have, frees them.
    #[test]
    fn a_models_kept_blocks_show_and_go_once_they_age_out() {
        let (_dir, package) = onnx_genai_test_support::build_variant("tiny-llama-gqa", Variant::Genai);
        let linger = Duration::from_millis(500);
        let model = NativeModel::load(&package, 1).unwrap().with_kv_keep(0, linger);
        assert_eq!((model.kept_memory_bytes(), model.release_idle_memory()), (0, None), "a fresh model keeps nothing");
        let mut seq = model.new_sequence();
        let mut logits = Vec::new();
        let prompt: Vec<u32> = (1..=70).collect();
        model.step(&mut [Entry { sequence: &mut *seq, input: Input::Tokens(&prompt), logits: &mut logits }]).unwrap();
        let resident = seq.resident_bytes();
        assert!(resident > 0);
        drop(seq);
        let dropped = std::time::Instant::now();
        assert_eq!(model.kept_memory_bytes(), resident, "the sequence's blocks are kept while they linger");
        let wait = model.release_idle_memory();
        // (A machine that stalled past the linger here has aged them out
        // already: only the end is checked then.)
        if dropped.elapsed() < linger / 2 {
            assert!(wait.is_some_and(|w| w > linger / 2 && w <= linger), "blocks past the keep say when: {wait:?}");
            assert_eq!(model.kept_memory_bytes(), resident, "nothing aged out yet");
        }
        std::thread::sleep(linger + Duration::from_millis(20));
        assert_eq!(model.release_idle_memory(), None, "nothing is left to age out");
        assert_eq!(model.kept_memory_bytes(), 0, "aged-out blocks are freed");
    }

    /// Bad input at load (DESIGN's no-abort rule): a package whose
    /// geometry passes validation but whose attention scratch, reserved
    /// for the whole context at load, cannot be allocated (4096 query
    /// heads sharing the tiny model's 2 KV heads over 2^24 positions:
    /// tens of GiB of score and part buffers) is a typed load error naming
    /// that scratch, not an allocation abort.
    #[test]
    fn attention_scratch_past_memory_is_a_load_error_not_an_abort() {
        let dir = tempfile::tempdir().unwrap();
        onnx_genai_test_support::build_into("tiny-llama-gqa", Variant::Decomposed, dir.path());
        let manifest = dir.path().join(onnx_genai_package::validate::MANIFEST_FILE);
        let text = std::fs::read_to_string(&manifest).unwrap();
        let absurd = text
            .replace("num_attention_heads: 4\n", "num_attention_heads: 4096\n")
            .replace("max_sequence_length: 256\n", "max_sequence_length: 16777216\n");
        assert_ne!(absurd, text, "the manifest's geometry was rewritten");
        std::fs::write(&manifest, absurd).unwrap();
        let package = onnx_genai_package::Package::open(dir.path()).unwrap();
        let err = NativeModel::load(&package, 1).err().expect("the scratch cannot be reserved");
        let message = err.to_string();
        assert!(matches!(err, BackendError::Load { .. }), "{message}");
        assert!(message.contains("attention's scratch") && message.contains("max_sequence_length"), "{message}");
    }
}
