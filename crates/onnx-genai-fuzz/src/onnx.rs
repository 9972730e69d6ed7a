//! ONNX bytes decoded and compiled by the native compiler: as a standalone
//! graph (every input bound by name, as the ONNX node tests run) and as a
//! decoder bound to the fixture package's ports (the passes a package's
//! export goes through: KV binding, fusion, repacking).

use crate::fixture;

pub(crate) fn run(data: &[u8]) -> Result<(), String> {
    let model = onnx_genai_onnx::decode(data).map_err(|e| e.to_string())?;
    // What the IR encodes must decode again (the builder writes packages
    // this way).
    if let Err(e) = onnx_genai_onnx::decode(&onnx_genai_onnx::encode(&model)) {
        panic!("a decoded model does not survive encode + decode: {e}");
    }
    let standalone = onnx_genai_native::compile_graph(&model).map(drop);
    let binding = match onnx_genai_native::Binding::from_package(fixture::package()) {
        Ok((binding, _)) => binding,
        Err(e) => panic!("fuzz fixture: no decoder binding: {e}"),
    };
    // Deep means either form compiled: a decoder cannot run standalone
    // (attention needs its KV cache), an operator graph has no decoder
    // ports.
    match (standalone, onnx_genai_native::compile(&model, &binding)) {
        (Err(alone), Err(decoder)) => Err(format!("standalone: {alone}; as the decoder: {decoder}")),
        _ => Ok(()),
    }
}
