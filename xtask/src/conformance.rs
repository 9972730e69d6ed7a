//! `cargo xtask conformance`: build every package, validate it, load it in
//! ONNX Runtime and generate from it; print a summary table and write
//! `target/conformance/report.md`.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::{bail, Result};
use onnx_genai_engine::{Engine, Flow, GenerateRequest};

use crate::{ort, packages, util};

const PROMPT: &str = "The capital of France is";
const NEW_TOKENS: u32 = 16;

struct Row {
    package: String,
    bytes: u64,
    diagnostics: String,
    generated: String,
    tokens_per_s: String,
    ok: bool,
    note: String,
}

pub fn run(only: Option<&str>) -> Result<()> {
    let lib = ort::provision()?;
    // Read by the in-process reference backend; set before any thread starts.
    std::env::set_var("ORT_DYLIB_PATH", &lib);
    let built = packages::build_all(false)?;
    let mut rows = Vec::new();
    for package in built.iter().filter(|b| only.is_none_or(|name| b.name == name)) {
        println!("--> {}", package.name);
        let (report, _) = onnx_genai_package::validate(&package.dir);
        let mut row = Row {
            package: package.name.clone(),
            bytes: package.bytes,
            diagnostics: format!(
                "{} errors, {} warnings",
                report.errors().count(),
                report.diagnostics.len() - report.errors().count()
            ),
            generated: "-".into(),
            tokens_per_s: "-".into(),
            ok: !report.has_errors(),
            note: String::new(),
        };
        if report.has_errors() {
            row.note = report.to_string();
        } else {
            match generate_twice(&package.dir) {
                Ok((ids, rate)) => {
                    row.generated = format!("{} tokens {:?}", ids.len(), &ids[..ids.len().min(6)]);
                    row.tokens_per_s = format!("{rate:.0}");
                }
                Err(e) => {
                    row.ok = false;
                    row.note = format!("{e:#}");
                }
            }
        }
        rows.push(row);
    }
    if rows.is_empty() {
        bail!("no package matched {only:?}");
    }
    let table = render(&rows);
    println!("\n{table}");
    let dir = util::target().join("conformance");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("report.md"), format!("# onnx-genai conformance\n\ncommit: {}\n\n{table}", commit()))?;
    let failed: Vec<&str> = rows.iter().filter(|r| !r.ok).map(|r| r.package.as_str()).collect();
    if !failed.is_empty() {
        for r in rows.iter().filter(|r| !r.ok) {
            eprintln!("{}: {}", r.package, r.note);
        }
        bail!("conformance failed for {}", failed.join(", "));
    }
    println!("conformance: {} packages ok (report: target/conformance/report.md)", rows.len());
    Ok(())
}

/// Greedy generation twice on fresh state: the token ids must agree.
fn generate_twice(dir: &std::path::Path) -> Result<(Vec<u32>, f64)> {
    let mut engine = Engine::open_ort(dir, 1)?;
    let request = GenerateRequest { max_new_tokens: Some(NEW_TOKENS), ..GenerateRequest::text(PROMPT) };
    let started = Instant::now();
    let first = engine.generate(&request, &mut |_| Flow::Continue)?;
    let rate = first.token_ids.len() as f64 / started.elapsed().as_secs_f64();
    let second = engine.generate(&request, &mut |_| Flow::Continue)?;
    if first.token_ids != second.token_ids {
        bail!("greedy decoding is not deterministic: {:?} then {:?}", first.token_ids, second.token_ids);
    }
    if first.token_ids.is_empty() {
        bail!("generated no tokens (finish: {:?})", first.finish_reason);
    }
    Ok((first.token_ids, rate))
}

fn render(rows: &[Row]) -> String {
    let mut out = String::from("| package | bytes | validate | ORT greedy (deterministic) | tok/s (ORT, 1 thread) | result |\n|---|---:|---|---|---:|---|\n");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r.package,
            r.bytes,
            r.diagnostics,
            r.generated,
            r.tokens_per_s,
            if r.ok { "ok" } else { "FAIL" }
        );
    }
    out
}

fn commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(util::root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}
