//! `cargo xtask onnx-tests` (the `onnx-node` lane): ONNX's backend node test
//! cases from the pinned `onnx` wheel (pip, into target/onnx-node) on
//! native-cpu and ONNX Runtime, held to the ratchet
//! `conformance/onnx-node-tests.yaml`; the per-op table goes to
//! `target/conformance/onnx-node.md`.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use onnx_genai_conformance::onnx_node::{self, ratchet, Outcome};

use crate::{ort, util};

/// The last `onnx` release that ships the node cases in its wheel (1.23
/// ships none).
const VERSION: &str = "1.22.0";
const PREFIX: &str = "onnx/backend/test/data/node/";

pub struct Options {
    pub bless: bool,
    /// Only cases whose name contains this (the ratchet's other cases are
    /// not reported missing).
    pub case: Option<String>,
}

/// Ensures the node cases are unpacked under target/onnx-node/node.
pub(crate) fn provision() -> Result<PathBuf> {
    let dir = util::target().join("onnx-node");
    let cases = dir.join("node");
    let stamp = dir.join(format!("onnx-{VERSION}.unpacked"));
    if stamp.is_file() && cases.is_dir() {
        return Ok(cases);
    }
    let wheel = ort::pip_download("onnx", VERSION, &dir.join("wheel"))?;
    // A wheel is a zip file; Python (already required for pip) unpacks the
    // node cases and nothing else.
    let script = format!(
        "import os, sys, zipfile\n\
         z = zipfile.ZipFile(sys.argv[1])\n\
         for n in z.namelist():\n\
         \x20   if n.startswith('{PREFIX}') and not n.endswith('/'):\n\
         \x20       out = os.path.join(sys.argv[2], n[len('{PREFIX}'):])\n\
         \x20       os.makedirs(os.path.dirname(out), exist_ok=True)\n\
         \x20       open(out, 'wb').write(z.read(n))\n"
    );
    let _ = std::fs::remove_dir_all(&cases);
    let status = Command::new(ort::python()).args(["-c", &script]).arg(&wheel).arg(&cases).status()?;
    if !status.success() {
        bail!("could not unpack the node cases from {}", wheel.display());
    }
    std::fs::write(&stamp, "")?;
    Ok(cases)
}

pub fn run(options: Options) -> Result<()> {
    let lib = ort::provision()?;
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    let root = provision()?;
    let path = util::root().join("conformance/onnx-node-tests.yaml");
    let recorded: ratchet::Ratchet = if path.is_file() {
        let text = std::fs::read_to_string(&path)?;
        serde_path_to_error::deserialize(serde_yaml_ng::Deserializer::from_str(&text))
            .with_context(|| format!("reading {}", path.display()))?
    } else if options.bless {
        ratchet::Ratchet::default()
    } else {
        bail!("{} is missing; create it with `cargo xtask onnx-tests --bless`", path.display());
    };
    let mut cases = onnx_node::discover(&root).with_context(|| format!("listing {}", root.display()))?;
    if let Some(filter) = &options.case {
        cases.retain(|c| c.name.contains(filter.as_str()));
    }
    if cases.is_empty() {
        bail!("no node cases selected under {}", root.display());
    }
    let started = Instant::now();
    // A panicking kernel is caught and reported as its case's error; the
    // default hook would print a backtrace banner for each.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let results = run_time_boxed(&cases, &recorded);
    std::panic::set_hook(hook);
    let results = results?;
    let report = util::target().join("conformance/onnx-node.md");
    std::fs::create_dir_all(report.parent().context("report path")?)?;
    std::fs::write(&report, ratchet::markdown(VERSION, &results))?;
    let count = |o: Outcome, native: bool| {
        results.iter().filter(|r| (if native { &r.native } else { &r.ort }).outcome == o).count()
    };
    println!(
        "onnx-tests: {} cases in {:.1} s; native-cpu: {} pass, {} refused at compile time, {} no kernel, {} unreadable, {} run errors, {} wrong; ONNX Runtime: {} pass, {} errors, {} wrong",
        results.len(),
        started.elapsed().as_secs_f64(),
        count(Outcome::Pass, true),
        count(Outcome::Unsupported, true),
        count(Outcome::NoKernel, true),
        count(Outcome::Unreadable, true),
        count(Outcome::Error, true),
        count(Outcome::Wrong, true),
        count(Outcome::Pass, false),
        count(Outcome::Error, false) + count(Outcome::Unsupported, false),
        count(Outcome::Wrong, false),
    );
    println!("per-op table: {}", report.display());
    if options.bless {
        let mut blessed = recorded.blessed(VERSION, &results);
        if options.case.is_some() {
            // A filtered run rewrites only the cases it ran.
            let mut merged = recorded.clone();
            merged.cases.extend(blessed.cases);
            merged.onnx = VERSION.into();
            blessed = merged;
        }
        std::fs::write(&path, header() + &serde_yaml_ng::to_string(&blessed)?)?;
        println!("recorded {} cases in {}", blessed.cases.len(), path.display());
        return Ok(());
    }
    let mut differences = ratchet::check(&recorded, &results);
    if options.case.is_some() {
        differences.retain(|d| !matches!(d, ratchet::Difference::Missing { .. }));
    }
    for d in &differences {
        println!("  {d}");
    }
    if !differences.is_empty() {
        bail!(
            "{} node cases differ from {} (a regression is a bug; an improvement is recorded with --bless)",
            differences.len(),
            path.display()
        );
    }
    println!("onnx-tests: every case matches {}", path.display());
    Ok(())
}

/// Seconds any one case may take: the cases are tiny (all 1,765 run in
/// about 2 s), so a case past this is a kernel that hangs or explodes.
const CASE_SECONDS: u64 = 30;

/// Runs the cases on a worker thread; a case that overruns its time box
/// fails the run, naming it (the worker is abandoned with the process).
fn run_time_boxed(cases: &[onnx_node::Case], recorded: &ratchet::Ratchet) -> Result<Vec<onnx_node::CaseResult>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let work: Vec<_> = cases.iter().map(|c| (c.clone(), recorded.tolerance(&c.name))).collect();
    std::thread::spawn(move || {
        let runtime = onnx_genai_native::kernels::Runtime::serial();
        for (case, tolerance) in work {
            if tx.send(onnx_node::run_case(&case, tolerance, &runtime)).is_err() {
                return;
            }
        }
    });
    let mut results = Vec::with_capacity(cases.len());
    for case in cases {
        match rx.recv_timeout(std::time::Duration::from_secs(CASE_SECONDS)) {
            Ok(result) => results.push(result),
            Err(_) => bail!("node case {} did not finish within {CASE_SECONDS} s", case.name),
        }
    }
    Ok(results)
}

fn header() -> String {
    "# What every ONNX backend node case (onnx wheel, onnx/backend/test/data/node)\n\
     # does on native-cpu and ONNX Runtime: pass, unsupported (a typed compile\n\
     # error naming what is refused), no-kernel (an op native-cpu does not\n\
     # lower), unreadable (the ONNX reader refuses the model or data), error\n\
     # (failed at run time), wrong (a different answer). `cargo xtask\n\
     # onnx-tests` fails on any difference, better or worse; `--bless`\n\
     # rewrites this file. `tolerances` widens ONNX's default (rtol 1e-3,\n\
     # atol 1e-7) for a case, with the reason.\n"
        .into()
}
