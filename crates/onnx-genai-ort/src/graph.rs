//! Any ONNX model on ONNX Runtime: named tensors of any element type the
//! IR knows in, every output out. The reference side of ONNX's own backend
//! test cases (`cargo xtask onnx-tests`), where the models are single
//! operators rather than packages.

use std::path::Path;

use half::{bf16, f16};
use onnx_genai_backend::BackendError;
use onnx_genai_onnx::{DataType, Tensor};
use ort::session::Session;
use ort::value::TensorElementType as Ty;
use ort::value::{DynValue, Tensor as OrtTensor, ValueType};

fn run_err(reason: impl std::fmt::Display) -> BackendError {
    BackendError::Run { backend: crate::NAME, reason: reason.to_string() }
}

pub struct OrtGraph {
    session: Session,
}

impl OrtGraph {
    /// Opens the model at `path` with `intra_threads` threads (0: ONNX
    /// Runtime chooses). The session logs only fatal errors: a model it
    /// refuses is reported through the returned error, not its log.
    pub fn load(path: &Path, intra_threads: usize) -> Result<Self, BackendError> {
        let quiet = Some(ort::logging::LogLevel::Fatal);
        Ok(Self { session: crate::open_session_logging(path, intra_threads, quiet)? })
    }

    /// Runs the model on `inputs` (each tensor's name is the graph input it
    /// feeds); returns every output, named, in the session's order.
    pub fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>, BackendError> {
        let fed = inputs.iter().map(|t| Ok((t.name.clone(), to_ort(t)?))).collect::<Result<Vec<_>, BackendError>>()?;
        let outputs = self.session.run(fed).map_err(run_err)?;
        outputs.into_iter().map(|(name, value)| from_ort(name, &value)).collect()
    }
}

fn shape_of(t: &Tensor) -> Result<Vec<usize>, BackendError> {
    t.dims
        .iter()
        .map(|d| usize::try_from(*d).map_err(|_| run_err(format!("tensor `{}` has a negative dim {d}", t.name))))
        .collect()
}

/// Little-endian elements of `N` bytes, decoded by `f`.
fn elements<const N: usize, T>(raw: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N).map(|c| f(c.try_into().unwrap_or([0; N]))).collect()
}

fn to_ort(t: &Tensor) -> Result<DynValue, BackendError> {
    let shape = shape_of(t)?;
    let raw: &[u8] = &t.raw;
    let value = match t.dtype {
        DataType::Float => OrtTensor::from_array((shape, elements(raw, f32::from_le_bytes))).map(|v| v.into_dyn()),
        DataType::Double => OrtTensor::from_array((shape, elements(raw, f64::from_le_bytes))).map(|v| v.into_dyn()),
        DataType::Float16 => OrtTensor::from_array((shape, elements(raw, f16::from_le_bytes))).map(|v| v.into_dyn()),
        DataType::Bfloat16 => OrtTensor::from_array((shape, elements(raw, bf16::from_le_bytes))).map(|v| v.into_dyn()),
        DataType::Int64 => OrtTensor::from_array((shape, elements(raw, i64::from_le_bytes))).map(|v| v.into_dyn()),
        DataType::Int32 => OrtTensor::from_array((shape, elements(raw, i32::from_le_bytes))).map(|v| v.into_dyn()),
        DataType::Int8 => OrtTensor::from_array((shape, elements(raw, i8::from_le_bytes))).map(|v| v.into_dyn()),
        DataType::Uint8 => OrtTensor::from_array((shape, raw.to_vec())).map(|v| v.into_dyn()),
        DataType::Bool => {
            OrtTensor::from_array((shape, raw.iter().map(|b| *b != 0).collect::<Vec<_>>())).map(|v| v.into_dyn())
        }
    };
    value.map_err(|e| run_err(format!("input `{}`: {e}", t.name)))
}

fn from_ort(name: &str, value: &DynValue) -> Result<Tensor, BackendError> {
    let ValueType::Tensor { ty, .. } = value.dtype() else {
        return Err(run_err(format!("output `{name}` is not a tensor")));
    };
    fn bytes<T: ort::value::PrimitiveTensorElementType + Copy, const N: usize>(
        name: &str,
        value: &DynValue,
        le: fn(T) -> [u8; N],
    ) -> Result<(Vec<i64>, Vec<u8>), BackendError> {
        let (shape, data) = value.try_extract_tensor::<T>().map_err(|e| run_err(format!("output `{name}`: {e}")))?;
        Ok((shape.to_vec(), data.iter().flat_map(|x| le(*x)).collect()))
    }
    let (dtype, (dims, raw)) = match ty {
        Ty::Float32 => (DataType::Float, bytes(name, value, f32::to_le_bytes)?),
        Ty::Float64 => (DataType::Double, bytes(name, value, f64::to_le_bytes)?),
        Ty::Float16 => (DataType::Float16, bytes(name, value, f16::to_le_bytes)?),
        Ty::Bfloat16 => (DataType::Bfloat16, bytes(name, value, bf16::to_le_bytes)?),
        Ty::Int64 => (DataType::Int64, bytes(name, value, i64::to_le_bytes)?),
        Ty::Int32 => (DataType::Int32, bytes(name, value, i32::to_le_bytes)?),
        Ty::Int8 => (DataType::Int8, bytes(name, value, i8::to_le_bytes)?),
        Ty::Uint8 => (DataType::Uint8, bytes(name, value, u8::to_le_bytes)?),
        Ty::Bool => (DataType::Bool, bytes(name, value, |b: bool| [u8::from(b)])?),
        other => {
            return Err(run_err(format!("output `{name}` has element type {other:?}, which the IR does not hold")))
        }
    };
    Ok(Tensor { name: name.into(), dtype, dims, raw: raw.into() })
}
