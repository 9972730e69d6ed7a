//! Compile and run errors. Every compile error names the node (or tensor) at
//! fault and why; nothing falls back silently.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    #[error("node `{node}`: op {domain}::{op} is not supported by native-cpu: {reason}")]
    UnsupportedOp { node: String, op: String, domain: String, reason: String },
    /// The op is not one native-cpu lowers at all (as opposed to an
    /// attribute or input of a lowered op it does not support).
    #[error("node `{node}`: op {domain}::{op} has no native-cpu kernel")]
    NoKernel { node: String, op: String, domain: String },
    #[error("node `{node}` ({op}): {reason}")]
    Node { node: String, op: String, reason: String },
    #[error("tensor `{tensor}`: {reason}")]
    Tensor { tensor: String, reason: String },
    #[error("graph: {0}")]
    Graph(String),
}

impl CompileError {
    pub(crate) fn node(node: &str, op: &str, reason: impl Into<String>) -> Self {
        Self::Node { node: node.into(), op: op.into(), reason: reason.into() }
    }
    pub(crate) fn tensor(tensor: &str, reason: impl Into<String>) -> Self {
        Self::Tensor { tensor: tensor.into(), reason: reason.into() }
    }
}

/// A kernel failed at run time (shapes only known then, such as a prompt
/// longer than the KV cache).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node `{node}` ({op}): {reason}")]
pub struct RunError {
    pub node: String,
    pub op: String,
    pub reason: String,
}
