//! Bad input never panics: at least 500 deterministic truncations and bit
//! flips of real packages' ONNX files and manifests go through validation
//! and open; each either validates or fails with coded diagnostics.

mod support;

use onnx_genai_package::{validate, Package};
use support::{build, shipped_packages, Layout};

/// xorshift: positions are deterministic so a failure reproduces exactly.
fn positions(len: usize, count: usize, seed: u64) -> Vec<usize> {
    let mut s = seed | 1;
    (0..count)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % len as u64) as usize
        })
        .collect()
}

#[test]
fn truncations_and_bit_flips_never_panic() {
    let mut checked = 0;
    let mut rejected = 0;
    for (p, name) in shipped_packages().iter().enumerate() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("pkg");
        build(name, Layout::Native, &dir);
        for file in ["model.onnx", "package.yaml"] {
            let original = std::fs::read(dir.join(file)).unwrap();
            let len = original.len();
            // Structure lives at the start of an ONNX file (graph, nodes) and
            // everywhere in a manifest: aim half the flips at the first 4 KiB.
            let head = len.min(4096);
            let mut variants: Vec<Vec<u8>> = Vec::new();
            for cut in positions(len, 40, 11 + p as u64) {
                variants.push(original[..cut].to_vec());
            }
            for (i, at) in
                positions(head, 60, 23 + p as u64).into_iter().chain(positions(len, 40, 37 + p as u64)).enumerate()
            {
                let mut v = original.clone();
                v[at] ^= 1 << (i % 8);
                variants.push(v);
            }
            for bytes in variants {
                std::fs::write(dir.join(file), &bytes).unwrap();
                let (report, _) = validate(&dir);
                let opened = Package::open(&dir);
                assert_eq!(opened.is_err(), report.has_errors(), "open and validate disagree:\n{report}");
                if report.has_errors() {
                    rejected += 1;
                    assert!(report.errors().all(|d| !d.message.is_empty() && !d.hint.is_empty()));
                }
                checked += 1;
            }
            std::fs::write(dir.join(file), &original).unwrap();
        }
    }
    assert!(checked >= 500, "only {checked} variants");
    // Most mutations must be caught; a validator that accepts anything fails here.
    assert!(rejected * 2 > checked, "only {rejected} of {checked} variants were rejected");
}

/// Validation looks names up through maps built once, so its work grows
/// with the graph, not with its square: a decoder given 300,000 more
/// inputs that are also initializers (so no runtime input) and 300,000
/// rotary nodes each naming one of them still validates clean at once.
/// Scanning the initializers per input and per rotary node, as before,
/// took 2 x 9 x 10^10 name comparisons: minutes of a validator (and of
/// every command that opens a package) on a 20 MB file.
#[test]
fn validation_is_not_quadratic_in_the_graph() {
    use onnx_genai_onnx::{DataType, Node, Tensor, ValueInfo};
    const EXTRA: usize = 300_000;
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("pkg");
    build("tiny-llama-gqa", Layout::Native, &dir);
    let mut model = onnx_genai_onnx::read_model(&dir.join("model.onnx")).unwrap();
    for i in 0..EXTRA {
        let name = format!("extra.{i}");
        model.graph.initializers.push(Tensor::from_f32(name.clone(), vec![], &[0.0]));
        model.graph.inputs.push(ValueInfo { name: name.clone(), dtype: DataType::Float, shape: Some(vec![]) });
        model.graph.nodes.push(Node {
            name: format!("rotary.{i}"),
            op_type: "RotaryEmbedding".into(),
            domain: "com.microsoft".into(),
            inputs: vec![String::new(), String::new(), name],
            outputs: vec![format!("rotated.{i}")],
            attributes: Vec::new(),
        });
    }
    onnx_genai_onnx::write_model(&dir.join("model.onnx"), &model).unwrap();
    let (report, _) = validate(&dir);
    assert!(!report.has_errors(), "{report}");
}

/// A role bound again is one diagnostic however often and over however
/// many layers: 1,000 copies of a per-layer port (YAML aliases make them
/// cheap) each walked every layer, a diagnostic a layer, and two ports of
/// one per-layer name were a diagnostic a layer each.
#[test]
fn ports_bound_twice_are_reported_once() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("pkg");
    build("tiny-llama-gqa", Layout::Native, &dir);
    let manifest = std::fs::read_to_string(dir.join("package.yaml")).unwrap();
    let port = "  - role: past_key\n    name: past_key_values.{layer}.key\n";
    assert!(manifest.contains(port), "{manifest}");
    std::fs::write(dir.join("package.yaml"), manifest.replacen(port, &port.repeat(1_000), 1)).unwrap();
    let (report, _) = validate(&dir);
    let twice: Vec<_> = report.errors().filter(|d| d.message.contains("bound twice")).collect();
    assert_eq!(twice.len(), 1, "{report}");
    assert!(twice[0].message.contains("role `past_key` is bound twice"), "{report}");

    // Another role over the same per-layer names: once, not once a layer.
    let value = "    name: past_key_values.{layer}.value\n";
    std::fs::write(dir.join("package.yaml"), manifest.replacen(value, "    name: past_key_values.{layer}.key\n", 1))
        .unwrap();
    let (report, _) = validate(&dir);
    let twice: Vec<_> = report.errors().filter(|d| d.message.contains("bound twice")).collect();
    assert_eq!(twice.len(), 1, "{report}");
    assert!(twice[0].message.contains("tensor `past_key_values.0.key` is bound twice"), "{report}");
}
