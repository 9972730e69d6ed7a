//! The one decode-backend contract. ONNX Runtime (the reference) and the
//! native backends implement it, so the engine, the parity suite and the
//! benchmarks drive every backend the same way.
//!
//! It has two halves. A [`DecodeModel`] is loaded and compiled once per
//! served package (plan, packed weights, thread pool, ONNX Runtime session)
//! and is shared by every [`Sequence`] of that package. A sequence is one
//! conversation's KV cache and position: created in microseconds, holding
//! only the KV bytes it has filled (growing on demand). One
//! [`DecodeModel::step`] advances a batch of sequences with ragged lengths;
//! a session or a stateless request is just a sequence, and [`Decoder`] is
//! the single-sequence view the parity suite and the benchmarks use.

use std::any::Any;
use std::sync::Arc;

/// A backend's failure, with the backend and what it was doing.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{backend}: cannot load {what}: {reason}")]
    Load { backend: &'static str, what: String, reason: String },
    #[error("{backend}: {reason}")]
    Run { backend: &'static str, reason: String },
    #[error("{backend}: the KV cache holds {have} tokens; {reason}")]
    Capacity { backend: &'static str, have: usize, reason: String },
    /// The backend cannot run on this machine (no driver, no device).
    #[error("{backend}: {reason}")]
    Unavailable { backend: &'static str, reason: String },
}

/// How a model stores its sequences' keys and values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvCache {
    /// In the element type the model's KV ports declare: what the
    /// reference computes with.
    #[default]
    Model,
    /// In f16, whatever the model declares: half the bytes of an f32 cache
    /// (so twice the positions under one KV budget, and half the reads of
    /// a long context's attention), at f16's rounding of every key and
    /// value. native-cpu only.
    F16,
}

impl KvCache {
    pub const ALL: [KvCache; 2] = [KvCache::Model, KvCache::F16];

    pub fn name(self) -> &'static str {
        match self {
            KvCache::Model => "model",
            KvCache::F16 => "f16",
        }
    }
}

impl std::fmt::Display for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvCache {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
            format!("unknown KV cache type `{s}` (known: {})", known.join(", "))
        })
    }
}

/// What one sequence of a batch step feeds the model.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    /// Token ids after what the sequence's cache holds (a prefill, a chunk
    /// of one, or one decode token).
    Tokens(&'a [u32]),
    /// Rows of `hidden` embedding values, for a decoder that reads
    /// `inputs_embeds` (a workflow's decoder).
    Embeds { values: &'a [f32], hidden: usize },
}

impl Input<'_> {
    /// Positions this input adds to the cache.
    pub fn positions(&self) -> usize {
        match self {
            Input::Tokens(t) => t.len(),
            Input::Embeds { values, hidden } => values.len().checked_div(*hidden).unwrap_or(0),
        }
    }
}

/// One sequence's share of a batch step.
pub struct Entry<'a> {
    pub sequence: &'a mut dyn Sequence,
    pub input: Input<'a>,
    /// Receives the logits of the input's last position (`vocab_size`
    /// values); its buffer is reused, so a warmed-up step allocates nothing.
    pub logits: &'a mut Vec<f32>,
}

/// A loaded, compiled model: shared by all of its sequences.
pub trait DecodeModel: Send + Sync {
    /// Short name for reports (`ort`, `native-cpu`).
    fn name(&self) -> &'static str;

    /// Width of the logits this model returns.
    fn vocab_size(&self) -> usize;

    /// Positions a sequence may hold (the package's context length).
    fn context_length(&self) -> usize;

    /// A new, empty sequence of this model. It holds no KV memory until it
    /// is stepped.
    fn new_sequence(&self) -> Box<dyn Sequence>;

    /// Advances every entry of `batch` by its input and writes each entry's
    /// last-position logits. A batch may mix prefills and decode steps of
    /// different lengths. On error no sequence's [`Sequence::kv_len`] has
    /// changed, so the caller may retry entries one at a time to find the
    /// one at fault.
    fn step(&self, batch: &mut [Entry<'_>]) -> Result<(), BackendError>;

    /// How many sequences one [`DecodeModel::step`] advances in a single
    /// pass over the weights (1: the model runs a batch's entries one after
    /// another). No default: a wrapper that forgot to forward it would
    /// silently change how the engine batches.
    fn batch_width(&self) -> usize;

    /// Positions a sequence's KV memory grows by (its blocks; 1: exactly
    /// what it holds). Admission reserves whole blocks so that what it
    /// counts covers what is resident. No default, for the same reason.
    fn kv_granularity(&self) -> usize;

    /// KV bytes one position of one sequence holds, as this model stores
    /// them (admission reserves this much per position; `None`: the model
    /// keeps no KV cache). No default: the package's figure is wrong for a
    /// model that stores its cache in another type.
    fn kv_bytes_per_token(&self) -> Option<u64>;

    /// Gives back the memory this model kept for reuse past its standing
    /// keep (returned KV blocks) once it has lain unused long enough, and
    /// says how long until more would have (`None`: nothing kept past the
    /// standing keep). An idle server calls this, so what a past burst left
    /// does not stay for good. No default: a wrapper that forgot to forward
    /// it would keep a burst's memory for the server's life.
    fn release_idle_memory(&self) -> Option<std::time::Duration>;

    /// Bytes this model keeps for reuse outside every sequence (returned
    /// KV blocks: its standing keep, and more while they linger after a
    /// burst). Admission's budget does not count them; the server shows
    /// them as a gauge. No default, for the reason above.
    fn kept_memory_bytes(&self) -> u64;
}

/// One sequence's decode state: its KV cache and position.
pub trait Sequence: Send + Any {
    /// Tokens currently held in the KV cache.
    fn kv_len(&self) -> usize;

    /// Keeps the first `len` positions of the KV cache and forgets the rest
    /// (no-op when the cache holds fewer).
    fn truncate(&mut self, len: usize) -> Result<(), BackendError>;

    /// Drops the whole KV cache (and the memory it held).
    fn reset(&mut self);

    /// KV bytes this sequence holds resident now.
    fn resident_bytes(&self) -> u64;

    /// A new sequence holding a copy of this one's KV cache (several
    /// choices of one prompt share its prefill this way); `None` when the
    /// backend cannot copy one, and each copy must prefill itself.
    fn fork(&self) -> Result<Option<Box<dyn Sequence>>, BackendError> {
        Ok(None)
    }

    /// For the model that made this sequence: its concrete type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// Runs `batch` through `run` in chunks of at most `width` entries (a
/// model's [`DecodeModel::batch_width`]). When a chunk fails, every sequence
/// of the batch is put back where it was — earlier chunks had advanced — so
/// the [`DecodeModel::step`] contract (a failed step changes no sequence's
/// length) holds across chunks.
pub fn step_in_chunks(
    batch: &mut [Entry<'_>],
    width: usize,
    mut run: impl FnMut(&mut [Entry<'_>]) -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    if batch.len() <= width {
        return run(batch);
    }
    let pasts: Vec<usize> = batch.iter().map(|e| e.sequence.kv_len()).collect();
    for chunk in batch.chunks_mut(width.max(1)) {
        if let Err(e) = run(chunk) {
            for (entry, past) in batch.iter_mut().zip(&pasts) {
                let _ = entry.sequence.truncate(*past);
            }
            return Err(e);
        }
    }
    Ok(())
}

/// The concrete sequence type `S` behind `sequence`, or a typed error when a
/// sequence of another model is handed to `backend`.
pub fn downcast<'a, S: Sequence>(
    sequence: &'a mut dyn Sequence,
    backend: &'static str,
) -> Result<&'a mut S, BackendError> {
    sequence
        .as_any_mut()
        .downcast_mut::<S>()
        .ok_or_else(|| BackendError::Run { backend, reason: "a sequence of another model was stepped here".into() })
}

/// One sequence on a shared model: the single-sequence view (parity,
/// goldens, benchmarks, workflow decoding).
pub struct Decoder {
    model: Arc<dyn DecodeModel>,
    sequence: Box<dyn Sequence>,
    logits: Vec<f32>,
}

impl Decoder {
    pub fn new(model: Arc<dyn DecodeModel>) -> Self {
        let sequence = model.new_sequence();
        Self { model, sequence, logits: Vec::new() }
    }

    pub fn model(&self) -> &Arc<dyn DecodeModel> {
        &self.model
    }

    pub fn name(&self) -> &'static str {
        self.model.name()
    }

    pub fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    pub fn kv_len(&self) -> usize {
        self.sequence.kv_len()
    }

    /// Runs `input` after what the cache holds; the last position's logits.
    pub fn run(&mut self, input: Input<'_>) -> Result<&[f32], BackendError> {
        let mut batch = [Entry { sequence: self.sequence.as_mut(), input, logits: &mut self.logits }];
        self.model.step(&mut batch)?;
        Ok(&self.logits)
    }

    /// [`Decoder::run`] on token ids, returning owned logits.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, BackendError> {
        self.run(Input::Tokens(tokens)).map(<[f32]>::to_vec)
    }

    /// [`Decoder::run`] on `embeds.len() / hidden` rows of embeddings.
    pub fn forward_embeds(&mut self, embeds: &[f32], hidden: usize) -> Result<Vec<f32>, BackendError> {
        self.run(Input::Embeds { values: embeds, hidden }).map(<[f32]>::to_vec)
    }

    pub fn truncate(&mut self, len: usize) -> Result<(), BackendError> {
        self.sequence.truncate(len)
    }

    pub fn reset(&mut self) {
        self.sequence.reset();
    }

    pub fn resident_bytes(&self) -> u64 {
        self.sequence.resident_bytes()
    }
}
