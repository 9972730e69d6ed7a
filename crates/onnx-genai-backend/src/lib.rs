//! The one decode-backend trait. ONNX Runtime (the reference) and the native
//! backends implement it, so the engine, the parity suite and the benchmarks
//! drive every backend the same way.

/// A backend's failure, with the backend and what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{backend}: cannot load {what}: {reason}")]
    Load { backend: &'static str, what: String, reason: String },
    #[error("{backend}: {reason}")]
    Run { backend: &'static str, reason: String },
    #[error("{backend}: the KV cache holds {have} tokens; {reason}")]
    Capacity { backend: &'static str, have: usize, reason: String },
}

/// One sequence's decode state on one backend: the KV cache lives inside.
pub trait DecodeBackend: Send {
    /// Short name for reports (`ort`, `native-cpu`).
    fn name(&self) -> &'static str;

    /// Width of the logits this backend returns.
    fn vocab_size(&self) -> usize;

    /// Tokens currently held in the KV cache.
    fn kv_len(&self) -> usize;

    /// Runs `tokens` after what the cache holds (a prefill when the cache is
    /// empty, a decode step for one token), appends their KV, and returns the
    /// logits of the last token.
    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, BackendError>;

    /// [`DecodeBackend::forward`] for a decoder that reads embeddings: `embeds`
    /// holds `embeds.len() / hidden` rows of `hidden` values.
    fn forward_embeds(&mut self, embeds: &[f32], hidden: usize) -> Result<Vec<f32>, BackendError> {
        let _ = (embeds, hidden);
        Err(BackendError::Run {
            backend: self.name(),
            reason: "this backend's decoder does not take input embeddings".into(),
        })
    }

    /// Keeps the first `len` positions of the KV cache and forgets the rest
    /// (no-op when the cache holds fewer).
    fn truncate(&mut self, len: usize) -> Result<(), BackendError>;

    /// Drops the whole KV cache.
    fn reset(&mut self);
}
