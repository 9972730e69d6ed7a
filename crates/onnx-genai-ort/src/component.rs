//! A stateless workflow component (vision encoder, embedding table) run on
//! ONNX Runtime: named tensors in, named f32 tensors out.

use onnx_genai_backend::BackendError;
use onnx_genai_package::Package;
use ort::session::Session;
use ort::value::{DynValue, Tensor};

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
        let mut fed: Vec<(String, DynValue)> = Vec::with_capacity(inputs.len());
        for (name, input) in inputs {
            let value = match input {
                ComponentInput::F32 { shape, values } => {
                    Tensor::from_array((shape, values)).map_err(run_err)?.into_dyn()
                }
                ComponentInput::I64 { shape, values } => {
                    Tensor::from_array((shape, values)).map_err(run_err)?.into_dyn()
                }
            };
            fed.push((name, value));
        }
        let component = self.name.clone();
        let mut outputs = self.session.run(fed).map_err(|e| run_err(format!("component `{component}`: {e}")))?;
        let value = outputs
            .remove(output)
            .ok_or_else(|| run_err(format!("component `{component}` has no output `{output}`")))?;
        let (shape, data) = value.try_extract_tensor::<f32>().map_err(run_err)?;
        let shape = shape.iter().map(|d| usize::try_from(*d).unwrap_or(0)).collect();
        Ok((shape, data.to_vec()))
    }
}
