//! What the compiler makes of the shipped exports: the fusions fire, no
//! generic matrix product or KV concatenation survives, buffers are shared,
//! and the KV cache is preallocated once.

use std::sync::Arc;

use onnx_genai_backend::{DecodeModel, Decoder, Entry, Input};
use onnx_genai_build::Variant;
use onnx_genai_native::kv::BLOCK_TOKENS;
use onnx_genai_native::{compile_package, NativeModel};

fn decoder(package: &onnx_genai_package::Package, threads: usize) -> Decoder {
    Decoder::new(Arc::new(NativeModel::load(package, threads).unwrap()))
}

use onnx_genai_test_support::build_variant as package;

/// Fusion coverage per export: a matcher that silently stops firing fails
/// here even though the generic kernels would still compute the right
/// logits (decomposed attention cannot fall back: it must fuse). Every
/// separate Q/K/V trio is stacked into one split projection. The
/// logits projection writes the logits output itself (the exporters'
/// Identity before it is removed, no copy runs), so a prefill computes only
/// the last row's logits.
#[test]
fn fusions_fire_on_every_export() {
    let layers = 2;
    type Expected = (&'static str, Variant, Vec<(&'static str, usize)>);
    let expect: Vec<Expected> = vec![
        (
            "tiny-llama-gqa",
            Variant::Decomposed,
            vec![
                ("causal_mask", 1),
                ("linear", 15),
                ("rms_norm", 2 * layers + 1),
                ("gated_mlp", layers),
                ("rotary", 2 * layers),
                ("attention", layers),
                ("head_layout", layers),
                ("stack_projections", layers),
            ],
        ),
        (
            "tiny-llama-gqa",
            Variant::Opset23,
            vec![
                ("causal_mask", 1),
                ("linear", 15),
                ("gated_mlp", layers),
                ("head_layout", layers),
                ("stack_projections", layers),
            ],
        ),
        (
            "tiny-llama-gqa",
            Variant::Contrib,
            vec![("matmul_nbits", 15), ("gated_mlp", layers), ("stack_projections", layers)],
        ),
        // One packed QKV projection per layer (5 per layer plus the head):
        // nothing left to stack.
        (
            "tiny-llama-gqa",
            Variant::Genai,
            vec![("matmul_nbits", 5 * layers + 1), ("gated_mlp", layers), ("stack_projections", 0)],
        ),
        (
            "tiny-llama-f16",
            Variant::Genai,
            vec![("matmul_nbits", 5 * layers + 1), ("gated_mlp", layers), ("stack_projections", 0)],
        ),
        // GPT-2's attention input is one biased projection already.
        (
            "tiny-gpt2",
            Variant::Contrib,
            vec![("matmul_nbits", 13), ("linear_bias", 12), ("gelu_tanh", layers), ("stack_projections", 0)],
        ),
        (
            "tiny-gpt2",
            Variant::Decomposed,
            vec![
                ("causal_mask", 1),
                ("linear", 13),
                ("linear_bias", 12),
                ("layer_norm", 2 * layers + 1),
                ("gelu_tanh", layers),
                ("attention", layers),
                ("head_layout", layers),
            ],
        ),
        (
            "tiny-llama-f16",
            Variant::Decomposed,
            vec![
                ("linear", 15),
                ("rms_norm", 5),
                ("gated_mlp", layers),
                ("rotary", 4),
                ("attention", layers),
                ("stack_projections", layers),
            ],
        ),
    ];
    for (name, variant, fusions) in expect {
        let (_dir, package) = package(name, variant);
        let plan = compile_package(&package).unwrap();
        for (kind, n) in fusions {
            assert_eq!(plan.stats.fused(kind), n, "{name} {variant:?} {kind}: {:?}", plan.stats.fusions);
        }
        assert_eq!(plan.stats.fused("identity_forwarded"), 1, "{name} {variant:?}: {:?}", plan.stats.fusions);
        let ops = plan.step_ops();
        for generic in ["MatMul", "Concat", "Softmax", "MatMulNBits", "Tile", "Tanh", "Identity"] {
            assert!(!ops.iter().any(|o| o == generic), "{name} {variant:?} still runs a generic {generic}: {ops:?}");
        }
        assert_eq!(ops.iter().filter(|o| *o == "Attention").count(), layers, "{name} {variant:?}");
        assert!(plan.head_selects_rows(), "{name} {variant:?}: the logits projection runs on every row");
        // 9-13 slots for 29-37 values on these 2-layer exports (a
        // projection's output shares only with its own width, so a few more
        // slots than sharing by type alone gave).
        assert!(
            plan.slots() * 2 < plan.values,
            "{name} {variant:?}: {} slots for {} values",
            plan.slots(),
            plan.values
        );
    }
}

/// f16 weights stay f16 in the packed projections (not widened at compile
/// time — packed as f16 by the fusion itself; only the tied output
/// projection is widened and narrowed back at repacking), and 4-bit ones
/// stay 4-bit.
#[test]
fn compressed_weights_stay_compressed() {
    let (_d, f16) = package("tiny-llama-f16", Variant::Decomposed);
    let plan = compile_package(&f16).unwrap();
    assert!(plan.step_ops().iter().any(|o| o == "Linear[f16]"));
    // One weight reaches repacking as f32 and is narrowed back: the tied
    // output projection, whose transposed table constant folding widened.
    // Any other would be an f16 weight the fusions let go through f32.
    assert_eq!(plan.stats.fused("narrow_f16"), 1, "f16 weights that went through f32: {:?}", plan.stats.fusions);
    let (_d, q4) = package("tiny-llama-gqa", Variant::Contrib);
    let ops = compile_package(&q4).unwrap().step_ops();
    let projections: Vec<&String> = ops.iter().filter(|o| o.contains("Linear[")).collect();
    assert!(projections.iter().any(|o| o.starts_with("SplitLinear")), "{ops:?}");
    assert!(projections.iter().all(|o| o.ends_with("Linear[q4]")), "{ops:?}");
}

/// A compiled plan keeps all its tiled projection weights in one arena
/// (on huge pages where the OS grants them), f16 and 4-bit alike: a decode
/// step streams one run of memory, not a few hundred allocations.
#[test]
fn projection_weights_share_one_arena() {
    for (name, variant) in [("tiny-llama-f16", Variant::Decomposed), ("tiny-llama-gqa", Variant::Contrib)] {
        let (_d, p) = package(name, variant);
        assert!(compile_package(&p).unwrap().weights_in_one_arena(), "{name}");
    }
}

/// KV memory follows the positions held (B2's resident bytes): a new
/// sequence holds nothing; prefill and decode take whole blocks covering
/// exactly the positions written; truncating gives blocks back; running
/// past the context is a typed capacity error that leaves the sequence as
/// it was.
#[test]
fn kv_blocks_follow_the_positions_held() {
    let (_d, package) = package("tiny-llama-gqa", Variant::Decomposed);
    let mut b = decoder(&package, 1);
    assert_eq!(b.resident_bytes(), 0, "a new sequence holds no KV");
    let per_block = package.kv_geometry().unwrap().bytes_per_token() * BLOCK_TOKENS as u64;
    b.forward(&[1, 2, 3]).unwrap();
    assert_eq!(b.resident_bytes(), per_block);
    for t in 0..(BLOCK_TOKENS as u32 - 3) {
        b.forward(&[t]).unwrap();
    }
    assert_eq!((b.kv_len(), b.resident_bytes()), (BLOCK_TOKENS, per_block), "a full block, no more");
    b.forward(&[7]).unwrap();
    assert_eq!(b.resident_bytes(), 2 * per_block, "the next position takes a second block");
    b.truncate(10).unwrap();
    assert_eq!((b.kv_len(), b.resident_bytes()), (10, per_block));
    // Past capacity is a typed capacity error, and the state is unchanged.
    let max = package.manifest.architecture.max_sequence_length as usize;
    let err = b.forward(&vec![5; max]).unwrap_err();
    assert!(matches!(err, onnx_genai_backend::BackendError::Capacity { have: 10, .. }), "{err}");
    assert_eq!((b.kv_len(), b.resident_bytes()), (10, per_block));
    b.reset();
    assert_eq!(b.resident_bytes(), 0);
}

/// B1 at the model: sequences of different lengths (a prefill, a decode
/// step and a longer context) advanced together in one step get the logits
/// ONNX Runtime (the reference) gives each alone, within the package's
/// tier, on every export the batch runs.
#[test]
fn a_ragged_batch_step_matches_each_sequence_alone() {
    // (package, variant, tier atol = rtol): f32, f16 and 4-bit tiers, and
    // `accuracy_level` 4's int8 inputs.
    for (name, variant, tol) in [
        ("tiny-llama-gqa", Variant::Decomposed, 1e-4),
        ("tiny-llama-gqa", Variant::Opset23, 1e-4),
        ("tiny-llama-gqa", Variant::Contrib, 2e-4),
        ("tiny-llama-gqa", Variant::Genai, 2e-2),
        ("tiny-gpt2", Variant::Decomposed, 1e-4),
        ("tiny-llama-f16", Variant::Decomposed, 2e-3),
    ] {
        let (_d, package) = package(name, variant);
        let model: Arc<dyn DecodeModel> = Arc::new(NativeModel::load(&package, 2).unwrap());
        assert!(model.batch_width() > 1, "{name} {variant:?} runs one sequence at a time");
        let reference: Arc<dyn DecodeModel> = Arc::new(onnx_genai_ort::OrtModel::load(&package, 1).unwrap());
        let prompts: [Vec<u32>; 3] = [vec![5, 9, 14], (1..40).collect(), vec![300, 2, 2, 8, 1, 90, 91]];
        let nexts: [Vec<u32>; 3] = [vec![7], (50..61).collect(), vec![1]];
        // Alone, on the reference.
        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .zip(&nexts)
            .map(|(p, n)| {
                let mut d = Decoder::new(reference.clone());
                d.forward(p).unwrap();
                d.forward(n).unwrap()
            })
            .collect();
        // Together: the prompts as one batch, then the continuations as one.
        let mut seqs: Vec<_> = (0..3).map(|_| model.new_sequence()).collect();
        let mut logits = vec![Vec::new(); 3];
        for inputs in [&prompts, &nexts] {
            let mut batch: Vec<Entry<'_>> = seqs
                .iter_mut()
                .zip(inputs.iter())
                .zip(logits.iter_mut())
                .map(|((s, t), l)| Entry { sequence: s.as_mut(), input: Input::Tokens(t), logits: l })
                .collect();
            model.step(&mut batch).unwrap();
        }
        assert_eq!(alone.len(), logits.len());
        for (i, (a, b)) in alone.iter().zip(&logits).enumerate() {
            assert_eq!(a.len(), b.len(), "sequence {i}");
            let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (tol + tol * x.abs())).fold(0.0f32, f32::max);
            assert!(worst <= 1.0, "{name} {variant:?} sequence {i}: batched logits off by {worst}x the tier");
            assert_eq!(seqs[i].kv_len(), prompts[i].len() + nexts[i].len());
        }
    }
}

/// Threads change where large kernels run, not what they compute: a long
/// prefill and decode (parallel projections and attention past their size
/// thresholds) on two threads give the one-thread logits bit for bit.
#[test]
fn threaded_kernels_compute_the_same_logits() {
    let (_d, package) = package("tiny-llama-gqa", Variant::Decomposed);
    let prompt: Vec<u32> = (0..200).map(|i| (i * 37 + 11) % 380).collect();
    let run = |threads| {
        let mut b = decoder(&package, threads);
        let mut all = b.forward(&prompt).unwrap();
        for t in 0..8 {
            all.extend(b.forward(&[t * 13]).unwrap());
        }
        all
    };
    assert_eq!(run(1), run(2));
}

/// A model forced onto a lower instruction-set path runs it (each path
/// computes its own bits: the logits move, within the kernels' f32
/// rounding of one another) and refuses a path this CPU lacks with a typed
/// error, keeping the one it had.
#[test]
fn a_model_runs_the_instruction_set_it_is_set_to() {
    use onnx_genai_native::kernels::isa::Isa;
    let (_d, package) = package("tiny-llama-gqa", Variant::Contrib);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 380).collect();
    let model = Arc::new(NativeModel::load(&package, 2).unwrap());
    let mut best = Decoder::new(model.clone());
    let want = best.forward(&prompt).unwrap();
    for isa in Isa::ALL {
        let set = model.set_isa(isa);
        if !isa.available() {
            assert!(matches!(set, Err(onnx_genai_backend::BackendError::Unavailable { .. })), "{isa}: {set:?}");
            continue;
        }
        set.unwrap();
        let mut b = Decoder::new(model.clone());
        let got = b.forward(&prompt).unwrap();
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-3, "{isa}: logits {worst} away from the best path's");
        // Another family of kernels (portable, AVX2, AVX-512) adds in
        // another order; within a family the VNNI variant differs only
        // for int8 inputs, which this export does not take.
        let family = |i: Isa| (i.x86(), i.wide());
        if family(isa) != family(Isa::best()) {
            assert!(got != want, "{isa}: exactly the best path's logits, so it did not run");
        }
    }
}

/// A buffer slot holds values of one row width wherever the compiler knows
/// it: buffers are resized, not cleared, so a slot shared by a 960-wide
/// projection output and a 576-wide one would zero-fill its growth every
/// time it widened (on the calling thread, the other threads waiting).
/// Every step's first output of a traced decode step has its slot's width,
/// and every projection's output slot has a known width, on every export
/// the batch runs.
#[test]
fn a_slot_holds_values_of_one_row_width() {
    for (name, variant) in
        [("tiny-llama-gqa", Variant::Decomposed), ("tiny-llama-gqa", Variant::Genai), ("tiny-gpt2", Variant::Contrib)]
    {
        let (_d, package) = package(name, variant);
        let model = NativeModel::load(&package, 1).unwrap();
        let mut seq = model.new_sequence();
        let mut logits = Vec::new();
        model
            .step(&mut [Entry { sequence: &mut *seq, input: Input::Tokens(&[3, 5, 7]), logits: &mut logits }])
            .unwrap();
        model.set_tracing(true);
        model.step(&mut [Entry { sequence: &mut *seq, input: Input::Tokens(&[9]), logits: &mut logits }]).unwrap();
        let trace = model.trace();
        let plan = model.plan();
        // The trace holds the first output of each step that has one.
        let traced: Vec<_> = plan.steps().filter(|s| !s.outputs.is_empty()).collect();
        assert_eq!(traced.len(), trace.len(), "{name} {variant:?}: trace and steps differ");
        let mut checked = 0;
        for (step, value) in traced.iter().zip(&trace) {
            let slot = &step.outputs[0];
            let known = plan.slot_width(*slot);
            if step.op.projection_weight().is_some() {
                assert!(known.is_some(), "{name} {variant:?}: {}'s output slot has no known width", step.name);
            }
            if let Some(width) = known {
                assert_eq!(
                    value.shape.last(),
                    Some(&width),
                    "{name} {variant:?}: {} in slot {slot} shape {:?}",
                    step.name,
                    value.shape
                );
                checked += 1;
            }
        }
        let projections = plan.steps().filter(|s| s.op.projection_weight().is_some()).count();
        assert!(projections >= 5 && checked >= projections, "{name} {variant:?}: {checked} steps checked");
    }
}

/// An f32 model with its KV cache stored in f16 (`KvCache::F16`): a
/// position holds half the bytes — what a sequence reports resident and
/// what the model tells admission it stores per position (A1: the
/// reservation covers what is resident) — while the logits stay within
/// f16's rounding of the f32 cache's (the f16 tier; the int8-activation
/// tier for `accuracy_level` 4, whose input quantization turns small
/// differences into whole steps) and greedy decoding picks the same tokens,
/// over a prompt longer than one KV block.
#[test]
fn an_f16_cache_halves_the_bytes_and_keeps_the_tokens() {
    use onnx_genai_backend::KvCache;
    let argmax = |l: &[f32]| (0..l.len()).max_by(|&i, &j| l[i].total_cmp(&l[j])).unwrap() as u32;
    for (variant, tol) in [(Variant::Decomposed, 2e-3), (Variant::Genai, 2e-2)] {
        let (_d, package) = package("tiny-llama-gqa", variant);
        let wide = Arc::new(NativeModel::load(&package, 2).unwrap());
        let narrow = Arc::new(NativeModel::load_with(&package, 2, KvCache::F16).unwrap());
        let declared = package.kv_geometry().map(|g| g.bytes_per_token());
        assert_eq!(wide.kv_bytes_per_token(), declared, "{variant:?}: an f32 cache stores what the package declares");
        assert_eq!(narrow.kv_bytes_per_token().map(|b| 2 * b), declared, "{variant:?}: an f16 cache stores half");
        let (mut a, mut b) = (Decoder::new(wide), Decoder::new(narrow));
        let prompt: Vec<u32> = (0..70).map(|i| (i * 37 + 11) % 380).collect();
        let (mut la, mut lb) = (a.forward(&prompt).unwrap(), b.forward(&prompt).unwrap());
        for step in 0..16 {
            let worst = la.iter().zip(&lb).map(|(x, y)| (x - y).abs() / (tol + tol * x.abs())).fold(0.0f32, f32::max);
            assert!(worst <= 1.0, "{variant:?} step {step}: the f16 cache's logits are off by {worst}x the f16 tier");
            let (ta, tb) = (argmax(&la), argmax(&lb));
            assert_eq!(ta, tb, "{variant:?} step {step}: greedy tokens part");
            la = a.forward(&[ta]).unwrap();
            lb = b.forward(&[tb]).unwrap();
        }
        assert_eq!(b.kv_len(), a.kv_len());
        assert_eq!(2 * b.resident_bytes(), a.resident_bytes(), "{variant:?}: resident bytes");
    }
}
