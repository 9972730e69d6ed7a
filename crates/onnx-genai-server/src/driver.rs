//! One driver thread per model owns its engine; routes talk to it through
//! channels. A turn's admission promise (A9) is resolved exactly once: `Ok`
//! when the engine admits the request, the typed failure when it refuses —
//! and if the command is dropped unprocessed (the driver stopped), the
//! promise's own `Drop` resolves it, so a route never waits forever.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};

use onnx_genai_engine::{Engine, Flow, GenerateRequest, GenerateResult, SessionId};
use tokio::sync::{mpsc, oneshot};

use crate::error::{from_engine, ApiError};
use crate::sessions::Lease;

/// Resolves a route's wait for admission.
pub struct Promise(Option<oneshot::Sender<Result<(), ApiError>>>);

impl Promise {
    pub fn new() -> (Self, oneshot::Receiver<Result<(), ApiError>>) {
        let (tx, rx) = oneshot::channel();
        (Self(Some(tx)), rx)
    }

    fn resolve(&mut self, outcome: Result<(), ApiError>) -> bool {
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

/// What a turn streams back.
pub enum Event {
    Delta(String),
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
    },
    /// Opens an engine session under an id the route minted (the route does
    /// not wait: a busy driver must not stall session creation).
    OpenSession {
        id: SessionId,
    },
    CloseSession {
        id: SessionId,
    },
}

/// Counters the tests and the load check read.
#[derive(Debug, Default)]
pub struct Counters {
    pub admitted: AtomicU64,
    pub turns: AtomicU64,
}

#[derive(Clone)]
pub struct Driver {
    pub model: String,
    tx: std_mpsc::Sender<Command>,
    pub counters: Arc<Counters>,
    pub scheduler: onnx_genai_engine::Scheduler,
    next_session: Arc<AtomicU64>,
}

impl Driver {
    /// Starts the driver thread for `engine`.
    pub fn spawn(model: String, engine: Engine) -> Self {
        let (tx, rx) = std_mpsc::channel::<Command>();
        let counters = Arc::new(Counters::default());
        let scheduler = engine.scheduler().clone();
        let c = counters.clone();
        let name = format!("driver-{model}");
        let spawned = std::thread::Builder::new().name(name).spawn(move || run(engine, rx, &c));
        if let Err(e) = spawned {
            // Commands sent to a driver that never started are dropped,
            // which resolves their promises with an error.
            tracing::error!("cannot start the driver thread for {model}: {e}");
        }
        Self { model, tx, counters, scheduler, next_session: Arc::new(AtomicU64::new(1)) }
    }

    /// A fresh engine session id on this model's worker.
    pub fn mint_session(&self) -> SessionId {
        SessionId(self.next_session.fetch_add(1, Ordering::SeqCst))
    }

    pub fn send(&self, command: Command) -> Result<(), ApiError> {
        // A send error drops the command, resolving its promise.
        self.tx.send(command).map_err(|_| ApiError::internal())
    }
}

fn run(mut engine: Engine, rx: std_mpsc::Receiver<Command>, counters: &Counters) {
    while let Ok(command) = rx.recv() {
        match command {
            Command::Generate { request, lease, mut admission, events } => {
                counters.turns.fetch_add(1, Ordering::SeqCst);
                let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    engine.generate_with(
                        &request,
                        &mut |_| {
                            counters.admitted.fetch_add(1, Ordering::SeqCst);
                            admission.resolve(Ok(()));
                        },
                        &mut |token| {
                            // Backpressure: a client that stops reading holds
                            // the turn here; one that disconnects stops it.
                            match events.blocking_send(Event::Delta(token.text_delta.to_string())) {
                                Ok(()) => Flow::Continue,
                                Err(_) => Flow::Stop,
                            }
                        },
                    )
                }));
                // The engine's work is over: release the session before the
                // client hears the end, so its next turn never meets a stale
                // lease (L2; L9 allows trailing, but clients should not see it).
                drop(lease);
                let failure = match outcome {
                    Ok(Ok(result)) => {
                        let _ = events.blocking_send(Event::Finished(result));
                        None
                    }
                    Ok(Err(e)) => Some(from_engine(&e)),
                    Err(_) => {
                        tracing::error!("a generation panicked on {}", engine.package().manifest.name);
                        Some(ApiError::internal())
                    }
                };
                if let Some(err) = failure {
                    if !admission.resolve(Err(err.clone())) {
                        let _ = events.blocking_send(Event::Failed(err));
                    }
                }
            }
            Command::OpenSession { id } => {
                if let Err(e) = engine.open_session(id) {
                    // Its first turn reports the session as gone.
                    tracing::error!("cannot open {id}: {e}");
                }
            }
            Command::CloseSession { id } => {
                let _ = engine.close_session(id);
            }
        }
    }
}
