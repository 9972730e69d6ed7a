//! The pool's regions, claims, nesting and panics, with real threads.

use super::*;
use std::sync::atomic::AtomicUsize;

/// Every index runs exactly once per region, on as many threads as the
/// pool has, region after region (the barrier holds: each region sees
/// the previous one's writes).
#[test]
fn every_thread_runs_each_region_once() {
    for threads in [1, 2, 3] {
        let pool = ThreadPool::new(threads, Duration::from_micros(50)).unwrap();
        assert_eq!(pool.threads(), threads);
        let counts: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
        let total = AtomicUsize::new(0);
        for region in 0..200 {
            pool.run(&|t| {
                counts[t].fetch_add(1, Ordering::Relaxed);
                total.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(total.load(Ordering::Relaxed), (region + 1) * threads);
            if region == 100 {
                // Long enough for the workers to park: they must wake.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        for c in &counts {
            assert_eq!(c.load(Ordering::Relaxed), 200);
        }
    }
}

/// Ranges cover `0..n` exactly once, aligned, for awkward sizes.
#[test]
fn ranges_partition_the_work() {
    for (n, align, threads) in [(0, 16, 2), (5, 16, 2), (100, 16, 3), (1536, 16, 2), (49152, 64, 7)] {
        let mut covered = vec![0u8; n];
        for t in 0..threads {
            let r = split(n, align, threads, t);
            if !r.is_empty() && r.end != n {
                assert_eq!(r.len() % align, 0, "n={n} t={t} {r:?}");
            }
            for i in r {
                covered[i] += 1;
            }
        }
        assert!(covered.iter().all(|c| *c == 1), "n={n} align={align} threads={threads}");
    }
}

/// Claimed items cover `0..n` exactly once, whatever the pool size, and
/// a thread slowed down leaves its share to the others (the claim is
/// dynamic: with thread 0 stalled on its first item, the other thread
/// computes every other item).
#[test]
fn claimed_items_run_once_and_balance() {
    for (n, threads) in [(0, 2), (1, 2), (7, 1), (97, 2), (500, 3)] {
        let pool = ThreadPool::new(threads, Duration::from_micros(50)).unwrap();
        let covered: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool.for_claimed(n, &|i, _| {
            covered[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(covered.iter().all(|c| c.load(Ordering::Relaxed) == 1), "n={n} threads={threads}");
    }
    let pool = ThreadPool::new(2, Duration::from_micros(50)).unwrap();
    let by_thread: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];
    pool.for_claimed(40, &|_, t| {
        if t == 0 && by_thread[0].load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(200));
        }
        by_thread[t].fetch_add(1, Ordering::Relaxed);
    });
    let (stalled, other) = (by_thread[0].load(Ordering::Relaxed), by_thread[1].load(Ordering::Relaxed));
    assert_eq!(stalled + other, 40);
    // A fixed split would give it 20; anything the other thread left
    // it (a scheduler hiccup) stays well below that.
    assert!(stalled < 20, "the stalled thread took {stalled} of 40 items: the split is not dynamic");
}

/// Claimed ranges cover `0..n` exactly once, none longer than the
/// chunk asked, for awkward sizes and pool sizes.
#[test]
fn claimed_ranges_cover_the_work_once() {
    for (n, chunk, threads) in [(0, 4, 2), (5, 16, 2), (18, 2, 2), (97, 5, 3), (1000, 1, 2), (200, 12, 2)] {
        let pool = ThreadPool::new(threads, Duration::from_micros(50)).unwrap();
        let covered: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool.for_claimed_ranges(n, chunk, &|r, _| {
            assert!(!r.is_empty() && r.len() <= chunk, "n={n} chunk={chunk}: {r:?}");
            r.for_each(|i| {
                covered[i].fetch_add(1, Ordering::Relaxed);
            });
        });
        assert!(covered.iter().all(|c| c.load(Ordering::Relaxed) == 1), "n={n} chunk={chunk} threads={threads}");
    }
}

/// `for_claimed_ranges_prepared`: a thread runs `prepare` once, before
/// any range it takes (what the int8-input projections rely on: each
/// thread's ranges read the rows it quantized for itself), and the ranges
/// still cover the work once — in a region, inline (a nested region),
/// and on one thread.
#[test]
fn each_thread_prepares_once_before_its_ranges() {
    for (n, chunk, threads) in [(1, 4, 2), (5, 16, 2), (18, 2, 2), (97, 5, 3), (200, 12, 2), (40, 3, 1)] {
        let pool = ThreadPool::new(threads, Duration::from_micros(50)).unwrap();
        // Returns how many threads ran a range. With `meet`, each
        // thread's first range waits (10 s at most) until every thread
        // has started one: no share is finished, so none is taken by
        // another, before every thread has reached its own.
        let check = |meet: bool| {
            let prepared: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
            let ran: Vec<AtomicBool> = (0..threads).map(|_| AtomicBool::new(false)).collect();
            let started = AtomicUsize::new(0);
            let covered: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let prepare = |t: usize| {
                prepared[t].fetch_add(1, Ordering::SeqCst);
            };
            pool.for_claimed_ranges_prepared(n, chunk, &prepare, &|r, t| {
                assert_eq!(prepared[t].load(Ordering::SeqCst), 1, "n={n}: thread {t} ran {r:?} unprepared");
                if !ran[t].swap(true, Ordering::SeqCst) && meet {
                    started.fetch_add(1, Ordering::SeqCst);
                    let since = std::time::Instant::now();
                    while started.load(Ordering::SeqCst) < threads && since.elapsed() < Duration::from_secs(10) {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                }
                r.for_each(|i| {
                    covered[i].fetch_add(1, Ordering::Relaxed);
                });
            });
            assert!(prepared.iter().all(|p| p.load(Ordering::SeqCst) <= 1), "n={n}: a thread prepared twice");
            assert!(covered.iter().all(|c| c.load(Ordering::Relaxed) == 1), "n={n} chunk={chunk} threads={threads}");
            ran.iter().filter(|r| r.load(Ordering::SeqCst)).count()
        };
        // (Not vacuous: where every thread has a share of two chunks or
        // more, every thread runs some of them.)
        let meet = n >= 2 * chunk * threads;
        let ran = check(meet);
        if meet {
            assert_eq!(ran, threads, "n={n} chunk={chunk}: only {ran} of {threads} threads ran ranges");
        }
        // Nested in a region, the ranges run inline on the calling thread
        // (one after another: no thread could wait for the others).
        pool.run(&|t| {
            if t == 0 {
                check(false);
            }
        });
    }
}

/// A region started inside another runs inline on the thread that
/// starts it, under that thread's own index — never another thread's,
/// whose per-thread state (`PerThread`, what `Scratch` is) that thread
/// may be using at the same moment: every thread of an outer region
/// starts nested ranges, claims and prepared ranges at once, each sees
/// only its own index, and each covers its work once.
#[test]
fn nested_regions_run_under_the_enclosing_threads_index() {
    for threads in [2, 3] {
        let pool = ThreadPool::new(threads, Duration::from_micros(50)).unwrap();
        let inside = std::sync::Barrier::new(threads);
        let foreign = AtomicUsize::new(0);
        pool.run(&|t| {
            // Every thread in the outer region before any nests.
            inside.wait();
            let seen = |u: usize| {
                if u != t {
                    foreign.fetch_add(1, Ordering::SeqCst);
                }
            };
            let covered = AtomicUsize::new(0);
            pool.for_ranges(40, 1, &|r, u| {
                seen(u);
                covered.fetch_add(r.len(), Ordering::SeqCst);
            });
            pool.for_claimed(7, &|_, u| {
                seen(u);
                covered.fetch_add(1, Ordering::SeqCst);
            });
            pool.for_claimed_ranges_prepared(50, 4, &seen, &|r, u| {
                seen(u);
                covered.fetch_add(r.len(), Ordering::SeqCst);
            });
            assert_eq!(covered.load(Ordering::SeqCst), 40 + 7 + 50, "{threads} threads: thread {t}'s nested work");
        });
        assert_eq!(foreign.load(Ordering::SeqCst), 0, "{threads} threads: nested work ran under another index");
    }
}

/// A share is claimed in chunks while it has two chunks or more left,
/// then in halves of what is left, down to single items: the thread
/// that finishes first never waits for more than one item of another's
/// share (whole chunks to the end left it waiting for up to a chunk).
#[test]
fn claims_shrink_to_single_items_at_a_share_end() {
    let drain = |mut left: usize, chunk: usize| {
        let mut sizes = Vec::new();
        while left > 0 {
            let size = claim_size(left, chunk);
            assert!(size >= 1 && size <= left && size <= chunk, "left {left} chunk {chunk}: claim {size}");
            sizes.push(size);
            left -= size;
        }
        sizes
    };
    assert_eq!(drain(48, 12), [12, 12, 12, 6, 3, 2, 1]);
    assert_eq!(drain(5, 1), [1; 5]);
    assert_eq!(drain(7, 100), [4, 2, 1]);
    for left in 1..200 {
        for chunk in 1..20 {
            assert_eq!(drain(left, chunk).last(), Some(&1), "left {left} chunk {chunk}");
        }
    }
}

/// Each thread runs its own share of the chunks front to back (one
/// forward run, so what a kernel fetches past a chunk is what the same
/// thread computes next), and a thread stalled on its first chunk, as
/// the OS may preempt one under a server, has the rest of its share
/// taken from the back by the other.
#[test]
fn claimed_ranges_run_forward_and_a_stalled_share_is_taken_from_the_back() {
    let pool = ThreadPool::new(2, Duration::from_micros(50)).unwrap();
    let log: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
    pool.for_claimed_ranges(40, 1, &|r, t| {
        if t == 1 && r.start == 20 {
            std::thread::sleep(Duration::from_millis(200));
        }
        log.lock().unwrap_or_else(|p| p.into_inner()).push((t, r.start));
    });
    let log = log.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut starts: Vec<usize> = log.iter().map(|e| e.1).collect();
    starts.sort_unstable();
    assert_eq!(starts, (0..40).collect::<Vec<_>>(), "every chunk exactly once");
    let first: Vec<usize> = log.iter().filter(|e| e.0 == 0).map(|e| e.1).collect();
    assert_eq!(first[..20], (0..20).collect::<Vec<_>>(), "thread 0's own share, in order");
    assert!(first.len() >= 30, "the stalled thread kept {} of its 20 chunks", 40 - first.len());
    assert!(first[20..].windows(2).all(|w| w[0] > w[1]), "taken from the back: {:?}", &first[20..]);
}

/// A panic in a worker reaches the caller after the region ends, as
/// itself (its message; watched red with the payload replaced by a
/// fixed message as before),
/// and the pool keeps working afterwards, its next region free of it.
#[test]
fn a_worker_panic_is_reraised_and_the_pool_survives() {
    let pool = ThreadPool::new(2, Duration::from_micros(50)).unwrap();
    let caught = catch_unwind(AssertUnwindSafe(|| {
        pool.run(&|t| {
            if t == 1 {
                panic!("boom in row {}", 7);
            }
        })
    }));
    let payload = caught.expect_err("the worker's panic is re-raised");
    let message =
        payload.downcast_ref::<String>().map(String::as_str).or_else(|| payload.downcast_ref::<&str>().copied());
    assert_eq!(message, Some("boom in row 7"), "the worker's own message");
    assert!(catch_unwind(AssertUnwindSafe(|| pool.run(&|_| {}))).is_ok(), "the next region does not re-raise it");
    let n = AtomicUsize::new(0);
    pool.run(&|_| {
        n.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(n.load(Ordering::Relaxed), 2);
}

/// A per-thread slot is one holder's at a time: taken again while held,
/// it panics naming the slot (two callers running kernels on one runtime
/// got the same scratch, a data race, before), and it is free again once
/// its holder drops it. Two threads on a barrier taking slot 0 in a loop
/// never hold it together: each take either has it alone or panics.
#[test]
fn a_slot_is_one_holders_at_a_time() {
    let slots: PerThread<Vec<u8>> = PerThread::new(2);
    let held = slots.take(0);
    let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(slots.take(0))));
    let message = again.expect_err("a taken slot was taken again");
    let message = message.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("per-thread slot 0 is already in use"), "{message}");
    drop(slots.take(1));
    drop(held);
    slots.take(0).push(7);
    assert_eq!(*slots.take(0), [7]);

    let holders = AtomicUsize::new(0);
    let start = std::sync::Barrier::new(2);
    let (mut alone, mut refused) = (0, 0);
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    start.wait();
                    let (mut alone, mut refused) = (0, 0);
                    for _ in 0..5_000 {
                        let took = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            let mut slot = slots.take(0);
                            let together = holders.fetch_add(1, Ordering::SeqCst) + 1;
                            slot.push(1);
                            slot.clear();
                            holders.fetch_sub(1, Ordering::SeqCst);
                            together
                        }));
                        match took {
                            Ok(together) => {
                                assert_eq!(together, 1, "two holders of one slot");
                                alone += 1;
                            }
                            Err(_) => refused += 1,
                        }
                    }
                    (alone, refused)
                })
            })
            .collect();
        for run in runs {
            let (a, r) = run.join().unwrap();
            (alone, refused) = (alone + a, refused + r);
        }
    });
    assert_eq!(alone + refused, 10_000);
    assert!(alone > 0);
}
