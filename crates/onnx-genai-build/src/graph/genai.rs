//! The pieces of the genai export that ONNX Runtime GenAI's model builder
//! lays out its own way: the token embedding (a plain `Gather`, or with
//! shared embeddings a `GatherBlockQuantized` over the output projection's
//! 4-bit table) and attention (one packed QKV projection into
//! `GroupQueryAttention`, which applies rotary itself).

use onnx_genai_onnx::builder::{attr_float, attr_int};

use super::forms::{self, gqa_lengths, present_names, Rotary};
use super::{names, transposed_embedding, Decoder, WeightValues, MS_DOMAIN, NBITS_BLOCK};

/// The embedding of `input_ids`. With shared embeddings the 4-bit table is
/// made here and kept in [`Decoder::tied_q4`] for the output projection.
pub(super) fn embed(d: &mut Decoder, embedding: &WeightValues) -> String {
    let spec = d.spec;
    if !(spec.genai.shared_embeddings && spec.tie_embeddings) {
        let table = d.store(embedding);
        return d.b.op_with("Gather", &[&table, names::INPUT_IDS], vec![attr_int("axis", 0)]);
    }
    let w = transposed_embedding(spec, embedding);
    let (k, n) = (w.dims[0] as usize, w.dims[1] as usize);
    let q = forms::quantize_q4(&w.values, k, n, spec.genai.symmetric);
    let stored = forms::store_q4(d, "lm_head.shared", k, n, q);
    // GatherBlockQuantized reads the same bytes as rows of `[vocab,
    // blocks * 16]`, with one scale (and zero point) per row and block.
    let rows = d.b.const_i64(&[n as i64, (stored.blocks * NBITS_BLOCK / 2) as i64]);
    let data = d.b.op("Reshape", &[&stored.weight, &rows]);
    let per_row = d.b.const_i64(&[n as i64, stored.blocks as i64]);
    let scales = d.b.op("Reshape", &[&stored.scales, &per_row]);
    let mut inputs = vec![data, names::INPUT_IDS.to_string(), scales];
    if let Some(z) = &stored.zeros {
        let zero_rows = d.b.const_i64(&[n as i64, stored.blocks.div_ceil(2) as i64]);
        inputs.push(d.b.op("Reshape", &[z, &zero_rows]));
    }
    let out = d.b.fresh("GatherBlockQuantized");
    let attrs = vec![
        attr_int("bits", 4),
        attr_int("block_size", NBITS_BLOCK as i64),
        attr_int("gather_axis", 0),
        attr_int("quantize_axis", 1),
    ];
    let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    d.b.node_in(MS_DOMAIN, "GatherBlockQuantized", &refs, &[&out], attrs);
    d.tied_q4 = Some(stored);
    out
}

/// `GroupQueryAttention` over one packed projection `x @ [Wq | Wk | Wv]`
/// (plus `[bq | bk | bv]` when `biases` holds the three, as for Qwen2;
/// key and value inputs left empty), rotating Q and K itself from the
/// cos/sin caches at the positions the sequence lengths imply.
pub(super) fn packed_attention(
    d: &mut Decoder,
    layer: u32,
    x: &str,
    qkv: [&WeightValues; 3],
    biases: &[WeightValues],
    r: &Rotary,
) -> String {
    let spec = d.spec;
    let k = qkv[0].dims[0] as usize;
    let widths: Vec<usize> = qkv.iter().map(|w| w.dims[1] as usize).collect();
    let n: usize = widths.iter().sum();
    let mut values = Vec::with_capacity(k * n);
    for row in 0..k {
        for (w, width) in qkv.iter().zip(&widths) {
            values.extend_from_slice(&w.values[row * width..(row + 1) * width]);
        }
    }
    let name = format!("model.layers.{layer}.self_attn.qkv_proj.weight");
    let packed = WeightValues { name, dims: vec![k as u32, n as u32], values, q4: None };
    let mut projected = d.apply_weight(x, &packed);
    if !biases.is_empty() {
        let values = biases.iter().flat_map(|b| b.values.iter().copied()).collect();
        let name = format!("model.layers.{layer}.self_attn.qkv_proj.bias");
        let bias = WeightValues { name, dims: vec![n as u32], values, q4: None };
        projected = d.add_bias(&projected, &bias);
    }
    let (past_k, past_v, present_k, present_v) = present_names(layer);
    let (seqlens, total) = gqa_lengths(d);
    let out = d.b.fresh("GroupQueryAttention");
    let attrs = vec![
        attr_int("num_heads", spec.num_attention_heads.into()),
        attr_int("kv_num_heads", spec.kv_heads().into()),
        attr_float("scale", 1.0 / (spec.head_dim() as f32).sqrt()),
        attr_int("do_rotary", 1),
        attr_int("rotary_interleaved", 0),
        attr_int("local_window_size", -1),
    ];
    d.b.node_in(
        MS_DOMAIN,
        "GroupQueryAttention",
        &[&projected, "", "", &past_k, &past_v, &seqlens, &total, &r.cos, &r.sin],
        &[&out, &present_k, &present_v],
        attrs,
    );
    out
}
