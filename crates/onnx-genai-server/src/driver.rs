//! One driver thread per model owns its engine and runs a step loop: each
//! iteration takes the commands that arrived (admitting new turns, opening
//! and closing sessions), advances every running turn by one batched model
//! step, and ends the turns that finished. Requests therefore join and
//! leave between steps (continuous batching).
//!
//! A turn's admission promise (A9) is resolved exactly once: `Ok` when the
//! engine admits the request, the typed failure when it refuses — and if
//! the command is dropped unprocessed (the driver stopped), the promise's
//! own `Drop` resolves it, so a route never waits forever. A turn's lease
//! travels with it and is released when the engine is done with the turn,
//! before the client hears the end (L2).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::{Duration, Instant};

use onnx_genai_engine::{Engine, Flow, GenerateRequest, GenerateResult, SessionId, Turn, TurnState};
use tokio::sync::{mpsc, oneshot};

use crate::backlog::{send_backlog, Sent};
use crate::error::{from_engine, ApiError};
use crate::sessions::Lease;

/// Resolves a route's wait for admission: the prompt tokens admission
/// counted (carried and new, A5: the answer's `usage`), or the refusal.
pub struct Promise(Option<oneshot::Sender<Result<u64, ApiError>>>);

impl Promise {
    pub fn new() -> (Self, oneshot::Receiver<Result<u64, ApiError>>) {
        let (tx, rx) = oneshot::channel();
        (Self(Some(tx)), rx)
    }

    fn resolve(&mut self, outcome: Result<u64, ApiError>) -> bool {
        match self.0.take() {
            Some(tx) => {
                let _ = tx.send(outcome);
                true
            }
            None => false,
        }
    }
}

impl Drop for Promise {
    fn drop(&mut self) {
        self.resolve(Err(ApiError::internal()));
    }
}

/// Resolves (by being dropped) once a turn no longer holds anything.
pub type Released = oneshot::Sender<()>;

/// What a turn streams back.
pub enum Event {
    /// A generated token of choice `.0`: its text (empty while a character
    /// is incomplete) and, when the request asked, its log-probability.
    Delta(usize, String, Option<onnx_genai_engine::TokenLogprob>),
    Finished(GenerateResult),
    /// A failure after admission (headers are already sent).
    Failed(ApiError),
}

pub enum Command {
    Generate {
        request: Box<GenerateRequest>,
        /// Held for the whole turn, dropped (released) when it ends (L2).
        lease: Option<Lease>,
        admission: Promise,
        events: mpsc::Sender<Event>,
        /// Dropped when the engine's work on the turn is over (its lease
        /// and reservation released): a route that ends a response early
        /// (a stop string) waits for it, so the client's next turn never
        /// meets its own lease.
        released: Released,
    },
    /// Opens an engine session under an id the route minted (the route does
    /// not wait: a busy driver must not stall session creation).
    OpenSession {
        id: SessionId,
    },
    CloseSession {
        id: SessionId,
    },
    /// Cuts an idle session's history where a stop string cut its last
    /// answer: the turn's first `keep` generated tokens, then `tail` (the
    /// text the client got after the last whole token). Sent before the answer, so the
    /// client's next turn comes after it.
    TrimSession {
        id: SessionId,
        /// Where the cut turn's generated tokens begin (a cut for a turn
        /// that is no longer the session's last changes nothing).
        start: usize,
        /// Generated tokens kept.
        keep: usize,
        tail: Vec<u32>,
    },
    /// Spills the KV of the model's least recently used idle session (its
    /// history kept): sent by the driver of another model on the same
    /// budget whose next request waits for room (B5 across models).
    GiveWay,
    /// Makes the driver thread panic outside every guard: how the tests
    /// kill a driver.
    #[cfg(test)]
    Die,
}

/// How a driver runs its model's turns.
#[derive(Clone, Copy, Debug)]
pub struct DriverOptions {
    /// Generate commands that may wait for the driver; beyond it a request
    /// is refused with 429.
    pub queue_limit: usize,
    /// How long a turn may wait for its client to read its stream before
    /// the turn is cancelled (and its lease and reservation released).
    /// While it waits it is parked: not stepped, so a client that stops
    /// reading costs the others nothing but its KV.
    pub stall_timeout: Duration,
    /// How long a request that does not fit the KV budget now waits in line
    /// (first come, first served) for room before it is refused with 429.
    pub admission_wait: Duration,
}

/// `wait` from now, or as far as an `Instant` reaches (the options are a
/// library's: a caller may pass `Duration::MAX` for "never", which
/// `Instant + Duration` panics on).
fn later(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait).or_else(|| now.checked_add(FAR_FUTURE)).unwrap_or(now)
}

/// A hundred years: "never" where `Instant` cannot reach a caller's wait.
/// (Written out: as `100 * 365 * 86_400` its products were mutants no test
/// could tell apart from a hundred days.)
const FAR_FUTURE: Duration = Duration::from_secs(3_153_600_000);

impl Default for DriverOptions {
    fn default() -> Self {
        Self { queue_limit: 256, stall_timeout: Duration::from_secs(30), admission_wait: Duration::from_millis(500) }
    }
}

/// Counters the tests and the load check read.
#[derive(Debug, Default)]
pub struct Counters {
    pub admitted: AtomicU64,
    pub turns: AtomicU64,
    /// Turns running on the model right now.
    pub running: AtomicU64,
    /// Turns cancelled because their client stopped reading.
    pub stalled: AtomicU64,
    /// Turns parked now: their client has not taken what they sent, so
    /// they are not stepped until it does (or `stall_timeout` cancels them).
    pub parked: AtomicU64,
    /// Ended turns whose events still trail their client (`Trailing`).
    pub trailing: AtomicU64,
    /// The most turns one step advanced.
    pub widest_step: AtomicU64,
    /// Model steps run (each advancing at least one turn).
    pub steps: AtomicU64,
    /// The turns those steps advanced, summed: over `steps`, the mean
    /// batch width.
    pub stepped: AtomicU64,
    /// Nanoseconds those steps spent in the engine (the model's pass and
    /// sampling): over `steps`, what a step costs the engine; the rest of a
    /// step's wall time is the driver's own work and its waits.
    pub step_nanos: AtomicU64,
    /// Requests waiting in line for KV room.
    pub waiting: AtomicU64,
    /// KV bytes the model's idle sessions keep (what the budget reserves for
    /// them at rest, B2).
    pub idle_kv_bytes: AtomicU64,
    /// Bytes the model keeps for reuse outside its sequences and outside
    /// the budget (returned KV blocks), as it said last.
    pub kept_bytes: AtomicU64,
    /// The driver thread died (a panic outside the guards around the
    /// engine): the model answers 503 and `/health` is red.
    pub dead: AtomicBool,
}

/// Every driver of a server, filled once all have started: a driver whose
/// request waits for room asks those on its budget to give way.
pub type Peers = Arc<std::sync::OnceLock<Vec<Peer>>>;

/// What a driver needs to reach another.
pub struct Peer {
    model: String,
    scheduler: onnx_genai_engine::Scheduler,
    tx: std_mpsc::Sender<Command>,
}

#[derive(Clone)]
pub struct Driver {
    pub model: String,
    /// The model's tokenizer and chat template: routes tokenize prompts on
    /// their own threads, so the driver only steps the model.
    pub prompter: Arc<onnx_genai_engine::Prompter>,
    tx: std_mpsc::Sender<Command>,
    pub counters: Arc<Counters>,
    pub scheduler: onnx_genai_engine::Scheduler,
    next_session: Arc<AtomicU64>,
    /// Generate commands sent and not yet taken by the driver.
    queued: Arc<AtomicUsize>,
    queue_limit: usize,
}

impl Driver {
    /// Starts the driver thread for `engine`; `peers` will hold the
    /// server's drivers.
    pub fn spawn(model: String, engine: Engine, options: DriverOptions, peers: Peers) -> Self {
        let (tx, rx) = std_mpsc::channel::<Command>();
        let counters = Arc::new(Counters::default());
        let scheduler = engine.scheduler().clone();
        let prompter = engine.prompter();
        let queued = Arc::new(AtomicUsize::new(0));
        let (c, q) = (counters.clone(), queued.clone());
        let name = format!("driver-{model}");
        let own = model.clone();
        let supervised = move || {
            let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
                Loop::new(engine, &c, &q, options, (own, peers)).run(&rx)
            }));
            if ran.is_err() {
                bury(&c, &rx);
            }
        };
        let spawned = std::thread::Builder::new().name(name).spawn(supervised);
        if let Err(e) = spawned {
            // A driver that never started is down as a dead one is: its
            // model answers 503 and `/health` turns red (sends check
            // `alive` before they count or queue anything).
            tracing::error!("cannot start the driver thread for {model}: {e}");
            counters.dead.store(true, Ordering::SeqCst);
        }
        Self {
            model,
            prompter,
            tx,
            counters,
            scheduler,
            next_session: Arc::new(AtomicU64::new(1)),
            queued,
            queue_limit: options.queue_limit,
        }
    }

    /// How other drivers reach this one.
    pub fn peer(&self) -> Peer {
        Peer { model: self.model.clone(), scheduler: self.scheduler.clone(), tx: self.tx.clone() }
    }

    /// A fresh engine session id on this model's worker.
    pub fn mint_session(&self) -> SessionId {
        SessionId(self.next_session.fetch_add(1, Ordering::SeqCst))
    }

    /// Whether the driver thread still runs.
    pub fn alive(&self) -> bool {
        !self.counters.dead.load(Ordering::SeqCst)
    }

    /// Why a dead driver's model refuses work.
    pub fn down(&self) -> ApiError {
        ApiError::unavailable(format!(
            "model `{}` is down: its driver stopped after an internal error (see the server log); restart the server",
            self.model
        ))
    }

    pub fn send(&self, command: Command) -> Result<(), ApiError> {
        if !self.alive() {
            return Err(self.down());
        }
        if let Command::Generate { .. } = command {
            // Bounded: a full queue refuses (transient) instead of growing.
            if self.queued.fetch_add(1, Ordering::SeqCst) >= self.queue_limit {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                return Err(ApiError::busy(format!(
                    "the queue of model `{}` is full ({} requests waiting); retry shortly",
                    self.model, self.queue_limit
                )));
            }
        }
        // A send error drops the command, resolving its promise; the
        // receiver is gone only once the driver is dead. (The command
        // counted as queued never will be taken.)
        self.tx.send(command).map_err(|e| {
            if let Command::Generate { .. } = e.0 {
                self.queued.fetch_sub(1, Ordering::SeqCst);
            }
            self.down()
        })
    }
}

/// After the driver's loop panicked: unwinding dropped the loop and its
/// engine, so every running turn's lease, reservation and event channel is
/// released (its client hears the stream end); the driver is marked dead
/// and the commands still queued are refused with 503 before the channel
/// closes (later sends see the mark).
fn bury(counters: &Counters, rx: &std_mpsc::Receiver<Command>) {
    counters.dead.store(true, Ordering::SeqCst);
    counters.running.store(0, Ordering::SeqCst);
    counters.parked.store(0, Ordering::SeqCst);
    counters.trailing.store(0, Ordering::SeqCst);
    counters.waiting.store(0, Ordering::SeqCst);
    counters.idle_kv_bytes.store(0, Ordering::SeqCst);
    counters.kept_bytes.store(0, Ordering::SeqCst);
    tracing::error!("a model driver died; its model answers 503 until the server restarts");
    let down = || ApiError::unavailable("the model is down: its driver stopped after an internal error");
    while let Ok(command) = rx.try_recv() {
        if let Command::Generate { mut admission, .. } = command {
            admission.resolve(Err(down()));
        }
    }
}

/// A turn running on the model, with where its events go.
struct Running {
    turn: Turn,
    lease: Option<Lease>,
    events: mpsc::Sender<Event>,
    /// Events the client has not taken yet (its channel was full): while
    /// any wait, the turn is parked, so this holds at most one step's.
    backlog: VecDeque<Event>,
    /// Since when the backlog has not drained.
    stalled_since: Option<Instant>,
    /// The client is gone (its channel closed).
    gone: bool,
    /// Shared by every choice of the request: the route hears the release
    /// when the last one ends.
    released: Arc<Released>,
}

impl Running {
    fn new(turn: Turn, lease: Option<Lease>, events: mpsc::Sender<Event>, gone: bool, released: Arc<Released>) -> Self {
        Self { turn, lease, events, backlog: VecDeque::new(), stalled_since: None, gone, released }
    }

    /// Whether the turn waits for its client (not stepped meanwhile).
    fn parked(&self) -> bool {
        !self.backlog.is_empty() && self.turn.state() == TurnState::Running
    }

    /// Sends what the channel takes; returns whether everything went out.
    fn flush(&mut self) -> bool {
        match send_backlog(&self.events, &mut self.backlog) {
            Sent::Drained => {
                self.stalled_since = None;
                true
            }
            Sent::Full => {
                self.stalled_since.get_or_insert_with(Instant::now);
                false
            }
            Sent::Closed => {
                self.gone = true;
                self.backlog.clear();
                false
            }
        }
    }
}

/// A request waiting in line for KV room.
struct Waiting {
    request: Box<GenerateRequest>,
    lease: Option<Lease>,
    admission: Promise,
    events: mpsc::Sender<Event>,
    until: Instant,
    released: Released,
}

struct Loop<'a> {
    engine: Engine,
    counters: &'a Counters,
    queued: &'a AtomicUsize,
    options: DriverOptions,
    running: Vec<Running>,
    /// Requests that did not fit the budget yet, in arrival order (B5).
    line: VecDeque<Waiting>,
    /// The model's `kept_memory_bytes` has panicked (logged once).
    kept_panicked: std::cell::Cell<bool>,
    /// This model's name and the server's drivers.
    peers: (String, Peers),
    /// When this driver last asked the others on its budget to give way.
    asked_way: Option<Instant>,
    /// Ended turns whose clients have not yet taken every event.
    trailing: Vec<Trailing>,
}

/// What an ended turn could not send at once (its client reads slower than
/// it finished): sent from the driver's loop as the client takes it, until
/// the client leaves or `until` passes. Held here, not by a thread of its
/// own, so clients that never read cost the process no threads — one a
/// choice could reach the OS's limit, whose spawn panic killed the driver.
struct Trailing {
    events: mpsc::Sender<Event>,
    backlog: VecDeque<Event>,
    until: Instant,
}

impl Trailing {
    /// Sends what the channel takes; whether anything is left to send.
    fn flush(&mut self, now: Instant) -> bool {
        match send_backlog(&self.events, &mut self.backlog) {
            Sent::Full => now < self.until,
            Sent::Drained | Sent::Closed => false,
        }
    }
}

/// How often a driver whose next request waits for room asks the drivers
/// of the other models on its budget to give way (each spills one idle
/// session a time).
const GIVE_WAY_EVERY: Duration = Duration::from_millis(10);

/// How long an idle driver with requests in line sleeps before it looks
/// for room again (room frees on other models sharing the budget).
const LINE_POLL: Duration = Duration::from_millis(2);

/// The shortest an idle driver sleeps between asking its model to give
/// back idle memory (so a model that says "now" again does not spin it).
const IDLE_RELEASE_MIN_WAIT: Duration = Duration::from_millis(10);

impl<'a> Loop<'a> {
    fn new(
        engine: Engine,
        counters: &'a Counters,
        queued: &'a AtomicUsize,
        options: DriverOptions,
        peers: (String, Peers),
    ) -> Self {
        Self {
            engine,
            counters,
            queued,
            options,
            running: Vec::new(),
            line: VecDeque::new(),
            kept_panicked: std::cell::Cell::new(false),
            peers,
            asked_way: None,
            trailing: Vec::new(),
        }
    }

    /// Asks the drivers of the other models on this budget to spill an
    /// idle session each (at most every [`GIVE_WAY_EVERY`]): this model
    /// spills its own for its requests, and another model's idle sessions
    /// would otherwise keep a request to this one waiting until refused.
    fn ask_peers_to_give_way(&mut self) {
        if self.asked_way.is_some_and(|t| t.elapsed() < GIVE_WAY_EVERY) {
            return;
        }
        self.asked_way = Some(Instant::now());
        let (own, peers) = &self.peers;
        for peer in peers.get().into_iter().flatten() {
            if peer.model != *own && peer.scheduler.shares_budget_with(self.engine.scheduler()) {
                // (A dead peer's channel is closed: nothing to ask.)
                let _ = peer.tx.send(Command::GiveWay);
            }
        }
    }

    fn run(mut self, rx: &std_mpsc::Receiver<Command>) {
        loop {
            // Idle: wait for work. Busy: take what arrived, then step. When
            // every running turn is parked, or only ended turns' events
            // trail, wait a moment for commands instead of spinning on
            // clients that do not read.
            if self.running.iter().all(Running::parked) {
                let next = if self.line.is_empty() && self.running.is_empty() && self.trailing.is_empty() {
                    self.wait_idle(rx)
                } else {
                    // Parked turns take and return no KV blocks: what
                    // ages out meanwhile is given back here.
                    self.release_idle_memory();
                    rx.recv_timeout(LINE_POLL).map_err(|e| e == std_mpsc::RecvTimeoutError::Disconnected)
                };
                match next {
                    Ok(command) => self.take(command),
                    Err(true) => return,
                    Err(false) => {}
                }
            }
            while let Ok(command) = rx.try_recv() {
                self.take(command);
            }
            let now = Instant::now();
            self.trailing.retain_mut(|t| t.flush(now));
            self.counters.trailing.store(self.trailing.len() as u64, Ordering::SeqCst);
            self.admit_waiting();
            if !self.running.is_empty() {
                self.step();
            }
            self.counters.idle_kv_bytes.store(self.engine.idle_kv_bytes(), Ordering::SeqCst);
            self.show_kept_memory();
        }
    }

    /// Waits for the next command with nothing to run. Meanwhile the model
    /// gives back the memory it kept for reuse past its standing keep, as
    /// that ages out (`Err(true)`: the channel closed).
    fn wait_idle(&self, rx: &std_mpsc::Receiver<Command>) -> Result<Command, bool> {
        loop {
            let next = self.release_idle_memory();
            // (Busy, the loop's end shows it once an iteration.)
            self.show_kept_memory();
            let Some(next) = next else {
                return rx.recv().map_err(|_| true);
            };
            match rx.recv_timeout(next.max(IDLE_RELEASE_MIN_WAIT)) {
                Ok(command) => return Ok(command),
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return Err(true),
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// The model's `release_idle_memory`, a panic of it logged and taken
    /// as nothing more kept (the driver lives on).
    fn release_idle_memory(&self) -> Option<Duration> {
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.model().release_idle_memory())) {
            Ok(next) => next,
            Err(_) => {
                tracing::error!("giving back idle memory panicked on {}", self.engine.package().manifest.name);
                None
            }
        }
    }

    /// Updates the gauge of what the model keeps outside its sequences,
    /// once a loop iteration and after every release while idle. A panic of the
    /// model's `kept_memory_bytes` is logged once and leaves the gauge as
    /// it was (the driver lives on).
    fn show_kept_memory(&self) {
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.model().kept_memory_bytes())) {
            Ok(bytes) => self.counters.kept_bytes.store(bytes, Ordering::SeqCst),
            Err(_) => {
                if !self.kept_panicked.replace(true) {
                    tracing::error!(
                        "reading the memory {} keeps panicked; its kv_kept_bytes gauge stays as it was",
                        self.engine.package().manifest.name
                    );
                }
            }
        }
    }

    fn take(&mut self, command: Command) {
        match command {
            Command::Generate { request, lease, admission, events, released } => {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                self.counters.turns.fetch_add(1, Ordering::SeqCst);
                let until = later(self.options.admission_wait);
                self.line.push_back(Waiting { request, lease, admission, events, until, released });
                self.admit_waiting();
            }
            Command::OpenSession { id } => {
                // A backend that fails (or panics) making the sequence fails
                // this session alone; its first turn reports it gone.
                match std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.open_session(id))) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::error!("cannot open {id}: {e}"),
                    Err(_) => tracing::error!("opening {id} panicked"),
                }
            }
            Command::CloseSession { id } => {
                if std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.close_session(id))).is_err() {
                    tracing::error!("closing {id} panicked");
                }
            }
            Command::TrimSession { id, start, keep, tail } => {
                match std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.trim_session(id, start, keep, &tail))) {
                    Ok(Ok(())) => {}
                    // Closed meanwhile, or its turn failed: nothing to cut.
                    Ok(Err(e)) => tracing::warn!("cannot trim {id}: {e}"),
                    Err(_) => tracing::error!("trimming {id} panicked"),
                }
            }
            Command::GiveWay => {
                if std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.give_way())).is_err() {
                    tracing::error!("giving way to another model panicked");
                }
            }
            #[cfg(test)]
            Command::Die => panic!("driver death injected by a test"),
        }
    }

    /// Admits requests from the front of the line while they fit: first
    /// come, first served, so a large request is never overtaken by the
    /// small ones behind it (B5). One whose client left runs nothing (B4);
    /// one that waited past its time is refused (429, A9).
    fn admit_waiting(&mut self) {
        while let Some(mut w) = self.line.pop_front() {
            if w.events.is_closed() {
                // Cancelled while queued: no admission, no prefill.
                continue;
            }
            let counters = self.counters;
            let admitted = std::panic::catch_unwind(AssertUnwindSafe(|| {
                self.engine.admit(&w.request, &mut |admitted| {
                    counters.admitted.fetch_add(1, Ordering::SeqCst);
                    w.admission.resolve(Ok(admitted.prompt_tokens));
                })
            }));
            let Waiting { lease, mut admission, events, until, request, released } = w;
            match admitted {
                Ok(Ok(turn)) => {
                    self.running.push(Running::new(turn, lease, events, false, Arc::new(released)));
                }
                Ok(Err(e)) if deferred(&e) && Instant::now() < until => {
                    // Not yet: it keeps its place at the front of the line,
                    // and idle sessions of the other models make room.
                    self.line.push_front(Waiting { request, lease, admission, events, until, released });
                    self.ask_peers_to_give_way();
                    break;
                }
                Ok(Err(e)) => {
                    // Refused (or failed before it ran): nothing holds the
                    // session any more.
                    drop(lease);
                    fail(&mut admission, &events, from_engine(&e));
                }
                Err(_) => {
                    drop(lease);
                    tracing::error!("admitting a request panicked on {}", self.engine.package().manifest.name);
                    fail(&mut admission, &events, ApiError::internal());
                }
            }
        }
        self.counters.running.store(self.running.len() as u64, Ordering::SeqCst);
        self.counters.waiting.store(self.line.len() as u64, Ordering::SeqCst);
    }

    /// One batched model step over every running turn whose client keeps
    /// up (a turn whose client has not taken its last events is parked:
    /// skipped, keeping its KV and reservation, until the client drains or
    /// `stall_timeout` cancels it), then the endings.
    fn step(&mut self) {
        let now = Instant::now();
        for r in &mut self.running {
            // A decoding turn learns that its client left at its next send
            // (every step sends); a prefilling one sends nothing until its
            // prompt is read, many chunks for a long prompt: it looks (B4).
            if r.turn.prefilling() && r.events.is_closed() {
                r.gone = true;
            }
            let drained = r.flush();
            let stalled = r.stalled_since.is_some_and(|t| now.duration_since(t) >= self.options.stall_timeout);
            if r.gone || (!drained && stalled) {
                // (Here a client still there is one that stalled.)
                if !r.gone {
                    self.counters.stalled.fetch_add(1, Ordering::SeqCst);
                }
                r.turn.cancel();
            }
        }
        let parked = self.running.iter().filter(|r| r.parked()).count() as u64;
        self.counters.parked.store(parked, Ordering::SeqCst);
        let width = self.running.iter().filter(|r| r.turn.state() == TurnState::Running && !r.parked()).count() as u64;
        self.counters.widest_step.fetch_max(width, Ordering::SeqCst);
        // Only a step that advanced a turn counts (an empty one, every turn
        // parked, is the driver idling).
        let advances = width > 0;
        if advances {
            self.counters.steps.fetch_add(1, Ordering::SeqCst);
            self.counters.stepped.fetch_add(width, Ordering::SeqCst);
        }
        {
            let takes = |r: &Running| !r.parked();
            // Positions in `running` of the turns this step takes.
            let stepped: Vec<usize> = (0..self.running.len()).filter(|&i| takes(&self.running[i])).collect();
            let mut turns: Vec<&mut Turn> = self.running.iter_mut().filter(|r| takes(r)).map(|r| &mut r.turn).collect();
            let mut deltas: Vec<(usize, String, Option<onnx_genai_engine::TokenLogprob>)> = Vec::new();
            let stepping = advances.then(Instant::now);
            self.engine.step(&mut turns, &mut |i, token| {
                deltas.push((stepped[i], token.text_delta.to_string(), token.logprob.cloned()));
                Flow::Continue
            });
            if let Some(stepping) = stepping {
                let nanos = u64::try_from(stepping.elapsed().as_nanos()).unwrap_or(u64::MAX);
                self.counters.step_nanos.fetch_add(nanos, Ordering::SeqCst);
            }
            drop(turns);
            for (i, delta, logprob) in deltas {
                let r = &mut self.running[i];
                r.backlog.push_back(Event::Delta(r.turn.choice(), delta, logprob));
                if !r.flush() && r.gone {
                    // The client left: stop at the next step boundary (B4).
                    r.turn.cancel();
                }
            }
        }
        // A request's other choices, made once its prompt ran, answer on
        // its channel.
        for choice in self.engine.take_forked() {
            let conversation = choice.conversation();
            match self.running.iter().find(|r| r.turn.choice() == 0 && r.turn.conversation() == conversation) {
                Some(first) => {
                    let running = Running::new(choice, None, first.events.clone(), first.gone, first.released.clone());
                    self.running.push(running);
                }
                // (Its first choice is always running when it forks.)
                None => drop(std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.finish(choice)))),
            }
        }
        // End what finished.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].turn.state() == TurnState::Done {
                let done = self.running.swap_remove(i);
                self.end(done);
            } else {
                i += 1;
            }
        }
        self.counters.running.store(self.running.len() as u64, Ordering::SeqCst);
        self.counters.parked.store(self.running.iter().filter(|r| r.parked()).count() as u64, Ordering::SeqCst);
    }

    fn end(&mut self, done: Running) {
        let Running { turn, lease, events, mut backlog, gone, released, .. } = done;
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.finish(turn)));
        // The engine's work is over: release the session before the client
        // hears the end, so its next turn never meets a stale lease (L2; L9
        // allows trailing, but clients should not see it).
        drop(lease);
        drop(released);
        let last = match outcome {
            Ok(Ok(result)) => Event::Finished(result),
            Ok(Err(e)) => Event::Failed(from_engine(&e)),
            Err(_) => {
                tracing::error!("a generation panicked on {}", self.engine.package().manifest.name);
                Event::Failed(ApiError::internal())
            }
        };
        if gone {
            return;
        }
        backlog.push_back(last);
        // Usually everything fits the channel now; what does not trails,
        // sent from the loop as the client reads, so the driver never
        // blocks on it.
        let mut trailing = Trailing { events, backlog, until: later(self.options.stall_timeout) };
        if trailing.flush(Instant::now()) {
            self.trailing.push(trailing);
            self.counters.trailing.store(self.trailing.len() as u64, Ordering::SeqCst);
        }
    }
}

/// Whether the budget refused for now (room may free), not for good.
fn deferred(e: &onnx_genai_engine::EngineError) -> bool {
    matches!(e, onnx_genai_engine::EngineError::Admission(onnx_genai_engine::AdmissionError::Deferred { .. }))
}

/// Tells the route why a turn failed: through the admission promise when
/// headers have not gone out, else as the stream's last event.
fn fail(admission: &mut Promise, events: &mpsc::Sender<Event>, err: ApiError) {
    if !admission.resolve(Err(err.clone())) {
        let _ = events.try_send(Event::Failed(err));
    }
}
