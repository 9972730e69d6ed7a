//! GGUF reading against files written byte by byte here, and
//! dequantization against blocks computed by hand.

use half::f16;

use super::quant::{dequantize, TensorType};
use super::writer::{string, Writer};
use super::*;

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

fn sample() -> Writer {
    let mut w = Writer::default();
    w.str("general.architecture", "llama")
        .kv("k.u8", 0, vec![200])
        .kv("k.i8", 1, vec![0xFE])
        .kv("k.u16", 2, 513u16.to_le_bytes().to_vec())
        .kv("k.i16", 3, (-3i16).to_le_bytes().to_vec())
        .u32("k.u32", 70_000)
        .kv("k.i32", 5, (-70_000i32).to_le_bytes().to_vec())
        .kv("k.f32", 6, 0.5f32.to_le_bytes().to_vec())
        .kv("k.bool", 7, vec![1])
        .kv("k.u64", 10, (1u64 << 40).to_le_bytes().to_vec())
        .kv("k.i64", 11, (-5i64).to_le_bytes().to_vec())
        .kv("k.f64", 12, 0.25f64.to_le_bytes().to_vec())
        .kv("k.array", 9, {
            let mut p = 8u32.to_le_bytes().to_vec();
            p.extend(2u64.to_le_bytes());
            p.extend(string("a b"));
            p.extend(string("ü"));
            p
        })
        .tensor("v", &[3], 0, [1.0f32, -2.0, 3.5].iter().flat_map(|x| x.to_le_bytes()).collect())
        .tensor("h", &[2], 1, [f16_bytes(0.5), f16_bytes(-4.0)].concat());
    w
}

/// Every metadata type reads back with its value; tensor infos land at
/// aligned absolute offsets.
#[test]
fn header_metadata_and_tensor_infos() {
    let g = Gguf::parse(sample().bytes()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 32);
    let m = |k: &str| g.get(k).unwrap().clone();
    assert_eq!(m("k.u8"), Value::U8(200));
    assert_eq!(m("k.i8"), Value::I8(-2));
    assert_eq!(m("k.u16"), Value::U16(513));
    assert_eq!(m("k.i16"), Value::I16(-3));
    assert_eq!(m("k.u32"), Value::U32(70_000));
    assert_eq!(m("k.i32"), Value::I32(-70_000));
    assert_eq!(m("k.f32"), Value::F32(0.5));
    assert_eq!(m("k.bool"), Value::Bool(true));
    assert_eq!(m("k.u64"), Value::U64(1 << 40));
    assert_eq!(m("k.i64"), Value::I64(-5));
    assert_eq!(m("k.f64"), Value::F64(0.25));
    assert_eq!(m("k.array"), Value::Array(vec![Value::String("a b".into()), Value::String("ü".into())]));
    assert_eq!(m("general.architecture").as_str(), Some("llama"));
    let v = g.tensor("v").unwrap();
    assert_eq!((v.dims.clone(), v.ty, v.bytes), (vec![3], TensorType::F32, 12));
    assert_eq!(v.offset % 32, 0);
    assert_eq!(g.dequantize(v), [1.0, -2.0, 3.5]);
    let h = g.tensor("h").unwrap();
    assert_eq!(h.offset, v.offset + 32);
    assert_eq!(g.dequantize(h), [0.5, -4.0]);
}

/// Every cut of a valid file is an error that names an offset and field,
/// never a panic; a cut inside the tensor data names that tensor.
#[test]
fn truncated_files_name_offset_and_field() {
    let bytes = sample().bytes();
    for len in 0..bytes.len() {
        let err = Gguf::parse(bytes[..len].to_vec()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, GgufError::Truncated { .. } | GgufError::Magic { .. }), "cut at {len}: {text}");
        if len >= 4 {
            assert!(text.contains("at byte") && text.contains("while reading"), "cut at {len}: {text}");
        }
    }
    let cut = Gguf::parse(bytes[..bytes.len() - 1].to_vec()).unwrap_err().to_string();
    assert!(cut.contains("data of tensor `h`"), "{cut}");
}

#[test]
fn corrupt_headers_are_named() {
    let mut bytes = sample().bytes();
    bytes[0] = b'X';
    assert!(matches!(Gguf::parse(bytes).unwrap_err(), GgufError::Magic { .. }));
    let mut bytes = sample().bytes();
    bytes[4] = 9;
    assert_eq!(Gguf::parse(bytes).unwrap_err().to_string(), "GGUF version 9 is not supported (versions 2 and 3 are)");
    let mut w = Writer::default();
    w.kv("bad", 13, vec![0; 8]);
    let err = Gguf::parse(w.bytes()).unwrap_err().to_string();
    assert!(err.contains("unknown value type 13") && err.contains("bad"), "{err}");
    let mut w = Writer::default();
    w.kv("huge", 9, {
        let mut p = 8u32.to_le_bytes().to_vec();
        p.extend(u64::MAX.to_le_bytes());
        p
    });
    let err = Gguf::parse(w.bytes()).unwrap_err().to_string();
    assert!(err.contains("array elements"), "{err}");
    let mut w = Writer::default();
    w.tensor("q", &[32], 12, vec![0; 144]);
    let err = Gguf::parse(w.bytes()).unwrap_err().to_string();
    assert!(err.contains("tensor `q` has type Q4_K (ggml type 12), which is not supported"), "{err}");
    let mut w = Writer::default();
    w.tensor("odd", &[31], 8, vec![0; 34]);
    let err = Gguf::parse(w.bytes()).unwrap_err().to_string();
    assert!(err.contains("not a whole number of Q8_0 blocks"), "{err}");
    // 2^62 f32 values count in a u64, their bytes do not (found by the gguf
    // fuzz target: the multiplication overflowed).
    let mut w = Writer::default();
    w.tensor("huge", &[1 << 62], 0, vec![]);
    let err = Gguf::parse(w.bytes()).unwrap_err().to_string();
    assert!(err.contains("`huge`") && err.contains("overflow 64 bits"), "{err}");
}

/// Sizes a small file may declare but not hold: a metadata array of more
/// than 2^24 elements (each 32 bytes once read: a 17 MB file asked 540 MB),
/// and tensors whose data overlap (every tensor of a model reading the
/// same bytes: a 10 MB file declared a model of 100 GB).
#[test]
fn sizes_a_file_cannot_hold_are_refused() {
    let count = (1u64 << 24) + 1;
    let mut w = Writer::default();
    w.kv("many", 9, {
        let mut p = 0u32.to_le_bytes().to_vec();
        p.extend(count.to_le_bytes());
        p.extend(vec![0u8; count as usize]);
        p
    });
    let err = Gguf::parse(w.bytes()).unwrap_err().to_string();
    assert!(err.contains("16777217 elements, more than the 16777216"), "{err}");

    let values = |n: usize| vec![0u8; 4 * n];
    let mut w = Writer::default();
    w.tensor("a", &[8], 0, values(8)).tensor("b", &[8], 0, values(8));
    let bytes = w.bytes();
    assert!(Gguf::parse(bytes.clone()).is_ok(), "the file as written reads");
    // Tensor `b`'s info: its name, one dim of 8, F32, then its offset (32).
    let mut info = string("b");
    info.extend(1u32.to_le_bytes());
    info.extend(8u64.to_le_bytes());
    info.extend(0u32.to_le_bytes());
    let at = bytes.windows(info.len()).position(|w| w == info.as_slice()).unwrap() + info.len();
    assert_eq!(bytes[at..at + 8], 32u64.to_le_bytes());
    let mut shared = bytes;
    shared[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    let err = Gguf::parse(shared).unwrap_err().to_string();
    assert!(err.contains("data of tensor `b`") && err.contains("overlaps the data of `a`"), "{err}");
}

/// Q8_0: d = 0.5; q = -128, -1, 0, 1, 127, then zeros.
#[test]
fn q8_0_block_by_hand() {
    let mut block = f16_bytes(0.5).to_vec();
    let qs: [i8; 32] = std::array::from_fn(|i| [-128, -1, 0, 1, 127].get(i).copied().unwrap_or(0));
    block.extend(qs.iter().map(|q| *q as u8));
    let v = dequantize(TensorType::Q8_0, &block);
    assert_eq!(v.len(), 32);
    assert_eq!(&v[..5], &[-64.0, -0.5, 0.0, 0.5, 63.5]);
    assert!(v[5..].iter().all(|x| *x == 0.0));
}

/// Q4_0: d = 2; byte j holds value j (low nibble) and value j + 16 (high
/// nibble); stored q means d·(q − 8).
#[test]
fn q4_0_block_by_hand() {
    let mut block = f16_bytes(2.0).to_vec();
    block.extend((0..16u8).map(|j| (j % 16) | ((15 - j) << 4)));
    let v = dequantize(TensorType::Q4_0, &block);
    assert_eq!(v[0], 2.0 * (0.0 - 8.0));
    assert_eq!(v[15], 2.0 * (15.0 - 8.0));
    assert_eq!(v[16], 2.0 * (15.0 - 8.0));
    assert_eq!(v[31], 2.0 * (0.0 - 8.0));
    assert_eq!(v[9], 2.0);
}

/// Q4_1: d = 0.25, m = -1; value = d·q + m.
#[test]
fn q4_1_block_by_hand() {
    let mut block = f16_bytes(0.25).to_vec();
    block.extend(f16_bytes(-1.0));
    block.extend((0..16u8).map(|j| j | (3 << 4)));
    let v = dequantize(TensorType::Q4_1, &block);
    assert_eq!(v[0], -1.0);
    assert_eq!(v[4], 0.0);
    assert_eq!(v[15], 0.25 * 15.0 - 1.0);
    assert!(v[16..].iter().all(|x| *x == 0.25 * 3.0 - 1.0));
}

#[test]
fn f16_and_bf16_by_hand() {
    assert_eq!(dequantize(TensorType::F16, &[f16_bytes(1.5), f16_bytes(-0.125)].concat()), [1.5, -0.125]);
    let bf = [half::bf16::from_f32(3.0).to_le_bytes(), half::bf16::from_f32(-2.0).to_le_bytes()].concat();
    assert_eq!(dequantize(TensorType::BF16, &bf), [3.0, -2.0]);
}

/// Bad input names what is unsupported: the architecture, the tokenizer
/// model, the pre-tokenizer, and a missing tensor.
#[test]
fn unsupported_models_are_named() {
    let load = |w: &Writer| {
        let g = Gguf::parse(w.bytes()).unwrap();
        super::weights::spec_from_gguf(&g, "m", "test.gguf").unwrap_err().to_string()
    };
    let mut w = Writer::default();
    w.str("general.architecture", "gpt2");
    assert_eq!(load(&w), "architecture `gpt2` is not supported (general.architecture must be `llama`)");

    let mut w = Writer::default();
    w.str("general.architecture", "llama");
    for (k, v) in
        [("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128), ("attention.head_count", 2)]
    {
        w.u32(&format!("llama.{k}"), v);
    }
    w.u32("llama.context_length", 256);
    assert_eq!(load(&w), "tensor `token_embd.weight` is missing");

    // Geometry that would divide by zero, split rows of zero width or
    // overflow `kv_heads * head_dim` is named before any tensor is read.
    let geometry = |overrides: &[(&str, u32)]| {
        let mut w = Writer::default();
        w.str("general.architecture", "llama");
        for (k, v) in [
            ("block_count", 1),
            ("embedding_length", 64),
            ("feed_forward_length", 128),
            ("attention.head_count", 2),
            ("attention.head_count_kv", 2),
            ("context_length", 256),
        ] {
            let v = overrides.iter().find(|(o, _)| *o == k).map_or(v, |(_, v)| *v);
            w.u32(&format!("llama.{k}"), v);
        }
        load(&w)
    };
    assert_eq!(geometry(&[("feed_forward_length", 0)]), "llama.feed_forward_length is 0");
    assert_eq!(geometry(&[("embedding_length", 0)]), "llama.embedding_length is 0");
    assert_eq!(geometry(&[("attention.head_count_kv", 0)]), "llama.attention.head_count_kv is 0");
    assert!(geometry(&[("attention.head_count_kv", u32::MAX)]).contains("KV heads must divide the heads"));
    assert!(geometry(&[("attention.head_count", 3)]).contains("KV heads must divide the heads"));
    assert!(geometry(&[("attention.head_count", 64), ("attention.head_count_kv", 64)]).contains("even head size"));

    let tokenizer_error = |model: &str, pre: &str| {
        let mut w = Writer::default();
        w.str("tokenizer.ggml.model", model).str("tokenizer.ggml.pre", pre);
        let g = Gguf::parse(w.bytes()).unwrap();
        super::tokenizer::tokenizer_json(&g).unwrap_err().to_string()
    };
    assert!(tokenizer_error("llama", "default").contains("tokenizer model `llama` is not supported"));
    let mut w = Writer::default();
    w.str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", "qwen2")
        .strings("tokenizer.ggml.tokens", &["a", "b", "ab"])
        .strings("tokenizer.ggml.merges", &["a b"]);
    let g = Gguf::parse(w.bytes()).unwrap();
    let err = super::tokenizer::tokenizer_json(&g).unwrap_err().to_string();
    assert!(err.contains("pre-tokenizer `qwen2` is not supported"), "{err}");
}

/// A minimal byte-level vocabulary builds a tokenizer that loads and
/// encodes with its merge.
#[test]
fn a_small_vocabulary_becomes_a_tokenizer() {
    let mut w = Writer::default();
    w.str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", "smollm")
        .strings("tokenizer.ggml.tokens", &["<|end|>", "a", "b", "ab", "1", "2"])
        .kv("tokenizer.ggml.token_type", 9, {
            let mut p = 5u32.to_le_bytes().to_vec();
            p.extend(6u64.to_le_bytes());
            [3i32, 1, 1, 1, 1, 1].iter().for_each(|t| p.extend(t.to_le_bytes()));
            p
        })
        .strings("tokenizer.ggml.merges", &["a b"]);
    let g = Gguf::parse(w.bytes()).unwrap();
    let t = tokenizers::Tokenizer::from_bytes(super::tokenizer::tokenizer_json(&g).unwrap().as_bytes()).unwrap();
    let enc = t.encode("ab12<|end|>", false).unwrap();
    assert_eq!(enc.get_tokens(), ["ab", "1", "2", "<|end|>"]);
    assert_eq!(enc.get_ids(), [3, 4, 5, 0]);
}
