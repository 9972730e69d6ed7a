//! native-cuda on the machine at hand: with a GPU it loads a package and
//! decodes; without one it says so with a typed error.

use onnx_genai_backend::{BackendError, Decoder};
use onnx_genai_cuda::CudaModel;

/// Choosing native-cuda on a machine without a CUDA driver or device is
/// `BackendError::Unavailable` naming what is missing (never a panic, never
/// a compile error about the package); where a GPU is (and always under
/// `ONNX_GENAI_REQUIRE_GPU=1`, the gpu lane) the model loads and a decode
/// step returns finite logits of the vocabulary's width.
#[test]
fn native_cuda_loads_on_a_gpu_and_says_why_not_elsewhere() {
    let (_dir, package) = onnx_genai_test_support::build("tiny-llama-gqa");
    let required = std::env::var("ONNX_GENAI_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match onnx_genai_cuda::probe() {
        Ok(device) => {
            let model = CudaModel::load(&package).unwrap_or_else(|e| panic!("{device}: {e}"));
            let mut decoder = Decoder::new(std::sync::Arc::new(model));
            let logits = decoder.forward(&[1, 2, 3]).unwrap();
            assert_eq!(logits.len(), 384);
            assert!(logits.iter().all(|v| v.is_finite()));
        }
        Err(probe) => {
            assert!(!required, "ONNX_GENAI_REQUIRE_GPU=1 but no GPU is usable: {probe}");
            let err = CudaModel::load(&package).err().expect("native-cuda loaded without a GPU");
            match &err {
                BackendError::Unavailable { backend, reason } => {
                    assert_eq!(*backend, "native-cuda");
                    assert!(reason.contains("CUDA"), "{reason}");
                }
                other => panic!("expected Unavailable, got {other:?}"),
            }
        }
    }
}
