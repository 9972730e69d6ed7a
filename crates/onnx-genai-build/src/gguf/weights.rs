//! A llama-architecture GGUF → a [`Spec`] carrying its weights in the
//! builder's layout: GGML `[out, in]` matrices transposed to `[in, out]`,
//! and the query/key rows put back in the rotate-half order the graphs use
//! (llama.cpp's converter interleaves each head's two rotary halves).

use std::collections::HashMap;
use std::sync::Arc;

use super::quant::TensorType;
use super::{Gguf, GgufError, TensorInfo, Value};
use crate::pretrained::{transpose, LlamaShape, Pretrained, Q4Blocks, Weight};
use crate::spec::Spec;

/// The spec (f32) and weights of a llama-architecture GGUF, named `name`.
pub fn spec_from_gguf(g: &Gguf, name: &str, origin: &str) -> Result<Spec, GgufError> {
    let arch = g.require("general.architecture", "a string", |v| v.as_str().map(str::to_string))?;
    if arch != "llama" {
        return Err(GgufError::Unsupported(format!(
            "architecture `{arch}` is not supported (general.architecture must be `llama`)"
        )));
    }
    let int = |key: &str| g.require(&format!("llama.{key}"), "an integer", |v| v.as_u64()?.try_into().ok());
    let layers: u32 = int("block_count")?;
    let hidden: u32 = int("embedding_length")?;
    let ffn: u32 = int("feed_forward_length")?;
    let heads: u32 = int("attention.head_count")?;
    let kv_heads: u32 = match g.get("llama.attention.head_count_kv") {
        Some(_) => int("attention.head_count_kv")?,
        None => heads,
    };
    let context: u32 = int("context_length")?;
    // Checked before any tensor is read: a zero would divide by zero or
    // split rows of zero width further on.
    for (key, v) in [
        ("block_count", layers),
        ("embedding_length", hidden),
        ("feed_forward_length", ffn),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv_heads),
        ("context_length", context),
    ] {
        if v == 0 {
            return Err(GgufError::Unsupported(format!("llama.{key} is 0")));
        }
    }
    // Grouped-query attention: KV heads divide the query heads (so
    // `kv_heads * head_dim` never exceeds the hidden size), and rotate-half
    // rotary needs an even head size.
    if !hidden.is_multiple_of(heads)
        || kv_heads > heads
        || !heads.is_multiple_of(kv_heads)
        || !(hidden / heads).is_multiple_of(2)
    {
        return Err(GgufError::Unsupported(format!(
            "{heads} heads ({kv_heads} KV heads) for hidden size {hidden}: KV heads must divide the heads, and the \
             heads an even head size"
        )));
    }
    let float = |key: &str, default: f64| match g.get(&format!("llama.{key}")) {
        None => Ok(default),
        Some(_) => g.require(&format!("llama.{key}"), "a number", Value::as_f64),
    };
    let theta = float("rope.freq_base", 10_000.0)?;
    let eps = float("attention.layer_norm_rms_epsilon", 1e-5)?;
    let embed = tensor(g, "token_embd.weight")?;
    let vocab = embed.dims.get(1).copied().unwrap_or(0) as u32;
    if vocab == 0 {
        return Err(GgufError::Unsupported("tensor `token_embd.weight` has no vocabulary rows".into()));
    }
    let head_dim = hidden / heads;
    if let Some(v) = g.get("llama.rope.dimension_count") {
        if v.as_u64() != Some(head_dim.into()) {
            return Err(GgufError::Unsupported(format!(
                "llama.rope.dimension_count {v:?} differs from the head size {head_dim} (partial rotary is not supported)"
            )));
        }
    }
    let tied = g.tensor("output.weight").is_none();
    let mut weights = HashMap::new();
    let mut put = |hf: String, w: Weight| {
        weights.insert(hf, w);
    };
    put("model.embed_tokens.weight".into(), rows(g, "token_embd.weight", &[hidden, vocab])?);
    for l in 0..layers {
        let (p, b) = (format!("model.layers.{l}"), format!("blk.{l}"));
        put(format!("{p}.input_layernorm.weight"), vector(g, &format!("{b}.attn_norm.weight"), hidden)?);
        put(format!("{p}.post_attention_layernorm.weight"), vector(g, &format!("{b}.ffn_norm.weight"), hidden)?);
        let q = unpermute(matrix(g, &format!("{b}.attn_q.weight"), hidden, hidden)?, heads, head_dim);
        put(format!("{p}.self_attn.q_proj.weight"), transpose(q));
        let k = unpermute(matrix(g, &format!("{b}.attn_k.weight"), hidden, kv_heads * head_dim)?, kv_heads, head_dim);
        put(format!("{p}.self_attn.k_proj.weight"), transpose(k));
        let v = matrix(g, &format!("{b}.attn_v.weight"), hidden, kv_heads * head_dim)?;
        put(format!("{p}.self_attn.v_proj.weight"), transpose(v));
        put(
            format!("{p}.self_attn.o_proj.weight"),
            transpose(matrix(g, &format!("{b}.attn_output.weight"), hidden, hidden)?),
        );
        put(format!("{p}.mlp.gate_proj.weight"), transpose(matrix(g, &format!("{b}.ffn_gate.weight"), hidden, ffn)?));
        put(format!("{p}.mlp.up_proj.weight"), transpose(matrix(g, &format!("{b}.ffn_up.weight"), hidden, ffn)?));
        put(format!("{p}.mlp.down_proj.weight"), transpose(matrix(g, &format!("{b}.ffn_down.weight"), ffn, hidden)?));
    }
    put("model.norm.weight".into(), vector(g, "output_norm.weight", hidden)?);
    if !tied {
        put("lm_head.weight".into(), transpose(matrix(g, "output.weight", hidden, vocab)?));
    }
    let id = |key: &str| g.get(key).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok());
    let pretrained = Pretrained {
        weights,
        tokenizer_json: super::tokenizer::tokenizer_json(g)?,
        chat_template: g.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_string),
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
        sampling: Default::default(),
        max_new_tokens: None,
        origin: origin.into(),
    };
    let shape = LlamaShape {
        hidden,
        layers,
        heads,
        kv_heads,
        ffn,
        vocab,
        context,
        rope_theta: theta,
        norm_epsilon: eps,
        tied,
        qkv_bias: false,
    };
    Ok(shape.spec(name, pretrained))
}

fn tensor<'g>(g: &'g Gguf, name: &str) -> Result<&'g TensorInfo, GgufError> {
    g.tensor(name).ok_or_else(|| GgufError::Unsupported(format!("tensor `{name}` is missing")))
}

/// A tensor whose GGML dims must be exactly `dims`, as row-major values
/// (`dims` reversed).
fn rows(g: &Gguf, name: &str, dims: &[u32]) -> Result<Weight, GgufError> {
    let t = tensor(g, name)?;
    let want: Vec<u64> = dims.iter().map(|d| u64::from(*d)).collect();
    if t.dims != want {
        return Err(GgufError::Unsupported(format!("tensor `{name}` has dims {:?}, expected {want:?}", t.dims)));
    }
    let q4 = (t.ty == TensorType::Q4_1 && dims.len() == 2)
        .then(|| Arc::new(q4_1_blocks(g.raw(t), dims[1] as usize, dims[0] as usize)));
    Ok(Weight { dims: dims.iter().rev().copied().collect(), values: g.dequantize(t), q4 })
}

/// Q4_1 rows (`d`, `m`, then 16 bytes: low nibbles hold elements 0–15,
/// high nibbles 16–31) → [`Q4Blocks`] in `MatMulNBits` nibble order.
fn q4_1_blocks(raw: &[u8], n: usize, k: usize) -> Q4Blocks {
    let blocks = k / 32;
    let (mut packed, mut scales, mut mins) = (Vec::with_capacity(n * blocks * 16), Vec::new(), Vec::new());
    for b in raw.chunks_exact(20) {
        scales.push(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
        mins.push(half::f16::from_le_bytes([b[2], b[3]]).to_f32());
        let q = |e: usize| if e < 16 { b[4 + e] & 0x0F } else { b[4 + e - 16] >> 4 };
        packed.extend((0..16).map(|i| q(2 * i) | (q(2 * i + 1) << 4)));
    }
    Q4Blocks { n, blocks, packed, scales, mins }
}

fn vector(g: &Gguf, name: &str, n: u32) -> Result<Weight, GgufError> {
    rows(g, name, &[n])
}

/// A GGML `[inputs, outputs]` matrix: row-major `[outputs][inputs]`.
fn matrix(g: &Gguf, name: &str, inputs: u32, outputs: u32) -> Result<Weight, GgufError> {
    rows(g, name, &[inputs, outputs])
}

/// Undoes llama.cpp's query/key permutation on `[heads·head_dim][inputs]`
/// rows: within a head, GGUF row `2i + j` holds the original row
/// `j·head_dim/2 + i` (j = 0, 1 picks the rotary half).
fn unpermute(w: Weight, heads: u32, head_dim: u32) -> Weight {
    let rows = (heads * head_dim) as usize;
    let values = unpermute_rows(&w.values, rows, heads, head_dim);
    let q4 = w.q4.map(|q| {
        Arc::new(Q4Blocks {
            n: q.n,
            blocks: q.blocks,
            packed: unpermute_rows(&q.packed, rows, heads, head_dim),
            scales: unpermute_rows(&q.scales, rows, heads, head_dim),
            mins: unpermute_rows(&q.mins, rows, heads, head_dim),
        })
    });
    Weight { dims: w.dims, values, q4 }
}

/// Rows of `data` (`rows` equal rows) in rotate-half order.
fn unpermute_rows<T: Copy + Default>(data: &[T], rows: usize, heads: u32, head_dim: u32) -> Vec<T> {
    let cols = data.len() / rows;
    let (hd, half) = (head_dim as usize, head_dim as usize / 2);
    let mut out = vec![T::default(); data.len()];
    for h in 0..heads as usize {
        for i in 0..half {
            for j in 0..2 {
                let from = (h * hd + 2 * i + j) * cols;
                let to = (h * hd + j * half + i) * cols;
                out[to..to + cols].copy_from_slice(&data[from..from + cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's permutation (`reshape(h, 2, hd/2).swapaxes(1, 2)`)
    /// followed by [`unpermute`] is the identity.
    #[test]
    fn unpermute_inverts_the_converter_permutation() {
        let (heads, hd, cols) = (2usize, 4usize, 3usize);
        let original: Vec<f32> = (0..heads * hd * cols).map(|x| x as f32).collect();
        let mut permuted = vec![0.0; original.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    let src = (h * hd + j * hd / 2 + i) * cols;
                    let dst = (h * hd + 2 * i + j) * cols;
                    permuted[dst..dst + cols].copy_from_slice(&original[src..src + cols]);
                }
            }
        }
        assert_ne!(permuted, original);
        let back = unpermute(Weight { dims: vec![(heads * hd) as u32, cols as u32], values: permuted, q4: None }, 2, 4);
        assert_eq!(back.values, original);
    }

    /// Q4_1 rows repacked for `MatMulNBits` (element `2i` in the low nibble
    /// of byte `i`) give back, with `scale · q + min`, exactly the values
    /// the GGUF dequantizes to.
    #[test]
    fn q4_1_blocks_repack_to_the_same_values() {
        let mut raw = Vec::new();
        for (d, m) in [(0.5f32, -1.0f32), (0.25, 2.0), (1.0, 0.0), (0.125, -0.5)] {
            raw.extend(half::f16::from_f32(d).to_le_bytes());
            raw.extend(half::f16::from_f32(m).to_le_bytes());
            raw.extend((0..16u8).map(|j| (j * 7 % 16) | ((15 - j) << 4)));
        }
        let want = super::super::quant::dequantize(TensorType::Q4_1, &raw);
        let q = q4_1_blocks(&raw, 2, 64);
        assert_eq!((q.n, q.blocks, q.packed.len()), (2, 2, 64));
        for (i, v) in want.iter().enumerate() {
            let (row, block, e) = (i / 64, (i % 64) / 32, i % 32);
            let byte = q.packed[(row * 2 + block) * 16 + e / 2];
            let nibble = if e % 2 == 0 { byte & 0x0F } else { byte >> 4 };
            let at = row * 2 + block;
            assert_eq!(q.scales[at] * f32::from(nibble) + q.mins[at], *v, "element {i}");
        }
    }

    #[test]
    fn transpose_swaps_axes() {
        let t = transpose(Weight { dims: vec![2, 3], values: vec![1., 2., 3., 4., 5., 6.], q4: None });
        assert_eq!(t.dims, [3, 2]);
        assert_eq!(t.values, [1., 4., 2., 5., 3., 6.]);
    }
}
