//! ONNX protobuf I/O: round trips, reading the reference Python writer's
//! output, and ONNX Runtime running what we write.

use onnx_genai_onnx::builder::attr_ints;
use onnx_genai_onnx::{decode, encode, AttrValue, DataType, Dim, GraphBuilder, Tensor};

const PYTHON_FIXTURE: &[u8] = include_bytes!("fixtures/python_onnx_model.onnx");

fn small_model() -> onnx_genai_onnx::Model {
    let mut b = GraphBuilder::new("small", 17);
    b.input("x", DataType::Float, vec![Dim::Symbolic("batch".into()), Dim::Fixed(3)]);
    b.output("y", DataType::Float, vec![Dim::Fixed(3), Dim::Symbolic("batch".into())]);
    let w = b.initializer(Tensor::from_f32("w", vec![3], &[1.5, -2.0, 0.25]));
    let scaled = b.op("Mul", &["x", &w]);
    b.op_into("Transpose", &[&scaled], &["y"], vec![attr_ints("perm", &[1, 0])]);
    b.finish(8, "test")
}

#[test]
fn encode_decode_round_trip_is_lossless() {
    let model = small_model();
    let bytes = encode(&model);
    let back = decode(&bytes).unwrap();
    assert_eq!(back, model);
    assert_eq!(encode(&back), bytes, "re-encoding is byte-stable");
}

/// The reference writer stores small tensors in typed fields (`float_data`)
/// and uses TENSOR and INTS attributes; all must come through.
#[test]
fn decodes_a_model_written_by_python_onnx() {
    let model = decode(PYTHON_FIXTURE).unwrap();
    assert_eq!(model.producer_name, "onnx-python");
    assert_eq!(model.opset(""), Some(17));
    let g = &model.graph;
    assert_eq!(g.name, "python_fixture");
    assert_eq!(g.inputs[0].shape, Some(vec![Dim::Symbolic("batch".into()), Dim::Fixed(3)]));
    assert_eq!(g.initializer("w").unwrap().to_f32().unwrap(), vec![0.5, -2.0, 4.0]);
    let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
    assert_eq!(ops, ["Constant", "Add", "Mul", "Add", "Transpose"]);
    match g.nodes[0].attr("value") {
        Some(AttrValue::Tensor(t)) => assert_eq!(t.to_f32().unwrap(), vec![1.25]),
        other => panic!("Constant value attribute: {other:?}"),
    }
    assert_eq!(g.nodes[4].attr("perm"), Some(&AttrValue::Ints(vec![1, 0])));
}

/// A tensor whose payload is shorter than its dims is a typed error naming it.
#[test]
fn short_payload_is_an_error_naming_the_tensor() {
    let mut model = small_model();
    let short = model.graph.initializers[0].raw[..8].to_vec();
    model.graph.initializers[0].raw = short.into();
    let err = decode(&encode(&model)).unwrap_err();
    assert!(err.to_string().contains("initializer 'w'"), "{err}");
}

/// An empty initializer whose other dims are huge (`[0, 2^40]`: no
/// bytes, but kernels size index buffers and loops by its axes) is a
/// typed error naming it, as is one past 2^32 elements; `[0, 2^32]` and a
/// real empty tensor read.
#[test]
fn an_empty_tensor_spanning_past_2_32_is_an_error_naming_it() {
    for (dims, readable) in [
        (vec![0, 1i64 << 40], false),
        (vec![1i64 << 20, 0, 1 << 13], false),
        (vec![0, 1 << 32], true),
        (vec![0, 3], true),
    ] {
        let mut model = small_model();
        model.graph.initializers.push(Tensor::from_f32("empty", dims.clone(), &[]));
        let read = decode(&encode(&model));
        assert_eq!(read.is_ok(), readable, "{dims:?}: {read:?}");
        if let Err(err) = read {
            assert!(err.to_string().contains("initializer 'empty'") && err.to_string().contains("span"), "{err}");
        }
    }
}

fn run_in_ort(bytes: &[u8], inputs: Vec<(&str, ort::value::DynValue)>) -> Vec<f32> {
    let env = onnx_genai_ort::environment().expect("ONNX Runtime (run `cargo xtask ort`)");
    let mut session = ort::session::Session::builder(env).unwrap().commit_from_memory(bytes).unwrap();
    let outputs = session.run(inputs).unwrap();
    let (_, data) = outputs[0].try_extract_tensor::<f32>().unwrap();
    data.to_vec()
}

/// ONNX Runtime loads and runs what we encode, including a decoded-and-
/// re-encoded model from the Python writer.
#[test]
fn onnx_runtime_runs_what_we_write() {
    // Loads the library; the `ort` crate must not be touched before this.
    onnx_genai_ort::environment().expect("ONNX Runtime (run `cargo xtask ort`)");
    let x = || ort::value::Tensor::from_array(([2usize, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])).unwrap().into_dyn();
    let ours = run_in_ort(&encode(&small_model()), vec![("x", x())]);
    assert_eq!(ours, vec![1.5, 6.0, -4.0, -10.0, 0.75, 1.5]);

    let reencoded = encode(&decode(PYTHON_FIXTURE).unwrap());
    let y = ort::value::Tensor::from_array(([2usize, 3], vec![1.0f32; 6])).unwrap().into_dyn();
    let got = run_in_ort(&reencoded, vec![("x", x()), ("y", y)]);
    // z = transpose((x + y) * w + 1.25)
    let expected = [2.25, 3.75, -4.75, -10.75, 17.25, 29.25];
    assert_eq!(got, expected);
}
