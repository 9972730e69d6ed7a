//! GPT-2-style decoder: LayerNorm, learned positions, GELU (tanh) MLP,
//! biased projections, multi-head attention, tied embeddings.

use onnx_genai_onnx::builder::attr_int;

use super::forms::{layer_norm, self_attention};
use super::{names, Decoder};

pub(super) fn build(d: &mut Decoder) {
    let spec = d.spec;
    let (h, heads, hd) = (spec.hidden_size, spec.num_attention_heads, spec.head_dim());
    d.b.set_scope("/embed");
    let wte = d.draw("transformer.wte.weight", &[spec.vocab_size, h], super::llama::embedding_scale(d), 0.0);
    let wte_table = d.store(&wte);
    let wpe = d.weight("transformer.wpe.weight", &[spec.max_sequence_length, h], 0.5, 0.0);
    let tok = d.b.op_with("Gather", &[&wte_table, names::INPUT_IDS], vec![attr_int("axis", 0)]);
    let pos = d.b.op_with("Gather", &[&wpe, names::POSITION_IDS], vec![attr_int("axis", 0)]);
    let mut x = d.b.op("Add", &[&tok, &pos]);
    for layer in 0..spec.num_layers {
        let p = format!("transformer.h.{layer}");
        d.b.set_scope(&format!("/h.{layer}/attn"));
        let normed = layer_norm(d, &x, &format!("{p}.ln_1"));
        let q = d.biased_project(&normed, &format!("{p}.attn.q_proj"), h, h);
        let k = d.biased_project(&normed, &format!("{p}.attn.k_proj"), h, h);
        let v = d.biased_project(&normed, &format!("{p}.attn.v_proj"), h, h);
        let ctx = self_attention(d, layer, &q, &k, &v, None);
        let attn_out = d.biased_project(&ctx, &format!("{p}.attn.c_proj"), heads * hd, h);
        x = d.b.op("Add", &[&x, &attn_out]);

        d.b.set_scope(&format!("/h.{layer}/mlp"));
        let normed = layer_norm(d, &x, &format!("{p}.ln_2"));
        let fc = d.biased_project(&normed, &format!("{p}.mlp.c_fc"), h, spec.intermediate_size);
        let act = gelu_tanh(d, &fc);
        let out = d.biased_project(&act, &format!("{p}.mlp.c_proj"), spec.intermediate_size, h);
        x = d.b.op("Add", &[&x, &out]);
    }
    d.b.set_scope("/head");
    let normed = layer_norm(d, &x, "transformer.ln_f");
    d.lm_head(&normed, &wte, &wte_table);
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
fn gelu_tanh(d: &mut Decoder, x: &str) -> String {
    let x2 = d.b.op("Mul", &[x, x]);
    let x3 = d.b.op("Mul", &[&x2, x]);
    let c1 = d.b.scalar_f32(0.044715);
    let t = d.b.op("Mul", &[&x3, &c1]);
    let inner = d.b.op("Add", &[x, &t]);
    let c2 = d.b.scalar_f32((2.0 / std::f32::consts::PI).sqrt());
    let inner = d.b.op("Mul", &[&inner, &c2]);
    let th = d.b.op("Tanh", &[&inner]);
    let one = d.b.scalar_f32(1.0);
    let th1 = d.b.op("Add", &[&th, &one]);
    let half = d.b.scalar_f32(0.5);
    let hx = d.b.op("Mul", &[x, &half]);
    d.b.op("Mul", &[&hx, &th1])
}
