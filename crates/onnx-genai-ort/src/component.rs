//! A stateless workflow component (vision encoder, embedding table) run on
//! ONNX Runtime: named tensors in, named f32 tensors out.

use onnx_genai_backend::BackendError;
use onnx_genai_package::Package;
use ort::session::Session;
use ort::value::{DynValue, Tensor, TensorElementType};

use crate::NAME;

fn run_err(reason: impl std::fmt::Display) -> BackendError {
    BackendError::Run { backend: NAME, reason: reason.to_string() }
}

/// A tensor fed to a component.
pub enum ComponentInput {
    F32 { shape: Vec<usize>, values: Vec<f32> },
    I64 { shape: Vec<usize>, values: Vec<i64> },
}

pub struct OrtComponent {
    name: String,
    session: Session,
}

/// The element type the session declares for one of its inputs or outputs.
fn declared(ports: &[ort::value::Outlet], name: &str) -> Option<TensorElementType> {
    ports.iter().find(|o| o.name() == name).and_then(|o| o.dtype().tensor_type())
}

impl OrtComponent {
    pub fn load(package: &Package, component: &str, intra_threads: usize) -> Result<Self, BackendError> {
        let (_, path) = package.component(component).map_err(|e| BackendError::Load {
            backend: NAME,
            what: format!("component `{component}`"),
            reason: e.to_string(),
        })?;
        let session = crate::open_session(path, intra_threads)?;
        Ok(Self { name: component.into(), session })
    }

    /// Runs the component; returns `output`'s shape and values.
    pub fn run(
        &mut self,
        inputs: Vec<(String, ComponentInput)>,
        output: &str,
    ) -> Result<(Vec<usize>, Vec<f32>), BackendError> {
        // Ids and floats go in as the graph declares them (validation lets a
        // component take int32 ids and f16 values, as a decoder may).
        let mut fed: Vec<(String, DynValue)> = Vec::with_capacity(inputs.len());
        for (name, input) in inputs {
            let wanted = declared(self.session.inputs(), &name);
            let value = match input {
                ComponentInput::F32 { shape, values } if wanted == Some(TensorElementType::Float16) => {
                    let narrow: Vec<half::f16> = values.iter().map(|v| half::f16::from_f32(*v)).collect();
                    Tensor::from_array((shape, narrow)).map_err(run_err)?.into_dyn()
                }
                ComponentInput::F32 { shape, values } => {
                    Tensor::from_array((shape, values)).map_err(run_err)?.into_dyn()
                }
                ComponentInput::I64 { shape, values } if wanted == Some(TensorElementType::Int32) => {
                    let narrow = values
                        .iter()
                        .map(|v| i32::try_from(*v).map_err(|_| run_err(format!("`{name}` value {v} is past int32"))))
                        .collect::<Result<Vec<i32>, _>>()?;
                    Tensor::from_array((shape, narrow)).map_err(run_err)?.into_dyn()
                }
                ComponentInput::I64 { shape, values } => {
                    Tensor::from_array((shape, values)).map_err(run_err)?.into_dyn()
                }
            };
            fed.push((name, value));
        }
        let f16_out = declared(self.session.outputs(), output) == Some(TensorElementType::Float16);
        let component = self.name.clone();
        let mut outputs = self.session.run(fed).map_err(|e| run_err(format!("component `{component}`: {e}")))?;
        let value = outputs
            .remove(output)
            .ok_or_else(|| run_err(format!("component `{component}` has no output `{output}`")))?;
        let (shape, data) = if f16_out {
            let (shape, data) = value.try_extract_tensor::<half::f16>().map_err(run_err)?;
            (shape, data.iter().map(|v| v.to_f32()).collect())
        } else {
            let (shape, data) = value.try_extract_tensor::<f32>().map_err(run_err)?;
            (shape, data.to_vec())
        };
        let shape = shape.iter().map(|d| usize::try_from(*d).unwrap_or(0)).collect();
        Ok((shape, data))
    }
}
