//! The committed seeds start the fuzzer deep: each reaches the end of its
//! target's happy path (a package that opens, a decoder that compiles, a
//! GGUF whose spec extracts, a chat that renders, a request answered 200).
//! A seed that stopped at the first check would leave the fuzzer to find
//! the format from scratch. The exception is ONNX's node-test models
//! (`node-*`): they seed the operator coverage, and many use operators the
//! native compiler refuses by name, which is their deepest path.

use std::path::PathBuf;

use onnx_genai_fuzz::{deep, Target};

#[test]
fn every_seed_reaches_the_end_of_its_target() {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    for target in Target::ALL {
        let dir = corpus.join(target.name());
        let mut seeds: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask fuzz --seeds`)", dir.display()))
            .flatten()
            .map(|e| e.path())
            .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("node-")))
            .collect();
        seeds.sort();
        assert!(!seeds.is_empty(), "no seeds for `{}`", target.name());
        for seed in seeds {
            let data = std::fs::read(&seed).unwrap();
            assert_eq!(deep(target, &data), Ok(()), "{}", seed.display());
        }
    }
}
