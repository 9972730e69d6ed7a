//! CPU kernels: f32 compute; f16 and 4-bit weights and f16 KV are widened as
//! they are read.

pub mod attention;
pub mod elementwise;
pub mod gather_q4;
pub mod layout;
pub mod linear;
pub mod linear_int8;
pub mod math;
pub mod rotary;
pub mod simd;
