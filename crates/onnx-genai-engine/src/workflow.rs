//! Interpreted workflows: the package declares its components, their order,
//! the application inputs a request may bind and which components a request
//! may override; the engine runs them on ONNX Runtime. For a
//! vision-language package: image features (from the vision component, an
//! override, or the encoder cache) replace the expanded image placeholder
//! rows of the token embeddings, and the decoder reads embeddings.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use onnx_genai_ort::{ComponentInput, OrtComponent};
use onnx_genai_package::manifest::{ImageInput, Workflow};
use onnx_genai_package::{Package, Role};
use sha2::{Digest, Sha256};

use crate::request::{BoundTensor, GenerateRequest, TensorType};
use crate::EngineError;

pub(crate) struct WorkflowRuntime {
    spec: Workflow,
    image: Option<ImageInput>,
    placeholder: Option<u32>,
    components: BTreeMap<String, OrtComponent>,
    embed: (String, String, String),
    hidden: usize,
    /// Image features by digest of the bound tensor and the prompt tokens.
    cache: FeatureCache,
    /// Times the feature component actually ran (the cache's evidence).
    pub encoder_runs: usize,
}

fn bad(name: &str, reason: impl Into<String>) -> EngineError {
    EngineError::Tensor { name: name.into(), reason: reason.into() }
}

impl WorkflowRuntime {
    /// `None` for a package without declared steps (it runs on a decode
    /// core). Components other than the decoder get `threads` threads each
    /// (0: ONNX Runtime decides).
    pub fn load(package: &Package, threads: usize) -> Result<Option<Self>, EngineError> {
        let Some(spec) = package.manifest.workflow.clone().filter(|w| !w.steps.is_empty()) else { return Ok(None) };
        let decoder = package.decoder()?.0.name.clone();
        let mut components = BTreeMap::new();
        let mut embed = None;
        for step in spec.steps.iter().filter(|s| s.component != decoder) {
            let (component, _) = package.component(&step.component)?;
            if let (Some(i), Some(o)) = (component.port(Role::TokenIds), component.port(Role::InputsEmbeds)) {
                embed = Some((step.component.clone(), i.to_string(), o.to_string()));
            }
            components.insert(step.component.clone(), OrtComponent::load(package, &step.component, threads)?);
        }
        let embed = embed.ok_or_else(|| {
            EngineError::Request("the workflow has no embedding component (token_ids -> inputs_embeds)".into())
        })?;
        let image = spec.image.clone();
        let placeholder = match &image {
            Some(img) => Some(package.tokenizer().token_to_id(&img.placeholder).ok_or_else(|| {
                EngineError::Request(format!("image placeholder `{}` is not a token of the tokenizer", img.placeholder))
            })?),
            None => None,
        };
        Ok(Some(Self {
            spec,
            image,
            placeholder,
            components,
            embed,
            hidden: package.manifest.architecture.hidden_size as usize,
            cache: FeatureCache::default(),
            encoder_runs: 0,
        }))
    }

    /// The prompt with each image placeholder expanded to the image's token
    /// count (what admission counts and the decoder runs, A7). The number of
    /// placeholders must match the images the request supplies.
    pub fn expand(&self, ids: &[u32], request: &GenerateRequest) -> Result<Vec<u32>, EngineError> {
        let (Some(image), Some(ph)) = (&self.image, self.placeholder) else { return Ok(ids.to_vec()) };
        let marks = ids.iter().filter(|t| **t == ph).count();
        let images = usize::from(self.image_supplied(request));
        if marks != images {
            return Err(EngineError::Request(format!(
                "the prompt marks {marks} image(s) with `{}` but the request supplies {images}",
                image.placeholder
            )));
        }
        Ok(ids.iter().flat_map(|t| std::iter::repeat_n(*t, if *t == ph { image.tokens as usize } else { 1 })).collect())
    }

    fn image_supplied(&self, request: &GenerateRequest) -> bool {
        let Some(image) = &self.image else { return false };
        request.overrides.iter().any(|o| o.component == image.features.component)
            || request.inputs.iter().any(|t| {
                self.spec.application_inputs.iter().any(|a| a.name == t.name && a.component == image.features.component)
            })
    }

    /// Refuses what the package does not declare: inputs that are not
    /// application inputs, overrides of components that do not allow them.
    pub fn check_bindings(&self, request: &GenerateRequest) -> Result<(), EngineError> {
        for t in &request.inputs {
            if !self.spec.application_inputs.iter().any(|a| a.name == t.name) {
                let declared: Vec<&str> = self.spec.application_inputs.iter().map(|a| a.name.as_str()).collect();
                return Err(EngineError::Request(format!(
                    "`{}` is not an application input of this workflow (declared: {})",
                    t.name,
                    declared.join(", ")
                )));
            }
        }
        for o in &request.overrides {
            match self.spec.steps.iter().find(|s| s.component == o.component) {
                Some(s) if s.overridable => {}
                Some(_) => {
                    return Err(EngineError::Request(format!("component `{}` does not allow overrides", o.component)))
                }
                None => return Err(EngineError::Request(format!("the workflow has no component `{}`", o.component))),
            }
        }
        Ok(())
    }

    /// The image's `[tokens, hidden]` features: an override, a cached
    /// encoding of the same tensor and tokens, or a fresh encoder run.
    fn features(&mut self, request: &GenerateRequest, ids: &[u32]) -> Result<Option<Arc<Vec<f32>>>, EngineError> {
        let Some(image) = self.image.clone() else { return Ok(None) };
        let want = image.tokens as usize * self.hidden;
        if let Some(o) = request.overrides.iter().find(|o| o.component == image.features.component) {
            let t = o.outputs.iter().find(|t| t.name == image.features.port).ok_or_else(|| {
                EngineError::Request(format!("the override of `{}` must supply `{}`", o.component, image.features.port))
            })?;
            let shape = [1, image.tokens as usize, self.hidden];
            if t.dtype != TensorType::F32 || t.shape != shape {
                return Err(bad(&t.name, format!("expected f32 {shape:?}, got {:?} {:?}", t.dtype, t.shape)));
            }
            return Ok(Some(Arc::new(f32s(t))));
        }
        let Some(input) = self.spec.application_inputs.iter().find(|a| a.component == image.features.component) else {
            return Ok(None);
        };
        let Some(t) = request.inputs.iter().find(|t| t.name == input.name) else { return Ok(None) };
        let p = &image.preprocess;
        let shape = [1, 3, p.height as usize, p.width as usize];
        if t.dtype != TensorType::F32 || t.shape != shape {
            return Err(bad(
                &t.name,
                format!("expected f32 {shape:?} (the declared preprocessing), got {:?} {:?}", t.dtype, t.shape),
            ));
        }
        let key = digest(t, ids);
        if let Some(hit) = self.cache.get(&key) {
            return Ok(Some(hit));
        }
        let component = self.components.get_mut(&image.features.component).ok_or_else(|| {
            EngineError::Request(format!("component `{}` is not a workflow step", image.features.component))
        })?;
        let (out_shape, values) = component.run(
            vec![(input.port.clone(), ComponentInput::F32 { shape: t.shape.clone(), values: f32s(t) })],
            &image.features.port,
        )?;
        if values.len() != want {
            return Err(inconsistent(format!(
                "component `{}` produced `{}` of shape {out_shape:?}: {want} values expected, {} image tokens of \
                 architecture.hidden_size {}",
                image.features.component, image.features.port, image.tokens, self.hidden
            )));
        }
        self.encoder_runs += 1;
        let features = Arc::new(values);
        self.cache.insert(key, features.clone());
        Ok(Some(features))
    }

    /// Token embeddings `[ids.len(), hidden]` (a decode step's input).
    pub fn embed(&mut self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        let (name, input, output) = self.embed.clone();
        let component =
            self.components.get_mut(&name).ok_or_else(|| EngineError::Request(format!("no component `{name}`")))?;
        let values = ids.iter().map(|t| i64::from(*t)).collect();
        let (shape, embeds) =
            component.run(vec![(input, ComponentInput::I64 { shape: vec![1, ids.len()], values })], &output)?;
        // Image features are spliced in by rows of `hidden`: an embedding
        // of another width would misplace them (or reach past the end).
        if embeds.len() != ids.len() * self.hidden {
            return Err(inconsistent(format!(
                "component `{name}` produced `{output}` of shape {shape:?} for {} tokens: rows of \
                 architecture.hidden_size {} expected",
                ids.len(),
                self.hidden
            )));
        }
        Ok(embeds)
    }

    /// The embeddings a prefill of `feed` runs: the part of the
    /// conversation the decoder's KV lacks, whose suffix from `new_start` is
    /// this turn's prompt with images (their placeholder rows replaced by
    /// the image features).
    pub fn prefill_embeds(
        &mut self,
        request: &GenerateRequest,
        feed: &[u32],
        new_start: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let mut embeds = self.embed(feed)?;
        let new_start = new_start.min(feed.len());
        if let (Some(features), Some(ph)) = (self.features(request, &feed[new_start..])?, self.placeholder) {
            let rows: Vec<usize> = (new_start..feed.len()).filter(|i| feed[*i] == ph).collect();
            let h = self.hidden;
            if rows.len() * h != features.len() {
                return Err(EngineError::Request(format!(
                    "the prompt holds {} image placeholder tokens for {} rows of image features",
                    rows.len(),
                    features.len() / h.max(1)
                )));
            }
            // `embed` checked `embeds` holds `feed.len()` rows of `h`.
            for (row, feature) in rows.iter().zip(features.chunks_exact(h)) {
                embeds[row * h..(row + 1) * h].copy_from_slice(feature);
            }
        }
        Ok(embeds)
    }
}

/// A component whose output disagrees with the manifest: the package's
/// fault, not the request's (a server answers 500 and logs it).
fn inconsistent(what: String) -> EngineError {
    EngineError::Backend(onnx_genai_backend::BackendError::Run {
        backend: onnx_genai_ort::NAME,
        reason: format!("the package is inconsistent: {what}; re-export it or correct its manifest"),
    })
}

fn f32s(t: &BoundTensor) -> Vec<f32> {
    t.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The most bytes of image features the encoder cache keeps (64 MiB: a
/// few hundred SmolVLM-sized images, seven of LLaVA's 576 x 4096). Every
/// request with a new image or prompt adds an entry, so without a bound
/// a client changing one pixel a request grew the driver's memory until
/// the process was killed.
const FEATURE_CACHE_BYTES: usize = 64 << 20;

/// Image features by key, the least recently used evicted past
/// [`FEATURE_CACHE_BYTES`] (an entry larger than that is not kept).
#[derive(Default)]
struct FeatureCache {
    entries: HashMap<[u8; 32], Arc<Vec<f32>>>,
    /// Keys, least recently used first.
    order: std::collections::VecDeque<[u8; 32]>,
    bytes: usize,
}

impl FeatureCache {
    fn get(&mut self, key: &[u8; 32]) -> Option<Arc<Vec<f32>>> {
        let hit = self.entries.get(key)?.clone();
        // (A few entries: a linear search costs nothing beside an encoder run.)
        if let Some(at) = self.order.iter().position(|k| k == key) {
            self.order.remove(at);
        }
        self.order.push_back(*key);
        Some(hit)
    }

    fn insert(&mut self, key: [u8; 32], features: Arc<Vec<f32>>) {
        let size = features.len() * std::mem::size_of::<f32>();
        if size > FEATURE_CACHE_BYTES || self.entries.contains_key(&key) {
            return;
        }
        while self.bytes + size > FEATURE_CACHE_BYTES {
            let Some(oldest) = self.order.pop_front() else { break };
            if let Some(gone) = self.entries.remove(&oldest) {
                self.bytes -= gone.len() * std::mem::size_of::<f32>();
            }
        }
        self.entries.insert(key, features);
        self.order.push_back(key);
        self.bytes += size;
    }
}

/// The encoder-cache key: the bound tensor (name, type, shape, bytes) and
/// the tokens it is encoded for, so two different images never share an
/// entry.
fn digest(t: &BoundTensor, ids: &[u32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(t.name.as_bytes());
    h.update([t.dtype as u8]);
    for d in &t.shape {
        h.update((*d as u64).to_le_bytes());
    }
    h.update(&t.bytes);
    for id in ids {
        h.update(id.to_le_bytes());
    }
    h.finalize().into()
}

/// `[1, 3, height, width]` pixel values from an RGB8 image already resized
/// to the declared size: scaled to [0, 1], then `(x - mean) / std`.
pub fn pixel_values(rgb: &[u8], width: u32, height: u32, image: &ImageInput) -> Result<BoundTensor, EngineError> {
    let p = &image.preprocess;
    // (In u64: validation bounds the declared size, not what a caller passes.)
    if (width, height) != (p.width, p.height) || rgb.len() as u64 != u64::from(width) * u64::from(height) * 3 {
        return Err(bad(
            "pixel_values",
            format!("expected a {}x{} RGB image, got {width}x{height} with {} bytes", p.width, p.height, rgb.len()),
        ));
    }
    let plane = (width * height) as usize;
    let mut values = vec![0.0f32; 3 * plane];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for c in 0..3 {
            values[c * plane + i] = (f32::from(px[c]) / 255.0 - p.mean[c]) / p.std[c];
        }
    }
    Ok(BoundTensor::f32("pixel_values", vec![1, 3, height as usize, width as usize], &values))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{FeatureCache, FEATURE_CACHE_BYTES};

    /// The encoder cache stays within `FEATURE_CACHE_BYTES` however many
    /// distinct images arrive, evicting the least recently used: an entry
    /// read again outlives those added before it, and one larger than the
    /// whole cache is not kept.
    #[test]
    fn the_feature_cache_keeps_to_its_bytes_evicting_the_least_recently_used() {
        let quarter = FEATURE_CACHE_BYTES / 4 / std::mem::size_of::<f32>();
        let features = || Arc::new(vec![0.5f32; quarter]);
        let mut cache = FeatureCache::default();
        for k in 0..4u8 {
            cache.insert([k; 32], features());
        }
        assert_eq!(cache.bytes, FEATURE_CACHE_BYTES);
        assert!(cache.get(&[0; 32]).is_some(), "the first entry is still there");
        for k in 4..40u8 {
            cache.insert([k; 32], features());
            assert!(cache.bytes <= FEATURE_CACHE_BYTES, "{} bytes after {k} images", cache.bytes);
            if k == 4 {
                assert!(cache.get(&[1; 32]).is_none(), "the least recently used went first");
                assert!(cache.get(&[0; 32]).is_some(), "the one read again stayed");
            }
        }
        assert_eq!((cache.entries.len(), cache.order.len()), (4, 4));
        cache.insert([99; 32], Arc::new(vec![0.0; 2 * 4 * quarter]));
        assert!(cache.get(&[99; 32]).is_none() && cache.entries.len() == 4, "a too-large entry is not kept");
    }
}
