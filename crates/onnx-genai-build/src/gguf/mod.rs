//! GGUF (v3) files, as llama.cpp writes them: the header, metadata
//! key/values of every type, tensor infos, the aligned data section, and
//! dequantization of the tensor types in [`quant`]. A truncated or corrupt
//! file is an error naming the byte offset and the field being read.

pub mod quant;
pub mod tokenizer;
pub mod weights;
pub mod writer;

use std::collections::BTreeMap;
use std::path::Path;

pub use quant::TensorType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a GGUF file: the first bytes are {found:?}, not \"GGUF\"")]
    Magic { found: Vec<u8> },
    #[error("GGUF version {0} is not supported (versions 2 and 3 are)")]
    Version(u32),
    #[error("truncated at byte {offset} while reading {field}: {need} bytes needed, {left} left")]
    Truncated { offset: u64, field: String, need: u64, left: u64 },
    #[error("corrupt at byte {offset} in {field}: {reason}")]
    Corrupt { offset: u64, field: String, reason: String },
    #[error("tensor `{name}` has type {ty}, which is not supported (supported: {supported})")]
    UnsupportedType { name: String, ty: String, supported: &'static str },
    #[error("metadata `{key}`: {reason}")]
    Metadata { key: String, reason: String },
    #[error("{0}")]
    Unsupported(String),
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Any integer value that fits `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor's data lies.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` varies fastest (a `[out, in]` matrix is
    /// `dims = [in, out]`).
    pub dims: Vec<u64>,
    pub ty: TensorType,
    /// Absolute offset of the data in the file.
    pub offset: u64,
    pub bytes: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A whole GGUF file in memory.
pub struct Gguf {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    bytes: Vec<u8>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let bytes = std::fs::read(path).map_err(|source| GgufError::Io { path: path.display().to_string(), source })?;
        Self::parse(bytes)
    }

    pub fn parse(bytes: Vec<u8>) -> Result<Self, GgufError> {
        let mut r = Cursor { bytes: &bytes, pos: 0 };
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(GgufError::Magic { found: magic.to_vec() });
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let tensor_count = r.u64("tensor_count")?;
        let kv_count = r.u64("metadata_kv_count")?;
        let mut metadata = BTreeMap::new();
        for i in 0..kv_count {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("type of `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::Metadata {
                        key: "general.alignment".into(),
                        reason: format!("{v:?} is not a positive power of two"),
                    })
                }
            },
        };
        let mut infos = Vec::new();
        for i in 0..tensor_count {
            let name = r.string(&format!("name of tensor #{i}"))?;
            let at = r.pos;
            let n_dims = r.u32(&format!("n_dims of `{name}`"))?;
            if n_dims == 0 || n_dims > 4 {
                return Err(r.corrupt(at, &format!("n_dims of `{name}`"), format!("{n_dims} dimensions (1 to 4)")));
            }
            let dims = (0..n_dims).map(|_| r.u64(&format!("dims of `{name}`"))).collect::<Result<Vec<_>, _>>()?;
            let at = r.pos;
            let code = r.u32(&format!("type of `{name}`"))?;
            let ty = TensorType::from_code(code).ok_or_else(|| GgufError::UnsupportedType {
                name: name.clone(),
                ty: TensorType::code_name(code),
                supported: TensorType::SUPPORTED,
            })?;
            let offset = r.u64(&format!("offset of `{name}`"))?;
            let elements = dims.iter().try_fold(1u64, |a, d| a.checked_mul(*d));
            let too_large = || r.corrupt(at, &format!("`{name}`"), format!("{dims:?} {ty:?} values overflow 64 bits"));
            let elements = elements.ok_or_else(too_large)?;
            if !elements.is_multiple_of(ty.block().0) {
                return Err(r.corrupt(
                    at,
                    &format!("`{name}`"),
                    format!("{dims:?} is not a whole number of {ty:?} blocks"),
                ));
            }
            let bytes = ty.bytes_for(elements).ok_or_else(too_large)?;
            infos.push(TensorInfo { name, dims, ty, offset, bytes });
        }
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let len = bytes.len() as u64;
        for t in &mut infos {
            if !t.offset.is_multiple_of(alignment) {
                return Err(GgufError::Corrupt {
                    offset: t.offset,
                    field: format!("data offset of `{}`", t.name),
                    reason: format!("not aligned to {alignment}"),
                });
            }
            let start = data_start.checked_add(t.offset);
            match start.and_then(|s| s.checked_add(t.bytes)) {
                Some(end) if end <= len => t.offset += data_start,
                _ => {
                    return Err(GgufError::Truncated {
                        offset: start.unwrap_or(u64::MAX),
                        field: format!("data of tensor `{}`", t.name),
                        need: t.bytes,
                        left: len.saturating_sub(start.unwrap_or(len)),
                    })
                }
            }
        }
        // Each tensor's data its own: ranges that overlap would let a file
        // of a few megabytes declare a model of any size, every tensor
        // reading the same bytes (and each dequantized apart).
        let mut ranges: Vec<(u64, u64, &str)> =
            infos.iter().map(|t| (t.offset, t.offset + t.bytes, t.name.as_str())).collect();
        ranges.sort_unstable();
        if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(GgufError::Corrupt {
                offset: w[1].0,
                field: format!("data of tensor `{}`", w[1].2),
                reason: format!("overlaps the data of `{}`", w[0].2),
            });
        }
        Ok(Self { version, metadata, tensors: infos, alignment, bytes })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required metadata value, converted by `f`.
    pub fn require<T>(&self, key: &str, what: &str, f: impl Fn(&Value) -> Option<T>) -> Result<T, GgufError> {
        let v = self
            .get(key)
            .ok_or_else(|| GgufError::Metadata { key: key.into(), reason: format!("missing (expected {what})") })?;
        f(v).ok_or_else(|| GgufError::Metadata { key: key.into(), reason: format!("expected {what}, found {v:?}") })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (bounds checked at parse time).
    pub fn raw(&self, t: &TensorInfo) -> &[u8] {
        &self.bytes[t.offset as usize..(t.offset + t.bytes) as usize]
    }

    /// A tensor's values as f32, in GGML order.
    pub fn dequantize(&self, t: &TensorInfo) -> Vec<f32> {
        quant::dequantize(t.ty, self.raw(t))
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: u64,
}

/// The most elements a metadata array may hold (2^24: a tokenizer's
/// tokens, scores and merges are the largest, a few hundred thousand).
const MAX_ARRAY_ELEMENTS: u64 = 1 << 24;

/// Nested arrays deeper than this are corrupt, not data.
const MAX_DEPTH: u32 = 4;

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        self.bytes.len() as u64 - self.pos
    }

    fn corrupt(&self, offset: u64, field: &str, reason: String) -> GgufError {
        GgufError::Corrupt { offset, field: field.into(), reason }
    }

    fn take(&mut self, n: u64, field: &str) -> Result<&'a [u8], GgufError> {
        if n > self.left() {
            return Err(GgufError::Truncated { offset: self.pos, field: field.into(), need: n, left: self.left() });
        }
        let start = self.pos as usize;
        self.pos += n;
        Ok(&self.bytes[start..start + n as usize])
    }

    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, field)?);
        Ok(out)
    }

    fn u32(&mut self, field: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    fn string(&mut self, field: &str) -> Result<String, GgufError> {
        let at = self.pos;
        let len = self.u64(field)?;
        let raw = self.take(len, field)?;
        String::from_utf8(raw.to_vec()).map_err(|e| self.corrupt(at, field, format!("string is not UTF-8: {e}")))
    }

    fn value(&mut self, ty: u32, field: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(field)?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array(field)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(field)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            4 => Value::U32(self.u32(field)?),
            5 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            7 => {
                let at = self.pos;
                match self.array::<1>(field)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(self.corrupt(at, field, format!("bool byte {b}"))),
                }
            }
            8 => Value::String(self.string(field)?),
            9 => {
                let at = self.pos;
                if depth >= MAX_DEPTH {
                    return Err(self.corrupt(at, field, format!("arrays nested deeper than {MAX_DEPTH}")));
                }
                let elem = self.u32(field)?;
                let count = self.u64(field)?;
                // Every element takes at least one byte: a count beyond the
                // bytes left is corruption, not a reason to allocate.
                if count > self.left() {
                    return Err(GgufError::Truncated {
                        offset: self.pos,
                        field: format!("{field} ({count} array elements)"),
                        need: count,
                        left: self.left(),
                    });
                }
                if count > MAX_ARRAY_ELEMENTS {
                    return Err(self.corrupt(
                        at,
                        field,
                        format!("an array of {count} elements, more than the {MAX_ARRAY_ELEMENTS} read"),
                    ));
                }
                // Reserved for at most what the file could hold one byte an
                // element, and never all at once: an element takes 32
                // bytes here, so a count the bytes left allow could still
                // ask many times the file.
                let mut items = Vec::with_capacity((count as usize).min(1 << 16));
                for _ in 0..count {
                    items.push(self.value(elem, field, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(field)?),
            11 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(field)?)),
            other => {
                return Err(self.corrupt(self.pos, field, format!("unknown value type {other}")));
            }
        })
    }
}

#[cfg(test)]
pub(crate) mod tests;
