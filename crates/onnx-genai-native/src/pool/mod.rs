//! The plan's own thread pool. A decode step runs a few hundred small
//! parallel regions (every projection, every attention); handing each to a
//! general-purpose pool and sleeping between them costs more than the work.
//! Here the calling thread takes part as worker 0, work is split statically
//! (`for_ranges`: every worker knows its range from its index) or claimed
//! as the workers go (`for_claimed`: the next item from one shared count;
//! `for_claimed_ranges*`: each runs its own share front to back, then takes
//! from the back of the unfinished ones), each region ends in one barrier
//! (a countdown the caller spins on), and workers spin for a short while
//! after a region before they park, so back-to-back regions never pay for
//! a wake-up. Starting a region allocates nothing.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A job: called once per worker with the worker's index.
type Job = dyn Fn(usize) + Sync;

thread_local! {
    /// The index this thread runs in the region it is in, if any: a nested
    /// region then runs inline instead of deadlocking on the pool.
    static IN_REGION: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Marks the current thread as running index `t` of a region for the
/// guard's lifetime.
struct RegionMark(Option<usize>);

impl RegionMark {
    fn enter(t: usize) -> Self {
        Self(IN_REGION.with(|r| r.replace(Some(t))))
    }
}

/// The index this thread runs in an enclosing region, if it is in one.
fn enclosing() -> Option<usize> {
    IN_REGION.with(|r| r.get())
}

impl Drop for RegionMark {
    fn drop(&mut self) {
        IN_REGION.with(|r| r.set(self.0));
    }
}

/// How long an idle worker spins before it parks, by default: longer than
/// the gap between two regions of one step, and between the steps of a
/// decode loop, so workers stay awake while a model is busy.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(300);

struct Shared {
    /// Bumped once per region; a worker runs the job once per new value.
    generation: AtomicU64,
    /// The region's job. Written by the caller only while no region is in
    /// flight (every worker has finished reading it), read by workers only
    /// after they observe the generation bump that publishes it.
    job: UnsafeCell<Option<*const Job>>,
    /// Workers that have not finished the current region.
    remaining: AtomicUsize,
    /// Whether a worker panicked in the current region (checked every
    /// region; the payload's lock only where one did).
    panicked: AtomicBool,
    /// The first panic of a worker in the current region (its payload, so
    /// the caller re-raises what went wrong, not just that something did).
    payload: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    shutdown: AtomicBool,
    /// Parked workers, and the condition they wait on.
    sleepers: Mutex<usize>,
    wake: Condvar,
    spin: Duration,
}

impl Shared {
    /// No region posted yet; idle workers spin for `spin` before parking.
    fn new(spin: Duration) -> Self {
        Self {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            payload: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
            spin,
        }
    }
}

// SAFETY: `job` is the only non-thread-safe field. It is written by the
// thread that owns the `ThreadPool` (through `&mut`-exclusive `run`
// semantics: `run` holds `region` for its whole duration) while no worker
// can read it, and read by workers only between the Release bump of
// `generation` and their Release decrement of `remaining`; `run` does not
// return (or write `job` again) before `remaining` reaches zero.
unsafe impl Sync for Shared {}
// SAFETY: the raw job pointer is only dereferenced under the protocol above.
unsafe impl Send for Shared {}

/// A fixed set of worker threads plus the caller.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes regions: one region at a time per pool.
    region: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({} threads)", self.threads())
    }
}

impl ThreadPool {
    /// A pool of `threads` threads in all (the caller counts as one; 0 and 1
    /// both mean the caller alone), whose idle workers spin for `spin`
    /// before parking.
    pub fn new(threads: usize, spin: Duration) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::new(spin));
        let mut workers = Vec::new();
        for index in 1..threads.max(1) {
            let s = shared.clone();
            let handle =
                std::thread::Builder::new().name(format!("native-cpu-{index}")).spawn(move || worker(&s, index));
            match handle {
                Ok(h) => workers.push(h),
                Err(e) => {
                    // Stop the ones already started before reporting.
                    drop(Self { shared, workers, region: Mutex::new(()) });
                    return Err(e);
                }
            }
        }
        Ok(Self { shared, workers, region: Mutex::new(()) })
    }

    /// The caller alone: regions run inline.
    pub fn serial() -> Self {
        // No thread is spawned, so this cannot fail.
        Self { shared: Arc::new(Shared::new(Duration::ZERO)), workers: Vec::new(), region: Mutex::new(()) }
    }

    /// Threads a region runs on (workers plus the caller).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `job(i)` for every `i` in `0..threads()`, `i = 0` on the calling
    /// thread, and returns when all have finished. A panic in any of them
    /// is re-raised here after every worker is done with `job`. Inside
    /// another region it runs every `i` in turn on the calling thread, so a
    /// job that reaches per-thread state by `i` must not be nested (the
    /// methods below run nested work under the thread's own index instead).
    /// Regions nest within one pool only.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            job(0);
            return;
        }
        if enclosing().is_some() {
            (0..self.threads()).for_each(job);
            return;
        }
        let _region = self.region.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // SAFETY: erasing the lifetime is sound because this function does
        // not return before every worker has finished with the pointer
        // (`remaining` reaches zero below, on every path, panics included).
        let erased: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(job) };
        // SAFETY: no region is in flight (we hold `region` and the previous
        // region waited for `remaining == 0`), so no worker reads `job` now.
        unsafe { *s.job.get() = Some(erased) };
        s.remaining.store(self.workers.len(), Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        {
            let sleepers = s.sleepers.lock().unwrap_or_else(|p| p.into_inner());
            if *sleepers > 0 {
                s.wake.notify_all();
            }
        }
        let mine = catch_unwind(AssertUnwindSafe(|| {
            let _mark = RegionMark::enter(0);
            job(0)
        }));
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: every worker has finished with the job (remaining is 0).
        unsafe { *s.job.get() = None };
        let theirs = if s.panicked.swap(false, Ordering::AcqRel) {
            s.payload.lock().unwrap_or_else(|p| p.into_inner()).take()
        } else {
            None
        };
        if let Err(payload) = mine {
            resume_unwind(payload);
        }
        if let Some(payload) = theirs {
            resume_unwind(payload);
        }
    }

    /// The index inline work runs under: 0 (the calling thread's) outside
    /// any region; inside one, the index this thread runs there, so nested
    /// work reaches this thread's own per-thread state ([`PerThread`]),
    /// never that of another thread, which may be using it at that moment.
    /// (A region of another pool with more threads would give an index past
    /// this pool's: the last is taken, and regions do not nest that way.)
    pub fn inline_index(&self) -> usize {
        enclosing().map_or(0, |t| t.min(self.threads() - 1))
    }

    /// Splits `0..n` into one contiguous range per thread, each (but the
    /// last non-empty one) a multiple of `align` items, and runs `f(range,
    /// thread)` for every non-empty range in parallel.
    pub fn for_ranges(&self, n: usize, align: usize, f: &(dyn Fn(std::ops::Range<usize>, usize) + Sync)) {
        let threads = self.threads();
        if threads == 1 || n <= align || enclosing().is_some() {
            f(0..n, self.inline_index());
            return;
        }
        self.run(&|t| {
            let r = split(n, align, threads, t);
            if !r.is_empty() {
                f(r, t);
            }
        });
    }

    /// Runs `f(item, thread)` for every item of `0..n`, each thread claiming
    /// the next unclaimed item when it finishes one. For items of uneven
    /// cost (or threads of uneven speed: the one that packed the inputs
    /// has them in its own cache) this keeps every thread busy to the end,
    /// where [`ThreadPool::for_ranges`]'s fixed split leaves the faster
    /// thread waiting. Which thread computes an item never changes its
    /// result, so outputs stay deterministic.
    pub fn for_claimed(&self, n: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        self.for_claimed_prepared(n, &|_| {}, f);
    }

    /// [`ThreadPool::for_claimed`], each thread that takes part first
    /// running `prepare(thread)` once (see
    /// [`ThreadPool::for_claimed_ranges_prepared`]).
    fn for_claimed_prepared(&self, n: usize, prepare: &(dyn Fn(usize) + Sync), f: &(dyn Fn(usize, usize) + Sync)) {
        if n == 0 {
            return;
        }
        if self.threads() == 1 || n == 1 || enclosing().is_some() {
            let t = self.inline_index();
            prepare(t);
            (0..n).for_each(|i| f(i, t));
            return;
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        self.run(&|t| {
            prepare(t);
            loop {
                let item = next.fetch_add(1, Ordering::Relaxed);
                if item >= n {
                    break;
                }
                f(item, t);
            }
        });
    }

    /// `0..n` in ranges of at most `chunk` items, each item run once: every
    /// thread walks its own contiguous share (its [`split`]) front to back,
    /// then takes ranges from the back of any share still unfinished. For
    /// a projection: a thread's ranges stay one forward run through the
    /// weights, so the kernels' fetch of what follows a range brings in
    /// what this thread computes next (items claimed in turn from one
    /// counter went to either thread, and the fetch served the other one:
    /// 10% of a one-sequence decode step on a Zen 4, `examples/batch_profile`,
    /// against a fixed split); and a thread the OS preempts under a server
    /// still has its share finished by the others (a fixed split made the
    /// region wait for it). A claim takes at most half of what its share
    /// has left ([`claim_size`]), so claims shrink toward a share's end and
    /// the thread that finishes first waits for at most one item of the
    /// other's, not for a whole chunk.
    pub fn for_claimed_ranges(&self, n: usize, chunk: usize, f: &(dyn Fn(std::ops::Range<usize>, usize) + Sync)) {
        self.for_claimed_ranges_prepared(n, chunk, &|_| {}, f);
    }

    /// [`ThreadPool::for_claimed_ranges`], each thread that takes part
    /// first running `prepare(thread)` once (before its first range; also
    /// where it then finds no range left): for what every thread needs its
    /// own copy of, made in the region rather than by the caller before it.
    pub fn for_claimed_ranges_prepared(
        &self,
        n: usize,
        chunk: usize,
        prepare: &(dyn Fn(usize) + Sync),
        f: &(dyn Fn(std::ops::Range<usize>, usize) + Sync),
    ) {
        let chunk = chunk.max(1);
        let threads = self.threads();
        if n == 0 {
            return;
        }
        if threads == 1 || n <= chunk || enclosing().is_some() {
            let t = self.inline_index();
            prepare(t);
            f(0..n, t);
            return;
        }
        if threads > MAX_SHARES || n > u32::MAX as usize {
            // One counter over the chunks, claimed in turn.
            let range = |c: usize| c * chunk..((c + 1) * chunk).min(n);
            self.for_claimed_prepared(n.div_ceil(chunk), prepare, &|c, t| f(range(c), t));
            return;
        }
        // Each share's unclaimed items `front..back`, packed in one word:
        // the owner takes from the front, others from the back, both by
        // compare-and-swap, so every item is taken exactly once.
        let shares: [AtomicU64; MAX_SHARES] = std::array::from_fn(|t| {
            let r = if t < threads { split(n, 1, threads, t) } else { 0..0 };
            AtomicU64::new(pack(r.start, r.end))
        });
        let take = |share: &AtomicU64, from_back: bool| -> Option<std::ops::Range<usize>> {
            let mut now = share.load(Ordering::Relaxed);
            loop {
                let (front, back) = unpack(now);
                if front >= back {
                    return None;
                }
                let size = claim_size(back - front, chunk);
                let (next, taken) = if from_back {
                    (pack(front, back - size), back - size..back)
                } else {
                    (pack(front + size, back), front..front + size)
                };
                match share.compare_exchange_weak(now, next, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => return Some(taken),
                    Err(seen) => now = seen,
                }
            }
        };
        self.run(&|t| {
            prepare(t);
            while let Some(r) = take(&shares[t], false) {
                f(r, t);
            }
            // Others' shares, from their backs, until none has any left.
            while let Some(r) = (1..threads).find_map(|k| take(&shares[(t + k) % threads], true)) {
                f(r, t);
            }
        });
    }
}

/// How many of the `left` (at least one) unclaimed items of a share one
/// claim takes (`chunk` is at least one too): at most `chunk`, and at
/// most half of them (rounded up), so the last claims of every share are
/// single items. Claims of whole chunks to the end left
/// the thread that finished first waiting for up to a chunk of the other's
/// (a 16-sequence MLP's chunk is 12 tile pairs, about 25 µs): with claims
/// that shrink, a 16-sequence decode step ran 2-4% faster (medians of
/// steps alternating with the fixed chunks in one process, 4 runs, Zen 4,
/// 2 threads; no change at 1 sequence).
fn claim_size(left: usize, chunk: usize) -> usize {
    chunk.min(left.div_ceil(2))
}

/// Threads a region splits owned shares among at most (more fall back to
/// one shared counter).
const MAX_SHARES: usize = 64;

fn pack(front: usize, back: usize) -> u64 {
    ((front as u64) << 32) | back as u64
}

fn unpack(word: u64) -> (usize, usize) {
    ((word >> 32) as usize, (word & u64::from(u32::MAX)) as usize)
}

/// Threads a pool asked for `threads` runs on: `threads`, or for 0 one per
/// core.
pub fn threads_or_cores(threads: usize) -> usize {
    match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        t => t,
    }
}

/// The `t`-th of `threads` ranges over `0..n`, in units of `align`.
pub fn split(n: usize, align: usize, threads: usize, t: usize) -> std::ops::Range<usize> {
    let align = align.max(1);
    let units = n.div_ceil(align);
    let per = units / threads;
    let extra = units % threads;
    let start = (t * per + t.min(extra)) * align;
    let len = (per + usize::from(t < extra)) * align;
    start.min(n)..(start + len).min(n)
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _g = self.shared.sleepers.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(s: &Shared, index: usize) {
    // Regions are counted from the pool's creation: one posted before this
    // thread got to run is still ahead of it.
    let mut seen = 0;
    loop {
        // Wait for the next region: spin first, then park.
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || started.elapsed() < s.spin {
                std::hint::spin_loop();
                continue;
            }
            let mut sleepers = s.sleepers.lock().unwrap_or_else(|p| p.into_inner());
            *sleepers += 1;
            while s.generation.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Acquire) {
                sleepers = s.wake.wait(sleepers).unwrap_or_else(|p| p.into_inner());
            }
            *sleepers -= 1;
        }
        // SAFETY: the generation bump (Acquire above) published the job,
        // and the caller keeps it alive until `remaining` reaches zero.
        let job = unsafe { *s.job.get() };
        if let Some(job) = job {
            // SAFETY: see above: the pointee outlives this call.
            let f = unsafe { &*job };
            let _mark = RegionMark::enter(index);
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(index))) {
                let mut first = s.payload.lock().unwrap_or_else(|p| p.into_inner());
                if first.is_none() {
                    *first = Some(payload);
                } else {
                    // Another worker's panic came first. This one's payload
                    // is let go without running its drop: a drop that
                    // panicked would skip the count below, and the caller
                    // would wait forever (one box, once per extra panic).
                    std::mem::forget(payload);
                }
                drop(first);
                s.panicked.store(true, Ordering::Release);
            }
        }
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}

/// One value per pool thread, each touched only by its own thread while a
/// region runs (per-thread scratch buffers). A slot is taken for as long
/// as its [`Slot`] lives, and taking one already taken panics: a runtime
/// shared by two callers (its kernels are safe functions, and it is
/// `Sync`) would otherwise hand both slot 0 at once.
pub struct PerThread<T> {
    slots: Vec<(UnsafeCell<T>, AtomicBool)>,
}

// SAFETY: a slot's value is only reached through `take`, whose flag gives
// it to one `Slot` at a time, or through `&mut self`.
unsafe impl<T: Send> Sync for PerThread<T> {}

impl<T: Default> PerThread<T> {
    pub fn new(threads: usize) -> Self {
        Self { slots: (0..threads.max(1)).map(|_| (UnsafeCell::new(T::default()), AtomicBool::new(false))).collect() }
    }
}

impl<T> PerThread<T> {
    /// Thread `t`'s value, for as long as the returned [`Slot`] lives.
    ///
    /// # Panics
    /// Where slot `t` is already taken: two callers ran kernels on one
    /// runtime at once, or a thread took another's index.
    pub fn take(&self, t: usize) -> Slot<'_, T> {
        let (value, taken) = &self.slots[t];
        assert!(
            !taken.swap(true, Ordering::Acquire),
            "per-thread slot {t} is already in use: one runtime runs one caller's kernels at a time"
        );
        // SAFETY: the flag was clear and is now set: no other `Slot` of
        // this index lives until this one drops and clears it, and `&mut
        // self` (`get_mut`) cannot coexist with the `&self` it borrows.
        Slot { value: unsafe { &mut *value.get() }, taken }
    }

    pub fn get_mut(&mut self, t: usize) -> &mut T {
        self.slots[t].0.get_mut()
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// One thread's value of a [`PerThread`], taken until dropped.
pub struct Slot<'a, T> {
    value: &'a mut T,
    taken: &'a AtomicBool,
}

impl<T> std::ops::Deref for Slot<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value
    }
}

impl<T> std::ops::DerefMut for Slot<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.value
    }
}

impl<T> Drop for Slot<'_, T> {
    fn drop(&mut self) {
        self.taken.store(false, Ordering::Release);
    }
}

/// A mutable slice several pool threads write at once, each to its own
/// elements (rows of an output that a region splits between threads).
pub struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: access goes through `slice`, whose contract forbids overlapping
// ranges between threads.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    pub fn new(data: &'a mut [T]) -> Self {
        Self { ptr: data.as_mut_ptr(), len: data.len(), _borrow: std::marker::PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `start..start + n`.
    ///
    /// # Safety
    /// While the returned slice lives, no other call may return a range
    /// overlapping it. Panics if the range is out of bounds.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, n: usize) -> &mut [T] {
        assert!(start <= self.len && n <= self.len - start, "disjoint range {start}+{n} outside {}", self.len);
        // SAFETY: in bounds (asserted); exclusive by the caller's contract;
        // the borrow of the underlying slice outlives `'a`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }
}

#[cfg(test)]
mod tests;
