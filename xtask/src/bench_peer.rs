//! `cargo xtask bench --peer ort-genai|llama.cpp` (either or both): prefill
//! and decode tokens/s of ONNX Runtime GenAI (the pinned Python package,
//! driven by `tests/python/ort_genai.py`) on the same contrib package, of
//! llama.cpp (llama-cpp-python, `tests/python/llama_cpp_peer.py`) on the
//! GGUF the real packages are built from, and of our native-cpu, at the same
//! thread count, in one run, as ratios.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use onnx_genai_build::Variant;
use onnx_genai_engine::BackendKind;
use onnx_genai_package::Package;

use crate::bench_real::{measure, min_median, Speed, CONTEXT, PREFILL};
use crate::{ort, pyclient, real, util};

/// A runtime raced against native-cpu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// ONNX Runtime GenAI on the same package directory.
    OrtGenai,
    /// llama.cpp (llama-cpp-python) on the GGUF the real packages are
    /// built from; the tiny packages have no GGUF, so no llama.cpp column.
    LlamaCpp,
}

impl Peer {
    const ALL: [Peer; 2] = [Peer::OrtGenai, Peer::LlamaCpp];

    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .with_context(|| format!("unknown peer `{name}` (known: {})", Self::ALL.map(Peer::name).join(", ")))
    }

    fn name(self) -> &'static str {
        match self {
            Peer::OrtGenai => "ort-genai",
            Peer::LlamaCpp => "llama.cpp",
        }
    }

    fn title(self) -> String {
        match self {
            Peer::OrtGenai => format!("ORT GenAI {}", pyclient::ORT_GENAI_VERSION),
            Peer::LlamaCpp => format!("llama.cpp (llama-cpp-python {})", pyclient::LLAMA_CPP_PYTHON_VERSION),
        }
    }

    fn short(self) -> &'static str {
        match self {
            Peer::OrtGenai => "ORT GenAI",
            Peer::LlamaCpp => "llama.cpp",
        }
    }
}

/// How a peer script runs: its thread count, rounds, decode steps, and the
/// vocabulary its prompt ids are drawn from (native-cpu's, so every runtime
/// is fed the same ids).
#[derive(Clone, Copy)]
struct Run {
    threads: usize,
    rounds: usize,
    steps: usize,
    vocab: usize,
}

/// Runs one of the peer scripts (`tests/python/<script>`) in bench mode on
/// `model` (a package directory or a GGUF file): prefill and decode
/// tokens/s per round.
fn python_bench(script: &str, pythonpath: &Path, model: &Path, run: Run) -> Result<Speed> {
    let Run { threads, rounds, steps, vocab } = run;
    let script = util::root().join("crates/onnx-genai-conformance/tests/python").join(script);
    let out = Command::new(ort::python())
        .arg(&script)
        .args(["bench", &model.display().to_string()])
        .args([threads, PREFILL, CONTEXT, steps, rounds, vocab].map(|n| n.to_string()))
        .env("PYTHONPATH", pythonpath)
        .output()
        .context("cannot run python3")?;
    if !out.status.success() {
        // A crash (a signal) often leaves stderr empty: the status says it.
        bail!(
            "{} failed on {} ({}): {}",
            script.display(),
            model.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let series =
        |k: &str| -> Vec<f64> { json[k].as_array().into_iter().flatten().filter_map(|v| v.as_f64()).collect() };
    let (prefill, decode) = (series("prefill"), series("decode"));
    if prefill.is_empty() || decode.is_empty() {
        bail!("{} printed no rates for {}", script.display(), model.display());
    }
    Ok(Speed { prefill: min_median(prefill), decode: min_median(decode) })
}

/// The packages raced, built fresh under `target/bench/peer/`: the tiny
/// llama's contrib export and its genai export (ONNX Runtime GenAI's own
/// form, `accuracy_level` 4), and every real model's contrib and genai
/// exports.
fn packages(tiny: bool) -> Result<Vec<Raced>> {
    let out = util::target().join("bench/peer");
    let mut list = Vec::new();
    if tiny {
        let spec = onnx_genai_build::read_spec(&util::root().join("packages/tiny-llama-gqa/spec.yaml"))?;
        for variant in [Variant::Contrib, Variant::Genai] {
            let dir = out.join(format!("tiny-llama-gqa-{}", variant.name()));
            onnx_genai_build::build_variant(&spec, variant, &dir)?;
            list.push(Raced { name: format!("tiny-llama-gqa ({})", variant.name()), dir, gguf: None });
        }
    }
    for model in real::models()? {
        real::fetch(&model)?;
        let base = model.load_spec(&util::target())?;
        for export in model.exports.iter().chain(&model.bench_exports).filter(|e| e.variant.contrib_ops()) {
            let dir = out.join(model.package(export));
            model.build(&base, export, &dir)?;
            list.push(Raced { name: model.package(export), dir, gguf: Some(model.gguf_path(&util::target())) });
        }
    }
    Ok(list)
}

/// A package raced, and the GGUF it was built from (real models only).
struct Raced {
    name: String,
    dir: PathBuf,
    gguf: Option<PathBuf>,
}

pub fn run(named: &[Peer], threads: usize, rounds: usize, steps: usize) -> Result<()> {
    let mut peers: Vec<Peer> = Vec::new();
    for p in named {
        if !peers.contains(p) {
            peers.push(*p);
        }
    }
    let lib = ort::provision()?;
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    // Where each peer's Python package was installed (its PYTHONPATH).
    let mut sites = Vec::with_capacity(peers.len());
    for peer in &peers {
        sites.push(match peer {
            Peer::OrtGenai => pyclient::provision_ort_genai()?,
            Peer::LlamaCpp => pyclient::provision_llama_cpp()?,
        });
    }
    let titles: Vec<String> = peers.iter().map(|p| p.title()).collect();
    let mut md = format!(
        "# native-cpu against {}\n\n{threads} thread(s) each, one run; prefill of {PREFILL} tokens, decode of {steps} \
         steps after a {CONTEXT}-token context, {rounds} rounds (min / median tokens/s); ratio = native median / peer \
         median. ONNX Runtime GenAI runs the same package; llama.cpp runs the GGUF the real packages are built from \
         (— where a package has none).\n\n",
        titles.join(" and ")
    );
    let mut header = String::from("| package | native decode |");
    let mut rule = String::from("|---|---:|");
    for p in &peers {
        let _ = write!(header, " {} decode | ratio |", p.short());
        rule.push_str("---:|---:|");
    }
    header.push_str(" native prefill |");
    rule.push_str("---:|");
    for p in &peers {
        let _ = write!(header, " {} prefill | ratio |", p.short());
        rule.push_str("---:|---:|");
    }
    let _ = writeln!(md, "{header}\n{rule}");
    // llama.cpp reads the GGUF, not the export: one measurement per file.
    let mut by_gguf: Vec<(PathBuf, Speed)> = Vec::new();
    let tiny = peers.contains(&Peer::OrtGenai);
    let raced_all = packages(tiny)?;
    if raced_all.is_empty() {
        bail!("no package to race: the peers {titles:?} have nothing to run here");
    }
    for raced in raced_all {
        let package = Package::open(&raced.dir)?;
        let mut b = BackendKind::NativeCpu.decoder(&package, threads)?;
        let run = Run { threads, rounds, steps, vocab: b.vocab_size() };
        let mut theirs = Vec::new();
        for (peer, site) in peers.iter().zip(&sites) {
            let speed = match (peer, &raced.gguf) {
                (Peer::OrtGenai, _) => Some(python_bench("ort_genai.py", site, &raced.dir, run)?),
                (Peer::LlamaCpp, Some(gguf)) => match by_gguf.iter().find(|(g, _)| g == gguf) {
                    Some((_, s)) => Some(*s),
                    None => {
                        let s = python_bench("llama_cpp_peer.py", site, gguf, run)?;
                        by_gguf.push((gguf.clone(), s));
                        Some(s)
                    }
                },
                (Peer::LlamaCpp, None) => None,
            };
            theirs.push(speed);
        }
        let ours = measure(&mut b, rounds, steps)?;
        let mut line =
            format!("{:<34} native decode {:>8.1} prefill {:>8.0} tok/s", raced.name, ours.decode.1, ours.prefill.1);
        let mut row = format!("| {} | {:.1} / {:.1} |", raced.name, ours.decode.0, ours.decode.1);
        for (peer, speed) in peers.iter().zip(&theirs) {
            match speed {
                Some(s) => {
                    let _ = write!(
                        line,
                        "; {} {:.1} / {:.0} ({:.2}x / {:.2}x)",
                        peer.name(),
                        s.decode.1,
                        s.prefill.1,
                        ours.decode.1 / s.decode.1,
                        ours.prefill.1 / s.prefill.1
                    );
                    let _ =
                        write!(row, " {:.1} / {:.1} | {:.2}x |", s.decode.0, s.decode.1, ours.decode.1 / s.decode.1);
                }
                None => row.push_str(" — | — |"),
            }
        }
        let _ = write!(row, " {:.0} / {:.0} |", ours.prefill.0, ours.prefill.1);
        for speed in &theirs {
            match speed {
                Some(s) => {
                    let _ = write!(
                        row,
                        " {:.0} / {:.0} | {:.2}x |",
                        s.prefill.0,
                        s.prefill.1,
                        ours.prefill.1 / s.prefill.1
                    );
                }
                None => row.push_str(" — | — |"),
            }
        }
        println!("{line}");
        let _ = writeln!(md, "{row}");
    }
    let path = util::target().join("bench/peer.md");
    std::fs::write(&path, &md)?;
    println!("\n{md}\nreport: {}", path.display());
    Ok(())
}
