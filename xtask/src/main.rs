//! `cargo xtask <command>`: the project's automation. See README.md.

mod conformance;
mod ort;
mod packages;
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
    /// The main job: build, validate, load in ONNX Runtime and generate from every package.
    Conformance {
        /// Only the package with this name.
        #[arg(long)]
        package: Option<String>,
    },
    /// Everything CI checks: ONNX Runtime, fmt, clippy, every test.
    Test,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Ort => ort::provision().map(|path| println!("ONNX Runtime ready: {}", path.display())),
        Command::Packages { bless } => packages::build_all(bless).map(|_| ()),
        Command::Conformance { package } => conformance::run(package.as_deref()),
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
    util::cargo(&["fmt", "--all", "--check"], &lib)?;
    util::cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"], &lib)?;
    util::cargo(&["test", "--workspace"], &lib)?;
    println!("cargo xtask test: all green in {:.0?}", started.elapsed());
    Ok(())
}
