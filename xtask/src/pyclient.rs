//! Pinned Python packages installed with pip into folders under `target/`:
//! the official `openai` client and `jsonschema` (`target/python`, for the
//! server's real-client test), schemathesis (`target/schemathesis`, the
//! API fuzzer of the `api-fuzz` lane), ONNX Runtime GenAI (`target/genai`, the peer
//! runtime of the interop lane and `cargo xtask bench --peer ort-genai`) and
//! llama-cpp-python (`target/llama-cpp`, `cargo xtask bench --peer llama.cpp`).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

pub const OPENAI_VERSION: &str = "3.57.0";
/// Validates structured outputs in the client test independently of the
/// server's grammar.
pub const JSONSCHEMA_VERSION: &str = "4.26.0";
pub const ORT_GENAI_VERSION: &str = "0.18.0";
/// The property-based API fuzzer of the `api-fuzz` lane.
pub const SCHEMATHESIS_VERSION: &str = "4.32.5";
/// llama.cpp's Python binding; the package index has it as source only, so
/// pip compiles llama.cpp (CMake and Ninja come from the index as build
/// requirements) once, for this machine's CPU.
pub const LLAMA_CPP_PYTHON_VERSION: &str = "0.3.36";

/// Ensures `target/python` holds `openai==OPENAI_VERSION` and
/// `jsonschema==JSONSCHEMA_VERSION`; idempotent.
pub fn provision() -> Result<PathBuf> {
    install("python", &[&format!("openai=={OPENAI_VERSION}"), &format!("jsonschema=={JSONSCHEMA_VERSION}")], &[], None)
}

/// Ensures `target/schemathesis` holds `schemathesis==SCHEMATHESIS_VERSION`;
/// idempotent.
pub fn provision_schemathesis() -> Result<PathBuf> {
    install("schemathesis", &[&format!("schemathesis=={SCHEMATHESIS_VERSION}")], &[], None)
}

/// Ensures `target/genai` holds `onnxruntime-genai==ORT_GENAI_VERSION` with
/// the `onnxruntime` wheel the rest of the project uses; idempotent.
pub fn provision_ort_genai() -> Result<PathBuf> {
    install(
        "genai",
        &[&format!("onnxruntime-genai=={ORT_GENAI_VERSION}"), &format!("onnxruntime=={}", crate::ort::VERSION)],
        &[],
        None,
    )
}

/// Ensures `target/llama-cpp` holds `llama-cpp-python==LLAMA_CPP_PYTHON_VERSION`,
/// built for this machine's CPU (llama.cpp's own default, `GGML_NATIVE`),
/// without its multimodal library, examples, tools or server; idempotent.
/// The first call compiles llama.cpp: minutes on two cores.
///
/// AMX is left out: these VMs report `amx_tile`/`amx_int8`, so a native
/// build takes ggml's AMX matmul for every multi-token batch of the Q4_1
/// weights, and that crashed (SIGSEGV in `llama_decode`, 2026-12-02) while
/// single-token decode ran; AVX-512 VNNI stays, as native-cpu uses it.
pub fn provision_llama_cpp() -> Result<PathBuf> {
    let no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16";
    let cmake_args = format!(
        "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
         -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF '-DCMAKE_C_FLAGS={no_amx}' \
         '-DCMAKE_CXX_FLAGS={no_amx}'"
    );
    install(
        "llama-cpp",
        &[&format!("llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}")],
        &[("CMAKE_ARGS", &cmake_args)],
        Some(&this_cpu()),
    )
}

/// This CPU as a native build depends on it ([`cpu_of`] `/proc/cpuinfo`;
/// empty where that file is missing).
fn this_cpu() -> String {
    cpu_of(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default())
}

/// The model name and instruction-set flags of a `/proc/cpuinfo` text:
/// only the flags a compiler's `-march=native` turns into instructions
/// (`avx*`, `amx*`, `fma`, `f16c`, `bmi*`, `sse*`, `ssse3`), so guests of
/// one CPU that differ in hypervisor or mitigation flags share a build.
fn cpu_of(info: &str) -> String {
    let field = |name: &str| crate::util::cpuinfo_field(info, name);
    let isa = ["avx", "amx", "fma", "f16c", "bmi", "sse", "ssse3"];
    let flags: Vec<&str> = field("flags").split_whitespace().filter(|f| isa.iter().any(|p| f.starts_with(p))).collect();
    format!("{} [{}]", field("model name"), flags.join(" "))
}

/// What a folder's marker records: the build settings, and for a build
/// made for this CPU (`GGML_NATIVE`) the CPU, so that a `target/` carried
/// to another machine builds again instead of running instructions that
/// machine may lack.
fn recorded(settings: &[(&str, &str)], built_for: Option<&str>) -> String {
    let mut out: String = settings.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    if let Some(cpu) = built_for {
        out.push_str(&format!("built for: {cpu}\n"));
    }
    out
}

/// `pip install --target target/<dir_name>`, with `settings` in the
/// environment for the build of a source-only requirement; returns the
/// folder (the `PYTHONPATH` that imports it).
fn install(
    dir_name: &str,
    requirements: &[&str],
    settings: &[(&str, &str)],
    built_for: Option<&str>,
) -> Result<PathBuf> {
    let dir = util::target().join(dir_name);
    // The marker holds the build settings it was made with ([`recorded`]):
    // a folder built with others (an AMX build of llama.cpp, or one for
    // another CPU) is built again. A plain
    // install's settings are empty, as its marker is.
    let marker = dir.join(format!(".installed-{}", requirements.join("-")));
    let recorded = recorded(settings, built_for);
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == recorded) {
        return Ok(dir);
    }
    println!("==> pip install {} into {}", requirements.join(" "), dir.display());
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).to_string();
    let status = Command::new(crate::ort::python())
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-warn-conflicts",
            "--root-user-action=ignore",
            "--upgrade",
            "--target",
        ])
        .arg(&dir)
        // pip's cache of wheels it built from source ignores the build
        // settings (and the CPU a native build was made for).
        .args(if settings.is_empty() { &[][..] } else { &["--no-cache-dir"][..] })
        .args(requirements)
        .envs(settings.iter().copied())
        // How many compilers a source build runs at once: not a setting of
        // what is built, so not recorded.
        .env("CMAKE_BUILD_PARALLEL_LEVEL", jobs)
        .status()
        .context("cannot run python3 -m pip (is Python with pip installed?)")?;
    if !status.success() {
        bail!("pip could not install {}; check access to the Python package index", requirements.join(" "));
    }
    std::fs::write(&marker, recorded)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain install's marker is empty (markers written before the CPU
    /// was recorded stay valid), and a native build's marker differs
    /// between two CPUs: a `target/` carried to another machine rebuilds
    /// llama.cpp rather than running instructions built for this one.
    #[test]
    fn native_builds_record_their_cpu() {
        assert_eq!(recorded(&[], None), "");
        let settings = [("CMAKE_ARGS", "-DGGML_NATIVE=ON")];
        let here = recorded(&settings, Some("Xeon [avx512f avx512_vnni]"));
        let there = recorded(&settings, Some("EPYC [avx2]"));
        assert_ne!(here, there);
        assert!(here.starts_with("CMAKE_ARGS=-DGGML_NATIVE=ON\n"), "{here}");
        let info =
            "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu sse2 avx2 hypervisor avx512_vnni md_clear fma\n";
        assert_eq!(cpu_of(info), "Some Xeon [sse2 avx2 avx512_vnni fma]", "ISA flags only");
        assert_eq!(cpu_of(""), " []");
    }
}
