//! `onnx-genai import` on Hugging Face checkpoint directories the test
//! writes with the `safetensors` crate (issue 18, part 2): a tiny spec's
//! weights, as its own decomposed export holds them, written out in Hugging
//! Face's layout (`config.json`, `tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json`): the llama family (`[outputs, inputs]`
//! projections), Qwen2 (the same with Q/K/V biases) and GPT-2 (`Conv1D`
//! `[inputs, outputs]` projections, one fused `c_attn`, with or without the
//! `transformer.` prefix and its causal-mask buffers). The import decodes
//! exactly the tokens of the direct build, in the decomposed, 4-bit
//! contrib and genai forms, from one file or from shards; an unsupported
//! architecture, a missing tensor, one the graph would not read (a bias)
//! or one of the wrong shape is an error naming it.

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
    built_from(&onnx_genai_test_support::spec_path("tiny-llama-gqa"), variant)
}

fn built_from(spec: &Path, variant: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    ok(cli(&["build", spec.to_str().unwrap(), dir.path().to_str().unwrap(), "--variant", variant]));
    dir
}

/// The direct build's weights by name, in Hugging Face's llama layout.
fn checkpoint_tensors(decomposed: &Path) -> BTreeMap<String, Shaped> {
    let mut out = BTreeMap::new();
    for t in &initializers(decomposed) {
        if !(t.name.starts_with("model.") || t.name == "lm_head.weight") {
            continue;
        }
        let (dims, values) = shaped(t);
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

fn shaped(t: &onnx_genai_onnx::Tensor) -> Shaped {
    (t.dims.iter().map(|d| *d as usize).collect(), t.to_f32().unwrap())
}

/// The initializers of a decomposed build, by name.
fn initializers(decomposed: &Path) -> Vec<onnx_genai_onnx::Tensor> {
    let bytes = std::fs::read(decomposed.join("model.onnx")).unwrap();
    onnx_genai_onnx::decode_in(&bytes, decomposed).unwrap().graph.initializers
}

fn write_safetensors(path: &Path, tensors: &[(&String, &Shaped)]) {
    let owned: Vec<(String, Vec<usize>, Vec<f32>)> =
        tensors.iter().map(|(name, (dims, values))| ((*name).clone(), dims.clone(), values.clone())).collect();
    onnx_genai_test_support::write_safetensors(path, &owned);
}

fn direct_manifest(direct: &Path) -> serde_yaml_ng::Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(direct.join("package.yaml")).unwrap()).unwrap()
}

/// The tiny llama's `config.json`.
fn llama_config(direct: &Path, arch: &str) -> serde_json::Value {
    let manifest = direct_manifest(direct);
    json!({
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
    })
}

fn checkpoint(direct: &Path, tensors: &BTreeMap<String, Shaped>, shards: usize, arch: &str) -> tempfile::TempDir {
    checkpoint_with(direct, tensors, shards, &llama_config(direct, arch))
}

/// A Hugging Face directory of `tensors` and `config` beside the direct
/// build's tokenizer and chat template; `shards` > 1 splits the weights
/// over an index.
fn checkpoint_with(
    direct: &Path,
    tensors: &BTreeMap<String, Shaped>,
    shards: usize,
    config: &serde_json::Value,
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let manifest = direct_manifest(direct);
    std::fs::write(dir.path().join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
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
    let phi = checkpoint(direct.path(), &tensors, 1, "Phi3ForCausalLM");
    assert!(failed(phi.path()).contains("Phi3ForCausalLM"));

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

    // A text file that is no regular file (here a link to /dev/zero, read
    // until the process was killed) is named, not read.
    let hf = checkpoint(direct.path(), &tensors, 1, "LlamaForCausalLM");
    std::fs::remove_file(hf.path().join("tokenizer.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", hf.path().join("tokenizer.json")).unwrap();
    let e = failed(hf.path());
    assert!(e.contains("tokenizer.json") && e.contains("not a regular file"), "{e}");
}

/// transformers v5 writes the rotary base inside `rope_parameters` (no
/// top-level `rope_theta`): it is read there — the package's base is the
/// checkpoint's, and the default type decodes the direct build's tokens —
/// and a scaled type, or a base disagreeing with a top-level one, is
/// refused by name (before, `rope_parameters` was ignored: a base of
/// 10,000 where the checkpoint said 500,000, a package that validated and
/// wrote wrong text). Bases and norm epsilons that make every logit NaN
/// are refused too.
#[test]
fn rope_parameters_are_read_and_what_they_cannot_mean_is_refused() {
    let direct = built("decomposed");
    let tensors = checkpoint_tensors(direct.path());
    let out = tempfile::tempdir().unwrap();
    let with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut config = llama_config(direct.path(), "LlamaForCausalLM");
        edit(&mut config);
        checkpoint_with(direct.path(), &tensors, 1, &config)
    };
    let v5 = with(&|c| {
        c.as_object_mut().unwrap().remove("rope_theta");
        c["rope_parameters"] = json!({"rope_theta": 10000.0, "rope_type": "default"});
    });
    let imported = out.path().join("v5");
    ok(import(v5.path(), &imported, "decomposed"));
    assert_eq!(greedy(&imported), greedy(direct.path()));
    let based = with(&|c| {
        c.as_object_mut().unwrap().remove("rope_theta");
        c["rope_parameters"] = json!({"rope_theta": 500000.0});
    });
    let imported = out.path().join("based");
    ok(import(based.path(), &imported, "decomposed"));
    let manifest: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(imported.join("package.yaml")).unwrap()).unwrap();
    assert_eq!(manifest["architecture"]["rope_theta"].as_f64(), Some(500000.0));

    let refused = |edit: &dyn Fn(&mut serde_json::Value), says: &str| {
        let hf = with(edit);
        let o = import(hf.path(), &out.path().join("refused"), "decomposed");
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(1), "{says}: {err}");
        assert!(err.contains(says), "expected `{says}` in: {err}");
    };
    refused(&|c| c["rope_parameters"] = json!({"rope_type": "llama3", "factor": 8.0}), "rope_type \"llama3\"");
    refused(&|c| c["rope_parameters"] = json!({"rope_theta": 500000.0}), "differs from the top-level rope_theta");
    refused(&|c| c["rope_theta"] = json!(0.0), "rope_theta 0.0 is not a positive number");
    refused(&|c| c["rms_norm_eps"] = json!(-1.0), "norm_epsilon -1 is not above 0");
    // Special ids: a malformed one is named (was dropped), and one outside
    // the vocabulary fails the import's validation (the package was
    // written, and refused only when opened).
    refused(&|c| c["eos_token_id"] = json!([2, -1]), "`eos_token_id` must be a token id");
    refused(&|c| c["bos_token_id"] = json!(1.5), "`bos_token_id` must be a token id");
    refused(&|c| c["eos_token_id"] = json!(400), "PKG043");
}

fn tiny_qwen2_spec(dir: &Path) -> std::path::PathBuf {
    let llama = std::fs::read_to_string(onnx_genai_test_support::spec_path("tiny-llama-gqa")).unwrap();
    let spec = dir.join("tiny-qwen2.yaml");
    std::fs::write(&spec, llama.replace("name: tiny-llama-gqa", "name: tiny-qwen2") + "qkv_bias: true\n").unwrap();
    spec
}

/// Qwen2 (issue 18): its Q/K/V biases are read and applied in every form —
/// the decomposed and 4-bit contrib exports and the genai export's packed
/// QKV projection — so each decodes the tokens of the direct build of a
/// `qkv_bias` spec; ONNX Runtime agrees with native on the genai import
/// (`check` exits 0); and the same checkpoint with zeroed biases decodes
/// other tokens in each form, so no form drops them on the way.
#[test]
fn a_qwen2_checkpoint_keeps_its_qkv_biases() {
    let specs = tempfile::tempdir().unwrap();
    let spec = tiny_qwen2_spec(specs.path());
    let direct = built_from(&spec, "decomposed");
    let tensors = checkpoint_tensors(direct.path());
    assert!(tensors.contains_key("model.layers.1.self_attn.k_proj.bias"), "{:?}", tensors.keys());
    let mut config = llama_config(direct.path(), "Qwen2ForCausalLM");
    config["model_type"] = json!("qwen2");
    // Qwen2 states a window it only uses with use_sliding_window.
    config["use_sliding_window"] = json!(false);
    config["sliding_window"] = json!(128);
    let hf = checkpoint_with(direct.path(), &tensors, 2, &config);
    let out = tempfile::tempdir().unwrap();
    let tokens = greedy(direct.path());
    for variant in ["decomposed", "contrib", "genai"] {
        let imported = out.path().join(variant);
        ok(import(hf.path(), &imported, variant));
        let want = if variant == "decomposed" { tokens.clone() } else { greedy(built_from(&spec, variant).path()) };
        assert_eq!(greedy(&imported), want, "{variant}");
    }
    let checked = cli(&["check", out.path().join("genai").to_str().unwrap(), "--steps", "4"]);
    assert_eq!(checked.status.code(), Some(0), "{}", String::from_utf8_lossy(&checked.stdout));

    let mut unbiased = tensors.clone();
    for (name, (_, values)) in unbiased.iter_mut() {
        if name.ends_with("_proj.bias") {
            values.iter_mut().for_each(|v| *v = 0.0);
        }
    }
    let hf = checkpoint_with(direct.path(), &unbiased, 1, &config);
    for variant in ["decomposed", "contrib", "genai"] {
        let imported = out.path().join(format!("unbiased-{variant}"));
        ok(import(hf.path(), &imported, variant));
        let biased = greedy(&out.path().join(variant));
        assert_ne!(greedy(&imported), biased, "{variant}: zeroed Q/K/V biases should change the tokens");
    }
    if std::env::var_os("SHOW").is_some() {
        eprintln!("{}", String::from_utf8_lossy(&checked.stdout));
    }
}

/// The `search` section of a genai export's `genai_config.json`.
fn search_of(package: &Path) -> serde_json::Value {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(package.join("genai_config.json")).unwrap()).unwrap();
    config["search"].clone()
}

/// `generation_config.json` (issue 18): with `do_sample` its sampling
/// defaults and `max_new_tokens` become the package's — in `package.yaml`
/// and in the genai export's `search` — and both packages validate; keys it
/// leaves out take Hugging Face's defaults (temperature 1, top_k 50);
/// without `do_sample` Hugging Face decodes greedily, and so does the
/// package by default; a default out of the sampler's range is refused
/// naming the file and the key.
#[test]
fn generation_config_defaults_become_the_packages() {
    let direct = built("decomposed");
    let tensors = checkpoint_tensors(direct.path());
    let hf = checkpoint(direct.path(), &tensors, 1, "LlamaForCausalLM");
    let generation = |value: serde_json::Value| {
        std::fs::write(hf.path().join("generation_config.json"), value.to_string()).unwrap();
    };
    generation(json!({
        "do_sample": true, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
        "repetition_penalty": 1.05, "max_new_tokens": 48
    }));
    let out = tempfile::tempdir().unwrap();
    let ours = out.path().join("ours");
    ok(import(hf.path(), &ours, "decomposed"));
    let manifest = direct_manifest(&ours);
    let sampling = &manifest["generation"]["sampling"];
    assert_eq!(sampling["temperature"].as_f64().map(|t| (t * 100.0).round()), Some(70.0), "{sampling:?}");
    assert_eq!(sampling["top_k"].as_u64(), Some(20));
    assert_eq!(sampling["top_p"].as_f64().map(|t| (t * 100.0).round()), Some(80.0));
    assert_eq!(sampling["repetition_penalty"].as_f64().map(|t| (t * 100.0).round()), Some(105.0));
    assert_eq!(manifest["generation"]["max_new_tokens"].as_u64(), Some(48));
    let theirs = out.path().join("theirs");
    ok(import(hf.path(), &theirs, "genai"));
    let search = search_of(&theirs);
    assert_eq!(
        (
            &search["do_sample"],
            &search["temperature"],
            &search["top_k"],
            &search["top_p"],
            &search["repetition_penalty"]
        ),
        (&json!(true), &json!(0.7), &json!(20), &json!(0.8), &json!(1.05)),
        "{search}"
    );
    for package in [&ours, &theirs] {
        ok(cli(&["validate", package.to_str().unwrap()]));
    }

    generation(json!({"temperature": 0.6, "top_p": 0.9}));
    let greedy_default = out.path().join("greedy");
    ok(import(hf.path(), &greedy_default, "decomposed"));
    let sampling = &direct_manifest(&greedy_default)["generation"]["sampling"];
    assert_eq!(sampling["temperature"].as_f64(), Some(0.0), "{sampling:?}");
    assert!(sampling["top_p"].is_null(), "{sampling:?}");

    // Keys save_pretrained leaves out take Hugging Face's defaults, in the
    // package and in the genai export's search alike.
    generation(json!({"do_sample": true, "top_p": 0.9}));
    let defaulted = out.path().join("defaulted");
    ok(import(hf.path(), &defaulted, "decomposed"));
    let sampling = &direct_manifest(&defaulted)["generation"]["sampling"];
    assert_eq!((sampling["temperature"].as_f64(), sampling["top_k"].as_u64()), (Some(1.0), Some(50)), "{sampling:?}");
    let defaulted_genai = out.path().join("defaulted-genai");
    ok(import(hf.path(), &defaulted_genai, "genai"));
    let search = search_of(&defaulted_genai);
    assert_eq!(
        (&search["do_sample"], &search["temperature"], &search["top_k"], &search["top_p"]),
        (&json!(true), &json!(1.0), &json!(50), &json!(0.9)),
        "{search}"
    );

    generation(json!({"do_sample": true, "top_p": 1.5}));
    let refused = import(hf.path(), &out.path().join("refused"), "decomposed");
    assert_eq!(refused.status.code(), Some(1));
    let e = String::from_utf8_lossy(&refused.stderr);
    assert!(e.contains("generation_config.json") && e.contains("top_p"), "{e}");
}

/// The tiny GPT-2's weights in Hugging Face's layout: `Conv1D`
/// projections `[inputs, outputs]` as the builder stores them, Q, K and V
/// fused into `attn.c_attn`, every name under `prefix`.
fn gpt2_checkpoint_tensors(decomposed: &Path, prefix: &str) -> BTreeMap<String, Shaped> {
    let mut out = BTreeMap::new();
    let mut fused: BTreeMap<String, [Option<Shaped>; 3]> = BTreeMap::new();
    for t in &initializers(decomposed) {
        let Some(name) = t.name.strip_prefix("transformer.") else { continue };
        let split = ["q_proj", "k_proj", "v_proj"].iter().enumerate().find_map(|(i, p)| {
            let infix = format!(".attn.{p}.");
            name.find(&infix).map(|at| (i, format!("{}.attn.c_attn.{}", &name[..at], &name[at + infix.len()..])))
        });
        match split {
            Some((i, c_attn)) => fused.entry(c_attn).or_default()[i] = Some(shaped(t)),
            None => {
                out.insert(format!("{prefix}{name}"), shaped(t));
            }
        }
    }
    for (name, parts) in fused {
        let parts: Vec<Shaped> = parts.into_iter().map(Option::unwrap).collect();
        let width = *parts[0].0.last().unwrap();
        let rows = parts[0].1.len() / width;
        let mut values = Vec::new();
        for r in 0..rows {
            for (_, v) in &parts {
                values.extend_from_slice(&v[r * width..(r + 1) * width]);
            }
        }
        let mut dims = parts[0].0.clone();
        *dims.last_mut().unwrap() = 3 * width;
        out.insert(format!("{prefix}{name}"), (dims, values));
    }
    assert!(out.contains_key(&format!("{prefix}h.1.attn.c_attn.weight")), "{:?}", out.keys());
    out
}

fn gpt2_config(direct: &Path) -> serde_json::Value {
    let manifest = direct_manifest(direct);
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_inner": 256,
        "n_positions": 256,
        "n_ctx": 256,
        "vocab_size": 384,
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "bos_token_id": manifest["generation"]["bos_token_id"].as_u64(),
        "eos_token_id": manifest["generation"]["eos_token_ids"][0].as_u64(),
    })
}

/// GPT-2 (issue 18): a `GPT2LMHeadModel` save (`transformer.` names, one
/// file) and an original-style one (bare `h.N` names with the causal-mask
/// buffers `attn.bias` / `attn.masked_bias`, two shards) both decode the
/// direct build's tokens; the 4-bit contrib import agrees with ONNX Runtime
/// (`check` exits 0); the genai form is refused by name; a missing fused
/// bias and an activation the graph does not compute are named.
#[test]
fn a_gpt2_checkpoint_decodes_the_direct_builds_tokens() {
    let spec = onnx_genai_test_support::spec_path("tiny-gpt2");
    let direct = built_from(&spec, "decomposed");
    let tokens = greedy(direct.path());
    let config = gpt2_config(direct.path());
    let out = tempfile::tempdir().unwrap();
    for (prefix, shards) in [("transformer.", 1), ("", 2)] {
        let mut tensors = gpt2_checkpoint_tensors(direct.path(), prefix);
        if prefix.is_empty() {
            for l in 0..2 {
                let causal = (0..256 * 256).map(|i| if i % 256 <= i / 256 { 1.0 } else { 0.0 }).collect();
                tensors.insert(format!("h.{l}.attn.bias"), (vec![1, 1, 256, 256], causal));
                tensors.insert(format!("h.{l}.attn.masked_bias"), (vec![], vec![-1e4]));
            }
        }
        let hf = checkpoint_with(direct.path(), &tensors, shards, &config);
        let imported = out.path().join(format!("decomposed{shards}"));
        ok(import(hf.path(), &imported, "decomposed"));
        assert_eq!(greedy(&imported), tokens, "prefix `{prefix}`");
    }
    let tensors = gpt2_checkpoint_tensors(direct.path(), "transformer.");
    let hf = checkpoint_with(direct.path(), &tensors, 1, &config);
    let contrib = out.path().join("contrib");
    ok(import(hf.path(), &contrib, "contrib"));
    let checked = cli(&["check", contrib.to_str().unwrap(), "--steps", "4"]);
    assert_eq!(checked.status.code(), Some(0), "{}", String::from_utf8_lossy(&checked.stdout));
    let refused = import(hf.path(), &out.path().join("genai"), "genai");
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("GPT-2"));

    let mut missing = tensors.clone();
    missing.remove("transformer.h.1.attn.c_attn.bias");
    let hf = checkpoint_with(direct.path(), &missing, 1, &config);
    let e = import(hf.path(), &out.path().join("missing"), "decomposed");
    assert!(String::from_utf8_lossy(&e.stderr).contains("transformer.h.1.attn.c_attn.bias"));
    let mut relu = config.clone();
    relu["activation_function"] = json!("relu");
    let hf = checkpoint_with(direct.path(), &tensors, 1, &relu);
    let e = import(hf.path(), &out.path().join("relu"), "decomposed");
    assert!(String::from_utf8_lossy(&e.stderr).contains("activation_function `relu`"));
}
