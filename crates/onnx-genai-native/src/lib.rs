//! Model compilation, back half: an ONNX decoder graph (through the
//! project's IR) becomes an execution plan for the CPU.
//!
//! Passes, in order: import (lowering each live node; unsupported ops,
//! dtypes and attributes are errors naming the node), shape/dtype inference
//! with constant folding, weight packing (f32, f16, 4-bit `MatMulNBits`),
//! pattern fusion (MatMul+Add, RMSNorm, LayerNorm, gated MLP, rotary,
//! KV-cache attention with GQA), KV binding against the manifest's ports,
//! dead-code elimination, and a static memory plan. See ARCHITECTURE.md.

mod compile;
mod decoder;
mod error;
mod exec;
mod fuse;
mod fuse_mask;
mod graph;
mod infer;
pub mod kernels;
mod lower;
mod ops;
mod plan;
pub mod value;

pub use compile::{compile, Binding, CompileStats, LayerBinding};
pub use decoder::{compile_package, NativeDecoder, NAME};
pub use error::{CompileError, RunError};
pub use plan::{Plan, State};
