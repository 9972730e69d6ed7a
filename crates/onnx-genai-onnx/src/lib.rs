//! ONNX protobuf I/O and a small graph IR with a builder.
//!
//! [`proto`] holds the wire messages; [`ir`] is what the rest of the project
//! works with; [`builder`] writes graphs. [`decode`] / [`encode`] convert
//! between bytes and the IR.

pub mod builder;
pub mod data;
pub mod ir;
pub mod proto;

use std::path::{Path, PathBuf};

pub use builder::GraphBuilder;
pub use data::TensorData;
pub use ir::{AttrValue, Attribute, DataType, Dim, Graph, Model, Node, OpsetImport, Tensor, ValueInfo};
use prost::Message;

#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    #[error("not a valid ONNX protobuf: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("{location}: {reason}")]
    Invalid { location: String, reason: String },
    #[error("unsupported: {what}")]
    Unsupported { what: String },
    #[error("external data of initializer '{tensor}' (`{location}`): {reason}")]
    External { tensor: String, location: String, reason: String },
    #[error("cannot read or write {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// Decodes a serialized `ModelProto` into the IR.
pub fn decode(bytes: &[u8]) -> Result<Model, OnnxError> {
    let proto = proto::ModelProto::decode(bytes)?;
    Model::try_from(proto)
}

/// Decodes a serialized `TensorProto` with its data inline (the input and
/// output files of ONNX's backend test cases).
pub fn decode_tensor(bytes: &[u8]) -> Result<Tensor, OnnxError> {
    let proto = proto::TensorProto::decode(bytes)?;
    ir::tensor_from_proto(proto, &mut None)
}

/// Serializes the IR as a `ModelProto`.
pub fn encode(model: &Model) -> Vec<u8> {
    proto::ModelProto::from(model).encode_to_vec()
}

/// Decodes a model whose external data lives relative to `dir`.
pub fn decode_in(bytes: &[u8], dir: &Path) -> Result<Model, OnnxError> {
    let proto = proto::ModelProto::decode(bytes)?;
    Model::from_proto_in(proto, Some(&mut data::Resolver::new(dir)))
}

/// Reads a model file; external data is mapped from beside it.
pub fn read_model(path: &Path) -> Result<Model, OnnxError> {
    let bytes = std::fs::read(path).map_err(|source| OnnxError::Io { path: path.into(), source })?;
    decode_in(&bytes, model_dir(path))
}

/// The directory a model file's external data is resolved from: `.` for
/// a bare file name (whose parent is the empty path, which cannot be
/// canonicalized: every external tensor was refused as leaving it).
fn model_dir(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

pub fn write_model(path: &Path, model: &Model) -> Result<(), OnnxError> {
    std::fs::write(path, encode(model)).map_err(|source| OnnxError::Io { path: path.into(), source })
}

/// Writes `model` to `path` with every initializer of at least
/// `min_tensor_bytes` moved into `<file name>.data` beside it (ONNX
/// external data, page-aligned); returns the bytes moved.
pub fn write_model_external(path: &Path, model: &Model, min_tensor_bytes: usize) -> Result<u64, OnnxError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| OnnxError::Io { path, source }
    };
    let file_name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "model.onnx".into());
    let data_name = format!("{file_name}.data");
    let data_path = path.with_file_name(&data_name);
    let mut proto = proto::ModelProto::from(model);
    let mut sink = std::io::BufWriter::new(std::fs::File::create(&data_path).map_err(io(&data_path))?);
    let moved = data::externalize(&mut proto, &data_name, min_tensor_bytes, &mut sink).map_err(io(&data_path))?;
    std::io::Write::flush(&mut sink).map_err(io(&data_path))?;
    std::fs::write(path, proto.encode_to_vec()).map_err(io(path))?;
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bare file name's external data lies in the working directory.
    #[test]
    fn a_bare_file_name_resolves_from_the_working_directory() {
        assert_eq!(model_dir(Path::new("model.onnx")), Path::new("."));
        assert_eq!(model_dir(Path::new("pkg/model.onnx")), Path::new("pkg"));
        assert_eq!(model_dir(Path::new("/model.onnx")), Path::new("/"));
    }
}
