//! A property-based API fuzzer against a real server on loopback (issue
//! 19): schemathesis reads `/openapi.json` and sends generated requests —
//! valid and invalid — to every operation; the server must never answer 5xx,
//! and every answer must have a documented status, content type and shape.
//! `cargo xtask lane api-fuzz` installs the pinned schemathesis into
//! `target/schemathesis`.

mod support;

use std::path::Path;
use std::process::Command;

use onnx_genai_engine::Scheduler;
use support::{engine, package, Gate};

#[test]
fn schemathesis_finds_no_server_error_or_schema_violation() {
    let site = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/schemathesis");
    assert!(
        site.join("schemathesis").is_dir(),
        "schemathesis is not installed in {}; run `cargo xtask lane api-fuzz` (it installs it with pip)",
        site.display()
    );
    let (_dir, mut p) = package("tiny-llama-gqa");
    // Tools described in a system message overflow the tiny model's
    // 256-token context: a template that renders them compactly.
    p.manifest.chat_template = Some(support::TOOLS_TEMPLATE.into());
    let server =
        onnx_genai_server::start(vec![engine(&p, &Gate::default(), Scheduler::new(1 << 30))], "127.0.0.1:0", 64)
            .unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let scratch = scratch.path();
    let out = Command::new("python3")
        .args(["-m", "schemathesis.cli", "run", &format!("http://{}/openapi.json", server.addr)])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
        ])
        .args([
            "--max-examples",
            "100",
            "--seed",
            "19",
            "--workers",
            "1",
            "--no-color",
            "--generation-database",
            "none",
        ])
        .args(["--phases", "examples,coverage,fuzzing,stateful", "--request-timeout", "60"])
        .env("PYTHONPATH", &site)
        .env("SCHEMATHESIS_TELEMETRY", "false")
        // schemathesis writes a `.schemathesis/` cache where it runs: in a
        // scratch dir, not the source tree.
        .current_dir(scratch)
        .output()
        .expect("python3 runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "schemathesis found failures:\n{stdout}\n{stderr}");
    // The run's summary (operations, phases, test cases) for the lane's log.
    println!("{stdout}");
    server.stop();
}
