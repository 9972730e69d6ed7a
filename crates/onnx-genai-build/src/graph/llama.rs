//! Llama-style decoder: RMSNorm, rotary positions, SiLU-gated MLP; MHA, GQA
//! or MQA; tied or untied embeddings.

use onnx_genai_onnx::builder::attr_int;

use super::{names, Decoder};

pub(super) fn build(d: &mut Decoder) {
    let spec = d.spec;
    let (h, heads, kv_heads, hd) = (spec.hidden_size, spec.num_attention_heads, spec.kv_heads(), spec.head_dim());
    d.b.set_scope("/embed");
    let embedding = d.weight("model.embed_tokens.weight", &[spec.vocab_size, h], 1.0, 0.0);
    let mut x = d.b.op_with("Gather", &[&embedding, names::INPUT_IDS], vec![attr_int("axis", 0)]);
    let (cos, sin) = rotary_tables(d);
    for layer in 0..spec.num_layers {
        let p = format!("model.layers.{layer}");
        d.b.set_scope(&format!("/layers.{layer}/attn"));
        let normed = d.rms_norm(&x, &format!("{p}.input_layernorm.weight"));
        let mut qkv = Vec::new();
        for (proj, n_heads) in [("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)] {
            let w = d.linear(&format!("{p}.self_attn.{proj}.weight"), h, n_heads * hd);
            let y = d.matmul(&normed, &w);
            qkv.push(d.split_heads(&y, n_heads));
        }
        let q = rotate(d, &qkv[0], &cos, &sin);
        let k = rotate(d, &qkv[1], &cos, &sin);
        let ctx = d.attention(layer, &q, &k, &qkv[2]);
        let wo = d.linear(&format!("{p}.self_attn.o_proj.weight"), heads * hd, h);
        let attn_out = d.matmul(&ctx, &wo);
        x = d.b.op("Add", &[&x, &attn_out]);

        d.b.set_scope(&format!("/layers.{layer}/mlp"));
        let normed = d.rms_norm(&x, &format!("{p}.post_attention_layernorm.weight"));
        let wg = d.linear(&format!("{p}.mlp.gate_proj.weight"), h, spec.intermediate_size);
        let wu = d.linear(&format!("{p}.mlp.up_proj.weight"), h, spec.intermediate_size);
        let wd = d.linear(&format!("{p}.mlp.down_proj.weight"), spec.intermediate_size, h);
        let gate = d.matmul(&normed, &wg);
        let up = d.matmul(&normed, &wu);
        let sig = d.b.op("Sigmoid", &[&gate]);
        let silu = d.b.op("Mul", &[&gate, &sig]);
        let act = d.b.op("Mul", &[&silu, &up]);
        let down = d.matmul(&act, &wd);
        x = d.b.op("Add", &[&x, &down]);
    }
    d.b.set_scope("/head");
    let normed = d.rms_norm(&x, "model.norm.weight");
    d.lm_head(&normed, &embedding);
}

/// `cos`/`sin` of `[batch, 1, seq, head_dim]` gathered by `position_ids`
/// from tables precomputed in f64 (HF's rotate-half layout: the half-size
/// frequency table is repeated across both halves).
fn rotary_tables(d: &mut Decoder) -> (String, String) {
    let spec = d.spec;
    let hd = spec.head_dim() as usize;
    let half = hd / 2;
    let theta = spec.rope_theta.unwrap_or(10_000.0);
    let max = spec.max_sequence_length as usize;
    let (mut cos, mut sin) = (Vec::with_capacity(max * hd), Vec::with_capacity(max * hd));
    for pos in 0..max {
        for i in 0..hd {
            let freq = 1.0 / theta.powf((2 * (i % half)) as f64 / hd as f64);
            let angle = pos as f64 * freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    d.b.set_scope("/rotary");
    let dims = vec![max as i64, hd as i64];
    let cos_t = d.table("rotary.cos", dims.clone(), &cos);
    let sin_t = d.table("rotary.sin", dims, &sin);
    let axis = d.b.const_i64(&[1]);
    let mut by_position = |table: &str| {
        let g = d.b.op_with("Gather", &[table, names::POSITION_IDS], vec![attr_int("axis", 0)]);
        d.b.op("Unsqueeze", &[&g, &axis])
    };
    let (cos, sin) = (by_position(&cos_t), by_position(&sin_t));
    (cos, sin)
}

/// `x * cos + rotate_half(x) * sin` where `rotate_half([a, b]) = [-b, a]`.
fn rotate(d: &mut Decoder, x: &str, cos: &str, sin: &str) -> String {
    let hd = i64::from(d.spec.head_dim());
    let axis = d.b.const_i64(&[3]);
    let (s0, mid, end) = (d.b.const_i64(&[0]), d.b.const_i64(&[hd / 2]), d.b.const_i64(&[hd]));
    let first = d.b.op("Slice", &[x, &s0, &mid, &axis]);
    let second = d.b.op("Slice", &[x, &mid, &end, &axis]);
    let neg = d.b.op("Neg", &[&second]);
    let rotated = d.b.op_with("Concat", &[&neg, &first], vec![attr_int("axis", 3)]);
    let a = d.b.op("Mul", &[x, cos]);
    let b = d.b.op("Mul", &[&rotated, sin]);
    d.b.op("Add", &[&a, &b])
}
