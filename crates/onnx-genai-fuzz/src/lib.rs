//! Fuzz targets: each takes arbitrary bytes, feeds them to one of the
//! project's parsers, and panics only on a finding — a panic inside the
//! code under test, a broken invariant (a lease left behind, a 500), or an
//! answer that contradicts another (a package that validates but does not
//! open). Errors are the expected answer to bad input; a memory or time
//! limit overrun is caught by the fuzzer that runs the target.
//!
//! The libFuzzer binaries in `fuzz/` (`cargo xtask fuzz`) and the replay
//! test (`tests/replay.rs`, every committed corpus file and regression)
//! call the same [`run`]; seeds are written by [`seeds::write`].

mod chat;
mod fixture;
mod gguf;
mod http;
mod onnx;
mod package_dir;
pub mod seeds;

/// One fuzzed entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A package directory (manifest or `genai_config.json`, ONNX,
    /// tokenizer) validated and opened.
    Package,
    /// ONNX bytes decoded, then compiled by the native compiler (as a
    /// standalone graph and as the fixture's decoder).
    Onnx,
    /// A GGUF file parsed, its spec and tokenizer extracted.
    Gguf,
    /// A chat template rendered over messages and tokenized.
    Chat,
    /// A request body sent through the server's router on loopback.
    Http,
}

impl Target {
    pub const ALL: [Target; 5] = [Target::Package, Target::Onnx, Target::Gguf, Target::Chat, Target::Http];

    pub fn name(self) -> &'static str {
        match self {
            Target::Package => "package",
            Target::Onnx => "onnx",
            Target::Gguf => "gguf",
            Target::Chat => "chat",
            Target::Http => "http",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// What the libFuzzer binaries call: [`run`], where only a panic that
/// escapes it is a finding (printed, then the process aborts so libFuzzer
/// saves the input). libFuzzer's own panic hook aborts on *any* panic,
/// also one the code under test catches by design (a panicking backend
/// sequence fails its turn alone; the tokenizers library's panics on
/// malformed files become diagnostics), so it is replaced by one that only
/// remembers where the input's first panic happened.
pub fn fuzz(target: Target, data: &[u8]) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            // The first panic of an input is the cause; later ones (the
            // target noticing a dead handler) are symptoms.
            if let Ok(mut first) = FIRST_PANIC.lock() {
                if first.is_empty() {
                    *first = info.to_string();
                }
            }
        }))
    });
    if let Ok(mut first) = FIRST_PANIC.lock() {
        first.clear();
    }
    if std::panic::catch_unwind(|| run(target, data)).is_err() {
        let first = FIRST_PANIC.lock().map(|l| l.clone()).unwrap_or_default();
        eprintln!("fuzz target `{}` panicked: {first}", target.name());
        std::process::abort();
    }
}

static FIRST_PANIC: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// Feeds `data` to `target`; panics on a finding.
pub fn run(target: Target, data: &[u8]) {
    let _refused_or_done = deep(target, data);
}

/// [`run`], telling how far the input got: `Ok` when it passed every step
/// of the target (a package that opened, a graph that compiled, a request
/// answered 200), else the first error, which is the right answer to bad
/// input. Panics on a finding.
pub fn deep(target: Target, data: &[u8]) -> Result<(), String> {
    match target {
        Target::Package => package_dir::run(data),
        Target::Onnx => onnx::run(data),
        Target::Gguf => gguf::run(data),
        Target::Chat => chat::run(data),
        Target::Http => http::run(data),
    }
}
