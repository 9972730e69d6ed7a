//! The server's HTTP tests again with native-cpu behind the gate instead of
//! ONNX Runtime (issue 21: the server was tested on ONNX Runtime alone, so
//! its batching, faults and leases never met the backend they most serve).
//! Each file is the same source as its own test target, compiled here as a
//! module; `support::engine` loads the backend this crate's name selects.

// Each file is also a test target of its own, so each declares `mod
// support;`; compiled together here, each keeps its copy of the same source.
#![allow(clippy::duplicate_mod)]

mod support;

#[path = "answers.rs"]
mod answers;
#[path = "batching.rs"]
mod batching;
#[path = "faults.rs"]
mod faults;
#[path = "operator.rs"]
mod operator;
#[path = "server.rs"]
mod server;
#[path = "tools.rs"]
mod tools;

/// The copies really run native-cpu: an engine made by the support code
/// of this binary serves its model on native-cpu.
#[test]
fn these_tests_run_on_native_cpu() {
    let (_dir, package) = support::package("tiny-llama-gqa");
    let engine = support::engine(&package, &support::Gate::default(), onnx_genai_engine::Scheduler::unlimited());
    assert_eq!(engine.backend_name(), "native-cpu");
}
