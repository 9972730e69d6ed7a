//! The admission test matrix on the decode core: every entry path x every
//! budget position. Each cell asserts the decision and its type, the number
//! of `on_admitted` calls, that a refusal did no backend work, that the
//! reservation is released, and the budget cap. Real packages, real ONNX
//! Runtime; the only wrapper counts and (on request) fails backend calls.
//!
//! The workflow matrix runs the same cells on the vision-language package,
//! whose engine interprets its declared workflow (no decode core).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use onnx_genai_backend::{BackendError, Entry};
use onnx_genai_engine::{
    AdmissionError, BackendKind, BoundTensor, ComponentOverride, Engine, EngineError, Flow, GenerateRequest, Prompt,
    Sampling, Scheduler,
};
use onnx_genai_package::Package;
use onnx_genai_test_support::Variant;
use onnx_genai_test_support::{build_into, Hook, Hooked};

/// Counts forward calls across every backend an engine makes; fails them
/// while `fail` is set.
#[derive(Clone, Default)]
struct Probe {
    forwards: Arc<AtomicUsize>,
    fail: Arc<AtomicBool>,
    /// Tokens fed per forward call, in order.
    fed: Arc<std::sync::Mutex<Vec<usize>>>,
}

/// What an engine reserves at rest (B2): the KV its idle sessions keep —
/// nothing for a package without KV geometry (A8).
fn resting(e: &Engine) -> u64 {
    if e.package().kv_geometry().is_some() {
        e.idle_kv_bytes()
    } else {
        0
    }
}

impl Hook for Probe {
    fn step(&self, batch: &[Entry<'_>]) -> Result<(), BackendError> {
        for e in batch {
            self.forwards.fetch_add(1, Ordering::SeqCst);
            self.fed.lock().unwrap().push(e.input.positions());
        }
        if self.fail.load(Ordering::SeqCst) {
            return Err(BackendError::Run { backend: "probe", reason: "injected failure".into() });
        }
        Ok(())
    }
}

fn build(dir: &Path, strip_geometry: bool) -> Package {
    build_named("tiny-llama-gqa", dir, strip_geometry)
}

fn build_named(name: &str, dir: &Path, strip_geometry: bool) -> Package {
    let package = build_into(name, Variant::Decomposed, dir);
    if !strip_geometry {
        return package;
    }
    let path = dir.join("package.yaml");
    let mut yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    yaml.as_mapping_mut().unwrap().remove("kv_cache").expect("the built manifest declares kv_cache");
    std::fs::write(&path, serde_yaml_ng::to_string(&yaml).unwrap()).unwrap();
    Package::open(dir).unwrap()
}

fn engine(package: Package, budget: u64, probe: &Probe) -> Engine {
    engine_on(BackendKind::Ort, package, budget, probe)
}

fn engine_on(kind: BackendKind, package: Package, budget: u64, probe: &Probe) -> Engine {
    let model = Arc::new(Hooked::new(kind.load(&package, 1).unwrap(), probe.clone()));
    Engine::new(package, model).unwrap().with_scheduler(Scheduler::new(budget))
}

const PROMPT: [u32; 6] = [10, 20, 30, 40, 50, 60];

/// Pins A4 for a continuing turn at its budget position: a backend error
/// releases the reservation and leaves the session's history as it was.
fn failed_turn_changes_nothing(e: &mut Engine, req: &GenerateRequest, probe: &Probe, carried: u64, what: &str) {
    let id = req.session.expect("a session request");
    probe.fail.store(true, Ordering::SeqCst);
    let failed = e.generate(req, &mut |_| Flow::Continue);
    probe.fail.store(false, Ordering::SeqCst);
    assert!(matches!(failed, Err(EngineError::Backend(_))), "{what}: injected failure gave {failed:?}");
    assert_eq!(e.scheduler().reserved_bytes(), resting(e), "{what}: after a backend error");
    assert_eq!(e.session_tokens(id).unwrap().len() as u64, carried, "{what}: a failed turn changed the session");
}

/// Pins A4 per cell: the same admitted request, ended by a backend error, by
/// the token callback stopping it and by the callback panicking, leaves
/// nothing reserved.
fn every_exit_releases(e: &mut Engine, req: &GenerateRequest, probe: &Probe, what: &str) {
    probe.fail.store(true, Ordering::SeqCst);
    let failed = e.generate(req, &mut |_| Flow::Continue);
    probe.fail.store(false, Ordering::SeqCst);
    assert!(matches!(failed, Err(EngineError::Backend(_))), "{what}: injected failure gave {failed:?}");
    assert_eq!(e.scheduler().reserved_bytes(), resting(e), "{what}: after a backend error");
    let stopped = e.generate(req, &mut |_| Flow::Stop).unwrap_or_else(|err| panic!("{what}: {err}"));
    assert_eq!(stopped.token_ids.len(), 1, "{what}");
    assert_eq!(e.scheduler().reserved_bytes(), resting(e), "{what}: after a callback abort");
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = e.generate(req, &mut |_| panic!("client went away"));
    }));
    assert!(unwound.is_err(), "{what}: the callback panic must propagate");
    assert_eq!(e.scheduler().reserved_bytes(), resting(e), "{what}: after a panic");
}
const NEW: u32 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path_ {
    DecodeCore,
    BoundTensor,
    Override,
    Session,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Budget {
    Within,
    Exact,
    OneOver,
    FarOver,
    NoGeometry,
}

/// What a cell must observe.
struct Cell {
    admitted: bool,
    clamped: bool,
    /// Admitted but refused by the path itself (no workflow to bind to).
    refused_after_admission: bool,
}

fn request(path: Path_) -> GenerateRequest {
    let mut r = GenerateRequest::new(Prompt::TokenIds(PROMPT.to_vec()));
    r.max_new_tokens = Some(NEW);
    match path {
        Path_::BoundTensor => r.inputs = vec![BoundTensor::f32("pixel_values", vec![1, 3, 2, 2], &[0.5; 12])],
        Path_::Override => {
            r.overrides = vec![ComponentOverride {
                component: "vision".into(),
                outputs: vec![BoundTensor::f32("image_embeds", vec![1, 4], &[0.0; 4])],
            }]
        }
        _ => {}
    }
    r
}

/// Pins A1 (every decode-core path is admitted before work), A2 (typed
/// refusal with numbers, before any backend call), A3 (`on_admitted` exactly
/// once after the decision, never on refusal), A4 (released on every exit),
/// A5 (a continuing turn counts its carried tokens and is admitted under
/// its first turn's conversation id), A6 (clamp and cap), A8 (no geometry passes through), A10
/// (exact boundary).
#[test]
fn admission_matrix_on_the_decode_core() {
    let dir = tempfile::tempdir().unwrap();
    let no_geo_dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    let bare = build(no_geo_dir.path(), true);
    assert!(bare.kv_geometry().is_none(), "the stripped package must lack geometry");
    let bpt = package.kv_geometry().unwrap().bytes_per_token();
    for path in [Path_::DecodeCore, Path_::BoundTensor, Path_::Override, Path_::Session] {
        for budget in [Budget::Within, Budget::Exact, Budget::OneOver, Budget::FarOver, Budget::NoGeometry] {
            let probe = Probe::default();
            // A session's second turn carries the first turn's prompt and
            // output; its budget positions are computed on the whole
            // conversation (A5).
            let carried = if path == Path_::Session { PROMPT.len() as u64 + 3 } else { 0 };
            let need = carried + PROMPT.len() as u64 + u64::from(NEW);
            let bytes = match budget {
                Budget::Within => (need + 20) * bpt,
                Budget::Exact | Budget::NoGeometry => need * bpt,
                Budget::OneOver => (need - 1) * bpt,
                // Less than the new tokens alone need, so ignoring the
                // carried tokens would not rescue it either way.
                Budget::FarOver => (carried + PROMPT.len() as u64) * bpt,
            };
            let pkg = if budget == Budget::NoGeometry { bare.clone() } else { package.clone() };
            let mut e = engine(pkg, bytes, &probe);
            let mut req = request(path);
            // The scheduler identity turn one was admitted under.
            let mut first_conversation = None;
            if path == Path_::Session {
                // Turn one runs unbudgeted-small: 3 tokens on a big budget.
                let big = Scheduler::new(u64::MAX);
                let mut e1 = std::mem::replace(&mut e, engine(package.clone(), 0, &probe)).with_scheduler(big);
                let id = e1.create_session().unwrap();
                let mut first = GenerateRequest::new(Prompt::TokenIds(PROMPT.to_vec()));
                first.session = Some(id);
                first.max_new_tokens = Some(3);
                let r = e1
                    .generate_with(&first, &mut |a| first_conversation = Some(a.conversation), &mut |_| Flow::Continue)
                    .unwrap();
                assert_eq!(r.token_ids.len(), 3, "turn one must generate its 3 tokens (no EOS in this prompt)");
                assert_eq!(e1.session_tokens(id).unwrap().len() as u64, carried);
                e = e1.with_scheduler(Scheduler::new(bytes));
                req.session = Some(id);
            }
            let cell = match (path, budget) {
                (_, Budget::FarOver) => Cell { admitted: false, clamped: false, refused_after_admission: false },
                (Path_::BoundTensor | Path_::Override, _) => {
                    Cell { admitted: true, clamped: budget == Budget::OneOver, refused_after_admission: true }
                }
                (_, b) => Cell { admitted: true, clamped: b == Budget::OneOver, refused_after_admission: false },
            };
            let what = format!("{path:?} x {budget:?}");
            if path == Path_::Session && cell.admitted {
                failed_turn_changes_nothing(&mut e, &req, &probe, carried, &what);
            }
            let forwards_before = probe.forwards.load(Ordering::SeqCst);
            let mut signals = Vec::new();
            let out = e.generate_with(&req, &mut |a| signals.push(a), &mut |_| Flow::Continue);
            assert_eq!(e.scheduler().reserved_bytes(), resting(&e), "{what}: reservation left behind");
            match (&out, cell.admitted) {
                (Err(EngineError::Admission(err)), false) => {
                    assert!(signals.is_empty(), "{what}: on_admitted fired for a refused request");
                    assert_eq!(
                        probe.forwards.load(Ordering::SeqCst),
                        forwards_before,
                        "{what}: backend work before refusal"
                    );
                    assert!(
                        matches!(err, AdmissionError::NeverFits { bytes_per_token, .. } if *bytes_per_token == bpt),
                        "{what}: {err}"
                    );
                }
                (_, true) => {
                    assert_eq!(signals.len(), 1, "{what}: on_admitted must fire exactly once");
                    let a = signals[0];
                    assert_eq!(a.prompt_tokens, carried + PROMPT.len() as u64, "{what}: carried tokens counted");
                    if let Some(first) = first_conversation {
                        assert_eq!(a.conversation, first, "{what}: a session's turns keep one scheduler identity (A5)");
                    }
                    if budget == Budget::NoGeometry {
                        assert_eq!(a.reserved_bytes, 0, "{what}: unknown geometry reserves nothing");
                    }
                    if cell.refused_after_admission {
                        assert!(
                            matches!(&out, Err(EngineError::Request(m)) if m.contains("pixel_values") || m.contains("vision")),
                            "{what}: {out:?}"
                        );
                        assert_eq!(
                            probe.forwards.load(Ordering::SeqCst),
                            forwards_before,
                            "{what}: ran a request it refuses"
                        );
                        continue;
                    }
                    let r = out.as_ref().unwrap_or_else(|e| panic!("{what}: {e}"));
                    if cell.clamped {
                        let cap = r.budget_cap.unwrap_or_else(|| panic!("{what}: clamp without a cap"));
                        assert_eq!((cap.requested_tokens, cap.admitted_tokens), (need, need - 1), "{what}");
                        assert_eq!(cap.admitted_bytes, (need - 1) * bpt, "{what}");
                        assert_eq!(r.token_ids.len(), NEW as usize - 1, "{what}: generates only what was admitted");
                    } else {
                        assert_eq!(r.budget_cap, None, "{what}: nothing clamped, no cap");
                        assert_eq!(r.token_ids.len(), NEW as usize, "{what}");
                    }
                    assert_eq!(r.prompt_tokens as u64, carried + PROMPT.len() as u64);
                    // A session's successful turn grew it; repeating fits only
                    // where the budget has room (or does not bind).
                    if path != Path_::Session || matches!(budget, Budget::Within | Budget::NoGeometry) {
                        every_exit_releases(&mut e, &req, &probe, &what);
                    }
                }
                (other, _) => panic!("{what}: unexpected {other:?}"),
            }
        }
    }
}

/// Pins A4: the reservation is released when the backend fails, when the
/// token callback stops generation, and when the callback panics.
#[test]
fn the_reservation_is_released_on_every_exit() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    let probe = Probe::default();
    let mut e = engine(package, u64::MAX / 2, &probe);
    let req = request(Path_::DecodeCore);

    probe.fail.store(true, Ordering::SeqCst);
    assert!(matches!(e.generate(&req, &mut |_| Flow::Continue), Err(EngineError::Backend(_))));
    assert_eq!(e.scheduler().reserved_bytes(), resting(&e), "backend error");
    probe.fail.store(false, Ordering::SeqCst);

    let r = e.generate(&req, &mut |_| Flow::Stop).unwrap();
    assert_eq!(r.token_ids.len(), 1);
    assert_eq!(e.scheduler().reserved_bytes(), resting(&e), "callback abort");

    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = e.generate(&req, &mut |_| panic!("client went away"));
    }));
    assert!(unwound.is_err());
    assert_eq!(e.scheduler().reserved_bytes(), resting(&e), "panic in the callback");
}

/// A9 beside a grammar: a constrained request deferred for room (a
/// driver admits it again on every loop turn while it waits) compiles its
/// grammar once admitted, not at every try — each compile ran on the
/// model's driver, holding every stream of the model.
#[test]
fn a_deferred_constrained_request_compiles_its_grammar_once_admitted() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    let bpt = package.kv_geometry().unwrap().bytes_per_token();
    let probe = Probe::default();
    let mut e = engine(package, (PROMPT.len() as u64 + u64::from(NEW)) * bpt, &probe);
    let req = request(Path_::DecodeCore);
    let holder = e.admit(&req, &mut |_| {}).unwrap();
    let constrained = GenerateRequest { response_format: onnx_genai_engine::ResponseFormat::JsonObject, ..req };
    for _ in 0..5 {
        let tried = e.admit(&constrained, &mut |_| {}).map(|_| ());
        assert!(matches!(tried, Err(EngineError::Admission(AdmissionError::Deferred { .. }))), "{tried:?}");
    }
    assert_eq!(e.prompter().grammars_compiled(), 0, "a request waiting for room compiled its grammar");
    drop(holder);
    let turn = e.admit(&constrained, &mut |_| {}).unwrap();
    assert_eq!(e.prompter().grammars_compiled(), 1);
    drop(turn);
    assert_eq!(e.scheduler().reserved_bytes(), 0);
}

/// Pins A11 through the engine: engines sharing one scheduler never hold
/// more than the budget together (a second engine is refused while the
/// first holds the room, and admitted once it is released).
#[test]
fn engines_share_one_budget() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    let bpt = package.kv_geometry().unwrap().bytes_per_token();
    let shared = Scheduler::new((PROMPT.len() as u64 + u64::from(NEW)) * bpt);
    let probe = Probe::default();
    let mut a = engine(package.clone(), 0, &probe).with_scheduler(shared.clone());
    let mut b = engine(package, 0, &probe).with_scheduler(shared.clone());
    let req = request(Path_::DecodeCore);
    let mut inner = None;
    a.generate(&req, &mut |_| {
        if inner.is_none() {
            inner = Some(b.generate(&req, &mut |_| Flow::Continue).map(|_| ()));
        }
        Flow::Continue
    })
    .unwrap();
    assert!(matches!(inner, Some(Err(EngineError::Admission(AdmissionError::Deferred { .. })))), "{inner:?}");
    assert_eq!(shared.reserved_bytes(), 0);
}

/// Pins A2 and A10 for a cache stored narrower than the package declares:
/// admission counts what the model stores per position (native-cpu with
/// `KvCache::F16`: half the package's f32 figure), so a request whose f32
/// reservation is more than the whole budget runs in f16 on exactly that
/// budget and gives it all back; a backend that cannot store another type refuses
/// the option at load with a typed error.
#[test]
fn admission_counts_the_kv_bytes_the_model_stores() {
    use onnx_genai_engine::KvCache;
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    let declared = package.kv_geometry().unwrap().bytes_per_token();
    let blocks = |model: &dyn onnx_genai_backend::DecodeModel| {
        let positions = (PROMPT.len() as u64 + u64::from(NEW)).next_multiple_of(model.kv_granularity() as u64);
        positions * model.kv_bytes_per_token().unwrap()
    };
    let narrow = BackendKind::NativeCpu.load_with(&package, 1, KvCache::F16).unwrap();
    let budget = blocks(narrow.as_ref());
    let wide = BackendKind::NativeCpu.load(&package, 1).unwrap();
    assert_eq!(blocks(wide.as_ref()), 2 * budget, "an f32 cache reserves twice an f16 one");
    assert_eq!(wide.kv_bytes_per_token(), Some(declared));
    let req = request(Path_::DecodeCore);
    let scheduler = Scheduler::new(budget);
    let mut e = Engine::new(package.clone(), wide).unwrap().with_scheduler(scheduler.clone());
    let refused = e.generate(&req, &mut |_| Flow::Continue);
    assert!(matches!(refused, Err(EngineError::Admission(AdmissionError::NeverFits { .. }))), "{refused:?}");
    let mut e = Engine::new(package.clone(), narrow).unwrap().with_scheduler(scheduler.clone());
    let mut held = 0;
    let done = e.generate(&req, &mut |_| {
        held = held.max(scheduler.reserved_bytes());
        Flow::Continue
    });
    assert_eq!(done.unwrap().token_ids.len(), NEW as usize);
    assert_eq!(held, budget, "the f16 request reserved its blocks at f16 bytes");
    assert_eq!(scheduler.reserved_bytes(), 0);
    for kind in [BackendKind::Ort, BackendKind::NativeCuda] {
        let err = kind.load_with(&package, 1, KvCache::F16).err();
        assert!(matches!(err, Some(BackendError::Unavailable { .. })), "{kind}: {err:?}");
    }
}

/// Bad input gets a typed error and leaves no reservation: malformed
/// tensors, unknown sessions, empty prompts, zero new tokens, oversized
/// prompts.
#[test]
fn bad_requests_are_typed_errors_with_nothing_reserved() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    let probe = Probe::default();
    let mut e = engine(package, u64::MAX / 2, &probe);
    let mut short = BoundTensor::f32("pixel_values", vec![1, 3, 2, 2], &[0.5; 12]);
    short.bytes.pop();
    let cases: Vec<(GenerateRequest, &str)> = vec![
        (GenerateRequest { inputs: vec![short], ..request(Path_::DecodeCore) }, "needs 48 bytes, the payload has 47"),
        (
            GenerateRequest { inputs: vec![BoundTensor::f32("x", vec![], &[])], ..request(Path_::DecodeCore) },
            "at least one axis",
        ),
        (
            GenerateRequest { session: Some(onnx_genai_engine::SessionId(999)), ..request(Path_::DecodeCore) },
            "unknown session session-999",
        ),
        (GenerateRequest::new(Prompt::TokenIds(vec![])), "empty"),
        (GenerateRequest { max_new_tokens: Some(0), ..request(Path_::DecodeCore) }, "max_new_tokens"),
        (GenerateRequest::new(Prompt::TokenIds(vec![1; 300])), "context length is 256"),
    ];
    for (req, want) in cases {
        let mut signalled = false;
        let err = e.generate_with(&req, &mut |_| signalled = true, &mut |_| Flow::Continue).unwrap_err().to_string();
        assert!(err.contains(want), "expected `{want}` in: {err}");
        assert!(!signalled, "{want}: signalled admission");
        assert_eq!(e.scheduler().reserved_bytes(), resting(&e), "{want}");
    }
    assert_eq!(probe.forwards.load(Ordering::SeqCst), 0, "no bad request reached the backend");
}

/// Sessions: a continuing turn prefills only its new tokens (the KV of
/// earlier turns is reused) and generates what a single uninterrupted
/// sequence would; closing frees the session.
#[test]
fn a_continuing_turn_reuses_the_kv_of_earlier_turns() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    for kind in BackendKind::available_here() {
        let probe = Probe::default();
        let mut e = engine_on(kind, package.clone(), u64::MAX / 2, &probe);
        let id = e.create_session().unwrap();
        let turn = |e: &mut Engine, prompt: Vec<u32>, n: u32| {
            let mut r = GenerateRequest::new(Prompt::TokenIds(prompt));
            r.session = Some(id);
            r.max_new_tokens = Some(n);
            e.generate(&r, &mut |_| Flow::Continue).unwrap()
        };
        let one = turn(&mut e, PROMPT.to_vec(), 4);
        let before = probe.fed.lock().unwrap().len();
        let two = turn(&mut e, vec![70, 80], 5);
        // Turn two's prefill feeds turn one's last token (sampled, not yet
        // run) and the two new ones — not the conversation again.
        assert_eq!(probe.fed.lock().unwrap()[before], 3, "{}: prefill of a continuing turn", kind.name());
        assert_eq!(two.prompt_tokens, PROMPT.len() + 4 + 2, "{}: carried + new", kind.name());
        let history = e.session_tokens(id).unwrap().to_vec();
        assert_eq!(history.len(), PROMPT.len() + 4 + 2 + 5);
        // The same conversation in one stateless request.
        let mut whole = PROMPT.to_vec();
        whole.extend(&one.token_ids);
        whole.extend([70, 80]);
        let mut r = GenerateRequest::new(Prompt::TokenIds(whole));
        r.max_new_tokens = Some(5);
        let fresh = e.generate(&r, &mut |_| Flow::Continue).unwrap();
        assert_eq!(fresh.token_ids, two.token_ids, "{}: session turn == uninterrupted sequence", kind.name());
        e.close_session(id).unwrap();
        assert!(matches!(e.close_session(id), Err(EngineError::UnknownSession(_))));
        let mut after = GenerateRequest::new(Prompt::TokenIds(vec![1]));
        after.session = Some(id);
        assert!(matches!(e.generate(&after, &mut |_| Flow::Continue), Err(EngineError::UnknownSession(_))));
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flowpath {
    Prompt,
    BoundTensor,
    Override,
    Session,
}

/// Pins A1, A2, A3, A4, A5, A6, A8, A10 on the workflow engine: a prompt, a
/// bound `pixel_values` (image placeholders expand to the image's tokens
/// and are counted, A7), a precomputed-feature override and a continuing
/// workflow session, each at every budget position.
#[test]
fn admission_matrix_on_workflows() {
    let (dir, bare_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let package = build_named("tiny-vlm", dir.path(), false);
    let bare = build_named("tiny-vlm", bare_dir.path(), true);
    let bpt = package.kv_geometry().unwrap().bytes_per_token();
    let tokens_per_image = 4u64;
    let image_id = package.tokenizer().token_to_id("<|image|>").unwrap();
    let hidden = package.manifest.architecture.hidden_size as usize;
    for path in [Flowpath::Prompt, Flowpath::BoundTensor, Flowpath::Override, Flowpath::Session] {
        for budget in [Budget::Within, Budget::Exact, Budget::OneOver, Budget::FarOver, Budget::NoGeometry] {
            let probe = Probe::default();
            let with_image = matches!(path, Flowpath::BoundTensor | Flowpath::Override);
            let mut prompt = PROMPT.to_vec();
            if with_image {
                prompt.insert(0, image_id);
            }
            let new_tokens = PROMPT.len() as u64 + if with_image { tokens_per_image } else { 0 };
            let carried = if path == Flowpath::Session { PROMPT.len() as u64 + 3 } else { 0 };
            let need = carried + new_tokens + u64::from(NEW);
            let bytes = match budget {
                Budget::Within => (need + 20) * bpt,
                Budget::Exact | Budget::NoGeometry => need * bpt,
                Budget::OneOver => (need - 1) * bpt,
                Budget::FarOver => (carried + new_tokens) * bpt,
            };
            let pkg = if budget == Budget::NoGeometry { bare.clone() } else { package.clone() };
            let mut e = engine(pkg, bytes, &probe);
            assert!(e.is_workflow());
            let mut req = GenerateRequest::new(Prompt::TokenIds(prompt));
            req.max_new_tokens = Some(NEW);
            match path {
                Flowpath::BoundTensor => {
                    req.inputs = vec![BoundTensor::f32("pixel_values", vec![1, 3, 8, 8], &[0.25; 192])]
                }
                Flowpath::Override => {
                    req.overrides = vec![ComponentOverride {
                        component: "vision".into(),
                        outputs: vec![BoundTensor::f32("image_embeds", vec![1, 4, hidden], &vec![0.1; 4 * hidden])],
                    }]
                }
                _ => {}
            }
            if path == Flowpath::Session {
                let saved = std::mem::replace(&mut e, engine(package.clone(), 0, &probe));
                let mut e1 = saved.with_scheduler(Scheduler::new(u64::MAX));
                let id = e1.create_session().unwrap();
                let mut first = GenerateRequest::new(Prompt::TokenIds(PROMPT.to_vec()));
                first.session = Some(id);
                first.max_new_tokens = Some(3);
                assert_eq!(e1.generate(&first, &mut |_| Flow::Continue).unwrap().token_ids.len(), 3);
                e = e1.with_scheduler(Scheduler::new(bytes));
                req.session = Some(id);
            }
            let what = format!("workflow {path:?} x {budget:?}");
            if path == Flowpath::Session && budget != Budget::FarOver {
                failed_turn_changes_nothing(&mut e, &req, &probe, carried, &what);
            }
            let forwards_before = probe.forwards.load(Ordering::SeqCst);
            let mut signals = Vec::new();
            let out = e.generate_with(&req, &mut |a| signals.push(a), &mut |_| Flow::Continue);
            assert_eq!(e.scheduler().reserved_bytes(), resting(&e), "{what}: reservation left behind");
            if budget == Budget::FarOver {
                assert!(
                    matches!(&out, Err(EngineError::Admission(AdmissionError::NeverFits { .. }))),
                    "{what}: {out:?}"
                );
                assert!(signals.is_empty(), "{what}: signalled a refusal");
                assert_eq!(
                    probe.forwards.load(Ordering::SeqCst),
                    forwards_before,
                    "{what}: backend work before refusal"
                );
                assert_eq!(e.encoder_runs(), 0, "{what}: ran the encoder before refusal");
                continue;
            }
            let r = out.unwrap_or_else(|err| panic!("{what}: {err}"));
            assert_eq!(signals.len(), 1, "{what}");
            assert_eq!(signals[0].prompt_tokens, carried + new_tokens, "{what}: counted tokens");
            assert_eq!(r.prompt_tokens as u64, carried + new_tokens);
            if budget == Budget::OneOver {
                let cap = r.budget_cap.unwrap_or_else(|| panic!("{what}: no cap"));
                assert_eq!((cap.requested_tokens, cap.admitted_tokens), (need, need - 1), "{what}");
                assert_eq!(r.token_ids.len(), NEW as usize - 1, "{what}");
            } else {
                assert_eq!(r.budget_cap, None, "{what}");
                assert_eq!(r.token_ids.len(), NEW as usize, "{what}");
            }
            if budget == Budget::NoGeometry {
                assert_eq!(signals[0].reserved_bytes, 0, "{what}");
            }
            assert_eq!(e.encoder_runs(), usize::from(path == Flowpath::BoundTensor), "{what}: encoder runs");
            if path != Flowpath::Session || matches!(budget, Budget::Within | Budget::NoGeometry) {
                every_exit_releases(&mut e, &req, &probe, &what);
            }
        }
    }
}

/// A turn that unwinds (its token callback panicked) leaves the session as
/// it was: the next turn generates what it would have without the failed
/// one, and nothing stays reserved.
#[test]
fn a_panicked_turn_leaves_the_session_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    let probe = Probe::default();
    let mut e = engine(package, u64::MAX / 2, &probe);
    let turn = |id, prompt: Vec<u32>| {
        let mut r = GenerateRequest::new(Prompt::TokenIds(prompt));
        r.session = Some(id);
        r.max_new_tokens = Some(4);
        r
    };
    let (clean, broken) = (e.create_session().unwrap(), e.create_session().unwrap());
    for id in [clean, broken] {
        let r = turn(id, PROMPT.to_vec());
        e.generate(&r, &mut |_| Flow::Continue).unwrap();
    }
    let r = turn(broken, vec![1, 2, 3]);
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut n = 0;
        let _ = e.generate(&r, &mut |_| {
            n += 1;
            if n == 3 {
                panic!("client went away mid-turn");
            }
            Flow::Continue
        });
    }));
    assert!(unwound.is_err());
    assert_eq!(e.scheduler().reserved_bytes(), resting(&e));
    assert_eq!(e.session_tokens(broken).unwrap(), e.session_tokens(clean).unwrap());
    let next = |e: &mut Engine, id| {
        let r = turn(id, vec![90, 91]);
        e.generate(&r, &mut |_| Flow::Continue).unwrap().token_ids
    };
    assert_eq!(next(&mut e, broken), next(&mut e, clean));
}

/// Pins A7: token rows count as `rows * longest row` (they would run as one
/// `[rows, cols]` batch), before the decode core refuses more than one row;
/// a single row runs exactly like token ids.
#[test]
fn token_rows_are_counted_as_a_padded_batch() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    let probe = Probe::default();
    let mut e = engine(package, u64::MAX / 2, &probe);
    let mut counted = Vec::new();
    let rows = GenerateRequest {
        max_new_tokens: Some(4),
        ..GenerateRequest::new(Prompt::TokenRows(vec![vec![1, 2, 3], vec![4, 5]]))
    };
    let err = e.generate_with(&rows, &mut |a| counted.push(a.prompt_tokens), &mut |_| Flow::Continue).unwrap_err();
    assert_eq!(counted, vec![6]);
    assert!(err.to_string().contains("runs one token row, the prompt has 2"), "{err}");
    assert_eq!(e.scheduler().reserved_bytes(), resting(&e));
    let one =
        GenerateRequest { max_new_tokens: Some(4), ..GenerateRequest::new(Prompt::TokenRows(vec![PROMPT.to_vec()])) };
    let ids = GenerateRequest { max_new_tokens: Some(4), ..GenerateRequest::new(Prompt::TokenIds(PROMPT.to_vec())) };
    let (a, b) =
        (e.generate(&one, &mut |_| Flow::Continue).unwrap(), e.generate(&ids, &mut |_| Flow::Continue).unwrap());
    assert_eq!(a.token_ids, b.token_ids);
}

/// Issue 19 (`n`): the choices of one request share its prefill — the
/// model runs the prompt once for all three, and choice `k` is exactly the
/// single request with seed + `k` (so the copied KV and logits are the
/// prompt's) — and admission reserves all three copies at once, on ORT and
/// native-cpu; under a response format every choice follows the grammar.
/// `n` outside 1–16, `n` > 1 on a session, and `n` > 1 through the
/// one-choice path are typed errors.
#[test]
fn choices_share_the_prefill_and_match_single_requests() {
    let dir = tempfile::tempdir().unwrap();
    let package = build(dir.path(), false);
    for backend in [BackendKind::Ort, BackendKind::NativeCpu] {
        let probe = Probe::default();
        let mut e = engine_on(backend, package.clone(), u64::MAX / 2, &probe);
        let fed = || probe.fed.lock().unwrap().drain(..).sum::<usize>();
        let prompt = e.encode("Once upon a time there was").unwrap();
        let ask = |seed: u64, n: usize| GenerateRequest {
            n,
            sampling: Sampling { temperature: 1.0, seed, ..Sampling::default() },
            ..GenerateRequest { max_new_tokens: Some(10), ..GenerateRequest::new(Prompt::TokenIds(prompt.clone())) }
        };
        let mut reserved = 0;
        let choices =
            e.generate_choices(&ask(7, 3), &mut |a| reserved = a.reserved_bytes, &mut |_, _| Flow::Continue).unwrap();
        let together = fed();
        assert_eq!(choices.iter().map(|c| c.choice).collect::<Vec<_>>(), [0, 1, 2]);
        let mut apart = 0;
        let mut single_reserved = 0;
        for (k, choice) in choices.iter().enumerate() {
            let one = e
                .generate_with(&ask(7 + k as u64, 1), &mut |a| single_reserved = a.reserved_bytes, &mut |_| {
                    Flow::Continue
                })
                .unwrap();
            assert_eq!(choice.token_ids, one.token_ids, "{backend:?}: choice {k} is the request with seed 7 + {k}");
            assert_eq!(choice.prompt_tokens, one.prompt_tokens);
            apart += fed();
        }
        assert_ne!(choices[0].token_ids, choices[1].token_ids, "choices sample apart");
        assert_eq!(together, apart - 2 * prompt.len(), "{backend:?}: the prompt ran once for three choices");
        assert_eq!(reserved, 3 * single_reserved, "three copies of the KV are reserved");
        assert_eq!(e.scheduler().reserved_bytes(), 0, "every choice released its share");
        // Each choice draws under the request's grammar from its start.
        let json = GenerateRequest { response_format: onnx_genai_engine::ResponseFormat::JsonObject, ..ask(3, 3) };
        let objects = e.generate_choices(&json, &mut |_| {}, &mut |_, _| Flow::Continue).unwrap();
        for o in &objects {
            assert!(o.text.starts_with('{'), "{backend:?} choice {}: {:?}", o.choice, o.text);
        }

        for n in [0, 17] {
            assert!(matches!(
                e.generate_choices(&ask(1, n), &mut |_| {}, &mut |_, _| Flow::Continue),
                Err(EngineError::Request(_))
            ));
        }
        let id = e.create_session().unwrap();
        let on_session = GenerateRequest { session: Some(id), ..ask(1, 2) };
        assert!(matches!(
            e.generate_choices(&on_session, &mut |_| {}, &mut |_, _| Flow::Continue),
            Err(EngineError::Request(_))
        ));
        assert!(matches!(
            e.generate_with(&ask(1, 2), &mut |_| {}, &mut |_| Flow::Continue),
            Err(EngineError::Request(_))
        ));
    }
}

/// B2 and A11: a continuing session turn refused once admitted — its
/// response format fails to compile — leaves the session's reservation as
/// it was: the bytes its idle KV holds stay reserved (before, the refused
/// admission, which had taken the session's idle bytes over, released them
/// all while the KV stayed resident), and the next turn on it runs.
#[test]
fn a_session_turn_refused_once_admitted_keeps_the_sessions_reservation() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let mut e = engine(build(dir.path(), false), u64::MAX / 2, &probe);
    let id = e.create_session().unwrap();
    let mut first = GenerateRequest::new(Prompt::TokenIds(PROMPT.to_vec()));
    first.session = Some(id);
    first.max_new_tokens = Some(3);
    e.generate(&first, &mut |_| Flow::Continue).unwrap();
    let idle = e.idle_kv_bytes();
    assert!(idle > 0 && e.scheduler().reserved_bytes() == idle);
    let mut bad = GenerateRequest::new(Prompt::TokenIds(vec![70, 80]));
    bad.session = Some(id);
    bad.max_new_tokens = Some(3);
    let schema = serde_json::json!({"type": "integer", "minimum": 5, "maximum": 1});
    bad.response_format = onnx_genai_engine::ResponseFormat::JsonSchema(schema);
    let refused = e.generate(&bad, &mut |_| Flow::Continue);
    assert!(matches!(refused, Err(EngineError::ResponseFormat(_))), "{refused:?}");
    assert_eq!(e.idle_kv_bytes(), idle, "the session's KV stayed resident");
    assert_eq!(e.scheduler().reserved_bytes(), idle, "the session's idle bytes were released with the refusal");
    let mut next = GenerateRequest::new(Prompt::TokenIds(vec![70, 80]));
    next.session = Some(id);
    next.max_new_tokens = Some(2);
    e.generate(&next, &mut |_| Flow::Continue).unwrap();
    assert_eq!(e.scheduler().reserved_bytes(), e.idle_kv_bytes());
}
