//! Decoding on ONNX Runtime behind the model/sequence contract. One
//! [`OrtModel`] holds the session (loaded once per package); each
//! [`OrtSequence`] holds its KV cache as the `present` values of its last
//! run, fed back as the next run's `past` inputs without host copies. The
//! exported graphs take one sequence per run, so a batch step runs its
//! sequences one after another.

use std::sync::Mutex;

use onnx_genai_backend::{downcast, BackendError, DecodeModel, Entry, Input, Sequence};
use onnx_genai_package::{ElementType, KvGeometry, Package, Role};
use ort::session::{Session, SessionInputValue};
use ort::value::{DynValue, Tensor, TensorElementType};

use crate::edge::{declared, float_input, float_output, int_input, run_err};
use crate::NAME;

type LayerPorts = onnx_genai_package::KvPorts;

/// What the decoder's ports are and what it expects of them.
struct Ports {
    /// Exactly one of `token_ids` and `inputs_embeds` is bound.
    token_ids: Option<String>,
    inputs_embeds: Option<String>,
    /// The element types the graph declares where the package allows
    /// either (validation accepts int32 or int64 ids, masks and
    /// positions, and f32 or f16 embeddings and logits): values are
    /// converted at the session's edge, so every such package runs.
    token_ids_i32: bool,
    embeds_f16: bool,
    attention_mask: Option<String>,
    attention_mask_i32: bool,
    position_ids: Option<String>,
    position_ids_i32: bool,
    logits: String,
    logits_f16: bool,
    layers: Vec<LayerPorts>,
    kv_dtype: ElementType,
    /// KV bytes per cached position (all layers, key and value).
    bytes_per_token: u64,
    vocab: usize,
    max_len: usize,
}

pub struct OrtModel {
    session: Mutex<Session>,
    ports: Ports,
}

/// One sequence: per layer `(key, value)` as returned by its last run.
pub struct OrtSequence {
    past: Vec<(DynValue, DynValue)>,
    kv_len: usize,
    /// Needed to cut the cache (`truncate` copies a prefix).
    layers: Vec<LayerPorts>,
    kv_dtype: ElementType,
    bytes_per_token: u64,
}

impl OrtModel {
    /// Opens the package's decoder in an ONNX Runtime session with
    /// `intra_threads` threads (0 lets ONNX Runtime choose).
    pub fn load(package: &Package, intra_threads: usize) -> Result<Self, BackendError> {
        let (component, path) = package.decoder().map_err(|e| BackendError::Load {
            backend: NAME,
            what: "the decoder".into(),
            reason: e.to_string(),
        })?;
        let load_err = |reason: String| BackendError::Load { backend: NAME, what: path.display().to_string(), reason };
        let session = crate::open_session(path, intra_threads)?;
        let m = &package.manifest;
        let geometry = package.kv_tensors();
        let required = |role: Role| {
            component
                .port(role)
                .map(str::to_string)
                .ok_or_else(|| load_err(format!("no `{}` port is bound", role.as_str())))
        };
        let token_ids = component.port(Role::TokenIds).map(str::to_string);
        let inputs_embeds = component.port(Role::InputsEmbeds).map(str::to_string);
        if token_ids.is_none() && inputs_embeds.is_none() {
            return Err(load_err("neither `token_ids` nor `inputs_embeds` is bound".into()));
        }
        let input_is = |name: Option<&str>, ty| name.and_then(|n| declared(session.inputs(), n)) == Some(ty);
        let attention_mask = component.port(Role::AttentionMask).map(str::to_string);
        let position_ids = component.port(Role::PositionIds).map(str::to_string);
        let logits = required(Role::Logits)?;
        let layers = package.kv_ports(component).map_err(|e| load_err(e.to_string()))?;
        let bytes_per_token = KvGeometry::from_ports(geometry.dtype, &layers).bytes_per_token();
        let ports = Ports {
            token_ids_i32: input_is(token_ids.as_deref(), TensorElementType::Int32),
            embeds_f16: input_is(inputs_embeds.as_deref(), TensorElementType::Float16),
            attention_mask_i32: input_is(attention_mask.as_deref(), TensorElementType::Int32),
            position_ids_i32: input_is(position_ids.as_deref(), TensorElementType::Int32),
            logits_f16: declared(session.outputs(), &logits) == Some(TensorElementType::Float16),
            token_ids,
            inputs_embeds,
            attention_mask,
            position_ids,
            logits,
            layers,
            kv_dtype: geometry.dtype,
            bytes_per_token,
            vocab: m.architecture.vocab_size as usize,
            max_len: m.architecture.max_sequence_length as usize,
        };
        Ok(Self { session: Mutex::new(session), ports })
    }

    /// One run of `input` after what `seq` holds; writes the last position's
    /// logits. On error the sequence is unchanged.
    fn run_one(&self, seq: &mut OrtSequence, input: Input<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let p = &self.ports;
        let count = input.positions();
        if count == 0 {
            return Err(run_err("forward needs at least one position"));
        }
        let total = seq.kv_len + count;
        if total > p.max_len {
            return Err(BackendError::Capacity {
                backend: NAME,
                have: seq.kv_len,
                reason: format!("{count} more exceed max_sequence_length {}", p.max_len),
            });
        }
        let first: (String, DynValue) = match input {
            Input::Tokens(tokens) => {
                let port = p
                    .token_ids
                    .clone()
                    .ok_or_else(|| run_err("this decoder reads `inputs_embeds`; run it through its workflow"))?;
                let ids = tokens.iter().map(|t| i64::from(*t)).collect();
                let value = int_input(vec![1, count], ids, p.token_ids_i32, &port)?;
                (port, value)
            }
            Input::Embeds { values, hidden } => {
                let port = p
                    .inputs_embeds
                    .clone()
                    .ok_or_else(|| run_err("this decoder reads token ids, not `inputs_embeds`"))?;
                if hidden == 0 || !values.len().is_multiple_of(hidden) {
                    return Err(run_err(format!("{} embedding values are not rows of {hidden}", values.len())));
                }
                let value = float_input(vec![1, count, hidden], values, p.embeds_f16)?;
                (port, value)
            }
        };
        if seq.past.is_empty() {
            seq.past = empty_cache(&p.layers, p.kv_dtype)?;
        }
        let mut inputs: Vec<(String, SessionInputValue<'_>)> = Vec::with_capacity(3 + 2 * p.layers.len());
        inputs.push((first.0, first.1.into()));
        if let Some(name) = &p.attention_mask {
            inputs.push((name.clone(), int_input(vec![1, total], vec![1; total], p.attention_mask_i32, name)?.into()));
        }
        if let Some(name) = &p.position_ids {
            let positions = (seq.kv_len as i64..total as i64).collect();
            inputs.push((name.clone(), int_input(vec![1, count], positions, p.position_ids_i32, name)?.into()));
        }
        for (l, (key, value)) in p.layers.iter().zip(&seq.past) {
            inputs.push((l.past_key.clone(), key.into()));
            inputs.push((l.past_value.clone(), value.into()));
        }
        let mut session = self.session.lock().unwrap_or_else(|e| e.into_inner());
        let mut outputs = session.run(inputs).map_err(run_err)?;
        let out = outputs.remove(&p.logits).ok_or_else(|| run_err(format!("no `{}` output", p.logits)))?;
        let mut next = Vec::with_capacity(p.layers.len());
        for l in &p.layers {
            let mut take = |name: &str| {
                let present = outputs.remove(name).ok_or_else(|| run_err(format!("no `{name}` output")))?;
                check_present(&present, name, l, total, p.kv_dtype)?;
                Ok::<_, BackendError>(present)
            };
            next.push((take(&l.present_key)?, take(&l.present_value)?));
        }
        let last_row = |shape: &[i64], len: usize| {
            let width = shape.last().copied().unwrap_or(0) as usize;
            if width != p.vocab || len < p.vocab {
                return Err(run_err(format!("logits shape {shape:?} does not end in vocab {}", p.vocab)));
            }
            Ok(len - p.vocab..len)
        };
        float_output(&out, p.logits_f16, last_row, logits)?;
        drop(outputs);
        drop(session);
        seq.past = next;
        seq.kv_len = total;
        Ok(())
    }
}

/// A present K/V output must be the whole cache, `[1, kv_heads, total,
/// head_dim]`, in the cache's type: it is fed back as the next step's
/// past and sliced by position (`prefix`), so a graph that returns only
/// the new positions, or another geometry, is refused here rather than
/// read past its end later.
fn check_present(
    present: &DynValue,
    name: &str,
    l: &LayerPorts,
    total: usize,
    dtype: ElementType,
) -> Result<(), BackendError> {
    let want = [1, l.kv_heads as i64, total as i64, l.head_dim as i64];
    // (Compared in place: two per layer every step, nothing allocated
    // unless it is wrong.)
    let shape: &[i64] = match dtype {
        ElementType::F32 => present.try_extract_tensor::<f32>().map_err(run_err)?.0,
        ElementType::F16 => present.try_extract_tensor::<half::f16>().map_err(run_err)?.0,
    };
    if shape != want {
        return Err(run_err(format!(
            "the decoder's output `{name}` has shape {shape:?}, the whole cache {want:?} expected (past and new \
             positions: batch, KV heads, positions, head_dim); the package's graph does not match its KV geometry"
        )));
    }
    Ok(())
}

fn empty_kv(kv_heads: usize, head_dim: usize, dtype: ElementType) -> Result<DynValue, BackendError> {
    let shape = [1usize, kv_heads, 0, head_dim];
    Ok(match dtype {
        ElementType::F32 => Tensor::from_array((shape, Vec::<f32>::new())).map_err(run_err)?.into_dyn(),
        ElementType::F16 => Tensor::from_array((shape, Vec::<half::f16>::new())).map_err(run_err)?.into_dyn(),
    })
}

fn empty_cache(layers: &[LayerPorts], dtype: ElementType) -> Result<Vec<(DynValue, DynValue)>, BackendError> {
    layers
        .iter()
        .map(|l| Ok((empty_kv(l.kv_heads, l.head_dim, dtype)?, empty_kv(l.kv_heads, l.head_dim, dtype)?)))
        .collect()
}

impl DecodeModel for OrtModel {
    fn name(&self) -> &'static str {
        NAME
    }

    fn vocab_size(&self) -> usize {
        self.ports.vocab
    }

    fn context_length(&self) -> usize {
        self.ports.max_len
    }

    fn new_sequence(&self) -> Box<dyn Sequence> {
        Box::new(OrtSequence {
            past: Vec::new(),
            kv_len: 0,
            layers: self.ports.layers.clone(),
            kv_dtype: self.ports.kv_dtype,
            bytes_per_token: self.ports.bytes_per_token,
        })
    }

    fn step(&self, batch: &mut [Entry<'_>]) -> Result<(), BackendError> {
        // One sequence at a time; a failure puts the ones already run back.
        onnx_genai_backend::step_in_chunks(batch, 1, |chunk| match chunk {
            [] => Ok(()),
            [Entry { sequence, input, logits }] => {
                downcast::<OrtSequence>(&mut **sequence, NAME).and_then(|seq| self.run_one(seq, *input, logits))
            }
            _ => Err(BackendError::Run { backend: NAME, reason: "a chunk of one holds more".into() }),
        })
    }

    // The exported graphs take one sequence per run, so a batch runs its
    // sequences one after another.
    fn batch_width(&self) -> usize {
        1
    }

    // Past KV is concatenated per token: what is resident is exactly what
    // the sequence holds.
    fn kv_granularity(&self) -> usize {
        1
    }

    fn kv_bytes_per_token(&self) -> Option<u64> {
        Some(self.ports.bytes_per_token)
    }

    /// Nothing kept: a sequence's cache tensors go with it.
    fn release_idle_memory(&self) -> Option<std::time::Duration> {
        None
    }

    /// Nothing kept, as above.
    fn kept_memory_bytes(&self) -> u64 {
        0
    }
}

impl OrtSequence {
    /// The first `len` positions of a `[1, kv_heads, kv_len, head_dim]` cache
    /// tensor, copied into a new tensor.
    fn prefix(&self, t: &DynValue, l: &LayerPorts, len: usize) -> Result<DynValue, BackendError> {
        fn rows<T: Copy>(data: &[T], l: &LayerPorts, have: usize, len: usize) -> Result<Vec<T>, BackendError> {
            let mut out = Vec::with_capacity(l.kv_heads * len * l.head_dim);
            for h in 0..l.kv_heads {
                let start = h * have * l.head_dim;
                // (`run_one` checked every cache tensor's shape; this
                // guards the slice all the same.)
                let head = data.get(start..start + len * l.head_dim).ok_or_else(|| {
                    run_err(format!("a cache tensor of {} values holds no {len} positions of head {h}", data.len()))
                })?;
                out.extend_from_slice(head);
            }
            Ok(out)
        }
        let shape = [1usize, l.kv_heads, len, l.head_dim];
        let have = self.kv_len;
        Ok(match self.kv_dtype {
            ElementType::F32 => {
                let (_, data) = t.try_extract_tensor::<f32>().map_err(run_err)?;
                Tensor::from_array((shape, rows(data, l, have, len)?)).map_err(run_err)?.into_dyn()
            }
            ElementType::F16 => {
                let (_, data) = t.try_extract_tensor::<half::f16>().map_err(run_err)?;
                Tensor::from_array((shape, rows(data, l, have, len)?)).map_err(run_err)?.into_dyn()
            }
        })
    }
}

impl Sequence for OrtSequence {
    fn kv_len(&self) -> usize {
        self.kv_len
    }

    fn truncate(&mut self, len: usize) -> Result<(), BackendError> {
        if len >= self.kv_len {
            return Ok(());
        }
        if len == 0 {
            self.reset();
            return Ok(());
        }
        let mut kept = Vec::with_capacity(self.past.len());
        for (l, (key, value)) in self.layers.iter().zip(&self.past) {
            kept.push((self.prefix(key, l, len)?, self.prefix(value, l, len)?));
        }
        self.past = kept;
        self.kv_len = len;
        Ok(())
    }

    fn reset(&mut self) {
        self.past = Vec::new();
        self.kv_len = 0;
    }

    fn resident_bytes(&self) -> u64 {
        self.kv_len as u64 * self.bytes_per_token
    }

    fn fork(&self) -> Result<Option<Box<dyn Sequence>>, BackendError> {
        let mut past = Vec::with_capacity(self.past.len());
        for (l, (key, value)) in self.layers.iter().zip(&self.past) {
            past.push((self.prefix(key, l, self.kv_len)?, self.prefix(value, l, self.kv_len)?));
        }
        Ok(Some(Box::new(OrtSequence {
            past,
            kv_len: self.kv_len,
            layers: self.layers.clone(),
            kv_dtype: self.kv_dtype,
            bytes_per_token: self.bytes_per_token,
        })))
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
