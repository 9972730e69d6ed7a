//! Values at the session's edge. Validation lets a graph declare int32 or
//! int64 ids, masks and positions and f16 or f32 embeddings, values and
//! logits; the runtime speaks i64 and f32, so every conversion happens
//! here, where a session's declared types are read.

use onnx_genai_backend::BackendError;
use ort::value::{DynValue, Outlet, Tensor, TensorElementType};

use crate::NAME;

pub(crate) fn run_err(reason: impl std::fmt::Display) -> BackendError {
    BackendError::Run { backend: NAME, reason: reason.to_string() }
}

/// The element type the session declares for its input or output `name`
/// (`None`: no such port, or not a tensor).
pub(crate) fn declared(ports: &[Outlet], name: &str) -> Option<TensorElementType> {
    ports.iter().find(|o| o.name() == name).and_then(|o| o.dtype().tensor_type())
}

/// `values` as a tensor of `shape`, narrowed to f16 where the port takes it.
pub(crate) fn float_input(shape: Vec<usize>, values: &[f32], as_f16: bool) -> Result<DynValue, BackendError> {
    Ok(if as_f16 {
        let narrow: Vec<half::f16> = values.iter().map(|v| half::f16::from_f32(*v)).collect();
        Tensor::from_array((shape, narrow)).map_err(run_err)?.into_dyn()
    } else {
        Tensor::from_array((shape, values.to_vec())).map_err(run_err)?.into_dyn()
    })
}

/// `values` as a tensor of `shape`, narrowed to int32 where the port
/// takes it; a value past int32 is an error naming `port` (never wrapped).
pub(crate) fn int_input(
    shape: Vec<usize>,
    values: Vec<i64>,
    as_i32: bool,
    port: &str,
) -> Result<DynValue, BackendError> {
    Ok(if as_i32 {
        let narrow = values
            .iter()
            .map(|v| i32::try_from(*v).map_err(|_| run_err(format!("`{port}` value {v} is past int32"))))
            .collect::<Result<Vec<i32>, _>>()?;
        Tensor::from_array((shape, narrow)).map_err(run_err)?.into_dyn()
    } else {
        Tensor::from_array((shape, values)).map_err(run_err)?.into_dyn()
    })
}

/// Reads a float output (f16 widened) into `out`: the values `pick` chooses
/// from the output's shape and length. Returns the shape.
pub(crate) fn float_output(
    value: &DynValue,
    is_f16: bool,
    pick: impl FnOnce(&[i64], usize) -> Result<std::ops::Range<usize>, BackendError>,
    out: &mut Vec<f32>,
) -> Result<Vec<i64>, BackendError> {
    out.clear();
    if is_f16 {
        let (shape, data) = value.try_extract_tensor::<half::f16>().map_err(run_err)?;
        out.extend(picked(data, pick(shape, data.len())?)?.iter().map(|v| v.to_f32()));
        Ok(shape.to_vec())
    } else {
        let (shape, data) = value.try_extract_tensor::<f32>().map_err(run_err)?;
        out.extend_from_slice(picked(data, pick(shape, data.len())?)?);
        Ok(shape.to_vec())
    }
}

fn picked<T>(data: &[T], range: std::ops::Range<usize>) -> Result<&[T], BackendError> {
    let len = data.len();
    data.get(range.clone()).ok_or_else(|| run_err(format!("values {range:?} of an output of {len}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An int32 port is given its values exactly or refused, naming the
    /// port: a value past int32 is never wrapped (the decoder's positions
    /// were cast with `as`, which wraps silently).
    #[test]
    fn an_id_past_int32_is_refused_naming_the_port() {
        let err = int_input(vec![1, 2], vec![7, 1 << 40], true, "position_ids").unwrap_err().to_string();
        assert!(err.contains("`position_ids` value 1099511627776 is past int32"), "{err}");
    }
}
