#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| onnx_genai_fuzz::fuzz(onnx_genai_fuzz::Target::Chat, data));
