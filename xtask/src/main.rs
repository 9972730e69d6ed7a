//! `cargo xtask <command>`: the project's automation. See README.md.

mod bench;
mod conformance;
mod load;
mod mutants;
mod ort;
mod packages;
mod pyclient;
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
    },
    /// Everything CI checks: ONNX Runtime, fmt, clippy, every test, the mutation batteries.
    Test,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Ort => ort::provision().map(|path| println!("ONNX Runtime ready: {}", path.display())),
        Command::Packages { bless } => packages::build_all(bless).map(|_| ()),
        Command::Conformance { package, backend, suite, shard, threads } => {
            conformance::run(conformance::Options { package, backend, suite, shard, threads })
        }
        Command::Bench { threads, rounds, steps, package } => {
            bench::run(bench::Options { threads, rounds: rounds.max(1), steps: steps.max(1), package })
        }
        Command::Load { clients, turns, max_tokens, backend } => {
            load::run(load::Options { clients, turns, max_tokens: max_tokens.max(1), backend })
        }
        Command::Mutants { battery, mutant, shard } => mutants::run(mutants::Options { battery, mutant, shard }),
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
    util::cargo(&["fmt", "--all", "--check"], &lib)?;
    util::cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"], &lib)?;
    util::cargo(&["test", "--workspace"], &lib)?;
    // The batteries prove the admission and lease tests catch real bugs.
    mutants::run(mutants::Options { battery: None, mutant: None, shard: None })?;
    println!("cargo xtask test: all green in {:.0?}", started.elapsed());
    Ok(())
}
