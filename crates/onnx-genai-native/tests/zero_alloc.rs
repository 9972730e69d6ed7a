//! A warmed-up decode step allocates nothing: every buffer a step writes is
//! reused from the step before (slots, per-thread scratch, staging, the KV
//! blocks already held), on every thread of the pool. A counting global
//! allocator proves it for f32, f16, 4-bit and int8-input (`accuracy_level`
//! 4) packages, on one thread and on two, and past one attention part (a
//! context of 700 positions, whose decode rows attend in parts run as
//! separate jobs) with the cache in f32 and in f16.
//!
//! One test function only: the allocator counts every thread of the
//! process, so nothing else may run while a step is measured.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use onnx_genai_backend::{DecodeModel, Entry, Input, KvCache, Sequence};
use onnx_genai_build::Variant;
use onnx_genai_native::NativeModel;

struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the
// counter is a side effect that touches no allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations (on any thread) while `f` runs.
fn allocations_in(f: impl FnOnce()) -> usize {
    ALLOCATIONS.store(0, Ordering::SeqCst);
    ARMED.store(true, Ordering::SeqCst);
    f();
    ARMED.store(false, Ordering::SeqCst);
    ALLOCATIONS.load(Ordering::SeqCst)
}

/// One entry per sequence, each fed its one token.
fn entries<'a>(
    seqs: &'a mut [Box<dyn Sequence>],
    logits: &'a mut [Vec<f32>],
    tokens: &'a [[u32; 1]],
) -> Vec<Entry<'a>> {
    seqs.iter_mut()
        .zip(logits.iter_mut())
        .zip(tokens)
        .map(|((s, l), t)| Entry { sequence: s.as_mut(), input: Input::Tokens(t), logits: l })
        .collect()
}

/// Pins issue 15's zero-allocation decode step on every weight storage the
/// native kernels have (f32, f16, 4-bit, 4-bit with int8 inputs), at one
/// and at two threads, on a batch of two sequences, and on a batch of
/// eight int8-input rows (the AMX kernel's, where the CPU has it).
#[test]
fn a_warm_decode_step_allocates_nothing() {
    let cases = [
        ("tiny-llama-gqa", Variant::Decomposed, "f32"),
        ("tiny-llama-f16", Variant::Decomposed, "f16"),
        ("tiny-llama-gqa", Variant::Contrib, "q4"),
        ("tiny-llama-gqa", Variant::Genai, "q4 with int8 inputs (accuracy_level 4)"),
        ("tiny-llama-gqa", Variant::Opset23, "f32, opset-23 ops"),
        ("tiny-gpt2", Variant::Contrib, "q4, gpt2"),
    ];
    for (name, variant, what) in cases {
        let (_dir, package) = onnx_genai_test_support::build_variant(name, variant);
        for threads in [1, 2] {
            let model: Arc<dyn DecodeModel> = Arc::new(NativeModel::load(&package, threads).unwrap());
            let mut seqs = [model.new_sequence(), model.new_sequence()];
            let mut logits = [Vec::with_capacity(model.vocab_size()), Vec::with_capacity(model.vocab_size())];
            let prompts: [&[u32]; 2] = [&[1, 2, 3, 4], &[9, 8, 7]];
            let next = [[5u32], [6u32]];
            let mut step = |width: usize, first: bool| {
                let [s0, s1] = &mut seqs;
                let [l0, l1] = &mut logits;
                let inputs = if first { prompts } else { [&next[0][..], &next[1][..]] };
                let mut batch = [
                    Entry { sequence: s0.as_mut(), input: Input::Tokens(inputs[0]), logits: l0 },
                    Entry { sequence: s1.as_mut(), input: Input::Tokens(inputs[1]), logits: l1 },
                ];
                model.step(&mut batch[..width]).unwrap();
            };
            step(2, true);
            for _ in 0..3 {
                step(1, false);
                step(2, false);
            }
            let one = allocations_in(|| step(1, false));
            let two = allocations_in(|| step(2, false));
            assert_eq!(one, 0, "{what} ({name} {variant:?}), {threads} thread(s): a decode step allocated {one} times");
            assert_eq!(
                two, 0,
                "{what} ({name} {variant:?}), {threads} thread(s): a batch of two allocated {two} times"
            );
        }
    }
    // A batch of eight int8-input rows: on a CPU with AMX they run on
    // tiles, whose images and sums live in each thread's scratch.
    let (_dir, package) = onnx_genai_test_support::build_variant("tiny-llama-gqa", Variant::Genai);
    for threads in [1, 2] {
        let model: Arc<dyn DecodeModel> = Arc::new(NativeModel::load(&package, threads).unwrap());
        let mut seqs: Vec<_> = (0..8).map(|_| model.new_sequence()).collect();
        let mut logits: Vec<Vec<f32>> = (0..8).map(|_| Vec::with_capacity(model.vocab_size())).collect();
        for t in 0..4 {
            let tokens: Vec<[u32; 1]> = (0..8).map(|i| [t + i + 1]).collect();
            model.step(&mut entries(&mut seqs, &mut logits, &tokens)).unwrap();
        }
        // (The batch's own vector is built outside the measured step.)
        let tokens: Vec<[u32; 1]> = (0..8).map(|i| [20 + i]).collect();
        let mut batch = entries(&mut seqs, &mut logits, &tokens);
        let eight = allocations_in(|| model.step(&mut batch).unwrap());
        assert_eq!(eight, 0, "int8 inputs, {threads} thread(s): a batch of eight allocated {eight} times");
    }
    let mut spec = onnx_genai_test_support::spec("tiny-llama-gqa");
    spec.max_sequence_length = 1024;
    let dir = tempfile::tempdir().unwrap();
    onnx_genai_build::build_variant(&spec, Variant::Decomposed, dir.path()).unwrap();
    let package = onnx_genai_package::Package::open(dir.path()).unwrap();
    let prompt: Vec<u32> = (0..700).map(|i| (i * 37 + 11) % 384).collect();
    for kv in [KvCache::Model, KvCache::F16] {
        for threads in [1, 2] {
            let model: Arc<dyn DecodeModel> = Arc::new(NativeModel::load_with(&package, threads, kv).unwrap());
            let mut seq = model.new_sequence();
            let mut logits = Vec::with_capacity(model.vocab_size());
            let mut step = |tokens: &[u32]| {
                let entry = Entry { sequence: seq.as_mut(), input: Input::Tokens(tokens), logits: &mut logits };
                model.step(&mut [entry]).unwrap();
            };
            step(&prompt);
            for t in 0..3 {
                step(&[t]);
            }
            let long = allocations_in(|| step(&[7]));
            assert_eq!(
                long, 0,
                "{kv} cache, {threads} thread(s): a decode step at 700 positions allocated {long} times"
            );
        }
    }
}
