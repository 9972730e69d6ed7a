//! CPU kernels: f32 compute; f16 and 4-bit weights and f16 KV are widened as
//! they are read.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod elementwise;
pub mod gather_q4;
pub mod isa;
pub mod layout;
pub mod linear;
pub mod linear_int8;
pub mod math;
mod portable;
pub mod rotary;
pub mod select;
pub mod simd;
pub mod tiled;
pub mod weights;

use crate::pool::{PerThread, ThreadPool};
use isa::Isa;

/// Working buffers a kernel reuses from step to step (one set per pool
/// thread), so a warmed-up step allocates nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub c: Vec<f32>,
    pub d: Vec<f32>,
    pub bytes: Vec<i8>,
    pub ints: Vec<i32>,
    /// The gated MLP's stacked gate/up product (staging only: the
    /// projection it comes from stages its inputs in the fields above).
    pub gate: Vec<f32>,
    /// The rows a row-selecting head projects (staging only).
    pub picked: Vec<f32>,
}

/// `v` cleared and resized to `n` zeros, keeping its buffer.
pub fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// A pool and its per-thread scratch: what a model (or a test) owns so that
/// kernels can borrow a [`Ctx`].
pub struct Runtime {
    pub pool: ThreadPool,
    pub scratch: PerThread<Scratch>,
    pub staging: std::sync::Mutex<Scratch>,
    /// The kernel path (the best this CPU has unless forced lower).
    pub isa: Isa,
}

impl Runtime {
    /// `threads` threads in all (0 or 1: the caller alone).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let pool = ThreadPool::new(threads, crate::pool::DEFAULT_SPIN)?;
        let scratch = PerThread::new(pool.threads());
        Ok(Self { pool, scratch, staging: Default::default(), isa: Isa::best() })
    }

    /// The caller alone, for constant folding.
    pub fn serial() -> Self {
        Self { pool: ThreadPool::serial(), scratch: PerThread::new(1), staging: Default::default(), isa: Isa::best() }
    }

    pub fn ctx(&self) -> Ctx<'_> {
        Ctx { pool: &self.pool, scratch: &self.scratch, staging: &self.staging, isa: self.isa }
    }
}

/// Where kernels run: the pool (the caller is thread 0) and each thread's
/// scratch.
pub struct Ctx<'a> {
    pub pool: &'a ThreadPool,
    pub scratch: &'a PerThread<Scratch>,
    /// Buffers the calling thread prepares before a region and every
    /// thread reads during it (a quantized input row, block sums).
    pub staging: &'a std::sync::Mutex<Scratch>,
    /// Which kernels run.
    pub isa: Isa,
}

impl Ctx<'_> {
    /// The staging buffers (held by the calling thread until dropped).
    pub fn staging(&self) -> std::sync::MutexGuard<'_, Scratch> {
        self.staging.lock().unwrap_or_else(|p| p.into_inner())
    }
}
