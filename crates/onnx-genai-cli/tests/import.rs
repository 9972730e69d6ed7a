//! `onnx-genai import` on Hugging Face checkpoint directories the test
//! writes with the `safetensors` crate (issue 18, part 2): the tiny llama's
//! weights, as its own decomposed export holds them, written out in Hugging
//! Face's layout (`[outputs, inputs]` projections, `config.json`,
//! `tokenizer.json`, `tokenizer_config.json`). The import decodes exactly
//! the tokens of the direct build, in the decomposed and the 4-bit contrib
//! forms, from one file or from shards; an unsupported architecture, a
//! missing tensor, one the graph would not read (a bias) or one of the
//! wrong shape is an error naming it.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::json;

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-genai")).args(args).output().unwrap()
}

fn ok(out: Output) -> String {
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn built(variant: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let spec = onnx_genai_test_support::spec_path("tiny-llama-gqa");
    ok(cli(&["build", spec.to_str().unwrap(), dir.path().to_str().unwrap(), "--variant", variant]));
    dir
}

/// The direct build's weights by name, in Hugging Face's layout.
fn checkpoint_tensors(decomposed: &Path) -> BTreeMap<String, Shaped> {
    let bytes = std::fs::read(decomposed.join("model.onnx")).unwrap();
    let model = onnx_genai_onnx::decode_in(&bytes, decomposed).unwrap();
    let mut out = BTreeMap::new();
    for t in &model.graph.initializers {
        if !(t.name.starts_with("model.") || t.name == "lm_head.weight") {
            continue;
        }
        let dims: Vec<usize> = t.dims.iter().map(|d| *d as usize).collect();
        let values = t.to_f32().unwrap();
        // The builder stores projections [inputs, outputs]; Hugging Face
        // [outputs, inputs] (the embedding is [vocab, hidden] in both).
        let (dims, values) = if dims.len() == 2 && t.name != "model.embed_tokens.weight" {
            onnx_genai_test_support::transposed(&dims, &values)
        } else {
            (dims, values)
        };
        out.insert(t.name.clone(), (dims, values));
    }
    assert!(out.len() >= 20, "expected the llama's weights by name, found {:?}", out.keys());
    out
}

/// A tensor's dims and values.
type Shaped = (Vec<usize>, Vec<f32>);

fn write_safetensors(path: &Path, tensors: &[(&String, &Shaped)]) {
    let owned: Vec<(String, Vec<usize>, Vec<f32>)> =
        tensors.iter().map(|(name, (dims, values))| ((*name).clone(), dims.clone(), values.clone())).collect();
    onnx_genai_test_support::write_safetensors(path, &owned);
}

/// A Hugging Face directory of `tensors` beside the direct build's
/// tokenizer; `shards` > 1 splits the weights over an index.
fn checkpoint(direct: &Path, tensors: &BTreeMap<String, Shaped>, shards: usize, arch: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let manifest: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(direct.join("package.yaml")).unwrap()).unwrap();
    let config = json!({
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 384,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": false,
        "bos_token_id": manifest["generation"]["bos_token_id"].as_u64(),
        "eos_token_id": manifest["generation"]["eos_token_ids"][0].as_u64(),
        "torch_dtype": "float32"
    });
    std::fs::write(dir.path().join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    std::fs::copy(direct.join("tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    let template = manifest["chat_template"].as_str().unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), json!({"chat_template": template}).to_string()).unwrap();
    let all: Vec<_> = tensors.iter().collect();
    if shards == 1 {
        write_safetensors(&dir.path().join("model.safetensors"), &all);
    } else {
        let mut map = serde_json::Map::new();
        for (k, chunk) in all.chunks(all.len().div_ceil(shards)).enumerate() {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", k + 1);
            write_safetensors(&dir.path().join(&file), chunk);
            for (name, _) in chunk {
                map.insert((*name).clone(), json!(file));
            }
        }
        std::fs::write(dir.path().join("model.safetensors.index.json"), json!({"weight_map": map}).to_string())
            .unwrap();
    }
    dir
}

fn greedy(package: &Path) -> String {
    ok(cli(&[
        "generate",
        package.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "12",
        "--backend",
        "native-cpu",
        "--show-ids",
    ]))
}

fn import(checkpoint: &Path, out: &Path, variant: &str) -> Output {
    cli(&["import", checkpoint.to_str().unwrap(), out.to_str().unwrap(), "--variant", variant])
}

#[test]
fn an_imported_checkpoint_decodes_the_direct_builds_tokens() {
    let direct = built("decomposed");
    let tensors = checkpoint_tensors(direct.path());
    for shards in [1, 3] {
        let hf = checkpoint(direct.path(), &tensors, shards, "LlamaForCausalLM");
        let out = tempfile::tempdir().unwrap();
        let imported = out.path().join("decomposed");
        ok(import(hf.path(), &imported, "decomposed"));
        assert_eq!(greedy(&imported), greedy(direct.path()), "{shards} shard(s)");
        let manifest = std::fs::read_to_string(imported.join("package.yaml")).unwrap();
        assert!(manifest.contains("chat_template"), "the template of tokenizer_config.json: {manifest}");
    }
    // The 4-bit export from the checkpoint is the direct 4-bit export.
    let hf = checkpoint(direct.path(), &tensors, 1, "MistralForCausalLM");
    let out = tempfile::tempdir().unwrap();
    let contrib = out.path().join("contrib");
    ok(import(hf.path(), &contrib, "contrib"));
    assert_eq!(greedy(&contrib), greedy(built("contrib").path()));
}

#[test]
fn what_the_importer_cannot_take_is_named() {
    let direct = built("decomposed");
    let tensors = checkpoint_tensors(direct.path());
    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("p");
    let failed = |hf: &Path| {
        let o = import(hf, &target, "decomposed");
        assert_eq!(o.status.code(), Some(1));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let gpt2 = checkpoint(direct.path(), &tensors, 1, "GPT2LMHeadModel");
    assert!(failed(gpt2.path()).contains("GPT2LMHeadModel"));

    let mut missing = tensors.clone();
    missing.remove("model.layers.1.mlp.up_proj.weight");
    let hf = checkpoint(direct.path(), &missing, 1, "LlamaForCausalLM");
    let e = failed(hf.path());
    assert!(e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("missing"), "{e}");

    // A bias the llama graph would not read is refused, not dropped.
    let mut biased = tensors.clone();
    biased.insert("model.layers.0.self_attn.q_proj.bias".into(), (vec![64], vec![0.5; 64]));
    let hf = checkpoint(direct.path(), &biased, 1, "LlamaForCausalLM");
    let e = failed(hf.path());
    assert!(e.contains("model.layers.0.self_attn.q_proj.bias") && e.contains("not read"), "{e}");

    let mut wrong = tensors.clone();
    wrong.get_mut("model.norm.weight").unwrap().0 = vec![32, 2];
    let hf = checkpoint(direct.path(), &wrong, 1, "LlamaForCausalLM");
    let e = failed(hf.path());
    assert!(e.contains("model.norm.weight") && e.contains("shape"), "{e}");
}
