//! Llama-style decoder: RMSNorm, rotary positions, SiLU-gated MLP; MHA, GQA
//! or MQA; tied or untied embeddings.

use onnx_genai_onnx::builder::attr_int;

use super::forms::{residual_rms_norm, rms_norm, rotary_tables, self_attention};
use super::{genai, names, Decoder, Variant};

pub(super) fn build(d: &mut Decoder) {
    let spec = d.spec;
    let (h, heads, kv_heads, hd) = (spec.hidden_size, spec.num_attention_heads, spec.kv_heads(), spec.head_dim());
    d.b.set_scope("/embed");
    let embedding = d.draw("model.embed_tokens.weight", &[spec.vocab_size, h], embedding_scale(d), 0.0);
    let (table, mut x) = if d.embeds_input {
        // The table lives in the embedding component; untied, so the head
        // does not need it.
        d.embedding = Some(embedding.clone());
        (String::new(), names::INPUTS_EMBEDS.to_string())
    } else if d.variant == Variant::Genai {
        (String::new(), genai::embed(d, &embedding))
    } else {
        let table = d.store(&embedding);
        let x = d.b.op_with("Gather", &[&table, names::INPUT_IDS], vec![attr_int("axis", 0)]);
        (table, x)
    };
    let rotary = rotary_tables(d);
    d.b.set_scope("/layers.0/attn");
    let mut normed = rms_norm(d, &x, "model.layers.0.input_layernorm.weight");
    for layer in 0..spec.num_layers {
        let p = format!("model.layers.{layer}");
        d.b.set_scope(&format!("/layers.{layer}/attn"));
        let wq = d.draw_projection(&format!("{p}.self_attn.q_proj.weight"), h, heads * hd);
        let wk = d.draw_projection(&format!("{p}.self_attn.k_proj.weight"), h, kv_heads * hd);
        let wv = d.draw_projection(&format!("{p}.self_attn.v_proj.weight"), h, kv_heads * hd);
        let mut biases = Vec::new();
        if spec.qkv_bias {
            for (proj, width) in [("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)] {
                biases.push(d.draw(&format!("{p}.self_attn.{proj}.bias"), &[width], 0.1, 0.0));
            }
        }
        let ctx = if d.variant == Variant::Genai {
            genai::packed_attention(d, layer, &normed, [&wq, &wk, &wv], &biases, &rotary)
        } else {
            let mut qkv = Vec::new();
            for (i, w) in [&wq, &wk, &wv].into_iter().enumerate() {
                let y = d.apply_weight(&normed, w);
                qkv.push(match biases.get(i) {
                    Some(b) => d.add_bias(&y, b),
                    None => y,
                });
            }
            self_attention(d, layer, &qkv[0], &qkv[1], &qkv[2], Some(&rotary))
        };
        let attn_out = d.project(&ctx, &format!("{p}.self_attn.o_proj.weight"), heads * hd, h);
        (x, normed) = residual_rms_norm(d, &x, &attn_out, &format!("{p}.post_attention_layernorm.weight"));

        d.b.set_scope(&format!("/layers.{layer}/mlp"));
        let inter = spec.intermediate_size;
        let gate = d.project(&normed, &format!("{p}.mlp.gate_proj.weight"), h, inter);
        let up = d.project(&normed, &format!("{p}.mlp.up_proj.weight"), h, inter);
        let sig = d.b.op("Sigmoid", &[&gate]);
        let silu = d.b.op("Mul", &[&gate, &sig]);
        let act = d.b.op("Mul", &[&silu, &up]);
        let down = d.project(&act, &format!("{p}.mlp.down_proj.weight"), inter, h);
        let next = if layer + 1 == spec.num_layers {
            "model.norm.weight".to_string()
        } else {
            format!("model.layers.{}.input_layernorm.weight", layer + 1)
        };
        (x, normed) = residual_rms_norm(d, &x, &down, &next);
    }
    d.b.set_scope("/head");
    d.lm_head(&normed, &embedding, &table);
}

/// Tied embeddings double as the output projection: at unit scale the
/// last input token's own embedding dominates the logits and greedy decoding
/// repeats it, so tied models draw smaller embeddings.
pub(super) fn embedding_scale(d: &Decoder) -> f32 {
    if d.spec.tie_embeddings {
        0.05
    } else {
        1.0
    }
}
