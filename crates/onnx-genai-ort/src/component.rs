//! A stateless workflow component (vision encoder, embedding table) run on
//! ONNX Runtime: named tensors in, named f32 tensors out.

use onnx_genai_backend::BackendError;
use onnx_genai_package::Package;
use ort::session::Session;
use ort::value::{DynValue, TensorElementType};

use crate::edge::{declared, float_input, float_output, int_input, run_err};
use crate::NAME;

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
        // Ids and floats go in as the graph declares them (validation lets a
        // component take int32 ids and f16 values, as a decoder may).
        let mut fed: Vec<(String, DynValue)> = Vec::with_capacity(inputs.len());
        for (name, input) in inputs {
            let wanted = declared(self.session.inputs(), &name);
            let value = match input {
                ComponentInput::F32 { shape, values } => {
                    float_input(shape, &values, wanted == Some(TensorElementType::Float16))?
                }
                ComponentInput::I64 { shape, values } => {
                    int_input(shape, values, wanted == Some(TensorElementType::Int32), &name)?
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
        let mut data = Vec::new();
        let shape = float_output(&value, f16_out, |_, len| Ok(0..len), &mut data)?;
        let shape = shape.iter().map(|d| usize::try_from(*d).unwrap_or(0)).collect();
        Ok((shape, data))
    }
}
