//! The shared pass-through wrapper answers exactly as the model it wraps:
//! a wrapper that let a trait default answer for the model (batch width
//! 1, token-exact KV) would silently change how the engine batches and
//! reserves in every test written against it (INVARIANTS T2: the probe
//! must not change what it measures).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use onnx_genai_backend::{BackendError, DecodeModel, Entry, Input};
use onnx_genai_test_support::{build, Hook, Hooked};

/// Counts steps; refuses every step whose input holds `refuse`.
struct Counting {
    steps: AtomicUsize,
    sequences: AtomicUsize,
    refuse: u32,
}

impl Hook for Counting {
    fn new_sequence(&self) {
        self.sequences.fetch_add(1, Ordering::SeqCst);
    }
    fn step(&self, batch: &[Entry<'_>]) -> Result<(), BackendError> {
        self.steps.fetch_add(1, Ordering::SeqCst);
        if batch.iter().any(|e| matches!(e.input, Input::Tokens(t) if t.contains(&self.refuse))) {
            return Err(BackendError::Run { backend: "hook", reason: "refused".into() });
        }
        Ok(())
    }
}

fn logits_of(model: &dyn DecodeModel, tokens: &[u32]) -> Vec<f32> {
    let mut seq = model.new_sequence();
    let mut logits = Vec::new();
    model.step(&mut [Entry { sequence: &mut *seq, input: Input::Tokens(tokens), logits: &mut logits }]).unwrap();
    logits
}

/// Every `DecodeModel` answer of the wrapped model comes through: on
/// native-cpu (batches of many, 64-token KV blocks, the answers that
/// differ from the trait's defaults) and on ONNX Runtime; the logits are
/// the model's own; a hook's error stops the step before the model runs
/// it (the sequence keeps its length).
#[test]
fn hooked_answers_as_the_model_it_wraps() {
    let (_dir, package) = build("tiny-llama-gqa");
    let models: [Arc<dyn DecodeModel>; 2] = [
        Arc::new(onnx_genai_native::NativeModel::load(&package, 1).unwrap()),
        Arc::new(onnx_genai_ort::OrtModel::load(&package, 1).unwrap()),
    ];
    assert!(models[0].batch_width() > 1 && models[0].kv_granularity() > 1, "native-cpu must differ from the defaults");
    for inner in models {
        let hooked = Hooked::new(inner.clone(), Counting { steps: 0.into(), sequences: 0.into(), refuse: 77 });
        let what = inner.name();
        assert_eq!(hooked.name(), inner.name(), "{what}");
        assert_eq!(hooked.vocab_size(), inner.vocab_size(), "{what}");
        assert_eq!(hooked.context_length(), inner.context_length(), "{what}");
        assert_eq!(hooked.batch_width(), inner.batch_width(), "{what}: batch width");
        assert_eq!(hooked.kv_granularity(), inner.kv_granularity(), "{what}: KV granularity");
        assert_eq!(logits_of(&hooked, &[3, 1, 4, 1, 5]), logits_of(&*inner, &[3, 1, 4, 1, 5]), "{what}: logits");
        assert_eq!(hooked.hook().steps.load(Ordering::SeqCst), 1, "{what}: the hook saw the step");
        assert_eq!(hooked.hook().sequences.load(Ordering::SeqCst), 1, "{what}: the hook saw the sequence");

        let mut seq = hooked.new_sequence();
        let mut logits = Vec::new();
        let refused =
            hooked.step(&mut [Entry { sequence: &mut *seq, input: Input::Tokens(&[9, 77]), logits: &mut logits }]);
        assert!(matches!(refused, Err(BackendError::Run { backend: "hook", .. })), "{what}: {refused:?}");
        assert_eq!(seq.kv_len(), 0, "{what}: a refused step ran on the model");
    }
}
