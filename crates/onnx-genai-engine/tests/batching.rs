//! Many turns of one model advanced together (`Engine::step` over several
//! turns): the batching contract B1–B4 of ../shared/docs/INVARIANTS.md on
//! real packages, on ONNX Runtime and native-cpu. A probe wrapper records
//! how many sequences each model step advanced and can fail (or panic) the
//! steps that carry a poisoned token.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use onnx_genai_backend::{BackendError, Entry, Input};
use onnx_genai_engine::{
    BackendKind, Engine, EngineError, FinishReason, Flow, GenerateRequest, Prompt, Scheduler, Turn, TurnState,
};
use onnx_genai_package::Package;
use onnx_genai_test_support::{build, Hook, Hooked};

/// A token no test prompt uses: a step that feeds it fails (or panics).
const POISON: u32 = 377;

#[derive(Default)]
struct Probe {
    /// Entries per model step, in order.
    widths: Mutex<Vec<usize>>,
    panic: std::sync::atomic::AtomicBool,
    steps: AtomicUsize,
}

impl Hook for Probe {
    fn step(&self, batch: &[Entry<'_>]) -> Result<(), BackendError> {
        self.steps.fetch_add(1, Ordering::SeqCst);
        self.widths.lock().unwrap().push(batch.len());
        let poisoned = batch.iter().any(|e| matches!(e.input, Input::Tokens(t) if t.contains(&POISON)));
        if poisoned {
            if self.panic.load(Ordering::SeqCst) {
                panic!("the backend crashed on this sequence");
            }
            return Err(BackendError::Run { backend: "probe", reason: "injected failure".into() });
        }
        Ok(())
    }
}

fn engine(kind: BackendKind, package: &Package, budget: u64, probe: &Arc<Probe>) -> Engine {
    let model = Arc::new(Hooked::new(kind.load(package, 2).unwrap(), probe.clone()));
    Engine::new(package.clone(), model).unwrap().with_scheduler(Scheduler::new(budget))
}

fn request(prompt: Vec<u32>, max: u32) -> GenerateRequest {
    GenerateRequest { max_new_tokens: Some(max), ..GenerateRequest::new(Prompt::TokenIds(prompt)) }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 9, 14], (1..30).collect(), vec![300, 2, 2, 8, 1, 90, 91], (100..112).collect()]
}

/// The tokens of `req` generated alone.
fn alone(e: &mut Engine, req: &GenerateRequest) -> Vec<u32> {
    e.generate(req, &mut |_| Flow::Continue).unwrap().token_ids
}

/// Runs `reqs` together: request `i` joins at step `joins[i]`; every step
/// checks that what is reserved covers every sequence's resident KV (B2).
fn together(e: &mut Engine, reqs: &[GenerateRequest], joins: &[usize]) -> Vec<Result<Vec<u32>, EngineError>> {
    let mut turns: Vec<Option<Turn>> = (0..reqs.len()).map(|_| None).collect();
    let mut results: Vec<Option<Result<Vec<u32>, EngineError>>> = (0..reqs.len()).map(|_| None).collect();
    let mut step = 0;
    while results.iter().any(Option::is_none) {
        for (i, r) in reqs.iter().enumerate() {
            if joins[i] == step && turns[i].is_none() && results[i].is_none() {
                match e.admit(r, &mut |_| {}) {
                    Ok(t) => turns[i] = Some(t),
                    Err(err) => results[i] = Some(Err(err)),
                }
            }
        }
        {
            let mut live: Vec<&mut Turn> = turns.iter_mut().flatten().collect();
            if !live.is_empty() {
                e.step(&mut live, &mut |_, _| Flow::Continue);
            }
        }
        let resident: u64 = turns.iter().flatten().map(Turn::resident_bytes).sum::<u64>() + e.idle_kv_bytes();
        assert!(
            e.scheduler().reserved_bytes() >= resident,
            "B2: {} bytes resident, {} reserved",
            resident,
            e.scheduler().reserved_bytes()
        );
        for (i, slot) in turns.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|t| t.state() == TurnState::Done) {
                let t = slot.take().unwrap();
                results[i] = Some(e.finish(t).map(|r| r.token_ids));
            }
        }
        step += 1;
        assert!(step < 500, "the batch never finished");
    }
    results.into_iter().map(Option::unwrap).collect()
}

/// Pins B1: requests of different lengths advanced together — prefills
/// chunked and mixed with decode steps, some joining mid-flight — each
/// generate the greedy tokens the reference (ONNX Runtime, one request at a
/// time) generates, on both backends; and the model really ran them
/// together (steps wider than one).
#[test]
fn batch_generates_what_each_request_generates_alone() {
    let (_dir, package) = build("tiny-llama-gqa");
    let reqs: Vec<_> = prompts().into_iter().zip([12, 7, 20, 9]).map(|(p, n)| request(p, n)).collect();
    let reference = Arc::new(Probe::default());
    let mut ort = engine(BackendKind::Ort, &package, u64::MAX / 2, &reference);
    let want: Vec<_> = reqs.iter().map(|r| alone(&mut ort, r)).collect();
    for kind in BackendKind::available_here() {
        let probe = Arc::new(Probe::default());
        let mut e = engine(kind, &package, u64::MAX / 2, &probe).with_prefill_chunk(5);
        let got = together(&mut e, &reqs, &[0, 0, 3, 6]);
        assert_eq!(got.len(), want.len(), "{}", kind.name());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.as_ref().unwrap(), w, "{}: request {i} in a batch", kind.name());
        }
        let widest = probe.widths.lock().unwrap().iter().copied().max().unwrap_or(0);
        assert_eq!(widest, reqs.len(), "{}: the model never advanced every request in one step", kind.name());
    }
}

/// Pins B2: at rest the budget reserves exactly the KV idle sessions keep
/// (whole blocks on native-cpu); a continuing turn takes its session's
/// bytes over; when the budget is short, the least recently used idle
/// session gives its KV up for a newcomer, and its next turn still
/// generates what an uninterrupted conversation would.
#[test]
fn batch_counts_idle_sessions_and_they_give_way() {
    let (_dir, package) = build("tiny-llama-gqa");
    let bpt = package.kv_geometry().unwrap().bytes_per_token();
    for kind in BackendKind::available_here() {
        let probe = Arc::new(Probe::default());
        // Room for one conversation's blocks and a little more.
        let granularity = kind.load(&package, 1).unwrap().kv_granularity() as u64;
        let budget = (granularity.max(40) + granularity) * bpt;
        let mut e = engine(kind, &package, budget, &probe);
        let a = e.create_session().unwrap();
        let mut first = request(prompts()[1].clone(), 6);
        first.session = Some(a);
        let one = e.generate(&first, &mut |_| Flow::Continue).unwrap();
        let held = e.scheduler().reserved_bytes();
        assert!(held > 0 && held == e.idle_kv_bytes(), "{}: at rest {held} reserved", kind.name());
        // A newcomer that does not fit beside the idle session: the idle KV
        // goes, the newcomer runs.
        let big = request((1..=(granularity.max(40) as u32)).collect(), 4);
        let newcomer = e.generate(&big, &mut |_| Flow::Continue);
        assert!(newcomer.is_ok(), "{}: {newcomer:?}", kind.name());
        assert_eq!(e.idle_kv_bytes(), 0, "{}: the idle session gave its KV up", kind.name());
        assert_eq!(e.scheduler().reserved_bytes(), 0);
        // Its conversation continues as if never interrupted.
        let mut second = request(vec![70, 80], 5);
        second.session = Some(a);
        let two = e.generate(&second, &mut |_| Flow::Continue).unwrap();
        let mut whole = prompts()[1].clone();
        whole.extend(&one.token_ids);
        whole.extend([70, 80]);
        let fresh = e.generate(&request(whole, 5), &mut |_| Flow::Continue).unwrap();
        assert_eq!(two.token_ids, fresh.token_ids, "{}: a spilled session continues correctly", kind.name());
        assert_eq!(e.scheduler().reserved_bytes(), e.idle_kv_bytes());
    }
}

/// Pins B3: a sequence whose step fails — an error, or a backend panic —
/// fails alone: the others of its batch finish with the tokens they
/// generate alone, and the reservations return to rest.
#[test]
fn batch_with_a_failing_sequence_fails_it_alone() {
    let (_dir, package) = build("tiny-llama-gqa");
    for kind in BackendKind::available_here() {
        for panics in [false, true] {
            let probe = Arc::new(Probe::default());
            probe.panic.store(panics, Ordering::SeqCst);
            let mut e = engine(kind, &package, u64::MAX / 2, &probe);
            let good: Vec<_> = prompts().into_iter().take(3).map(|p| request(p, 8)).collect();
            let want: Vec<_> = good.iter().map(|r| alone(&mut e, r)).collect();
            let mut reqs = good.clone();
            reqs.insert(1, request(vec![4, POISON, 6], 8));
            let got = together(&mut e, &reqs, &[0, 0, 0, 2]);
            let what = format!("{} (panic: {panics})", kind.name());
            match &got[1] {
                Err(EngineError::Backend(_)) if !panics => {}
                Err(EngineError::Panicked { .. }) if panics => {}
                other => panic!("{what}: the poisoned request gave {other:?}"),
            }
            for (g, w) in [&got[0], &got[2], &got[3]].into_iter().zip(&want) {
                assert_eq!(g.as_ref().unwrap(), w, "{what}: a healthy request in the failing batch");
            }
            assert_eq!(e.scheduler().reserved_bytes(), e.idle_kv_bytes(), "{what}: reservations at rest");
        }
    }
}

/// Pins B4: a cancelled turn leaves at the next step boundary (no model
/// step carries it after the cancel), finishes as stopped with what it had,
/// and the others carry on unchanged.
#[test]
fn batch_drops_a_cancelled_turn_at_the_next_step() {
    let (_dir, package) = build("tiny-llama-gqa");
    for kind in BackendKind::available_here() {
        let probe = Arc::new(Probe::default());
        let mut e = engine(kind, &package, u64::MAX / 2, &probe);
        let reqs: Vec<_> = prompts().into_iter().take(3).map(|p| request(p, 10)).collect();
        let want = alone(&mut e, &reqs[2]);
        let mut turns: Vec<Turn> = reqs.iter().map(|r| e.admit(r, &mut |_| {}).unwrap()).collect();
        for _ in 0..3 {
            let mut live: Vec<&mut Turn> = turns.iter_mut().collect();
            e.step(&mut live, &mut |_, _| Flow::Continue);
        }
        turns[0].cancel();
        probe.widths.lock().unwrap().clear();
        while turns.iter().any(|t| t.state() == TurnState::Running) {
            let mut live: Vec<&mut Turn> = turns.iter_mut().collect();
            e.step(&mut live, &mut |_, _| Flow::Continue);
        }
        let widths = probe.widths.lock().unwrap().clone();
        assert!(widths.iter().all(|w| *w <= 2), "{}: the cancelled turn kept running: {widths:?}", kind.name());
        let mut results = turns.into_iter().map(|t| e.finish(t).unwrap());
        let cancelled = results.next().unwrap();
        assert_eq!(
            (cancelled.finish_reason, cancelled.token_ids.len()),
            (FinishReason::Stopped, 3),
            "{}: the cancelled turn keeps its three tokens",
            kind.name()
        );
        assert_eq!(results.nth(1).unwrap().token_ids, want, "{}: a neighbour of the cancelled turn", kind.name());
        assert_eq!(e.scheduler().reserved_bytes(), 0);
    }
}

/// Every turn's conversation is its own: a request without a session
/// never shares its conversation id with a session's, whichever ids the
/// server minted for its sessions (it mints them from 1, as the engine
/// numbers requests). The server's driver hands a request's forked choices
/// to the running turn of its conversation; sharing one, a stateless
/// request of `n` choices could hand them to a session's turn.
#[test]
fn a_request_without_a_session_never_shares_a_sessions_conversation() {
    let (_dir, package) = build("tiny-llama-gqa");
    let probe = Arc::new(Probe::default());
    let mut e = engine(BackendKind::Ort, &package, u64::MAX / 2, &probe);
    let stateless: Vec<Turn> = (0..3).map(|_| e.admit(&request(vec![5, 9], 2), &mut |_| {}).unwrap()).collect();
    let mut seen: Vec<_> = stateless.iter().map(Turn::conversation).collect();
    for id in 1..=4 {
        let session = onnx_genai_engine::SessionId(id);
        e.open_session(session).unwrap();
        let turn = e.admit(&GenerateRequest { session: Some(session), ..request(vec![5, 9], 2) }, &mut |_| {}).unwrap();
        assert!(
            !seen.contains(&turn.conversation()),
            "session {id} runs as {:?}, taken: {seen:?}",
            turn.conversation()
        );
        seen.push(turn.conversation());
        e.finish(turn).unwrap();
    }
    for turn in stateless {
        e.finish(turn).unwrap();
    }
    assert_eq!(e.scheduler().reserved_bytes(), 0);
}
