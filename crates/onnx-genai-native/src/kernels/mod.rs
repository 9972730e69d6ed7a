//! CPU kernels: f32 compute; f16 and 4-bit weights and f16 KV are widened as
//! they are read.

#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
pub mod avx512_gemm;
pub mod elementwise;
pub mod gather_q4;
pub mod isa;
pub mod layout;
pub mod limbs;
pub mod linear;
pub mod linear_int8;
pub mod math;
mod narrow;
mod portable;
pub mod quantize;
pub mod rotary;
pub mod select;
pub mod simd;
pub mod storage;
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
    /// A split projection's stacked product (staging only, as `gate`; its
    /// own buffer: shared, the two widths alternating each layer made
    /// `linear`'s resize zero-fill the wider one's growth every time).
    pub split: Vec<f32>,
    /// The rows a row-selecting head projects (staging only).
    pub picked: Vec<f32>,
    /// A projection's input rows as this thread prepared them for itself
    /// (int8 values, or f32 rows split into limbs; per-block scales and
    /// sums): each thread of a region reads its own copy rather than rows
    /// another thread wrote.
    pub own_rows: Vec<i8>,
    pub own_scales: Vec<f32>,
    pub own_sums: Vec<i32>,
}

impl Scratch {
    /// Its buffers.
    const FIELDS: usize = 12;

    /// The capacity of every buffer, in field order.
    fn capacities(&self) -> [usize; Self::FIELDS] {
        [
            self.a.capacity(),
            self.b.capacity(),
            self.c.capacity(),
            self.d.capacity(),
            self.bytes.capacity(),
            self.ints.capacity(),
            self.gate.capacity(),
            self.split.capacity(),
            self.picked.capacity(),
            self.own_rows.capacity(),
            self.own_scales.capacity(),
            self.own_sums.capacity(),
        ]
    }

    /// Grows every buffer to at least the matching capacity in `caps`:
    /// exactly that where it grows (`reserve`'s amortized doubling made two
    /// threads' capacities leapfrog each other on every run).
    fn reserve_capacities(&mut self, caps: [usize; Self::FIELDS]) {
        fn at_least<T>(v: &mut Vec<T>, cap: usize) {
            v.reserve_exact(cap.saturating_sub(v.len()));
        }
        let [a, b, c, d, bytes, ints, gate, split, picked, own_rows, own_scales, own_sums] = caps;
        at_least(&mut self.a, a);
        at_least(&mut self.b, b);
        at_least(&mut self.c, c);
        at_least(&mut self.d, d);
        at_least(&mut self.bytes, bytes);
        at_least(&mut self.ints, ints);
        at_least(&mut self.gate, gate);
        at_least(&mut self.split, split);
        at_least(&mut self.picked, picked);
        at_least(&mut self.own_rows, own_rows);
        at_least(&mut self.own_scales, own_scales);
        at_least(&mut self.own_sums, own_sums);
    }
}

/// `v` cleared and resized to `n` zeros, keeping its buffer.
pub fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// Bytes from `p` to the next 64-byte cache line boundary (0 when `p` is
/// on one): where a buffer with 64 bytes to spare starts its aligned part.
pub(crate) fn line_offset<T>(p: *const T) -> usize {
    (64 - p as usize % 64) % 64
}

/// `v` grown to at least `n` values and never shrunk, for a buffer whose
/// user takes `&v[..n]` and writes all of it before reading: alternating
/// sizes then zero nothing once the largest has been seen.
pub fn grow_to<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// A pool and its per-thread scratch: what a model (or a test) owns so that
/// kernels can borrow a [`Ctx`].
pub struct Runtime {
    pub pool: ThreadPool,
    pub scratch: PerThread<Scratch>,
    pub staging: std::sync::Mutex<Scratch>,
    /// The results of attention's parts in a decode step of few long
    /// sequences, which every thread writes and the calling thread merges
    /// (not staging: the attention op holds that for its inputs).
    pub attention_parts: std::sync::Mutex<Vec<f32>>,
    /// The kernel path (the best this CPU has unless forced lower).
    pub isa: Isa,
}

impl Runtime {
    /// `threads` threads in all (0 or 1: the caller alone).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let pool = ThreadPool::new(threads, crate::pool::DEFAULT_SPIN)?;
        let scratch = PerThread::new(pool.threads());
        Ok(Self { pool, scratch, staging: Default::default(), attention_parts: Default::default(), isa: Isa::best() })
    }

    /// The caller alone, for constant folding.
    pub fn serial() -> Self {
        Self {
            pool: ThreadPool::serial(),
            scratch: PerThread::new(1),
            staging: Default::default(),
            attention_parts: Default::default(),
            isa: Isa::best(),
        }
    }

    /// Grows every thread's scratch to the largest any thread has.
    ///
    /// Which thread runs which job is decided at run time (threads claim
    /// work), so a thread can meet a job shape for the first time long after
    /// another thread has: without this, a warm step with shapes already
    /// seen could still allocate, on whichever thread was unlucky.
    pub fn even_out_scratch(&mut self) {
        let mut most = [0usize; Scratch::FIELDS];
        for t in 0..self.scratch.len() {
            for (m, c) in most.iter_mut().zip(self.scratch.get_mut(t).capacities()) {
                *m = (*m).max(c);
            }
        }
        for t in 0..self.scratch.len() {
            self.scratch.get_mut(t).reserve_capacities(most);
        }
    }

    pub fn ctx(&self) -> Ctx<'_> {
        Ctx {
            pool: &self.pool,
            scratch: &self.scratch,
            staging: &self.staging,
            attention_parts: &self.attention_parts,
            isa: self.isa,
        }
    }
}

/// Where kernels run: the pool (the caller is thread 0) and each thread's
/// scratch.
pub struct Ctx<'a> {
    pub pool: &'a ThreadPool,
    pub scratch: &'a PerThread<Scratch>,
    /// Buffers the calling thread prepares before a region and every
    /// thread reads during it (padded input rows, block sums; a row-form
    /// int8 projection's quantized row). A tiled projection's threads
    /// prepare their quantized or split rows for themselves, in
    /// [`Scratch::own_rows`].
    pub staging: &'a std::sync::Mutex<Scratch>,
    /// See [`Runtime::attention_parts`].
    pub attention_parts: &'a std::sync::Mutex<Vec<f32>>,
    /// Which kernels run.
    pub isa: Isa,
}

impl Ctx<'_> {
    /// The staging buffers (held by the calling thread until dropped).
    pub fn staging(&self) -> std::sync::MutexGuard<'_, Scratch> {
        self.staging.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pins issue 15's zero-allocation step under claimed work: after
    /// `even_out_scratch`, a thread that never ran a job shape has the
    /// buffers the thread that did grew, so its first such job allocates
    /// nothing. (The integration test `zero_alloc` sees this only when the
    /// scheduling happens to give every shape to one thread.)
    #[test]
    fn every_thread_gets_the_largest_scratch_any_thread_grew() {
        let mut runtime = Runtime::new(3).unwrap();
        super::sized(&mut runtime.scratch.get_mut(0).a, 1000);
        runtime.scratch.get_mut(2).ints.resize(77, 0);
        runtime.scratch.get_mut(1).picked.reserve(300);
        runtime.scratch.get_mut(1).split.reserve(500);
        runtime.even_out_scratch();
        for t in 0..3 {
            let caps = runtime.scratch.get_mut(t).capacities();
            assert!(caps[0] >= 1000, "thread {t}: a has {}", caps[0]);
            assert!(caps[5] >= 77, "thread {t}: ints has {}", caps[5]);
            assert!(caps[7] >= 500, "thread {t}: split has {}", caps[7]);
            assert!(caps[8] >= 300, "thread {t}: picked has {}", caps[8]);
        }
        // What a thread holds is kept: only capacity is added.
        assert_eq!(runtime.scratch.get_mut(0).a.len(), 1000);
    }

    /// Evening out gives every thread exactly the largest capacity, so the
    /// capacities settle. Grown with `reserve`'s amortized doubling, two
    /// threads that held 100 and 90 floats went 100/180, 200/180, 200/360,
    /// 400/360, ... — doubling on every run of the model, until `cargo
    /// xtask bench --peer` asked for 77 GB on a tiny package (watched red
    /// so: 10 runs ended at 3200 floats).
    #[test]
    fn evening_out_scratch_settles_on_the_largest() {
        let mut runtime = Runtime::new(2).unwrap();
        super::sized(&mut runtime.scratch.get_mut(0).a, 100);
        super::sized(&mut runtime.scratch.get_mut(1).a, 90);
        let largest = runtime.scratch.get_mut(0).a.capacity();
        for _ in 0..10 {
            runtime.even_out_scratch();
        }
        for t in 0..2 {
            let a = runtime.scratch.get_mut(t).a.capacity();
            assert_eq!(a, largest, "thread {t}: a has room for {a} after 10 runs, the largest was {largest}");
        }
    }
}
