//! A checkpoint's safetensors files, memory-mapped: one file, or the
//! shards `model.safetensors.index.json` names.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::Value;

use super::{json, HfError};
use crate::pretrained::Weight;

/// The checkpoint's safetensors files, memory-mapped, and which holds
/// which tensor.
pub(super) struct Tensors {
    /// Each file, its map and its header (read once: a header may be 100
    /// MB, and a checkpoint has thousands of tensors).
    maps: Vec<(String, memmap2::Mmap, Header)>,
    /// Tensor name → index into `maps`.
    at: HashMap<String, usize>,
    /// The names [`Self::get`] was asked for.
    read: HashSet<String>,
}

impl Tensors {
    pub(super) fn open(dir: &Path) -> Result<Self, HfError> {
        const INDEX: &str = "model.safetensors.index.json";
        let files: Vec<String> = if dir.join(INDEX).is_file() {
            let index = json(dir, INDEX)?;
            let map = index["weight_map"]
                .as_object()
                .ok_or_else(|| HfError::Invalid { file: INDEX.into(), reason: "no `weight_map` object".into() })?;
            let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(str::to_string).collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".into()]
        };
        let mut maps = Vec::new();
        let mut at = HashMap::new();
        for file in files {
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(HfError::Invalid {
                    file: INDEX.into(),
                    reason: format!("`{file}` is not a file of the checkpoint"),
                });
            }
            let path = dir.join(&file);
            let handle = std::fs::File::open(&path).map_err(|source| HfError::Io { path: path.clone(), source })?;
            // SAFETY: the map is only read, and the checkpoint's files are
            // not modified while the import runs (as every safetensors
            // reader assumes); a truncated file is caught by the header
            // check below, not by reading past the end.
            let map = unsafe { memmap2::Mmap::map(&handle) }.map_err(|source| HfError::Io { path, source })?;
            let (size, metadata) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| HfError::Invalid { file: file.clone(), reason: e.to_string() })?;
            for name in metadata.tensors().into_keys() {
                at.insert(name, maps.len());
            }
            maps.push((file, map, Header { data_start: HEADER_LENGTH_BYTES + size, metadata }));
        }
        Ok(Self { maps, at, read: HashSet::new() })
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.at.contains_key(name)
    }

    /// The checkpoint's tensors never asked for with [`Self::get`], sorted.
    pub(super) fn unused(&self) -> Vec<String> {
        let mut names: Vec<String> = self.at.keys().filter(|n| !self.read.contains(*n)).cloned().collect();
        names.sort();
        names
    }

    /// Tensor `name`, which must have exactly `shape`, as f32 values
    /// (F32, F16 and BF16 are read).
    pub(super) fn get(&mut self, name: &str, shape: &[u32]) -> Result<Weight, HfError> {
        let err = |reason: String| HfError::Tensor { name: name.into(), reason };
        self.read.insert(name.to_string());
        let &i = self.at.get(name).ok_or_else(|| err("missing from the checkpoint's safetensors files".into()))?;
        let (file, map, header) = &self.maps[i];
        let info = header.metadata.info(name).ok_or_else(|| err(format!("{file}: not in its header")))?;
        let want: Vec<usize> = shape.iter().map(|d| *d as usize).collect();
        if info.shape != want {
            return Err(err(format!("has shape {:?}, the config implies {want:?}", info.shape)));
        }
        // (The header's offsets were validated against the file when read.)
        let (start, end) = info.data_offsets;
        let bytes = map
            .get(header.data_start + start..header.data_start + end)
            .ok_or_else(|| err(format!("{file}: its data lies past the end of the file")))?;
        let values: Vec<f32> = match info.dtype {
            safetensors::Dtype::F32 => {
                bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            safetensors::Dtype::F16 => {
                bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            safetensors::Dtype::BF16 => {
                bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            other => return Err(err(format!("element type {other:?} is not read (F32, F16, BF16 are)"))),
        };
        Ok(Weight { dims: shape.to_vec(), values, q4: None })
    }
}

/// Bytes of a safetensors file before its JSON header: the header's length.
const HEADER_LENGTH_BYTES: usize = 8;

/// A safetensors file's header, as validated against the file.
struct Header {
    /// Where the tensors' data starts (after the length and the header).
    data_start: usize,
    metadata: safetensors::tensor::Metadata,
}
