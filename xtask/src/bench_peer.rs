//! `cargo xtask bench --peer ort-genai|llama.cpp` (either or both): prefill
//! and decode tokens/s of ONNX Runtime GenAI (the pinned Python package,
//! driven by `tests/python/ort_genai.py`) on the same contrib package, of
//! llama.cpp (llama-cpp-python, `tests/python/llama_cpp_peer.py`) on the
//! GGUF the real packages are built from, and of our native-cpu, at the same
//! thread count, in one run, as ratios. Every runtime is loaded before the
//! timing starts and each round runs them all in turn, so a noisy
//! neighbour's burst falls on every runtime's rounds alike.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use onnx_genai_build::Variant;
use onnx_genai_engine::BackendKind;
use onnx_genai_package::Package;

use crate::bench_real::{round, warm_up, Speed, CONTEXT, PREFILL, PREFILL_REPEATS};
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

/// How a peer script runs: its thread count, decode steps, and the
/// vocabulary its prompt ids are drawn from (native-cpu's, so every runtime
/// is fed the same ids).
#[derive(Clone, Copy)]
struct Run {
    threads: usize,
    steps: usize,
    vocab: usize,
    /// How long a peer may take to load or to run a round.
    patience: Duration,
}

/// One of the peer scripts (`tests/python/<script>`) in bench mode, its
/// model (a package directory or a GGUF file) loaded, running a round
/// whenever asked (the protocol of `tests/python/rounds.py`): the bench
/// runs every runtime's rounds in turn, so each round of each runtime
/// meets the machine as the others' did.
struct PeerProcess {
    child: Child,
    /// `None` once closed (the script then ends).
    ask: Option<ChildStdin>,
    /// The script's stdout, a line at a time, from a thread of its own (so
    /// a wait for an answer can give up); closed where the script ended.
    answers: Receiver<std::io::Result<String>>,
    /// How long a load or a round may take before the peer counts as hung.
    patience: Duration,
    what: String,
}

impl PeerProcess {
    fn start(script: &str, pythonpath: &Path, model: &Path, run: Run) -> Result<Self> {
        let Run { threads, steps, vocab, patience } = run;
        let path = scripts().join(script);
        let mut command = Command::new(ort::python());
        command
            .arg(&path)
            .args(["bench", &model.display().to_string()])
            .args([threads, PREFILL, PREFILL_REPEATS, CONTEXT, steps, vocab].map(|n| n.to_string()))
            .env("PYTHONPATH", pythonpath);
        Self::spawn(command, format!("{script} on {}", model.display()), patience)
    }

    /// Starts `command` (a script speaking the round protocol) and waits
    /// until it says it is ready, `patience` at most.
    fn spawn(mut command: Command, what: String, patience: Duration) -> Result<Self> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {what}"))?;
        let (Some(ask), Some(out)) = (child.stdin.take(), child.stdout.take()) else {
            bail!("{what}: no pipes to its stdin and stdout");
        };
        let (lines, answers) = mpsc::channel();
        let reader = std::thread::Builder::new().name("peer-answers".into()).spawn(move || {
            // The end of its output closes the channel; an error is passed
            // on and ends it.
            for line in BufReader::new(out).lines() {
                let failed = line.is_err();
                if lines.send(line).is_err() || failed {
                    return;
                }
            }
        });
        reader.with_context(|| format!("{what}: cannot start a thread to read its answers"))?;
        let mut peer = Self { child, ask: Some(ask), answers, patience, what };
        let ready = peer.answer()?;
        if ready["ready"] != serde_json::Value::Bool(true) {
            bail!("{} did not say it was ready: {ready}", peer.what);
        }
        Ok(peer)
    }

    /// Runs one round: (prefill, decode) tokens/s.
    fn round(&mut self) -> Result<(f64, f64)> {
        let ask = self.ask.as_mut().context("the peer's stdin is closed")?;
        // A peer that died since its last answer refuses the question (a
        // broken pipe); reading its answer then says how it ended.
        let _ = writeln!(ask, "round").and_then(|()| ask.flush());
        let answer = self.answer()?;
        match (answer["prefill"].as_f64(), answer["decode"].as_f64()) {
            (Some(p), Some(d)) => Ok((p, d)),
            _ => bail!("{} answered a round with {answer}", self.what),
        }
    }

    /// The script's next JSON line; where it ended instead, how (its
    /// stderr went to ours: a crash, often by a signal, prints little);
    /// where it says nothing for `patience`, an error, the script killed
    /// (a runtime wedged inside a round would otherwise hang the bench).
    fn answer(&mut self) -> Result<serde_json::Value> {
        let line = match self.answers.recv_timeout(self.patience) {
            Ok(line) => line.with_context(|| format!("reading {}'s answer", self.what))?,
            Err(RecvTimeoutError::Disconnected) => {
                // Its output ended: it is ending, or (a closed stdout) it
                // lives on and is given its patience to end.
                self.ask = None;
                let status = self.ended_within(self.patience)?;
                bail!("{} ended ({status}) without an answer", self.what);
            }
            Err(RecvTimeoutError::Timeout) => {
                self.ask = None;
                let _ = self.ended_within(Duration::ZERO);
                bail!(
                    "{} gave no answer within {} s and was stopped (a hung runtime; a slower machine may need a larger \
                     --peer-timeout)",
                    self.what,
                    self.patience.as_secs_f64()
                );
            }
        };
        serde_json::from_str(&line).with_context(|| format!("{} printed {line:?}", self.what))
    }

    /// How the script ended, waited for `patience` at most; killed then.
    fn ended_within(&mut self, patience: Duration) -> Result<std::process::ExitStatus> {
        let started = std::time::Instant::now();
        while started.elapsed() < patience {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        Ok(self.child.wait()?)
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        // Closing its stdin ends the script's loop; one that does not end
        // (a wedged round) is killed.
        self.ask = None;
        let _ = self.ended_within(Duration::from_secs(5));
    }
}

/// Where the peer scripts and their round protocol (`rounds.py`) live.
fn scripts() -> PathBuf {
    util::root().join("crates/onnx-genai-conformance/tests/python")
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

pub fn run(named: &[Peer], threads: usize, rounds: usize, steps: usize, patience: Duration) -> Result<()> {
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
        "# native-cpu against {}\n\n{threads} thread(s) each, one run; prefill of {PREFILL} tokens (a round's: the median of \
         {PREFILL_REPEATS}), decode of {steps} steps after a {CONTEXT}-token context, {rounds} rounds, each running every runtime once in turn (min / median \
         tokens/s); ratio = native median / peer median. ONNX Runtime GenAI runs the same package; llama.cpp runs the GGUF the real packages are built from \
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
    let tiny = peers.contains(&Peer::OrtGenai);
    let raced_all = packages(tiny)?;
    if raced_all.is_empty() {
        bail!("no package to race: the peers {titles:?} have nothing to run here");
    }
    for raced in raced_all {
        let package = Package::open(&raced.dir)?;
        let mut b = BackendKind::NativeCpu.decoder(&package, threads)?;
        let run = Run { threads, steps, vocab: b.vocab_size(), patience };
        // Every runtime loaded at once (llama.cpp again for each package
        // of its GGUF: measured beside each, not once for all).
        let mut racing = Vec::new();
        for (peer, site) in peers.iter().zip(&sites) {
            racing.push(match (peer, &raced.gguf) {
                (Peer::OrtGenai, _) => Some(PeerProcess::start("ort_genai.py", site, &raced.dir, run)?),
                (Peer::LlamaCpp, Some(gguf)) => Some(PeerProcess::start("llama_cpp_peer.py", site, gguf, run)?),
                (Peer::LlamaCpp, None) => None,
            });
        }
        warm_up(&mut b, steps)?;
        // Rates per runtime, native-cpu's last.
        let mut rates: Vec<(Vec<f64>, Vec<f64>)> = vec![Default::default(); racing.len() + 1];
        for r in 0..rounds {
            // Each round runs every runtime once, back to back, starting
            // one further along each time, so no runtime always follows
            // the same one.
            for i in 0..rates.len() {
                let who = (i + r) % rates.len();
                let (prefill, decode) = match racing.get_mut(who) {
                    Some(Some(peer)) => peer.round()?,
                    Some(None) => continue,
                    None => round(&mut b, steps)?,
                };
                rates[who].0.push(prefill);
                rates[who].1.push(decode);
            }
        }
        drop(racing);
        let (prefill, decode) = rates.pop().context("native-cpu's rates")?;
        let ours = Speed::of(prefill, decode);
        let theirs: Vec<Option<Speed>> =
            rates.into_iter().map(|(p, d)| (!d.is_empty()).then(|| Speed::of(p, d))).collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A script of the round protocol (`rounds.py`'s `serve`, as the peers
    /// use it) whose timed rounds evaluate `body` and report what it gives
    /// (its untimed warm-up round gives two rates).
    fn peer(body: &str) -> Result<PeerProcess> {
        peer_within(body, Duration::from_secs(60))
    }

    /// [`peer`], given up on after `patience`.
    fn peer_within(body: &str, patience: Duration) -> Result<PeerProcess> {
        let code = format!(
            "import rounds\ncalls = 0\ndef one_round():\n    global calls\n    calls += 1\n    \
             return ({body}) if calls > 1 else (1.0, 1.0)\nrounds.serve(one_round, {{}})\n"
        );
        let mut command = Command::new(ort::python());
        command.args(["-c", &code]).env("PYTHONPATH", scripts());
        PeerProcess::spawn(command, "a test peer".into(), patience)
    }

    /// The bench and the peer scripts agree on the round protocol: the
    /// peer is ready once loaded, answers each round asked for with its
    /// two rates, and ends, successfully, when its stdin closes (watched
    /// red with `serve` waiting on after the last line).
    #[test]
    fn a_peer_answers_each_round_it_is_asked_for() {
        let mut p = peer("(12.5, 3.25)").expect("the test peer starts");
        assert_eq!(p.round().expect("round 1"), (12.5, 3.25));
        assert_eq!(p.round().expect("round 2"), (12.5, 3.25));
        p.ask = None;
        // Killed (not a success) where it does not end within 5 s.
        let status = p.ended_within(Duration::from_secs(5)).expect("the peer's status");
        assert!(status.success(), "the peer ended with {status} on its stdin's close, within 5 s");
    }

    /// A peer that dies in a round (a crash of the runtime under test) is
    /// an error naming it and how it ended, not a hang, and so is the next
    /// round asked of it (its stdin is a broken pipe by then); one that
    /// answers something other than two rates is an error showing the
    /// answer. Watched red with `answer` reading past the end (it
    /// returned an empty line as JSON) and with `round` taking any JSON.
    #[test]
    fn a_peer_that_dies_or_answers_nonsense_is_an_error() {
        let mut dead = peer("exit(3)").expect("the test peer starts");
        let e = format!("{:#}", dead.round().expect_err("the peer died"));
        assert!(e.contains("a test peer ended") && e.contains('3'), "{e}");
        assert!(dead.round().is_err(), "a dead peer's next round");
        let mut odd = peer("('fast', 1.0)").expect("the test peer starts");
        let e = format!("{:#}", odd.round().expect_err("not two rates"));
        assert!(e.contains("answered a round with") && e.contains("fast"), "{e}");
    }

    /// A peer alive but silent inside a round (a runtime wedged in a
    /// loop) is an error within its patience (5 s: its start, Python and a
    /// warm-up round, must fit in it too), naming it, and the script is
    /// stopped, not left running; its next round is an error too. Watched
    /// red with `answer` waiting on the pipe as before (the test hung).
    #[test]
    fn a_peer_that_stops_answering_is_stopped_after_its_patience() {
        let started = std::time::Instant::now();
        let mut hung =
            peer_within("__import__('time').sleep(3600)", Duration::from_secs(5)).expect("the test peer starts");
        let e = format!("{:#}", hung.round().expect_err("the peer hangs"));
        assert!(e.contains("a test peer gave no answer within 5 s"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(30), "gave up after {:?}", started.elapsed());
        let status = hung.child.try_wait().expect("the peer's status");
        assert!(status.is_some(), "the hung peer was stopped");
        assert!(hung.round().is_err(), "a stopped peer's next round");
    }
}
