//! The official OpenAI Python client against a real server on loopback:
//! models, chat, streaming, a session turn via `X-Session-Id`, logit bias,
//! penalties and vLLM's sampling extensions, structured outputs checked
//! with `jsonschema`, logprobs, tool calls (plain, streamed, and their
//! results sent back), an inline image to a vision-language model, an
//! error.
//! `cargo xtask test` installs the pinned client and `jsonschema` into
//! `target/python`.

mod support;

use std::path::Path;
use std::process::Command;

use onnx_genai_engine::Scheduler;
use support::{engine, package, Gate};

#[test]
fn the_official_python_client_works() {
    let site = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/python");
    assert!(
        site.join("openai").is_dir(),
        "the Python openai client is not installed in {}; run `cargo xtask test` (it installs it with pip)",
        site.display()
    );
    let (_dir, mut p) = package("tiny-llama-gqa");
    // The tiny model's 256-token context has no room for tools described
    // in a system message: a template that renders them compactly.
    p.manifest.chat_template = Some(support::TOOLS_TEMPLATE.into());
    let (_vlm_dir, vlm) = package("tiny-vlm");
    let engines = vec![
        engine(&p, &Gate::default(), Scheduler::unlimited()),
        engine(&vlm, &Gate::default(), Scheduler::unlimited()),
    ];
    let server = onnx_genai_server::start(engines, "127.0.0.1:0", 8).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}", server.addr))
        .arg("tiny-llama-gqa")
        .arg("tiny-vlm")
        .env("PYTHONPATH", &site)
        .output()
        .expect("python3 runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "client failed:\n{stdout}\n{stderr}");
    for check in [
        "models ok",
        "chat ok",
        "stream ok",
        "session ok",
        "sampling ok",
        "stop ok",
        "structured ok",
        "logprobs ok",
        "tools ok",
        "images ok",
        "error ok",
    ] {
        assert!(stdout.contains(check), "missing `{check}`:\n{stdout}");
    }
    server.stop();
}
