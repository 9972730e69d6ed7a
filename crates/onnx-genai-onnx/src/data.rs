//! Tensor bytes, and ONNX external data: initializers stored in files beside
//! the model (`data_location: EXTERNAL` with `location`, `offset`,
//! `length`). External files are memory-mapped, never copied, and confined
//! to the model's directory.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use crate::proto;
use crate::OnnxError;

/// A read-only memory map of one external data file.
pub struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl MappedFile {
    fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::File::open(path)?;
        // SAFETY: the map is read-only, and a package's files are not
        // modified while it is open (packages are immutable artifacts;
        // the builder writes a new directory). A file truncated under a
        // live map is the one case this cannot guard against.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok(Self { path: path.to_path_buf(), map })
    }
}

/// A tensor's little-endian bytes: held inline, or a range of a mapped
/// external file.
#[derive(Clone)]
pub enum TensorData {
    Inline(Vec<u8>),
    Mapped { file: Arc<MappedFile>, offset: usize, len: usize },
}

impl TensorData {
    pub fn is_mapped(&self) -> bool {
        matches!(self, TensorData::Mapped { .. })
    }
}

impl std::ops::Deref for TensorData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            TensorData::Inline(v) => v,
            TensorData::Mapped { file, offset, len } => &file.map[*offset..*offset + *len],
        }
    }
}

impl From<Vec<u8>> for TensorData {
    fn from(v: Vec<u8>) -> Self {
        TensorData::Inline(v)
    }
}

impl PartialEq for TensorData {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for TensorData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorData::Inline(v) => write!(f, "Inline({} bytes)", v.len()),
            TensorData::Mapped { file, offset, len } => {
                write!(f, "Mapped({} bytes at {offset} of {})", len, file.path.display())
            }
        }
    }
}

/// Resolves external data relative to the model's directory, mapping each
/// file once.
pub struct Resolver {
    dir: PathBuf,
    canonical_dir: Option<PathBuf>,
    files: HashMap<PathBuf, Arc<MappedFile>>,
}

impl Resolver {
    pub fn new(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf(), canonical_dir: dir.canonicalize().ok(), files: HashMap::new() }
    }

    /// The bytes of `tensor` (whose payload must be `expected` bytes) from
    /// its `external_data` entries.
    pub fn resolve(
        &mut self,
        tensor: &str,
        entries: &[proto::StringStringEntryProto],
        expected: usize,
    ) -> Result<TensorData, OnnxError> {
        let err = |location: &str, reason: String| OnnxError::External {
            tensor: tensor.into(),
            location: location.into(),
            reason,
        };
        let get = |key: &str| entries.iter().find(|e| e.key == key).map(|e| e.value.as_str());
        let location = get("location").ok_or_else(|| err("", "no `location` entry".into()))?;
        let number = |key: &str| -> Result<Option<usize>, OnnxError> {
            get(key)
                .map(|v| v.parse::<usize>().map_err(|_| err(location, format!("`{key}` is `{v}`, not a byte count"))))
                .transpose()
        };
        let offset = number("offset")?.unwrap_or(0);
        let length = number("length")?.unwrap_or(expected);
        if length != expected {
            return Err(err(location, format!("`length` is {length} but the tensor's dims need {expected} bytes")));
        }
        let relative = Path::new(location);
        if relative.is_absolute() || relative.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(err(location, "the path leaves the model's directory (absolute or `..`)".into()));
        }
        let path = self.dir.join(relative);
        let canonical = path.canonicalize().map_err(|e| err(location, format!("missing or unreadable: {e}")))?;
        if self.canonical_dir.as_ref().is_none_or(|d| !canonical.starts_with(d)) {
            return Err(err(location, "the path leaves the model's directory (through a link)".into()));
        }
        let file = match self.files.get(&canonical) {
            Some(f) => f.clone(),
            // Opening a FIFO or a device would block or stream forever.
            None if !canonical.is_file() => {
                return Err(err(location, "not a regular file (a FIFO, device or directory)".into()));
            }
            None => {
                let f = Arc::new(MappedFile::open(&canonical).map_err(|e| err(location, format!("cannot map: {e}")))?);
                self.files.insert(canonical, f.clone());
                f
            }
        };
        let size = file.map.len();
        match offset.checked_add(length) {
            Some(end) if end <= size => Ok(TensorData::Mapped { file, offset, len: length }),
            _ => Err(err(
                location,
                format!("needs bytes {offset}..{} but the file has {size}", offset.saturating_add(length)),
            )),
        }
    }
}

/// Alignment of tensors in an external data file (page size, so each can be
/// mapped on its own).
pub const EXTERNAL_ALIGNMENT: u64 = 4096;

/// Moves every initializer of at least `min_bytes` out of `model` into
/// `data_name` (relative to the model) written through `sink`; returns the
/// bytes written.
pub fn externalize(
    model: &mut proto::ModelProto,
    data_name: &str,
    min_bytes: usize,
    sink: &mut impl std::io::Write,
) -> std::io::Result<u64> {
    let mut offset = 0u64;
    let Some(graph) = model.graph.as_mut() else { return Ok(0) };
    for t in graph.initializer.iter_mut().filter(|t| t.raw_data.len() >= min_bytes) {
        let pad = offset.next_multiple_of(EXTERNAL_ALIGNMENT) - offset;
        sink.write_all(&vec![0u8; pad as usize])?;
        offset += pad;
        let raw = std::mem::take(&mut t.raw_data);
        sink.write_all(&raw)?;
        let entry = |key: &str, value: String| proto::StringStringEntryProto { key: key.into(), value };
        t.external_data = vec![
            entry("location", data_name.into()),
            entry("offset", offset.to_string()),
            entry("length", raw.len().to_string()),
        ];
        t.data_location = proto::data_location::EXTERNAL;
        offset += raw.len() as u64;
    }
    Ok(offset)
}
