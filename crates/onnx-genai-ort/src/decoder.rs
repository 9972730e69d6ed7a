//! One sequence decoded on ONNX Runtime, with the KV cache carried between
//! steps: the `present` outputs of one run are fed back as the next run's
//! `past` inputs without copying through host arrays.

use onnx_genai_backend::{BackendError, DecodeBackend};
use onnx_genai_package::{ElementType, Package, Role};
use ort::session::Session;
use ort::value::{DynValue, Tensor, TensorElementType};

const NAME: &str = "ort";

fn run_err(reason: impl std::fmt::Display) -> BackendError {
    BackendError::Run { backend: NAME, reason: reason.to_string() }
}

type LayerPorts = onnx_genai_package::KvPorts;

pub struct OrtDecoder {
    session: Session,
    /// Exactly one of `token_ids` and `inputs_embeds` is bound.
    token_ids: Option<String>,
    inputs_embeds: Option<String>,
    token_ids_i32: bool,
    attention_mask: Option<String>,
    position_ids: Option<String>,
    logits: String,
    layers: Vec<LayerPorts>,
    kv_dtype: ElementType,
    /// Per layer: (key, value) as returned by the last run.
    past: Vec<(DynValue, DynValue)>,
    kv_len: usize,
    vocab: usize,
    max_len: usize,
}

impl OrtDecoder {
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
        let token_ids_i32 = session
            .inputs()
            .iter()
            .find(|o| Some(o.name()) == token_ids.as_deref())
            .and_then(|o| o.dtype().tensor_type())
            == Some(TensorElementType::Int32);
        let layers = package.kv_ports(component).map_err(|e| load_err(e.to_string()))?;
        let mut decoder = Self {
            session,
            token_ids,
            inputs_embeds,
            token_ids_i32,
            attention_mask: component.port(Role::AttentionMask).map(str::to_string),
            position_ids: component.port(Role::PositionIds).map(str::to_string),
            logits: required(Role::Logits)?,
            layers,
            kv_dtype: geometry.dtype,
            past: Vec::new(),
            kv_len: 0,
            vocab: m.architecture.vocab_size as usize,
            max_len: m.architecture.max_sequence_length as usize,
        };
        decoder.reset_cache()?;
        Ok(decoder)
    }

    fn empty_kv(&self, kv_heads: usize, head_dim: usize) -> Result<DynValue, BackendError> {
        let shape = [1usize, kv_heads, 0, head_dim];
        Ok(match self.kv_dtype {
            ElementType::F32 => Tensor::from_array((shape, Vec::<f32>::new())).map_err(run_err)?.into_dyn(),
            ElementType::F16 => Tensor::from_array((shape, Vec::<half::f16>::new())).map_err(run_err)?.into_dyn(),
        })
    }

    fn reset_cache(&mut self) -> Result<(), BackendError> {
        let mut past = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            past.push((self.empty_kv(l.kv_heads, l.head_dim)?, self.empty_kv(l.kv_heads, l.head_dim)?));
        }
        self.past = past;
        self.kv_len = 0;
        Ok(())
    }

    /// The first `len` positions of a `[1, kv_heads, kv_len, head_dim]` cache
    /// tensor, copied into a new tensor.
    fn prefix(&self, t: &DynValue, l: &LayerPorts, len: usize) -> Result<DynValue, BackendError> {
        fn rows<T: Copy>(data: &[T], l: &LayerPorts, have: usize, len: usize) -> Vec<T> {
            let mut out = Vec::with_capacity(l.kv_heads * len * l.head_dim);
            for h in 0..l.kv_heads {
                let start = h * have * l.head_dim;
                out.extend_from_slice(&data[start..start + len * l.head_dim]);
            }
            out
        }
        let shape = [1usize, l.kv_heads, len, l.head_dim];
        let have = self.kv_len;
        Ok(match self.kv_dtype {
            ElementType::F32 => {
                let (_, data) = t.try_extract_tensor::<f32>().map_err(run_err)?;
                Tensor::from_array((shape, rows(data, l, have, len))).map_err(run_err)?.into_dyn()
            }
            ElementType::F16 => {
                let (_, data) = t.try_extract_tensor::<half::f16>().map_err(run_err)?;
                Tensor::from_array((shape, rows(data, l, have, len))).map_err(run_err)?.into_dyn()
            }
        })
    }

    /// One run of `count` new positions whose first input is `first`.
    fn step(&mut self, first: (String, DynValue), count: usize) -> Result<Vec<f32>, BackendError> {
        if count == 0 {
            return Err(run_err("forward needs at least one position"));
        }
        let total = self.kv_len + count;
        if total > self.max_len {
            return Err(BackendError::Capacity {
                backend: NAME,
                have: self.kv_len,
                reason: format!("{count} more exceed max_sequence_length {}", self.max_len),
            });
        }
        let mut inputs: Vec<(String, DynValue)> = Vec::with_capacity(3 + 2 * self.layers.len());
        inputs.push(first);
        if let Some(name) = &self.attention_mask {
            inputs.push((name.clone(), self.int_input(vec![1; total], false)?));
        }
        if let Some(name) = &self.position_ids {
            inputs.push((name.clone(), self.int_input((self.kv_len as i64..total as i64).collect(), false)?));
        }
        let past = std::mem::take(&mut self.past);
        for (l, (key, value)) in self.layers.iter().zip(past) {
            inputs.push((l.past_key.clone(), key));
            inputs.push((l.past_value.clone(), value));
        }
        match run_step(&mut self.session, inputs, &self.logits, &self.layers, self.vocab) {
            Ok((logits, next)) => {
                self.past = next;
                self.kv_len = total;
                Ok(logits)
            }
            Err(e) => {
                // The past values were moved into the failed run; the cache is
                // no longer coherent, so start over rather than continue wrong.
                self.reset_cache()?;
                Err(e)
            }
        }
    }

    fn int_input(&self, values: Vec<i64>, as_i32: bool) -> Result<DynValue, BackendError> {
        let shape = [1usize, values.len()];
        Ok(if as_i32 {
            let v: Vec<i32> = values.into_iter().map(|x| x as i32).collect();
            Tensor::from_array((shape, v)).map_err(run_err)?.into_dyn()
        } else {
            Tensor::from_array((shape, values)).map_err(run_err)?.into_dyn()
        })
    }
}

impl DecodeBackend for OrtDecoder {
    fn name(&self) -> &'static str {
        NAME
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn kv_len(&self) -> usize {
        self.kv_len
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, BackendError> {
        let Some(port) = self.token_ids.clone() else {
            return Err(run_err("this decoder reads `inputs_embeds`; run it through its workflow"));
        };
        let ids = tokens.iter().map(|t| i64::from(*t)).collect();
        let first = (port, self.int_input(ids, self.token_ids_i32)?);
        self.step(first, tokens.len())
    }

    fn forward_embeds(&mut self, embeds: &[f32], hidden: usize) -> Result<Vec<f32>, BackendError> {
        let Some(port) = self.inputs_embeds.clone() else {
            return Err(run_err("this decoder reads token ids, not `inputs_embeds`"));
        };
        if hidden == 0 || !embeds.len().is_multiple_of(hidden) {
            return Err(run_err(format!("{} embedding values are not rows of {hidden}", embeds.len())));
        }
        let rows = embeds.len() / hidden;
        let value = Tensor::from_array(([1usize, rows, hidden], embeds.to_vec())).map_err(run_err)?.into_dyn();
        self.step((port, value), rows)
    }

    fn truncate(&mut self, len: usize) -> Result<(), BackendError> {
        if len >= self.kv_len {
            return Ok(());
        }
        let past = std::mem::take(&mut self.past);
        let mut kept = Vec::with_capacity(past.len());
        for (l, (key, value)) in self.layers.iter().zip(past) {
            kept.push((self.prefix(&key, l, len)?, self.prefix(&value, l, len)?));
        }
        self.past = kept;
        self.kv_len = len;
        Ok(())
    }

    fn reset(&mut self) {
        // Creating empty tensors only fails if ONNX Runtime cannot allocate;
        // the next forward would then report it.
        let _ = self.reset_cache();
    }
}

type Kv = (DynValue, DynValue);

/// Runs one step; returns the last position's logits and the new KV values.
fn run_step(
    session: &mut Session,
    inputs: Vec<(String, DynValue)>,
    logits_name: &str,
    layers: &[LayerPorts],
    vocab: usize,
) -> Result<(Vec<f32>, Vec<Kv>), BackendError> {
    let mut outputs = session.run(inputs).map_err(run_err)?;
    let logits = outputs.remove(logits_name).ok_or_else(|| run_err(format!("no `{logits_name}` output")))?;
    let (shape, data) = logits.try_extract_tensor::<f32>().map_err(run_err)?;
    let width = shape.last().copied().unwrap_or(0) as usize;
    if width != vocab || data.len() < vocab {
        return Err(run_err(format!("logits shape {shape:?} does not end in vocab {vocab}")));
    }
    let last = data[data.len() - vocab..].to_vec();
    let mut next = Vec::with_capacity(layers.len());
    for l in layers {
        let mut take = |name: &str| outputs.remove(name).ok_or_else(|| run_err(format!("no `{name}` output")));
        next.push((take(&l.present_key)?, take(&l.present_value)?));
    }
    Ok((last, next))
}
