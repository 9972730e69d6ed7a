//! The committed seeds start the fuzzer deep: each reaches the end of its
//! target's happy path (a package that opens, a decoder that compiles, a
//! GGUF whose spec extracts, a chat that renders, a request answered 200).
//! A seed that stopped at the first check would leave the fuzzer to find
//! the format from scratch.

use std::path::PathBuf;

fn seed(target: &str, name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target).join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask fuzz --seeds`)", path.display()))
}

#[test]
fn seeds_reach_the_end_of_each_target() {
    for variant in ["decomposed", "opset23", "contrib", "genai"] {
        let outcome = onnx_genai_fuzz::deep(onnx_genai_fuzz::Target::Package, &seed("package", variant));
        assert_eq!(outcome, Ok(()), "package seed {variant}");
    }
    for variant in ["decomposed", "opset23", "contrib"] {
        let outcome =
            onnx_genai_fuzz::deep(onnx_genai_fuzz::Target::Onnx, &seed("onnx", &format!("decoder-{variant}")));
        assert_eq!(outcome, Ok(()), "onnx seed {variant}");
    }
    assert_eq!(onnx_genai_fuzz::deep(onnx_genai_fuzz::Target::Gguf, &seed("gguf", "llama-tiny")), Ok(()));
    for name in ["fixture-template", "control-tokens-in-content", "filters-and-loops", "plain-text-message"] {
        assert_eq!(onnx_genai_fuzz::deep(onnx_genai_fuzz::Target::Chat, &seed("chat", name)), Ok(()), "chat {name}");
    }
    for name in ["chat", "chat-stream-stop", "completion-text", "completion-stream", "session", "chat-in-session"] {
        assert_eq!(onnx_genai_fuzz::deep(onnx_genai_fuzz::Target::Http, &seed("http", name)), Ok(()), "http {name}");
    }
}
