//! ONNX protobuf I/O and a small graph IR with a builder.
//!
//! [`proto`] holds the wire messages; [`ir`] is what the rest of the project
//! works with; [`builder`] writes graphs. [`decode`] / [`encode`] convert
//! between bytes and the IR.

pub mod builder;
pub mod ir;
pub mod proto;

use std::path::{Path, PathBuf};

pub use builder::GraphBuilder;
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
    #[error("cannot read or write {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// Decodes a serialized `ModelProto` into the IR.
pub fn decode(bytes: &[u8]) -> Result<Model, OnnxError> {
    let proto = proto::ModelProto::decode(bytes)?;
    Model::try_from(proto)
}

/// Serializes the IR as a `ModelProto`.
pub fn encode(model: &Model) -> Vec<u8> {
    proto::ModelProto::from(model).encode_to_vec()
}

pub fn read_model(path: &Path) -> Result<Model, OnnxError> {
    let bytes = std::fs::read(path).map_err(|source| OnnxError::Io { path: path.into(), source })?;
    decode(&bytes)
}

pub fn write_model(path: &Path, model: &Model) -> Result<(), OnnxError> {
    std::fs::write(path, encode(model)).map_err(|source| OnnxError::Io { path: path.into(), source })
}
