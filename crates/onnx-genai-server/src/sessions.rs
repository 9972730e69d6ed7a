//! The routing layer's session registry. A public session id maps to a
//! model-qualified placement `(model, worker, engine session)`. A turn takes
//! the session's exclusive lease before anything queues (L1); the lease
//! travels with the turn and releases on `Drop` (L2). Close, eviction and
//! capacity decisions are made under the registry's one lock (L4–L7).
//!
//! A session belongs to the client that created it (its [`Owner`]): to any
//! other client its id names no session (404), so an id is a capability only
//! in its owner's hands. When room must be made, the victim is an idle
//! session of the client holding the most (the creator's new one counted;
//! on a tie the creator's own), least recently used among those: a client
//! that opens many sessions pushes out its own once it holds as many as
//! anyone, so it can press others down to an equal share but never aim an
//! eviction at a particular conversation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use onnx_genai_engine::SessionId;

use crate::error::ApiError;

/// Where a session lives: the key leases are taken on (L3).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Placement {
    pub model: String,
    pub worker: usize,
    pub engine: SessionId,
}

/// Who a request comes from: the API key it used or, on a server without
/// keys, its IP address (set by the guard on every request).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Owner(pub String);

#[derive(Debug)]
struct Entry {
    placement: Placement,
    owner: Owner,
    leased: bool,
    last_used: u64,
}

#[derive(Debug, Default)]
struct Inner {
    sessions: HashMap<String, Entry>,
    /// Inserts between their capacity decision and their bind.
    pending: usize,
    tick: u64,
}

#[derive(Debug)]
pub struct Registry {
    inner: Mutex<Inner>,
    max_sessions: usize,
}

/// An exclusive lease on one session; dropping it releases the session.
#[derive(Debug)]
pub struct Lease {
    registry: Arc<Registry>,
    id: String,
    pub placement: Placement,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut inner = self.registry.lock();
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(e) = inner.sessions.get_mut(&self.id) {
            e.leased = false;
            e.last_used = tick;
        }
    }
}

/// A capacity slot for one insert; dropping it without binding gives the
/// slot back.
#[derive(Debug)]
pub struct Slot {
    registry: Arc<Registry>,
    bound: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.bound {
            self.registry.lock().pending -= 1;
        }
    }
}

impl Registry {
    pub fn new(max_sessions: usize) -> Arc<Self> {
        Arc::new(Self { inner: Mutex::default(), max_sessions })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update is a single statement; a poisoned lock holds consistent data.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the exclusive lease of session `id` for a turn on `model` by
    /// `owner` (another client's session is unknown to it).
    pub fn lease(self: &Arc<Self>, model: &str, id: &str, owner: &Owner) -> Result<Lease, ApiError> {
        let mut inner = self.lock();
        let e = inner.sessions.get_mut(id).filter(|e| e.owner == *owner).ok_or_else(|| unknown(id))?;
        if e.placement.model != model {
            return Err(ApiError::conflict(format!(
                "session `{id}` belongs to model `{}`, not `{model}`",
                e.placement.model
            )));
        }
        if e.leased {
            return Err(ApiError::conflict(format!("session `{id}` is busy with another turn; wait for it to finish")));
        }
        e.leased = true;
        let placement = e.placement.clone();
        Ok(Lease { registry: self.clone(), id: id.into(), placement })
    }

    /// Decides capacity for one new session of `owner`: a free slot, or an
    /// idle session evicted by taking its lease (L5) and unbinding it —
    /// returned so its engine session can be closed. The victim is the least
    /// recently used idle session of the client holding the most sessions,
    /// `owner`'s new one counted. Refused when every session is mid-turn
    /// (L6).
    pub fn reserve(self: &Arc<Self>, owner: &Owner) -> Result<(Slot, Option<Placement>), ApiError> {
        let mut inner = self.lock();
        let mut evicted = None;
        if inner.sessions.len() + inner.pending >= self.max_sessions {
            let mut held: HashMap<&Owner, usize> = HashMap::from([(owner, 1)]);
            for e in inner.sessions.values() {
                *held.entry(&e.owner).or_default() += 1;
            }
            let victim = inner
                .sessions
                .iter()
                .filter(|(_, e)| !e.leased)
                .max_by_key(|(_, e)| {
                    // Among equal holders the creator's own goes first.
                    let count = held.get(&e.owner).copied().unwrap_or(0);
                    (count, e.owner == *owner, std::cmp::Reverse(e.last_used))
                })
                .map(|(id, _)| id.clone());
            let Some(victim) = victim else {
                return Err(ApiError::busy(format!(
                    "all {} sessions are busy; retry when a turn finishes, or close a session",
                    self.max_sessions
                )));
            };
            evicted = inner.sessions.remove(&victim).map(|e| e.placement);
        }
        inner.pending += 1;
        drop(inner);
        Ok((Slot { registry: self.clone(), bound: false }, evicted))
    }

    /// Binds `id` for `owner` in a reserved slot (L7: an id is bound once).
    pub fn bind(&self, mut slot: Slot, id: &str, placement: Placement, owner: Owner) -> Result<(), ApiError> {
        let mut inner = self.lock();
        if inner.sessions.contains_key(id) {
            return Err(ApiError::conflict(format!("session `{id}` already exists")));
        }
        inner.tick += 1;
        let last_used = inner.tick;
        inner.sessions.insert(id.into(), Entry { placement, owner, leased: false, last_used });
        inner.pending -= 1;
        slot.bound = true;
        Ok(())
    }

    /// Close by `owner`: finds, checks the lease and unbinds under one lock
    /// (L4).
    pub fn close(&self, id: &str, owner: &Owner) -> Result<Placement, ApiError> {
        let mut inner = self.lock();
        match inner.sessions.get(id).filter(|e| e.owner == *owner) {
            None => Err(unknown(id)),
            Some(e) if e.leased => {
                Err(ApiError::conflict(format!("session `{id}` is busy with a turn; close it after the turn")))
            }
            Some(_) => Ok(inner.sessions.remove(id).map(|e| e.placement).ok_or_else(|| unknown(id))?),
        }
    }

    /// Unbinds every session of `model` (its driver died, taking their
    /// sequences with it); returns how many there were.
    pub fn purge_model(&self, model: &str) -> usize {
        let mut inner = self.lock();
        let before = inner.sessions.len();
        inner.sessions.retain(|_, e| e.placement.model != model);
        before - inner.sessions.len()
    }

    /// Bound sessions (the active-session gauge).
    pub fn active(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Leases held right now.
    pub fn leased(&self) -> usize {
        self.lock().sessions.values().filter(|e| e.leased).count()
    }
}

fn unknown(id: &str) -> ApiError {
    ApiError::not_found(crate::error::SESSION_GONE, format!("no session `{id}`: create one with POST /v1/sessions"))
}

/// A fresh random public session id.
pub fn mint_id() -> String {
    format!("sess_{}", random_hex())
}

/// 32 random hex digits.
pub fn random_hex() -> String {
    random_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// A random 64-bit number (a request's sampling seed when it names none).
pub fn random_u64() -> u64 {
    let b = random_bytes();
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

fn random_bytes() -> [u8; 16] {
    let mut bytes = [0u8; 16];
    // The OS random source failing is not recoverable; fall back to time so
    // ids stay unique within a process.
    if getrandom::fill(&mut bytes).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        bytes.copy_from_slice(&t.to_le_bytes());
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Owner {
        Owner("key-0".into())
    }

    fn placement(engine: u64) -> Placement {
        Placement { model: "m".into(), worker: 0, engine: SessionId(engine) }
    }

    /// Pins L7: binding an id that is already bound is refused, and the
    /// gauge moves by exactly one per insert and per close.
    #[test]
    fn bind_is_exact() {
        let r = Registry::new(4);
        let (slot, evicted) = r.reserve(&me()).unwrap();
        assert!(evicted.is_none());
        r.bind(slot, "s1", placement(1), me()).unwrap();
        assert_eq!(r.active(), 1);
        let (slot, _) = r.reserve(&me()).unwrap();
        assert_eq!(r.bind(slot, "s1", placement(2), me()).unwrap_err().status, axum::http::StatusCode::CONFLICT);
        assert_eq!(r.active(), 1);
        assert_eq!(r.lease("m", "s1", &me()).unwrap().placement, placement(1), "the first binding survives");
        r.close("s1", &me()).unwrap();
        assert_eq!(r.active(), 0);
        assert_eq!(r.lock().pending, 0, "a refused bind gives its slot back");
    }

    fn bound(max_sessions: usize, ids: &[&str]) -> Arc<Registry> {
        let r = Registry::new(max_sessions);
        for (engine, id) in ids.iter().enumerate() {
            let (slot, _) = r.reserve(&me()).unwrap();
            r.bind(slot, id, placement(engine as u64 + 1), me()).unwrap();
        }
        r
    }

    /// Pins L1 at the registry: a session holds one lease at a time; a
    /// second is refused with 409 until the first is dropped.
    #[test]
    fn a_second_lease_is_refused_until_the_first_ends() {
        let r = bound(4, &["s"]);
        let first = r.lease("m", "s", &me()).unwrap();
        assert_eq!(r.lease("m", "s", &me()).unwrap_err().status, axum::http::StatusCode::CONFLICT);
        assert_eq!(r.leased(), 1);
        drop(first);
        assert!(r.lease("m", "s", &me()).is_ok(), "the lease is free again once dropped");
    }

    /// Pins L3 at the registry: a session is leased only for the model
    /// that owns it; on another model's route it is a 409, never a turn.
    #[test]
    fn a_session_is_leased_only_on_its_model() {
        let r = bound(4, &["s"]);
        let err = r.lease("other-model", "s", &me()).unwrap_err();
        assert_eq!(err.status, axum::http::StatusCode::CONFLICT, "{}", err.message);
        assert_eq!(r.leased(), 0, "the refusal took no lease");
        assert!(r.lease("m", "s", &me()).is_ok());
    }

    /// Pins L4 at the registry: closing a session mid-turn is refused (409)
    /// and the session survives; once the turn's lease is dropped it
    /// closes.
    #[test]
    fn a_leased_session_does_not_close() {
        let r = bound(4, &["s"]);
        let turn = r.lease("m", "s", &me()).unwrap();
        assert_eq!(r.close("s", &me()).unwrap_err().status, axum::http::StatusCode::CONFLICT);
        assert_eq!(r.active(), 1, "the refused close unbound nothing");
        drop(turn);
        assert_eq!(r.close("s", &me()).unwrap(), placement(1));
        assert_eq!(r.active(), 0);
    }

    /// Pins L5 and L6 at the registry: with every slot bound and leased, a
    /// new session is refused (429), never made by evicting a session
    /// mid-turn; when the lease ends, that session is the one evicted.
    #[test]
    fn eviction_never_takes_a_leased_session() {
        let r = bound(1, &["busy"]);
        let turn = r.lease("m", "busy", &me()).unwrap();
        assert_eq!(r.reserve(&me()).unwrap_err().status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.active(), 1);
        drop(turn);
        let (_slot, evicted) = r.reserve(&me()).unwrap();
        assert_eq!(evicted, Some(placement(1)));
    }

    /// Pins L7 against a rebind that would take over a live session: binding
    /// a bound id (here while its turn holds the lease) is refused, and the
    /// first binding keeps its owner, placement and lease.
    #[test]
    fn a_rebind_cannot_take_over_a_live_session() {
        let r = bound(4, &["s"]);
        let turn = r.lease("m", "s", &me()).unwrap();
        let other = Owner("key-1".into());
        let (slot, _) = r.reserve(&other).unwrap();
        assert_eq!(
            r.bind(slot, "s", placement(9), other.clone()).unwrap_err().status,
            axum::http::StatusCode::CONFLICT
        );
        assert_eq!(r.lease("m", "s", &other).unwrap_err().status, axum::http::StatusCode::NOT_FOUND);
        assert_eq!(r.lease("m", "s", &me()).unwrap_err().status, axum::http::StatusCode::CONFLICT, "still mid-turn");
        drop(turn);
        assert_eq!(r.lease("m", "s", &me()).unwrap().placement, placement(1));
    }

    /// Pins L4's "racing closes unbind exactly once": eight threads
    /// released by one barrier close the same idle session; exactly one
    /// gets its placement, the others find nothing (404), and the session
    /// is gone. Repeated on fresh registries so the race is really run.
    #[test]
    fn racing_closes_unbind_exactly_once() {
        for round in 0..16 {
            let r = Registry::new(4);
            let (slot, _) = r.reserve(&me()).unwrap();
            r.bind(slot, "s", placement(1), me()).unwrap();
            let barrier = std::sync::Barrier::new(8);
            let outcomes: Vec<Result<Placement, ApiError>> = std::thread::scope(|scope| {
                let handles: Vec<_> = (0..8)
                    .map(|_| {
                        scope.spawn(|| {
                            barrier.wait();
                            r.close("s", &me())
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let closed = outcomes.iter().filter(|o| o.is_ok()).count();
            assert_eq!(closed, 1, "round {round}: {closed} of 8 racing closes unbound the session");
            assert!(outcomes
                .iter()
                .filter_map(|o| o.as_ref().err())
                .all(|e| e.status == axum::http::StatusCode::NOT_FOUND));
            assert_eq!(r.active(), 0);
        }
    }

    /// Pins L6: slots reserved but not yet bound count against
    /// `max_sessions`, so concurrent creates cannot overshoot it; a slot
    /// dropped unbound is given back. (Found by cargo-mutants.)
    #[test]
    fn pending_inserts_count_against_capacity() {
        let r = Registry::new(2);
        let (a, _) = r.reserve(&me()).unwrap();
        let (b, _) = r.reserve(&me()).unwrap();
        assert_eq!(r.reserve(&me()).unwrap_err().status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        drop(a);
        let (c, _) = r.reserve(&me()).unwrap();
        r.bind(b, "b", placement(1), me()).unwrap();
        r.bind(c, "c", placement(2), me()).unwrap();
        assert_eq!((r.active(), r.lock().pending), (2, 0));
    }

    /// Eviction takes the least recently used idle session: binding and
    /// finishing a turn both count as use. Repeated on fresh registries
    /// because a tie would be broken by hash order. (Found by cargo-mutants:
    /// a clock that stopped on bind or release went unnoticed.)
    #[test]
    fn eviction_takes_the_least_recently_used() {
        for _ in 0..32 {
            let r = Registry::new(2);
            for (id, engine) in [("old", 1), ("new", 2)] {
                let (slot, _) = r.reserve(&me()).unwrap();
                r.bind(slot, id, placement(engine), me()).unwrap();
            }
            let (_slot, evicted) = r.reserve(&me()).unwrap();
            assert_eq!(evicted, Some(placement(1)), "the older binding goes first");

            let r = Registry::new(2);
            for (id, engine) in [("a", 1), ("b", 2)] {
                let (slot, _) = r.reserve(&me()).unwrap();
                r.bind(slot, id, placement(engine), me()).unwrap();
            }
            drop(r.lease("m", "b", &me()).unwrap());
            drop(r.lease("m", "a", &me()).unwrap());
            let (_slot, evicted) = r.reserve(&me()).unwrap();
            assert_eq!(evicted, Some(placement(2)), "a finished turn makes its session the most recent");
        }
    }

    /// A session belongs to its creator: to another client its id names
    /// nothing (404) — no turn, no close — while its owner uses it as ever.
    #[test]
    fn another_clients_session_is_unknown() {
        let r = Registry::new(4);
        let (slot, _) = r.reserve(&me()).unwrap();
        r.bind(slot, "mine", placement(1), me()).unwrap();
        let stranger = Owner("key-1".into());
        assert_eq!(r.lease("m", "mine", &stranger).unwrap_err().status, axum::http::StatusCode::NOT_FOUND);
        assert_eq!(r.close("mine", &stranger).unwrap_err().status, axum::http::StatusCode::NOT_FOUND);
        drop(r.lease("m", "mine", &me()).unwrap());
        assert_eq!(r.close("mine", &me()).unwrap(), placement(1));
    }

    /// Room is made from the client holding the most sessions (the
    /// creator's new one counted), least recently used among its own: a
    /// client opening session after session evicts its own, never the one
    /// session another client keeps, however old that one is.
    #[test]
    fn eviction_takes_from_the_largest_holder() {
        let other = Owner("key-1".into());
        let r = Registry::new(3);
        let (slot, _) = r.reserve(&other).unwrap();
        r.bind(slot, "theirs", placement(1), other.clone()).unwrap();
        for (i, engine) in (2..12).enumerate() {
            let (slot, evicted) = r.reserve(&me()).unwrap();
            if i >= 2 {
                assert_ne!(evicted, Some(placement(1)), "another client's only session was evicted");
                assert!(evicted.is_some(), "room is made when full");
            }
            r.bind(slot, &format!("mine-{i}"), placement(engine), me()).unwrap();
        }
        assert!(r.lease("m", "theirs", &other).is_ok(), "the other client's session survived");
        // When the other client is the largest holder, its own LRU goes.
        let r = Registry::new(3);
        for (id, engine) in [("t1", 1), ("t2", 2)] {
            let (slot, _) = r.reserve(&other).unwrap();
            r.bind(slot, id, placement(engine), other.clone()).unwrap();
        }
        let (slot, _) = r.reserve(&me()).unwrap();
        r.bind(slot, "m1", placement(3), me()).unwrap();
        let (_slot, evicted) = r.reserve(&me()).unwrap();
        assert_eq!(evicted, Some(placement(3)), "2 held by the other client against 1 + 1 of mine: a tie takes mine");
        // Holding more, the other client gives up its oldest.
        let r = Registry::new(3);
        for (id, engine) in [("t1", 1), ("t2", 2), ("t3", 3)] {
            let (slot, _) = r.reserve(&other).unwrap();
            r.bind(slot, id, placement(engine), other.clone()).unwrap();
        }
        assert_eq!(r.reserve(&me()).unwrap().1, Some(placement(1)));
    }
}
