//! ONNX external data: initializers written beside the model, read back
//! memory-mapped, loaded by ONNX Runtime, and confined to the model's
//! directory.

use std::path::Path;

use onnx_genai_onnx::builder::attr_ints;
use onnx_genai_onnx::proto::ModelProto;
use onnx_genai_onnx::{decode, read_model, write_model_external, DataType, Dim, GraphBuilder, OnnxError, Tensor};
use prost::Message;

fn model() -> onnx_genai_onnx::Model {
    let mut b = GraphBuilder::new("external", 17);
    b.input("x", DataType::Float, vec![Dim::Symbolic("batch".into()), Dim::Fixed(3)]);
    b.output("y", DataType::Float, vec![Dim::Fixed(3), Dim::Symbolic("batch".into())]);
    let w = b.initializer(Tensor::from_f32("w", vec![3], &[1.5, -2.0, 0.25]));
    let bias = b.initializer(Tensor::from_f32("bias", vec![3], &[1.0, 0.0, -1.0]));
    let scaled = b.op("Mul", &["x", &w]);
    let shifted = b.op("Add", &[&scaled, &bias]);
    b.op_into("Transpose", &[&shifted], &["y"], vec![attr_ints("perm", &[1, 0])]);
    b.finish(8, "test")
}

fn written(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("model.onnx");
    let moved = write_model_external(&path, &model(), 1).unwrap();
    assert_eq!(moved, 4096 + 12, "two tensors, the second page-aligned");
    path
}

/// Edits the model file's protobuf in place.
fn edit(path: &Path, f: impl FnOnce(&mut ModelProto)) {
    let mut proto = ModelProto::decode(std::fs::read(path).unwrap().as_slice()).unwrap();
    f(&mut proto);
    std::fs::write(path, proto.encode_to_vec()).unwrap();
}

fn set_location(path: &Path, location: &str) {
    edit(path, |p| {
        let t = &mut p.graph.as_mut().unwrap().initializer[0];
        t.external_data.iter_mut().find(|e| e.key == "location").unwrap().value = location.into();
    });
}

fn external_error(path: &Path) -> String {
    match read_model(path) {
        Err(e @ OnnxError::External { .. }) => e.to_string(),
        other => panic!("expected an external-data error, got {other:?}"),
    }
}

/// Written external, read back mapped with the same values; the model file
/// holds no tensor bytes; ONNX Runtime loads it from its file and computes.
#[test]
fn external_data_round_trips_and_onnx_runtime_loads_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = written(dir.path());
    assert!(dir.path().join("model.onnx.data").is_file());
    let back = read_model(&path).unwrap();
    let original = model();
    assert_eq!(back.graph.initializers.len(), original.graph.initializers.len());
    for (a, b) in back.graph.initializers.iter().zip(&original.graph.initializers) {
        assert!(a.raw.is_mapped(), "{} was copied, not mapped", a.name);
        assert_eq!((&a.name, a.dims.clone(), a.to_f32().unwrap()), (&b.name, b.dims.clone(), b.to_f32().unwrap()));
    }
    let err = decode(&std::fs::read(&path).unwrap()).unwrap_err().to_string();
    assert!(err.contains("external data needs the model's directory"), "{err}");

    let env = onnx_genai_ort::environment().expect("ONNX Runtime (run `cargo xtask ort`)");
    let mut session = ort::session::Session::builder(env).unwrap().commit_from_file(&path).unwrap();
    let x = ort::value::Tensor::from_array(([2usize, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])).unwrap();
    let outputs = session.run(vec![("x", x.into_dyn())]).unwrap();
    let (_, y) = outputs[0].try_extract_tensor::<f32>().unwrap();
    assert_eq!(y, [2.5, 7.0, -4.0, -10.0, -0.25, 0.5]);
}

#[test]
fn a_missing_external_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = written(dir.path());
    std::fs::remove_file(dir.path().join("model.onnx.data")).unwrap();
    let err = external_error(&path);
    assert!(err.contains("initializer 'w'") && err.contains("model.onnx.data") && err.contains("missing"), "{err}");
}

#[test]
fn a_short_external_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = written(dir.path());
    let data = dir.path().join("model.onnx.data");
    let bytes = std::fs::read(&data).unwrap();
    std::fs::write(&data, &bytes[..bytes.len() - 4]).unwrap();
    let err = external_error(&path);
    assert!(
        err.contains("initializer 'bias'") && err.contains("needs bytes 4096..4108 but the file has 4104"),
        "{err}"
    );
}

/// `..`, absolute paths and links out of the directory are refused.
#[test]
fn external_paths_are_confined_to_the_model_directory() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("stolen.data"), [0u8; 64]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = written(dir.path());
    set_location(&path, "../stolen.data");
    assert!(external_error(&path).contains("leaves the model's directory"));
    set_location(&path, &outside.path().join("stolen.data").display().to_string());
    assert!(external_error(&path).contains("leaves the model's directory"));
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(outside.path().join("stolen.data"), dir.path().join("link.data")).unwrap();
        set_location(&path, "link.data");
        assert!(external_error(&path).contains("through a link"));
    }
}

/// A `length` that disagrees with the tensor's dims is refused.
#[test]
fn a_wrong_length_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = written(dir.path());
    edit(&path, |p| {
        let t = &mut p.graph.as_mut().unwrap().initializer[0];
        t.external_data.iter_mut().find(|e| e.key == "length").unwrap().value = "8".into();
    });
    assert!(external_error(&path).contains("`length` is 8 but the tensor's dims need 12 bytes"));
}

/// Issue 20, finding 6: a sparse initializer whose values live in external
/// data outside the model's directory used to pass (the reader skipped
/// sparse initializers unread, so their paths went unchecked). The IR holds
/// no sparse tensors, so any sparse initializer is a typed refusal naming it.
#[test]
fn a_sparse_initializer_is_refused_not_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = written(dir.path());
    edit(&path, |p| {
        let g = p.graph.as_mut().unwrap();
        let mut values = g.initializer[0].clone();
        values.name = "escaping".into();
        values.external_data.iter_mut().find(|e| e.key == "location").unwrap().value = "../../etc/passwd".into();
        g.sparse_initializer.push(onnx_genai_onnx::proto::SparseTensorProto {
            values: Some(values),
            indices: None,
            dims: vec![3],
        });
    });
    match read_model(&path) {
        Err(e @ OnnxError::Unsupported { .. }) => {
            let text = e.to_string();
            assert!(text.contains("sparse initializer `escaping`"), "{text}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}
