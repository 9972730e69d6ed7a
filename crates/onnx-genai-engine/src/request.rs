//! The one request type and its validation. Everything input can get wrong
//! is a typed [`EngineError`] before any reservation exists.

use crate::chat::Chat;
use crate::constraint::ResponseFormat;
use crate::sampling::{Sampling, MAX_TOP_LOGPROBS};
use crate::EngineError;

/// What the request's prompt is.
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    /// Rendered with the package's chat template (generation prompt added),
    /// with the tools the model may call.
    Chat(Chat),
    TokenIds(Vec<u32>),
    /// Several token rows; equal-length rows run as one `[rows, cols]`
    /// batch, so they count as `rows * longest row` tokens (A7).
    TokenRows(Vec<Vec<u32>>),
}

/// Element types a bound tensor may carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    I64,
}

impl TensorType {
    pub fn size_bytes(self) -> usize {
        match self {
            TensorType::F32 => 4,
            TensorType::F16 => 2,
            TensorType::I64 => 8,
        }
    }
}

/// A tensor the request binds: to an application input (`pixel_values`) or
/// as a component override's output. Raw little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct BoundTensor {
    pub name: String,
    pub dtype: TensorType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl BoundTensor {
    pub fn f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Self {
        Self {
            name: name.into(),
            dtype: TensorType::F32,
            shape,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// Checks that the payload is exactly `shape` of `dtype`.
    pub fn check(&self) -> Result<(), EngineError> {
        let bad = |reason: String| EngineError::Tensor { name: self.name.clone(), reason };
        if self.shape.is_empty() {
            return Err(bad("a bound tensor needs at least one axis".into()));
        }
        let elements = self.shape.iter().try_fold(1usize, |acc, d| acc.checked_mul(*d));
        match elements.and_then(|n| n.checked_mul(self.dtype.size_bytes())) {
            Some(n) if n == self.bytes.len() => Ok(()),
            Some(n) => Err(bad(format!(
                "shape {:?} of {:?} needs {n} bytes, the payload has {}",
                self.shape,
                self.dtype,
                self.bytes.len()
            ))),
            None => Err(bad(format!("shape {:?} overflows", self.shape))),
        }
    }
}

/// Replaces a workflow component's outputs with precomputed tensors (for
/// example image features instead of running the vision encoder).
#[derive(Clone, Debug, PartialEq)]
pub struct ComponentOverride {
    pub component: String,
    pub outputs: Vec<BoundTensor>,
}

/// An engine session: a conversation whose KV cache persists across turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "session-{}", self.0)
    }
}

/// The one request type.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// Tensors bound to the workflow's declared application inputs.
    pub inputs: Vec<BoundTensor>,
    /// Component outputs supplied instead of running the component.
    pub overrides: Vec<ComponentOverride>,
    /// Continue this session (its earlier turns' KV is reused).
    pub session: Option<SessionId>,
    /// `None`: the package's `generation.max_new_tokens`.
    pub max_new_tokens: Option<u32>,
    pub sampling: Sampling,
    /// What the text must be (JSON under a schema, say): a token mask
    /// before every choice.
    pub response_format: ResponseFormat,
    /// Report each generated token's log-probability with this many of the
    /// likeliest alternatives (at most [`MAX_TOP_LOGPROBS`]); `None`: none.
    pub logprobs: Option<usize>,
    /// Choices of this prompt (1 to [`MAX_CHOICES`]): they share its
    /// prefill (the KV is copied once the prompt has run) and choice `k`
    /// samples with `sampling.seed + k`.
    pub n: usize,
}

/// Choices one request may ask for.
pub const MAX_CHOICES: usize = 16;

impl GenerateRequest {
    pub fn text(prompt: impl Into<String>) -> Self {
        Self::new(Prompt::Text(prompt.into()))
    }

    pub fn new(prompt: Prompt) -> Self {
        Self {
            prompt,
            inputs: Vec::new(),
            overrides: Vec::new(),
            session: None,
            max_new_tokens: None,
            sampling: Sampling::default(),
            response_format: ResponseFormat::Text,
            logprobs: None,
            n: 1,
        }
    }

    /// Structure checks that need no package: sampling numbers, tensor
    /// payloads.
    pub(crate) fn check(&self) -> Result<(), EngineError> {
        self.sampling.check().map_err(EngineError::Request)?;
        if let Some(k) = self.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return Err(EngineError::Request(format!(
                "at most {MAX_TOP_LOGPROBS} alternatives per token, asked for {k}"
            )));
        }
        if self.max_new_tokens == Some(0) {
            return Err(EngineError::Request("max_new_tokens must be at least 1".into()));
        }
        if !(1..=MAX_CHOICES).contains(&self.n) {
            return Err(EngineError::Request(format!("n is 1 to {MAX_CHOICES} choices, got {}", self.n)));
        }
        if self.n > 1 && self.session.is_some() {
            return Err(EngineError::Request("n > 1 cannot continue a session: a session carries one history".into()));
        }
        for t in self.inputs.iter().chain(self.overrides.iter().flat_map(|o| &o.outputs)) {
            t.check()?;
        }
        Ok(())
    }
}
