//! The scheduler's contract, one invariant per test (ids from
//! ../shared/docs/INVARIANTS.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use onnx_genai_scheduler::{AdmissionError, AdmissionRequest, BudgetCap, ConversationId, Scheduler};
use proptest::prelude::*;

const BPT: u64 = 512;

fn req(prompt: u64, max_new: u64) -> AdmissionRequest {
    AdmissionRequest {
        conversation: ConversationId(1),
        prompt_tokens: prompt,
        max_new_tokens: max_new,
        bytes_per_token: Some(BPT),
        wait_until: None,
        granularity: 1,
    }
}

/// Pins A10: exactly the available bytes is admitted whole; one token more
/// is clamped (or, with no room for a new token, refused).
#[test]
fn the_boundary_is_exact() {
    let s = Scheduler::new(10 * BPT);
    let a = s.admit(&req(4, 6)).unwrap();
    assert_eq!((a.max_new_tokens, a.budget_cap, a.bytes()), (6, None, 10 * BPT));
    drop(a);
    let b = s.admit(&req(4, 7)).unwrap();
    assert_eq!(b.max_new_tokens, 6, "one token over is clamped to the room");
    assert!(b.budget_cap.is_some());
    drop(b);
    assert_eq!(s.admit(&req(9, 1)).unwrap().budget_cap, None, "prompt + 1 exactly at the budget");
    assert!(
        matches!(s.admit(&req(10, 1)), Err(AdmissionError::NeverFits { needed_bytes, .. }) if needed_bytes == 11 * BPT)
    );
}

/// Pins A4 for a split reservation (issue 19's `n` choices): the parts
/// hold what the whole held, each part releases its own bytes when it
/// drops, and a split never moves more than the whole holds.
#[test]
fn a_split_reservation_releases_each_part_alone() {
    let s = Scheduler::new(12 * BPT);
    let mut whole = s.admit(&req(3, 3)).unwrap();
    let part = whole.split_off(2 * BPT);
    assert_eq!((whole.bytes(), part.bytes(), s.reserved_bytes()), (4 * BPT, 2 * BPT, 6 * BPT));
    assert_eq!((part.conversation, part.max_new_tokens), (whole.conversation, whole.max_new_tokens));
    drop(part);
    assert_eq!(s.reserved_bytes(), 4 * BPT, "the part released its own bytes");
    let all = whole.split_off(100 * BPT);
    assert_eq!((whole.bytes(), all.bytes()), (0, 4 * BPT));
    drop(whole);
    assert_eq!(s.reserved_bytes(), 4 * BPT);
    drop(all);
    assert_eq!(s.reserved_bytes(), 0);
}

/// Pins A6: the clamp reports requested and admitted tokens and bytes and
/// what was free; nothing clamped means no cap.
#[test]
fn a_clamp_reports_the_numbers() {
    let s = Scheduler::new(100 * BPT);
    let _held = s.admit(&req(30, 40)).unwrap();
    let a = s.admit(&req(10, 50)).unwrap();
    assert_eq!(
        a.budget_cap,
        Some(BudgetCap {
            requested_tokens: 60,
            admitted_tokens: 30,
            requested_bytes: 60 * BPT,
            admitted_bytes: 30 * BPT,
            available_bytes: 30 * BPT,
        })
    );
    assert_eq!(a.max_new_tokens, 20);
    assert_eq!(s.available_bytes(), 0);
}

/// Pins A2: a refusal is typed and carries the numbers; `Deferred` fits an
/// empty budget, `NeverFits` does not.
#[test]
fn refusals_say_deferred_or_never_with_numbers() {
    let s = Scheduler::new(20 * BPT);
    let held = s.admit(&req(10, 5)).unwrap();
    assert_eq!(
        s.admit(&req(5, 1)).unwrap_err(),
        AdmissionError::Deferred {
            needed_bytes: 6 * BPT,
            available_bytes: 5 * BPT,
            budget_bytes: 20 * BPT,
            prompt_tokens: 5,
            bytes_per_token: BPT,
        }
    );
    let err = s.admit(&req(20, 4)).unwrap_err();
    assert!(
        matches!(err, AdmissionError::NeverFits { budget_bytes, prompt_tokens: 20, .. } if budget_bytes == 20 * BPT)
    );
    assert!(err.to_string().contains("more than the whole budget"), "{err}");
    drop(held);
    assert!(s.admit(&req(5, 1)).is_ok(), "deferred means: fits once room frees");
}

/// Pins A4: a reservation is released when its guard drops, including
/// during a panic unwinding through its holder.
#[test]
fn reservations_release_on_drop_and_on_panic() {
    let s = Scheduler::new(10 * BPT);
    let a = s.admit(&req(2, 3)).unwrap();
    assert_eq!(s.reserved_bytes(), 5 * BPT);
    drop(a);
    assert_eq!(s.reserved_bytes(), 0);
    let s2 = s.clone();
    let r = std::thread::spawn(move || {
        let _a = s2.admit(&req(2, 3)).unwrap();
        panic!("backend blew up");
    })
    .join();
    assert!(r.is_err());
    assert_eq!(s.reserved_bytes(), 0, "a panicking holder still released");
}

/// Pins A8: no geometry reserves nothing, caps nothing, and still admits.
#[test]
fn unknown_geometry_passes_through() {
    let s = Scheduler::new(0);
    let a = s.admit(&AdmissionRequest { bytes_per_token: None, ..req(1_000_000, 5) }).unwrap();
    assert_eq!((a.bytes(), a.budget_cap, a.max_new_tokens), (0, None, 5));
}

#[test]
fn empty_prompts_and_zero_new_tokens_are_invalid() {
    let s = Scheduler::new(10 * BPT);
    assert!(matches!(s.admit(&req(0, 3)), Err(AdmissionError::Invalid(_))));
    assert!(matches!(s.admit(&req(3, 0)), Err(AdmissionError::Invalid(_))));
    assert_eq!(s.reserved_bytes(), 0);
}

/// Waiting is first come, first served, and a deadline ends the wait with a
/// typed error (and leaves nothing queued).
#[test]
fn waiters_are_served_in_arrival_order_until_their_deadline() {
    let s = Scheduler::new(10 * BPT);
    let holder = s.admit(&req(5, 5)).unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let spawn = |name: &'static str| {
        let (s, order) = (s.clone(), order.clone());
        std::thread::spawn(move || {
            let r = AdmissionRequest { wait_until: Some(Instant::now() + Duration::from_secs(10)), ..req(5, 5) };
            let a = s.admit(&r).unwrap_or_else(|e| panic!("{name} was never admitted: {e:?}"));
            order.lock().unwrap().push(name);
            drop(a);
        })
    };
    // Each waiter is in line before the next arrives: arrival order is
    // what the queue says, not what a sleep hopes for.
    let first = spawn("first");
    queued(&s, 1);
    let second = spawn("second");
    queued(&s, 2);
    // A non-waiting request may not jump the queue.
    assert!(matches!(s.admit(&req(1, 1)), Err(AdmissionError::Deferred { .. })));
    drop(holder);
    first.join().unwrap();
    second.join().unwrap();
    assert_eq!(*order.lock().unwrap(), ["first", "second"]);

    let holder = s.admit(&req(5, 5)).unwrap();
    let started = Instant::now();
    let r = AdmissionRequest { wait_until: Some(Instant::now() + Duration::from_millis(50)), ..req(5, 5) };
    assert!(matches!(s.admit(&r), Err(AdmissionError::TimedOut { .. })));
    assert!(started.elapsed() >= Duration::from_millis(50));
    drop(holder);
    assert!(s.admit(&req(5, 5)).is_ok(), "the timed-out waiter left the queue");
}

/// Pins A2 for waiters: a wait that ends at its deadline is refused with
/// the numbers as they stood (needed for prompt + 1, what was free, the
/// budget), and a request that finds someone queued is refused with what
/// is free now. (Found by cargo-mutants: these numbers were unasserted.)
#[test]
fn timed_out_and_queued_refusals_carry_the_numbers() {
    let s = Scheduler::new(20 * BPT);
    let holder = s.admit(&req(12, 3)).unwrap();
    let r = AdmissionRequest { wait_until: Some(Instant::now() + Duration::from_millis(30)), ..req(7, 2) };
    assert_eq!(
        s.admit(&r).unwrap_err(),
        AdmissionError::TimedOut { needed_bytes: 8 * BPT, available_bytes: 5 * BPT, budget_bytes: 20 * BPT }
    );
    let waiter = {
        let s = s.clone();
        std::thread::spawn(move || {
            let r = AdmissionRequest { wait_until: Some(Instant::now() + Duration::from_secs(10)), ..req(10, 1) };
            s.admit(&r).map(|a| a.bytes())
        })
    };
    // Until the waiter is queued, a small request still fits.
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.admit(&req(1, 1)).is_ok() {
        assert!(Instant::now() < deadline, "a request is still admitted 10 s after a waiter began waiting");
        std::thread::yield_now();
    }
    assert_eq!(
        s.admit(&req(1, 1)).unwrap_err(),
        AdmissionError::Deferred {
            needed_bytes: 2 * BPT,
            available_bytes: 5 * BPT,
            budget_bytes: 20 * BPT,
            prompt_tokens: 1,
            bytes_per_token: BPT,
        }
    );
    drop(holder);
    assert_eq!(waiter.join().unwrap(), Ok(11 * BPT));
}

/// Pins A11's gauges: the budget, what live admissions hold, and what is
/// left, before, during and after an admission. (Found by cargo-mutants:
/// `budget_bytes` and `available_bytes` were unasserted.)
#[test]
fn gauges_report_budget_reserved_and_available() {
    let s = Scheduler::new(20 * BPT);
    assert_eq!((s.budget_bytes(), s.reserved_bytes(), s.available_bytes()), (20 * BPT, 0, 20 * BPT));
    let a = s.admit(&req(4, 3)).unwrap();
    assert_eq!((s.budget_bytes(), s.reserved_bytes(), s.available_bytes()), (20 * BPT, 7 * BPT, 13 * BPT));
    drop(a);
    assert_eq!(s.available_bytes(), 20 * BPT);
}

/// Pins first come, first served among waiters: a small waiter that would
/// fit stays behind a large one that came first, even when room frees that
/// is enough for the small one only. (Found by cargo-mutants: with every
/// ticket equal, the small one jumped the queue; the older FCFS test only
/// caught that when the threads woke in one of two orders.)
#[test]
fn a_small_waiter_does_not_overtake_a_large_one() {
    let s = Scheduler::new(20 * BPT);
    let holder = s.admit(&req(10, 3)).unwrap();
    let spare = s.admit(&req(1, 1)).unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let wait = |name: &'static str, prompt: u64| {
        let (s, order) = (s.clone(), order.clone());
        std::thread::spawn(move || {
            let r = AdmissionRequest { wait_until: Some(Instant::now() + Duration::from_secs(10)), ..req(prompt, 1) };
            let a = s.admit(&r).unwrap_or_else(|e| {
                panic!("{name} was never admitted ({e:?}): a later waiter took the room it was waiting for")
            });
            order.lock().unwrap().push(name);
            a
        })
    };
    let large = wait("large", 15);
    queued(&s, 1);
    let small = wait("small", 4);
    queued(&s, 2);
    // 7 free: enough for the small waiter (5), not the large one (16);
    // the release wakes both. Had the small one overtaken, it would hold 5
    // and the large one (16) could not fit even once the holder leaves:
    // the large waiter's deadline then fails the test, with that message.
    drop(spare);
    // The large one goes first; the small one (16 + 5 > 20) only after it.
    drop(holder);
    let large = large.join().unwrap();
    assert_eq!(*order.lock().unwrap(), ["large"]);
    drop(large);
    drop(small.join().unwrap());
    assert_eq!(*order.lock().unwrap(), ["large", "small"]);
    assert_eq!(s.waiting(), 0);
}

/// Waits (at most 10 s) until `n` requests wait in line.
fn queued(s: &Scheduler, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.waiting() < n {
        assert!(Instant::now() < deadline, "{n} waiters never queued ({} did)", s.waiting());
        std::thread::yield_now();
    }
}

#[derive(Clone, Debug)]
enum Step {
    Admit { prompt: u64, max_new: u64 },
    Release(usize),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            (1u64..40, 1u64..40).prop_map(|(prompt, max_new)| Step::Admit { prompt, max_new }),
            (0usize..8).prop_map(Step::Release),
        ],
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Pins A11 (and A10, A6 under contention): threads released together
    /// run random admits, clamps and releases; the bytes live admissions
    /// hold never exceed the budget, every admission is either whole or an
    /// exact clamp, and everything is released at the end.
    #[test]
    fn no_overcommit_under_concurrent_interleavings(
        budget_tokens in 10u64..120,
        plans in prop::collection::vec(steps(), 2..5),
    ) {
        let budget = budget_tokens * BPT;
        let s = Scheduler::new(budget);
        let live = Arc::new(AtomicU64::new(0));
        let barrier = Arc::new(Barrier::new(plans.len()));
        let handles: Vec<_> = plans.into_iter().map(|plan| {
            let (s, live, barrier) = (s.clone(), live.clone(), barrier.clone());
            std::thread::spawn(move || -> Result<(), String> {
                barrier.wait();
                let mut held = Vec::new();
                for step in plan {
                    match step {
                        Step::Admit { prompt, max_new } => match s.admit(&req(prompt, max_new)) {
                            Ok(a) => {
                                let now = live.fetch_add(a.bytes(), Ordering::SeqCst) + a.bytes();
                                if now > budget {
                                    return Err(format!("{now} bytes live over a budget of {budget}"));
                                }
                                let whole = (prompt + max_new) * BPT;
                                match a.budget_cap {
                                    None if a.bytes() != whole => return Err("unclamped admission of the wrong size".into()),
                                    Some(c) if c.admitted_bytes != a.bytes() || c.admitted_tokens != prompt + a.max_new_tokens || a.max_new_tokens == 0 || a.max_new_tokens >= max_new => {
                                        return Err(format!("inconsistent clamp {c:?} for {prompt}+{max_new}"));
                                    }
                                    _ => {}
                                }
                                held.push(a);
                            }
                            Err(AdmissionError::Deferred { needed_bytes, .. }) if needed_bytes == (prompt + 1) * BPT => {}
                            Err(AdmissionError::NeverFits { .. }) if (prompt + 1) * BPT > budget => {}
                            Err(e) => return Err(format!("unexpected refusal {e}")),
                        },
                        Step::Release(i) => {
                            if !held.is_empty() {
                                let a = held.remove(i % held.len());
                                live.fetch_sub(a.bytes(), Ordering::SeqCst);
                                drop(a);
                            }
                        }
                    }
                }
                for a in held {
                    live.fetch_sub(a.bytes(), Ordering::SeqCst);
                }
                Ok(())
            })
        }).collect();
        for h in handles {
            let r = h.join().map_err(|_| TestCaseError::fail("a thread panicked"))?;
            prop_assert!(r.is_ok(), "{:?}", r);
        }
        prop_assert_eq!(s.reserved_bytes(), 0);
    }
}

/// Pins B2 at the scheduler: with a backend that allocates KV in blocks,
/// bytes are counted for whole blocks (what the backend will hold), a clamp
/// admits whole blocks, and the boundary stays exact in blocks (A10).
#[test]
fn block_granularity_counts_whole_blocks() {
    let s = Scheduler::new(64 * BPT);
    let block = |prompt, max_new| AdmissionRequest { granularity: 16, ..req(prompt, max_new) };
    let a = s.admit(&block(5, 6)).unwrap();
    assert_eq!((a.bytes(), a.budget_cap), (16 * BPT, None), "11 tokens hold one block of 16");
    drop(a);
    let b = s.admit(&block(20, 40)).unwrap();
    assert_eq!((b.bytes(), b.max_new_tokens), (64 * BPT, 40), "60 tokens round to the 64 that fit");
    drop(b);
    let c = s.admit(&block(20, 50)).unwrap();
    assert_eq!(c.max_new_tokens, 44, "clamped to the whole blocks that fit: 64 - 20");
    assert_eq!(c.budget_cap.map(|cap| (cap.admitted_tokens, cap.requested_bytes)), Some((64, 80 * BPT)));
    drop(c);
    assert!(
        matches!(s.admit(&block(64, 1)), Err(AdmissionError::NeverFits { needed_bytes, .. }) if needed_bytes == 80 * BPT),
        "65 tokens need five blocks"
    );
}

/// Pins B2 for idle sessions: a finished turn shrinks its reservation to
/// the KV its session keeps (never grows it), and the freed bytes are free
/// at once (A11).
#[test]
fn a_reservation_shrinks_to_what_is_kept() {
    let s = Scheduler::new(100 * BPT);
    let mut a = s.admit(&req(10, 50)).unwrap();
    a.shrink_to(30 * BPT);
    assert_eq!((a.bytes(), s.reserved_bytes()), (30 * BPT, 30 * BPT));
    a.shrink_to(80 * BPT);
    assert_eq!(a.bytes(), 30 * BPT, "shrinking never grows");
    assert!(s.admit(&req(20, 50)).is_ok(), "the released bytes are usable at once");
    drop(a);
    assert_eq!(s.reserved_bytes(), 0);
}

/// Pins A5/B2 for a continuing turn: the bytes its session already holds
/// count as room for the turn, which takes them over (no double count);
/// a refusal hands the session's bytes back untouched; under concurrent
/// admissions the live total never passes the budget (A11).
#[test]
fn a_continuing_turn_takes_over_its_sessions_bytes() {
    let s = Scheduler::new(100 * BPT);
    let idle = s.admit(&req(40, 1)).unwrap();
    let _other = s.admit(&req(30, 10)).unwrap();
    assert_eq!(s.available_bytes(), 19 * BPT);
    // 41 held + 19 free = 60 tokens of room for the continuing turn.
    let turn = s.admit_over(&req(45, 15), idle).unwrap();
    assert_eq!((turn.bytes(), turn.max_new_tokens, s.available_bytes()), (60 * BPT, 15, 0));
    drop(turn);
    let idle = s.admit(&req(40, 1)).unwrap();
    let refused = *s.admit_over(&req(80, 1), idle).unwrap_err();
    let (err, back) = (refused.error, refused.held);
    assert!(matches!(err, AdmissionError::Deferred { .. }), "{err:?}");
    assert_eq!((back.bytes(), s.reserved_bytes()), (41 * BPT, 81 * BPT), "refused: the session keeps its bytes");
    drop(back);
    // Concurrent: sessions continuing and newcomers admitting, all at once.
    let shared = Scheduler::new(64 * BPT);
    let peak = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(8));
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let (s, peak, barrier) = (shared.clone(), peak.clone(), barrier.clone());
            std::thread::spawn(move || {
                let held = s.admit(&req(4, 1)).ok();
                barrier.wait();
                for _ in 0..200 {
                    let got = match &held {
                        Some(_) if i % 2 == 0 => s.admit(&req(6, 4)).ok(),
                        _ => s.admit(&req(3, 3)).ok(),
                    };
                    peak.fetch_max(s.reserved_bytes(), Ordering::SeqCst);
                    drop(got);
                }
                if let Some(h) = held {
                    let r = s.admit_over(&req(8, 8), h);
                    peak.fetch_max(s.reserved_bytes(), Ordering::SeqCst);
                    drop(r);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(peak.load(Ordering::SeqCst) <= 64 * BPT, "over-committed: {}", peak.load(Ordering::SeqCst));
    assert_eq!(shared.reserved_bytes(), 0);
}
