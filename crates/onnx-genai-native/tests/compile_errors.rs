//! Bad graphs are compile errors that name the node (or tensor) and the
//! reason — never a panic and never a silent fallback. Each case mutates a
//! real decoder graph the builder exports.

use onnx_genai_build::{graph::build_decoder, Variant};
use onnx_genai_native::{compile, Binding, CompileError};
use onnx_genai_onnx::ir::{AttrValue, Model};
use onnx_genai_onnx::{DataType, Dim, Tensor};

fn spec() -> onnx_genai_build::Spec {
    onnx_genai_test_support::spec("tiny-llama-gqa")
}

fn binding() -> Binding {
    let (_dir, package) = onnx_genai_test_support::build("tiny-llama-gqa");
    Binding::from_package(&package).unwrap().0
}

fn model(variant: Variant) -> Model {
    build_decoder(&spec(), variant).unwrap()
}

fn first(m: &mut Model, op: &str) -> usize {
    m.graph.nodes.iter().position(|n| n.op_type == op).unwrap_or_else(|| panic!("no {op} node"))
}

/// The name of the node that writes `output`.
fn producer_of(m: &Model, output: &str) -> String {
    m.graph.nodes.iter().find(|n| n.outputs.iter().any(|o| o == output)).unwrap().name.clone()
}

fn compile_err(m: &Model, b: &Binding, what: &str) -> CompileError {
    match compile(m, b) {
        Ok(_) => panic!("{what}: the broken graph compiled"),
        Err(e) => e,
    }
}

/// The unmutated graphs compile, so every failure below is the mutation's.
#[test]
fn unmutated_graphs_compile_in_every_variant() {
    let b = binding();
    for v in Variant::ALL {
        compile(&model(v), &b).unwrap_or_else(|e| panic!("{v:?}: {e}"));
    }
}

#[test]
fn broken_graphs_are_errors_naming_the_node_and_reason() {
    let b = binding();
    type Mutation = Box<dyn Fn(&mut Model) -> String>;
    let cases: Vec<(&str, Mutation, &str)> = vec![
        (
            "unsupported op",
            Box::new(|m| {
                let i = first(m, "Sigmoid");
                m.graph.nodes[i].op_type = "NonMaxSuppression".into();
                m.graph.nodes[i].name.clone()
            }),
            "ai.onnx::NonMaxSuppression has no native-cpu kernel",
        ),
        (
            "unknown domain",
            Box::new(|m| {
                let i = first(m, "Sigmoid");
                m.graph.nodes[i].domain = "com.example".into();
                m.graph.nodes[i].name.clone()
            }),
            "com.example::Sigmoid has no native-cpu kernel",
        ),
        (
            "matmul shape mismatch",
            Box::new(|m| {
                let w = m.graph.initializers.iter_mut().find(|t| t.name.ends_with("q_proj.weight")).unwrap();
                *w = Tensor::from_f32(w.name.clone(), vec![48, 64], &vec![0.0; 48 * 64]);
                let name = w.name.clone();
                m.graph.nodes.iter().find(|n| n.op_type == "MatMul" && n.inputs[1] == name).unwrap().name.clone()
            }),
            "inner dimensions differ: 64 vs 48",
        ),
        (
            "dtype mismatch",
            Box::new(|m| {
                let i = first(m, "Sigmoid");
                let input = m.graph.nodes[i].inputs[0].clone();
                let j = m.graph.nodes.iter().position(|n| n.op_type == "Mul" && n.inputs.contains(&input)).unwrap();
                m.graph.initializers.push(Tensor::from_i64("an_int", vec![1], &[2]));
                m.graph.nodes[j].inputs[1] = "an_int".into();
                m.graph.nodes[j].name.clone()
            }),
            "operand dtypes differ: f32 and i64",
        ),
        (
            "wrong KV shape",
            Box::new(|m| {
                let past = m.graph.inputs.iter_mut().find(|i| i.name == "past_key_values.0.key").unwrap();
                if let Some(s) = past.shape.as_mut() {
                    s[1] = Dim::Fixed(3);
                }
                producer_of(m, "present.0.key")
            }),
            "differ at axis 1 (3 vs 2)",
        ),
        (
            "KV dtype mismatch",
            Box::new(|m| {
                let past = m.graph.inputs.iter_mut().find(|i| i.name == "past_key_values.1.value").unwrap();
                past.dtype = DataType::Float16;
                producer_of(m, "present.1.value")
            }),
            "operand dtypes differ: f16 and f32",
        ),
        (
            "KV cache read outside a recognized attention",
            Box::new(|m| {
                let i = first(m, "Softmax");
                m.graph.nodes[i].attributes[0].value = AttrValue::Int(2);
                producer_of(m, "present.0.key")
            }),
            "reads the KV cache input `past_key_values.0.key` outside an attention",
        ),
        (
            "cast to an unsupported dtype",
            Box::new(|m| {
                let i = first(m, "Cast");
                m.graph.nodes[i].attributes[0].value = AttrValue::Int(DataType::Int8.onnx_code().into());
                m.graph.nodes[i].name.clone()
            }),
            "cast to ONNX type 3",
        ),
        (
            "logits not a graph output",
            Box::new(|m| {
                m.graph.outputs.retain(|o| o.name != "logits");
                "logits".into()
            }),
            "the logits port is not a graph output",
        ),
        (
            "input never produced",
            Box::new(|m| {
                let i = first(m, "Sigmoid");
                m.graph.nodes[i].inputs[0] = "no_such_tensor".into();
                m.graph.nodes[i].name.clone()
            }),
            "input `no_such_tensor` is never produced",
        ),
        (
            "transpose perm of the wrong rank",
            Box::new(|m| {
                let i = first(m, "Transpose");
                m.graph.nodes[i].attributes[0].value = AttrValue::Ints(vec![0, 2, 1]);
                m.graph.nodes[i].name.clone()
            }),
            "perm [0, 2, 1] does not match rank 4",
        ),
        (
            "tensor produced twice",
            Box::new(|m| {
                let i = first(m, "Sigmoid");
                let j = first(m, "Sqrt");
                m.graph.nodes[j].outputs[0] = m.graph.nodes[i].outputs[0].clone();
                m.graph.nodes[i].outputs[0].clone()
            }),
            "is produced by more than one node",
        ),
    ];
    for (what, mutate, want) in cases {
        let mut m = model(Variant::Decomposed);
        let named = mutate(&mut m);
        let err = compile_err(&m, &b, what).to_string();
        assert!(err.contains(want), "{what}: expected `{want}` in: {err}");
        assert!(err.contains(&named), "{what}: the error does not name `{named}`: {err}");
    }
}

/// Contrib and opset-23 forms: unsupported attribute values are refused by
/// the op that carries them.
#[test]
fn unsupported_fused_op_settings_are_errors() {
    let b = binding();
    let cases: Vec<(Variant, &str, &str, AttrValue, &str)> = vec![
        (Variant::Contrib, "MatMulNBits", "bits", AttrValue::Int(8), "bits=8: only 4-bit blocks are supported"),
        (Variant::Contrib, "GroupQueryAttention", "local_window_size", AttrValue::Int(16), "sliding-window"),
        (Variant::Contrib, "RotaryEmbedding", "interleaved", AttrValue::Int(1), "interleaved rotary"),
        (Variant::Opset23, "Attention", "softcap", AttrValue::Int(1), "softcap"),
        (Variant::Opset23, "RMSNormalization", "axis", AttrValue::Int(1), "axis=1"),
        (Variant::Genai, "GroupQueryAttention", "rotary_interleaved", AttrValue::Int(1), "interleaved rotary"),
        (Variant::Genai, "GroupQueryAttention", "do_rotary", AttrValue::Int(2), "do_rotary=2"),
        (Variant::Genai, "MatMulNBits", "accuracy_level", AttrValue::Int(7), "accuracy_level=7"),
        // A block off ONNX Runtime's powers of two (the int8-input path
        // read other blocks' scales), and a head count whose cast to usize
        // wrapped the kernels' buffer sizes.
        (Variant::Genai, "MatMulNBits", "block_size", AttrValue::Int(48), "block_size=48 (a power of two"),
        (
            Variant::Opset23,
            "Attention",
            "q_num_heads",
            AttrValue::Int(-4_611_686_018_427_387_900),
            "q_num_heads -4611686018427387900 must be positive",
        ),
    ];
    for (variant, op, attr, value, want) in cases {
        let mut m = model(variant);
        let i = first(&mut m, op);
        m.graph.nodes[i].attributes.retain(|a| a.name != attr);
        m.graph.nodes[i].attributes.push(onnx_genai_onnx::ir::Attribute { name: attr.into(), value });
        let name = m.graph.nodes[i].name.clone();
        let err = compile_err(&m, &b, op).to_string();
        assert!(err.contains(want) && err.contains(&name), "{variant:?} {op}.{attr}: {err}");
    }
}

/// `MatMulNBits` sizes whose weight count overflows are a compile error
/// naming the node: K = i64::MAX over blocks of 32 made N x blocks x 16
/// bytes wrap (a panic with overflow checks; in release a wrapped count
/// that an empty initializer could match).
#[test]
fn matmul_nbits_sizes_that_overflow_are_errors() {
    let b = binding();
    let mut m = model(Variant::Contrib);
    let i = first(&mut m, "MatMulNBits");
    // Its input through a reshape to its own run-time shape: a last axis
    // compile time does not know, so K is checked against nothing before.
    let x = m.graph.nodes[i].inputs[0].clone();
    let node = |op: &str, inputs: &[&str], output: &str| onnx_genai_onnx::ir::Node {
        name: format!("unknown_{output}"),
        op_type: op.into(),
        domain: String::new(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        outputs: vec![output.into()],
        attributes: Vec::new(),
    };
    m.graph.nodes.insert(i, node("Reshape", &[&x, "unknown_shape"], "unknown_rows"));
    m.graph.nodes.insert(i, node("Shape", &[&x], "unknown_shape"));
    let i = i + 2;
    m.graph.nodes[i].inputs[0] = "unknown_rows".into();
    m.graph.nodes[i].attributes.retain(|a| a.name != "K");
    m.graph.nodes[i]
        .attributes
        .push(onnx_genai_onnx::ir::Attribute { name: "K".into(), value: AttrValue::Int(i64::MAX) });
    let name = m.graph.nodes[i].name.clone();
    let err = compile_err(&m, &b, "K = i64::MAX").to_string();
    assert!(err.contains("more weights than can be addressed") && err.contains(&name), "{err}");
}

/// ONNX Runtime GenAI's forms: rotary inside attention needs its caches,
/// and `GatherBlockQuantized` is supported for 4-bit rows only.
#[test]
fn genai_layout_ops_refuse_what_they_cannot_run() {
    let b = binding();
    let mut m = model(Variant::Genai);
    let i = first(&mut m, "GroupQueryAttention");
    m.graph.nodes[i].inputs[7] = String::new();
    let err = compile_err(&m, &b, "rotary without caches").to_string();
    assert!(err.contains("needs the cos_cache and sin_cache") && err.contains(&m.graph.nodes[i].name), "{err}");

    let mut m = model(Variant::Genai);
    let i = first(&mut m, "GroupQueryAttention");
    m.graph.nodes[i].inputs[2] = "past_key_values.0.value".into();
    let err = compile_err(&m, &b, "value without key").to_string();
    assert!(err.contains("key without value"), "{err}");

    // The f16 spec's genai export shares its 4-bit table with the embedding.
    let shared = onnx_genai_test_support::spec("tiny-llama-f16");
    let (_dir, package) = onnx_genai_test_support::build_variant("tiny-llama-f16", Variant::Genai);
    let shared_binding = Binding::from_package(&package).unwrap().0;
    let base = build_decoder(&shared, Variant::Genai).unwrap();
    compile(&base, &shared_binding).unwrap();
    for (attr, value, want) in [
        ("bits", 8, "bits=8: only 4-bit blocks are supported"),
        ("quantize_axis", 0, "quantize_axis=0"),
        ("block_size", 24, "block_size=24"),
    ] {
        let mut m = base.clone();
        let i = first(&mut m, "GatherBlockQuantized");
        m.graph.nodes[i].attributes.retain(|a| a.name != attr);
        m.graph.nodes[i]
            .attributes
            .push(onnx_genai_onnx::ir::Attribute { name: attr.into(), value: AttrValue::Int(value) });
        let err = compile_err(&m, &shared_binding, attr).to_string();
        assert!(err.contains(want) && err.contains(&m.graph.nodes[i].name), "{attr}: {err}");
    }
}
