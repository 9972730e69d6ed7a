//! Runtime tensors: a shape and one typed buffer. Kernels recycle the buffer
//! of the slot they write into, so a warmed-up plan allocates nothing per step.

use half::f16;
use smallvec::SmallVec;

/// A tensor shape: up to six axes inline, so building or copying one never
/// touches the heap (a decode step allocates nothing).
pub type Shape = SmallVec<[usize; 6]>;

/// Element types the native backend computes with or stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    I64,
    Bool,
    U8,
    /// Storage and the few kernels that compute in it (standalone graphs:
    /// ONNX's node cases); decoders never produce it.
    F64,
    I32,
}

impl DType {
    pub fn from_onnx(t: onnx_genai_onnx::DataType) -> Option<Self> {
        use onnx_genai_onnx::DataType as D;
        Some(match t {
            D::Float => Self::F32,
            D::Float16 => Self::F16,
            D::Int64 => Self::I64,
            D::Bool => Self::Bool,
            D::Uint8 => Self::U8,
            D::Double => Self::F64,
            D::Int32 => Self::I32,
            _ => return None,
        })
    }

    /// Bytes one element takes in a [`Value`]'s buffer.
    pub fn size(self) -> usize {
        match self {
            Self::F32 | Self::I32 => 4,
            Self::F16 => 2,
            Self::I64 | Self::F64 => 8,
            Self::Bool | Self::U8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::I64 => "i64",
            Self::Bool => "bool",
            Self::U8 => "u8",
            Self::F64 => "f64",
            Self::I32 => "i32",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    F16(Vec<f16>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
    U8(Vec<u8>),
    F64(Vec<f64>),
    I32(Vec<i32>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub shape: Shape,
    pub data: Data,
}

impl Default for Value {
    fn default() -> Self {
        Self { shape: Shape::from_slice(&[0]), data: Data::F32(Vec::new()) }
    }
}

macro_rules! typed_access {
    ($get:ident, $recycle:ident, $variant:ident, $t:ty, $zero:expr) => {
        /// The elements, or an error naming the dtype found.
        pub fn $get(&self) -> Result<&[$t], String> {
            match &self.data {
                Data::$variant(v) => Ok(v),
                _ => Err(format!("expected {}, got {}", DType::$variant, self.dtype())),
            }
        }

        /// Takes this value's buffer for reuse as `n` zeroed elements.
        pub fn $recycle(&mut self, n: usize) -> Vec<$t> {
            let mut v = match std::mem::replace(&mut self.data, Data::U8(Vec::new())) {
                Data::$variant(v) => v,
                _ => Vec::new(),
            };
            v.clear();
            v.resize(n, $zero);
            v
        }
    };
}

impl Value {
    /// Takes this value's f32 buffer as it is (old length and values), for
    /// a kernel that writes every element it keeps: a projection's output,
    /// which [`Self::recycle_f32`] would zero first for nothing.
    pub fn take_f32(&mut self) -> Vec<f32> {
        match std::mem::replace(&mut self.data, Data::U8(Vec::new())) {
            Data::F32(v) => v,
            _ => Vec::new(),
        }
    }

    pub fn f32(shape: impl AsRef<[usize]>, v: Vec<f32>) -> Self {
        Self { shape: Shape::from_slice(shape.as_ref()), data: Data::F32(v) }
    }
    pub fn f16(shape: impl AsRef<[usize]>, v: Vec<f16>) -> Self {
        Self { shape: Shape::from_slice(shape.as_ref()), data: Data::F16(v) }
    }
    pub fn i64(shape: impl AsRef<[usize]>, v: Vec<i64>) -> Self {
        Self { shape: Shape::from_slice(shape.as_ref()), data: Data::I64(v) }
    }
    pub fn bool(shape: impl AsRef<[usize]>, v: Vec<bool>) -> Self {
        Self { shape: Shape::from_slice(shape.as_ref()), data: Data::Bool(v) }
    }
    pub fn u8(shape: impl AsRef<[usize]>, v: Vec<u8>) -> Self {
        Self { shape: Shape::from_slice(shape.as_ref()), data: Data::U8(v) }
    }
    pub fn f64(shape: impl AsRef<[usize]>, v: Vec<f64>) -> Self {
        Self { shape: Shape::from_slice(shape.as_ref()), data: Data::F64(v) }
    }
    pub fn i32(shape: impl AsRef<[usize]>, v: Vec<i32>) -> Self {
        Self { shape: Shape::from_slice(shape.as_ref()), data: Data::I32(v) }
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::I64(_) => DType::I64,
            Data::Bool(_) => DType::Bool,
            Data::U8(_) => DType::U8,
            Data::F64(_) => DType::F64,
            Data::I32(_) => DType::I32,
        }
    }

    pub fn len(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::Bool(v) => v.len(),
            Data::U8(v) => v.len(),
            Data::F64(v) => v.len(),
            Data::I32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    typed_access!(as_f32, recycle_f32, F32, f32, 0.0);
    typed_access!(as_f16, recycle_f16, F16, f16, f16::ZERO);
    typed_access!(as_i64, recycle_i64, I64, i64, 0);
    typed_access!(as_bool, recycle_bool, Bool, bool, false);
    typed_access!(as_u8, recycle_u8, U8, u8, 0);
    typed_access!(as_f64, recycle_f64, F64, f64, 0.0);
    typed_access!(as_i32, recycle_i32, I32, i32, 0);

    /// A scalar or one-element tensor as f32 (used for constants such as
    /// epsilons and scales).
    pub fn scalar_f32(&self) -> Option<f32> {
        match &self.data {
            Data::F32(v) if v.len() == 1 => Some(v[0]),
            Data::F16(v) if v.len() == 1 => Some(v[0].to_f32()),
            _ => None,
        }
    }

    /// An integer tensor's elements (constant shapes, axes, indices).
    pub fn ints(&self) -> Option<&[i64]> {
        match &self.data {
            Data::I64(v) => Some(v),
            _ => None,
        }
    }

    /// The ONNX tensor holding this value (for comparing with reference
    /// outputs).
    pub fn to_tensor(&self, name: &str) -> onnx_genai_onnx::Tensor {
        use onnx_genai_onnx::DataType as D;
        let (dtype, raw): (D, Vec<u8>) = match &self.data {
            Data::F32(v) => (D::Float, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Data::F16(v) => (D::Float16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Data::I64(v) => (D::Int64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Data::Bool(v) => (D::Bool, v.iter().map(|b| u8::from(*b)).collect()),
            Data::U8(v) => (D::Uint8, v.clone()),
            Data::F64(v) => (D::Double, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Data::I32(v) => (D::Int32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        };
        let dims = self.shape.iter().map(|d| *d as i64).collect();
        onnx_genai_onnx::Tensor { name: name.into(), dtype, dims, raw: raw.into() }
    }

    /// Converts an ONNX initializer or constant tensor.
    pub fn from_tensor(t: &onnx_genai_onnx::Tensor) -> Result<Self, String> {
        use onnx_genai_onnx::DataType as D;
        let shape: Shape = t
            .dims
            .iter()
            .map(|d| usize::try_from(*d).map_err(|_| format!("negative dim {d}")))
            .collect::<Result<_, _>>()?;
        let n: usize = shape.iter().product();
        if t.raw.len() != n * t.dtype.size_bytes() {
            return Err(format!(
                "payload has {} bytes, shape {:?} of {} needs {}",
                t.raw.len(),
                shape,
                t.dtype,
                n * t.dtype.size_bytes()
            ));
        }
        let data = match t.dtype {
            D::Float => {
                Data::F32(t.raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            D::Float16 => Data::F16(t.raw.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect()),
            D::Int64 => {
                Data::I64(t.raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
            }
            D::Bool => Data::Bool(t.raw.iter().map(|b| *b != 0).collect()),
            D::Uint8 => Data::U8(t.raw.to_vec()),
            D::Double => {
                Data::F64(t.raw.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
            }
            D::Int32 => {
                Data::I32(t.raw.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap_or([0; 4]))).collect())
            }
            other => return Err(format!("{other} tensors are not supported by native-cpu")),
        };
        Ok(Self { shape, data })
    }
}
