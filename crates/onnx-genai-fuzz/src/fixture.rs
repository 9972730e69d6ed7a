//! What the targets share, made once per process: a scratch directory, a
//! tiny package built from a spec, and a server over it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use onnx_genai_engine::{BackendKind, Engine};
use onnx_genai_package::Package;
use onnx_genai_server::{RunningServer, ServerOptions};

/// Small enough that a decode step costs microseconds and a seed of its
/// ONNX file stays a few tens of kilobytes.
pub(crate) const SPEC: &str = "\
name: fuzz-tiny
seed: 7
family: llama
dtype: f32
hidden_size: 32
num_layers: 1
num_attention_heads: 2
num_kv_heads: 1
intermediate_size: 32
vocab_size: 320
max_sequence_length: 64
rope_theta: 10000.0
norm_epsilon: 1.0e-5
tie_embeddings: true
";

/// This process's scratch directory (`<tmp>/onnx-genai-fuzz/<pid>`),
/// created empty; those of processes that no longer run are removed, since
/// a fuzzer exits without running destructors.
pub(crate) fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = std::env::temp_dir().join("onnx-genai-fuzz");
        // Without /proc no process can be told dead: leave them all.
        let entries = if Path::new("/proc/self").exists() { std::fs::read_dir(&base).ok() } else { None };
        if let Some(entries) = entries {
            for e in entries.flatten() {
                let pid = e.file_name().to_string_lossy().to_string();
                if !Path::new("/proc").join(&pid).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = base.join(std::process::id().to_string());
        let _ = std::fs::remove_dir_all(&dir);
        must(std::fs::create_dir_all(&dir), "create the scratch directory");
        dir
    })
}

/// The tiny package's directory.
pub(crate) fn package_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch().join("fixture");
        let spec = must(onnx_genai_build::spec::Spec::parse(SPEC, "fuzz fixture"), "parse the fixture spec");
        must(onnx_genai_build::build_package(&spec, &dir), "build the fixture package");
        dir
    })
}

pub(crate) fn package() -> &'static Package {
    static PACKAGE: OnceLock<Package> = OnceLock::new();
    PACKAGE.get_or_init(|| must(Package::open(package_dir()), "open the fixture package"))
}

/// A server over the tiny package on loopback (native CPU, one thread).
pub(crate) fn server() -> &'static RunningServer {
    static SERVER: OnceLock<RunningServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let engine = must(Engine::open(package_dir(), BackendKind::NativeCpu, 1), "open the fixture engine");
        let options = ServerOptions { max_sessions: 8, ..ServerOptions::default() };
        must(onnx_genai_server::start_with(vec![engine], "127.0.0.1:0", options), "start the fixture server")
    })
}

/// The fixture is the harness, not the input: failing to make it is a
/// broken set-up, reported as such.
fn must<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("fuzz fixture: cannot {what}: {e}"),
    }
}
