//! Admission: the engine never runs work the KV byte budget did not admit.
//!
//! A [`Scheduler`] owns one byte budget shared by every engine that holds a
//! clone. [`Scheduler::admit`] reserves the bytes a request may need
//! (`(prompt + max_new_tokens) * bytes_per_token`) and returns an
//! [`Admission`] guard that gives them back when dropped, so no exit path —
//! success, error, abort, panic — can forget the release (A4). When the
//! budget cannot hold the whole request but can hold the prompt and at least
//! one new token, `max_new_tokens` is clamped and the admission carries a
//! [`BudgetCap`] (A6). A refusal is a typed [`AdmissionError`] with the
//! numbers (A2), distinguishing a request that would fit an empty budget
//! (`Deferred`) from one that never fits (`NeverFits`). See
//! `../shared/docs/INVARIANTS.md` (A2, A4, A6, A8, A10, A11).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// The scheduler identity of a conversation: every turn of one session is
/// admitted under the same id (A5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConversationId(pub u64);

/// What admission needs to know about a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmissionRequest {
    pub conversation: ConversationId,
    /// Tokens the run will hold before generating: carried from earlier
    /// turns plus the new prompt (A5).
    pub prompt_tokens: u64,
    pub max_new_tokens: u64,
    /// KV bytes per token from the package's geometry; `None` when the
    /// package declares none (A8: reserve nothing, cap nothing).
    pub bytes_per_token: Option<u64>,
    /// Wait (first come, first served) until room frees up or this instant
    /// passes, instead of refusing a request that would fit an empty budget.
    pub wait_until: Option<Instant>,
    /// Positions the backend allocates KV in (its blocks; 1: token-exact).
    /// Bytes are counted for whole blocks and a clamp admits whole blocks,
    /// so what is reserved always covers what the backend holds (B2).
    pub granularity: u64,
}

/// `tokens` rounded up to whole blocks of `granularity`.
fn whole_blocks(tokens: u64, granularity: u64) -> u64 {
    let g = granularity.max(1);
    tokens.div_ceil(g).saturating_mul(g)
}

/// How a request was clamped to the room the budget had (A6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetCap {
    pub requested_tokens: u64,
    pub admitted_tokens: u64,
    pub requested_bytes: u64,
    pub admitted_bytes: u64,
    /// Bytes free when the request was decided.
    pub available_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// Fits an empty budget, but not what is free now.
    #[error(
        "KV byte budget: request needs at least {needed_bytes} bytes ({prompt_tokens} prompt tokens + 1 new, \
         {bytes_per_token} bytes per token) but {available_bytes} of {budget_bytes} bytes are free; retry later"
    )]
    Deferred { needed_bytes: u64, available_bytes: u64, budget_bytes: u64, prompt_tokens: u64, bytes_per_token: u64 },
    /// Larger than the whole budget: retrying cannot help.
    #[error(
        "KV byte budget: request needs at least {needed_bytes} bytes ({prompt_tokens} prompt tokens + 1 new, \
         {bytes_per_token} bytes per token), more than the whole budget of {budget_bytes} bytes"
    )]
    NeverFits { needed_bytes: u64, budget_bytes: u64, prompt_tokens: u64, bytes_per_token: u64 },
    /// Waited until the deadline without room.
    #[error(
        "KV byte budget: no room for {needed_bytes} bytes before the deadline ({available_bytes} of {budget_bytes} \
         bytes free)"
    )]
    TimedOut { needed_bytes: u64, available_bytes: u64, budget_bytes: u64 },
    /// Not a request admission can decide (no prompt or nothing to generate).
    #[error("invalid admission request: {0}")]
    Invalid(String),
}

#[derive(Debug, Default)]
struct State {
    reserved: u64,
    /// Tickets of requests waiting for room, in arrival order.
    queue: VecDeque<u64>,
    next_ticket: u64,
}

#[derive(Debug)]
struct Inner {
    budget: u64,
    state: Mutex<State>,
    room: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the counters half
        // updated (each update is one statement), so a poisoned lock is safe
        // to keep using.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A shared, thread-safe KV byte budget. Clones share the budget.
#[derive(Clone, Debug)]
pub struct Scheduler {
    inner: Arc<Inner>,
}

/// A live reservation; dropping it releases its bytes (A4) and wakes waiters.
#[derive(Debug)]
pub struct Admission {
    inner: Arc<Inner>,
    bytes: u64,
    pub conversation: ConversationId,
    /// `max_new_tokens` after clamping.
    pub max_new_tokens: u64,
    /// `Some` exactly when the request was clamped (A6).
    pub budget_cap: Option<BudgetCap>,
}

impl Admission {
    /// Bytes this admission holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps at most `bytes` and gives the rest back now (a finished turn
    /// whose session keeps only the KV it filled). Never grows.
    pub fn shrink_to(&mut self, bytes: u64) {
        if bytes < self.bytes {
            let released = self.bytes - bytes;
            let mut s = self.inner.lock();
            s.reserved -= released;
            drop(s);
            self.bytes = bytes;
            self.inner.room.notify_all();
        }
    }
}

impl Admission {
    /// Moves `bytes` of this reservation (at most all of it) into a new one
    /// of the same conversation and clamp: the budget's total is unchanged,
    /// and each part is released when its own guard drops (A4). Several
    /// choices of one request are admitted together and then split.
    pub fn split_off(&mut self, bytes: u64) -> Admission {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        Admission {
            inner: self.inner.clone(),
            bytes,
            conversation: self.conversation,
            max_new_tokens: self.max_new_tokens,
            budget_cap: self.budget_cap,
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let mut s = self.inner.lock();
            s.reserved -= self.bytes;
            drop(s);
            self.inner.room.notify_all();
        }
    }
}

/// A refused [`Scheduler::admit_over`]: why, and the reservation that was
/// held, unchanged.
#[derive(Debug)]
pub struct Refused {
    pub error: AdmissionError,
    pub held: Admission,
}

enum Decision {
    Admit { bytes: u64, new_tokens: u64, cap: Option<BudgetCap> },
    Deferred(AdmissionError),
}

impl Scheduler {
    /// A scheduler with `budget_bytes` of KV to hand out.
    pub fn new(budget_bytes: u64) -> Self {
        Self { inner: Arc::new(Inner { budget: budget_bytes, state: Mutex::default(), room: Condvar::new() }) }
    }

    /// A scheduler whose budget never binds (`u64::MAX` bytes).
    pub fn unlimited() -> Self {
        Self::new(u64::MAX)
    }

    pub fn budget_bytes(&self) -> u64 {
        self.inner.budget
    }

    /// Whether `other` hands out the same budget (a clone of this
    /// scheduler, as the models of one server share it).
    pub fn shares_budget_with(&self, other: &Scheduler) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Bytes held by live admissions.
    pub fn reserved_bytes(&self) -> u64 {
        self.inner.lock().reserved
    }

    /// Requests waiting their turn (FCFS) for room to free.
    pub fn waiting(&self) -> usize {
        self.inner.lock().queue.len()
    }

    pub fn available_bytes(&self) -> u64 {
        self.inner.budget - self.reserved_bytes()
    }

    /// Decides `request`: admits (possibly clamped), or refuses with the
    /// numbers. With `wait_until`, a request that would fit an empty budget
    /// waits its turn (FCFS) instead of being refused.
    pub fn admit(&self, request: &AdmissionRequest) -> Result<Admission, AdmissionError> {
        if request.prompt_tokens == 0 {
            return Err(AdmissionError::Invalid("the prompt has no tokens".into()));
        }
        if request.max_new_tokens == 0 {
            return Err(AdmissionError::Invalid("max_new_tokens must be at least 1".into()));
        }
        let Some(bpt) = request.bytes_per_token else {
            // A8: unknown geometry reserves nothing and caps nothing.
            return Ok(self.admission(request, 0, request.max_new_tokens, None));
        };
        let budget = self.inner.budget;
        let min_bytes = whole_blocks(request.prompt_tokens.saturating_add(1), request.granularity).saturating_mul(bpt);
        if min_bytes > budget {
            return Err(AdmissionError::NeverFits {
                needed_bytes: min_bytes,
                budget_bytes: budget,
                prompt_tokens: request.prompt_tokens,
                bytes_per_token: bpt,
            });
        }
        let mut state = self.inner.lock();
        let mut ticket = None;
        loop {
            let my_turn = match ticket {
                None => state.queue.is_empty(),
                Some(t) => state.queue.front() == Some(&t),
            };
            let free = budget - state.reserved;
            if my_turn {
                match decide(request, bpt, budget, state.reserved) {
                    Decision::Admit { bytes, new_tokens, cap } => {
                        state.reserved += bytes;
                        if ticket.is_some() {
                            state.queue.pop_front();
                        }
                        drop(state);
                        // The next in line may fit in what is left.
                        self.inner.room.notify_all();
                        return Ok(self.admission(request, bytes, new_tokens, cap));
                    }
                    Decision::Deferred(err) if request.wait_until.is_none() => return Err(err),
                    Decision::Deferred(_) => {}
                }
            } else if request.wait_until.is_none() {
                // Someone is already waiting: first come, first served.
                return Err(deferred(request, bpt, budget, free));
            }
            let Some(deadline) = request.wait_until else { return Err(deferred(request, bpt, budget, free)) };
            if ticket.is_none() {
                let t = state.next_ticket;
                state.next_ticket += 1;
                state.queue.push_back(t);
                ticket = Some(t);
            }
            let now = Instant::now();
            if now >= deadline {
                state.queue.retain(|x| Some(*x) != ticket);
                drop(state);
                self.inner.room.notify_all();
                return Err(AdmissionError::TimedOut {
                    needed_bytes: whole_blocks(request.prompt_tokens + 1, request.granularity) * bpt,
                    available_bytes: free,
                    budget_bytes: budget,
                });
            }
            state = match self.inner.room.wait_timeout(state, deadline - now) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// [`Scheduler::admit`] for a request whose conversation already holds
    /// `held` (an idle session's KV): the held bytes count as room for this
    /// request, which takes them over when admitted, atomically, so nothing
    /// can take them in between (A11). When refused, `held` comes back
    /// unchanged with the error — unless it was held under another budget:
    /// those bytes go back to that budget first, and a refusal returns it
    /// emptied. Never waits.
    pub fn admit_over(&self, request: &AdmissionRequest, mut held: Admission) -> Result<Admission, Box<Refused>> {
        if !Arc::ptr_eq(&held.inner, &self.inner) {
            // Held under another budget: give it back there, admit here.
            held.shrink_to(0);
            return self.admit(request).map_err(|error| Box::new(Refused { error, held }));
        }
        let Some(bpt) = request.bytes_per_token else {
            return match self.admit(request) {
                Ok(a) => {
                    held.shrink_to(0);
                    Ok(a)
                }
                Err(error) => Err(Box::new(Refused { error, held })),
            };
        };
        if request.prompt_tokens == 0 || request.max_new_tokens == 0 {
            return self.admit(request).map_err(|error| Box::new(Refused { error, held }));
        }
        let budget = self.inner.budget;
        let min_bytes = whole_blocks(request.prompt_tokens.saturating_add(1), request.granularity).saturating_mul(bpt);
        if min_bytes > budget {
            let err = AdmissionError::NeverFits {
                needed_bytes: min_bytes,
                budget_bytes: budget,
                prompt_tokens: request.prompt_tokens,
                bytes_per_token: bpt,
            };
            return Err(Box::new(Refused { error: err, held }));
        }
        let mut state = self.inner.lock();
        let others = state.reserved - held.bytes;
        if !state.queue.is_empty() {
            // Someone is already waiting: first come, first served.
            let error = deferred(request, bpt, budget, budget - state.reserved);
            return Err(Box::new(Refused { error, held }));
        }
        match decide(request, bpt, budget, others) {
            Decision::Admit { bytes, new_tokens, cap } => {
                state.reserved = others + bytes;
                drop(state);
                // The held bytes now belong to the new admission.
                held.bytes = 0;
                self.inner.room.notify_all();
                Ok(self.admission(request, bytes, new_tokens, cap))
            }
            Decision::Deferred(error) => Err(Box::new(Refused { error, held })),
        }
    }

    fn admission(&self, request: &AdmissionRequest, bytes: u64, new_tokens: u64, cap: Option<BudgetCap>) -> Admission {
        Admission {
            inner: self.inner.clone(),
            bytes,
            conversation: request.conversation,
            max_new_tokens: new_tokens,
            budget_cap: cap,
        }
    }
}

/// The whole request if it fits, else the prompt and as many new tokens as
/// fit (at least one), else deferred. Exact at the boundary (A10).
fn decide(request: &AdmissionRequest, bpt: u64, budget: u64, reserved: u64) -> Decision {
    let available = budget - reserved;
    let tokens = request.prompt_tokens.saturating_add(request.max_new_tokens);
    let bytes = whole_blocks(tokens, request.granularity).saturating_mul(bpt);
    if bytes <= available {
        return Decision::Admit { bytes, new_tokens: request.max_new_tokens, cap: None };
    }
    let g = request.granularity.max(1);
    let fit_tokens = available.checked_div(bpt).map_or(u64::MAX, |t| t / g * g);
    if fit_tokens > request.prompt_tokens {
        let new_tokens = fit_tokens - request.prompt_tokens;
        let admitted_bytes = fit_tokens * bpt;
        let cap = BudgetCap {
            requested_tokens: tokens,
            admitted_tokens: fit_tokens,
            requested_bytes: bytes,
            admitted_bytes,
            available_bytes: available,
        };
        return Decision::Admit { bytes: admitted_bytes, new_tokens, cap: Some(cap) };
    }
    Decision::Deferred(deferred(request, bpt, budget, available))
}

fn deferred(request: &AdmissionRequest, bpt: u64, budget: u64, available: u64) -> AdmissionError {
    AdmissionError::Deferred {
        needed_bytes: whole_blocks(request.prompt_tokens + 1, request.granularity) * bpt,
        available_bytes: available,
        budget_bytes: budget,
        prompt_tokens: request.prompt_tokens,
        bytes_per_token: bpt,
    }
}
