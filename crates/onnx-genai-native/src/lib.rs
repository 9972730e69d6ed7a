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
mod error;
mod exec;
mod fuse;
mod graph;
mod infer;
pub mod kernels;
pub mod kv;
mod lower;
mod model;
pub mod ops;
mod plan;
pub mod pool;
pub mod value;

pub use compile::{compile, compile_graph, compile_with, Binding, CompileStats, LayerBinding, WeightForm};
pub use error::{CompileError, RunError};
pub use model::{compile_package, compile_package_with, NativeModel, NativeSequence, MAX_BATCH, NAME};
pub use ops::{Op, PartialAttention};
pub use plan::{eval, Plan, Ports, Ref, StepView, Workspace};
