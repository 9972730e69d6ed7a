//! The `onnx-genai` binary: exit codes, output, and no panics on bad input.

use std::path::Path;
use std::process::{Command, Output};

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-genai")).args(args).output().unwrap()
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn built(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packages").join(name).join("spec.yaml");
    let out = cli(&["build", spec.to_str().unwrap(), dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{:?}", text(&out));
    dir
}

#[test]
fn validate_reports_ok_and_errors_with_exit_codes() {
    let dir = built("tiny-llama-gqa");
    let p = dir.path().to_str().unwrap();
    let ok = cli(&["validate", p]);
    assert_eq!(ok.status.code(), Some(0));
    assert!(text(&ok).0.contains(": ok"));

    std::fs::write(dir.path().join("tokenizer.json"), "not json").unwrap();
    let bad = cli(&["validate", p, "--format", "json"]);
    assert_eq!(bad.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert_eq!(report["diagnostics"][0]["code"], "PKG042");
    assert_eq!(report["diagnostics"][0]["severity"], "error");
}

#[test]
fn generate_is_greedy_deterministic_and_inspect_shows_geometry() {
    let dir = built("tiny-llama-gqa");
    let p = dir.path().to_str().unwrap();
    let args = ["generate", p, "--prompt", "The capital of France is", "--max-new-tokens", "8", "--show-ids"];
    let (a, b) = (cli(&args), cli(&args));
    assert!(a.status.success(), "{:?}", text(&a));
    assert_eq!(a.stdout, b.stdout);
    assert!(text(&a).0.contains("token ids: ["));
    let inspect = cli(&["inspect", p]);
    let (out, _) = text(&inspect);
    assert!(out.contains("512 bytes per token"), "{out}");
    assert!(out.contains("past_key_values.{layer}.key"), "{out}");
}

/// A reader that closed stdout before the command wrote (`onnx-genai
/// inspect PKG | head -0`) ends a command quietly, with the exit code its
/// work earned: `inspect`, whose output is its product, fails; `validate`
/// and `check` keep their verdict (0 for a good package, 1 for a bad one
/// or a mismatch) and `build` its success. Never a panic ("failed printing
/// to stdout", exit 101, before) nor an error message for a reader that
/// has gone; before, every one of them exited 1 (`check` 2, "could not
/// run", saying `Broken pipe`), losing the verdict a script piped into
/// `head` tests.
#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    let dir = built("tiny-llama-gqa");
    let p = dir.path().to_str().unwrap();
    let bad = built("tiny-llama-gqa");
    std::fs::write(bad.path().join("tokenizer.json"), "not json").unwrap();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packages/tiny-llama-gqa/spec.yaml");
    let out = tempfile::tempdir().unwrap();
    for (args, code) in [
        (vec!["inspect", p], 1),
        (vec!["validate", p], 0),
        (vec!["validate", bad.path().to_str().unwrap()], 1),
        (vec!["check", p, "--steps", "2"], 0),
        (vec!["build", spec.to_str().unwrap(), out.path().to_str().unwrap()], 0),
    ] {
        // The read end closed before the command starts: its first write fails.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let o = Command::new(env!("CARGO_BIN_EXE_onnx-genai")).args(&args).stdout(writer).output().unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.is_empty(), "{args:?} said something to a reader that has gone: {err}");
    }
}

/// `--backend native-cpu` generates the same greedy text as ONNX Runtime,
/// on a contrib (4-bit) export; `inspect` reports what the native compiler
/// made of it.
#[test]
fn native_backend_generates_like_ort_and_inspect_shows_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packages/tiny-llama-gqa/spec.yaml");
    let p = dir.path().to_str().unwrap();
    let out = cli(&["build", spec.to_str().unwrap(), p, "--variant", "contrib"]);
    assert!(out.status.success(), "{:?}", text(&out));
    let run = |backend| {
        cli(&["generate", p, "--prompt", "Once upon", "--max-new-tokens", "12", "--show-ids", "--backend", backend])
    };
    let (ort, native) = (run("ort"), run("native-cpu"));
    assert!(native.status.success(), "{:?}", text(&native));
    assert_eq!(ort.stdout, native.stdout);
    assert!(text(&native).1.contains("native-cpu"), "{:?}", text(&native));
    let (inspect, _) = text(&cli(&["inspect", p]));
    assert!(inspect.contains("native ") && inspect.contains("matmul_nbits x15"), "{inspect}");
    let bad = cli(&["build", spec.to_str().unwrap(), p, "--variant", "opset99"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad).1.contains("unknown variant `opset99`"));
}

/// `generate --image`: a PNG is decoded, resized to the declared size,
/// normalized and bound to `pixel_values`; different images give different
/// output; a chat prompt takes the image too; images on a package without an image input, or unreadable files,
/// are clean errors.
#[test]
fn generate_with_an_image_on_a_vision_language_package() {
    let vlm = built("tiny-vlm");
    let p = vlm.path().to_str().unwrap();
    let png = |name: &str, seed: u8| {
        let path = vlm.path().join(name);
        let img = image::RgbImage::from_fn(16, 12, |x, y| {
            image::Rgb([(x * 16) as u8 ^ seed, (y * 20) as u8, seed.wrapping_mul(3)])
        });
        img.save(&path).unwrap();
        path
    };
    let (a, b) = (png("a.png", 7), png("b.png", 200));
    let run = |img: &std::path::Path| {
        let out = cli(&[
            "generate",
            p,
            "--image",
            img.to_str().unwrap(),
            "--prompt",
            " What is it?",
            "--max-new-tokens",
            "8",
            "--show-ids",
        ]);
        assert!(out.status.success(), "{:?}", text(&out));
        text(&out).0
    };
    let (out_a, out_b) = (run(&a), run(&b));
    assert!(out_a.contains("token ids: ["));
    assert_ne!(out_a, out_b, "the image must reach the decoder");
    assert_eq!(out_a, run(&a), "deterministic");
    // In a chat the image is the message's placeholder token, not text.
    let chat = cli(&[
        "generate",
        p,
        "--chat",
        "--image",
        a.to_str().unwrap(),
        "--prompt",
        "What is it?",
        "--max-new-tokens",
        "4",
    ]);
    assert!(chat.status.success(), "{:?}", text(&chat));

    let lm = built("tiny-gpt2");
    let no_images = cli(&["generate", lm.path().to_str().unwrap(), "--image", a.to_str().unwrap(), "--prompt", "x"]);
    assert_eq!(no_images.status.code(), Some(1));
    assert!(text(&no_images).1.contains("takes no images"), "{:?}", text(&no_images));
    std::fs::write(vlm.path().join("broken.png"), b"not a png").unwrap();
    let broken = cli(&["generate", p, "--image", vlm.path().join("broken.png").to_str().unwrap(), "--prompt", "x"]);
    assert_eq!(broken.status.code(), Some(1));
    assert!(text(&broken).1.contains("cannot read image"), "{:?}", text(&broken));
    assert!(!text(&broken).1.contains("panicked"));
}

/// Bad input: a clear error and a non-zero exit, never a panic.
#[test]
fn bad_input_fails_cleanly() {
    let dir = built("tiny-gpt2");
    let p = dir.path().to_str().unwrap();
    let missing = cli(&["generate", "/nonexistent/pkg", "--prompt", "x"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(text(&missing).1.contains("PKG001"), "{:?}", text(&missing));

    let bad_arg = cli(&["generate", p, "--prompt", "x", "--max-new-tokens", "many"]);
    assert_eq!(bad_arg.status.code(), Some(2), "clap usage errors exit 2");

    let zero = cli(&["generate", p, "--prompt", "x", "--max-new-tokens", "0"]);
    assert_eq!(zero.status.code(), Some(1));
    assert!(text(&zero).1.contains("max_new_tokens"));

    // A KV cache type that does not exist is a usage error; one the backend
    // cannot store is refused at load, naming the backend that can.
    let bad_kv = cli(&["generate", p, "--prompt", "x", "--kv-cache", "f8"]);
    assert_eq!(bad_kv.status.code(), Some(2), "{:?}", text(&bad_kv));
    assert!(text(&bad_kv).1.contains("model, f16"), "{:?}", text(&bad_kv));
    let ort_f16 = cli(&["generate", p, "--prompt", "x", "--backend", "ort", "--kv-cache", "f16"]);
    assert_eq!(ort_f16.status.code(), Some(1), "{:?}", text(&ort_f16));
    assert!(text(&ort_f16).1.contains("native-cpu"), "{:?}", text(&ort_f16));
    let native_f16 =
        cli(&["generate", p, "--prompt", "x", "--backend", "native-cpu", "--kv-cache", "f16", "--max-new-tokens", "3"]);
    assert_eq!(native_f16.status.code(), Some(0), "{:?}", text(&native_f16));

    // An image file is read up to 64 MiB: `/dev/zero` was read until the
    // process was killed.
    let endless = cli(&["generate", p, "--prompt", "x", "--image", "/dev/zero"]);
    assert_eq!(endless.status.code(), Some(1), "{:?}", text(&endless));
    assert!(text(&endless).1.contains("more than 64 MiB"), "{:?}", text(&endless));

    std::fs::write(dir.path().join("model.onnx"), b"\x08\x01garbage").unwrap();
    let corrupt = cli(&["generate", p, "--prompt", "x"]);
    assert_eq!(corrupt.status.code(), Some(1));
    assert!(text(&corrupt).1.contains("PKG020"), "{:?}", text(&corrupt));

    // A wait beyond a day is a usage error, not a deadline that overflows
    // the clock in the driver once a stream stalls.
    let forever = cli(&["serve", p, "--stall-timeout-s", "18446744073709551615"]);
    assert_eq!(forever.status.code(), Some(2), "{:?}", text(&forever));
    assert!(text(&forever).1.contains("is not in 1..=86400"), "{:?}", text(&forever));

    // Counts no machine runs are usage errors before anything loads: a
    // thread count past 1,024 (100,000 threads were started; 2^32 + 1
    // wrapped to one in ONNX Runtime's C int), choices outside 1-16, an
    // empty API key (auth on with a key no header can match).
    let mut usage = Vec::new();
    for (args, says) in [
        (vec!["generate", p, "--prompt", "x", "--threads", "100000"], "is not in 0..=1024"),
        (vec!["generate", p, "--prompt", "x", "--threads", "4294967297"], "is not in 0..=1024"),
        (vec!["check", p, "--threads", "100000"], "is not in 0..=1024"),
        (vec!["serve", p, "--threads", "100000"], "is not in 0..=1024"),
        (vec!["serve", p, "--max-choices", "0"], "is not in 1..=16"),
        (vec!["serve", p, "--api-key", ""], "--api-key"),
    ] {
        let o = cli(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {:?}", text(&o));
        assert!(text(&o).1.contains(says), "{args:?}: {:?}", text(&o));
        usage.push(o);
    }

    for o in [missing, bad_arg, zero, bad_kv, ort_f16, corrupt, forever, endless].iter().chain(&usage) {
        assert!(!text(o).1.contains("panicked"), "{:?}", text(o));
    }
}

/// `serve --log-format json` writes one JSON object per line — its start-up
/// lines (KV budget, load time, address) included — and the line that
/// records an answer carries the request id the client got back in
/// `x-request-id` and the status it got (issue 20: structured logs).
/// Watched red with the start-up lines printed as plain text.
#[test]
fn serve_logs_json_lines_with_request_ids() {
    use std::io::{BufRead, BufReader, Read, Write};
    let dir = built("tiny-llama-gqa");
    let child = Command::new(env!("CARGO_BIN_EXE_onnx-genai"))
        .args(["serve", dir.path().to_str().unwrap(), "--port", "0", "--log-format", "json"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Killed however the test ends: a server left running keeps the test
    // harness's output pipe open, and the run never finishes.
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Server(child);
    let mut stderr = BufReader::new(child.0.stderr.take().unwrap());
    let mut addr = None;
    let mut startup = Vec::new();
    for _ in 0..50 {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            break;
        }
        let event: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        let message = event["fields"]["message"].as_str().unwrap_or_default().to_string();
        startup.push(message.clone());
        if let Some(a) = message.strip_prefix("serving on http://") {
            addr = Some(a.split_whitespace().next().unwrap().to_string());
            break;
        }
    }
    let addr = addr.unwrap_or_else(|| panic!("serve printed no address: {startup:?}"));
    assert!(startup.iter().any(|m| m.starts_with("KV budget: ")), "{startup:?}");
    assert!(startup.iter().any(|m| m.starts_with("loaded ") && m.ends_with(" s")), "{startup:?}");
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    write!(s, "GET /v1/models HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let id = answer.lines().find_map(|l| l.strip_prefix("x-request-id: ")).expect("no x-request-id").trim().to_string();
    // The log line is written before the answer leaves; stop the server.
    drop(child);
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    // Every whole line (the kill may cut the last one short).
    let events: Vec<serde_json::Value> = rest
        .split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    let answered = events
        .iter()
        .find(|v| v["fields"]["message"] == "answered")
        .unwrap_or_else(|| panic!("no JSON `answered` line in {rest}"));
    assert_eq!(answered["span"]["request_id"], id.as_str(), "{answered}");
    assert_eq!(answered["span"]["route"], "/v1/models", "{answered}");
    assert_eq!(answered["fields"]["status"], 200, "{answered}");
}
