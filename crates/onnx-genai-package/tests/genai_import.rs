//! An ONNX Runtime GenAI package is read whole (issue 18, part 3): its name
//! is its directory's, so two imported packages can be served side by
//! side, and its chat template comes from `chat_template.jinja` or else the
//! `chat_template` of `tokenizer_config.json`.

mod support;

use onnx_genai_package::Package;
use support::{build, Layout};

#[test]
fn name_and_chat_template_come_with_the_package() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("my-smol-int4");
    build("tiny-llama-gqa", Layout::OrtGenai, &dir);
    let p = Package::open(&dir).unwrap();
    assert_eq!(p.manifest.name, "my-smol-int4");
    let from_config = p.manifest.chat_template.clone().expect("the template of tokenizer_config.json");
    assert!(from_config.contains("<|im_start|>"), "{from_config}");

    // chat_template.jinja wins when both are there.
    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let p = Package::open(&dir).unwrap();
    assert_eq!(p.manifest.chat_template.as_deref(), Some("{% for m in messages %}{{ m.content }}{% endfor %}"));

    // A template that does not parse is a diagnostic, like a manifest's,
    // naming the file it came from.
    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}").unwrap();
    assert!(Package::open(&dir).is_err(), "a broken template must not open");
    let (report, _) = onnx_genai_package::validate(&dir);
    let broken = report.errors().find(|d| d.code == onnx_genai_package::Code::PKG050).expect("PKG050");
    assert_eq!(broken.file, "chat_template.jinja", "{report}");

    // Hugging Face's list of named templates: `default` is used.
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    let named = r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#;
    std::fs::write(dir.join("tokenizer_config.json"), named).unwrap();
    assert_eq!(Package::open(&dir).unwrap().manifest.chat_template.as_deref(), Some("D"));

    // A max_length beyond the context is a warning (generation stops at
    // the context length anyway).
    let config_path = dir.join("genai_config.json");
    let config = std::fs::read_to_string(&config_path).unwrap();
    std::fs::write(&config_path, config.replace("\"max_length\": 256", "\"max_length\": 4096")).unwrap();
    let p = Package::open(&dir).unwrap();
    assert!(p.warnings.iter().any(|d| d.code == onnx_genai_package::Code::PKG106), "{:?}", p.warnings);
    std::fs::write(&config_path, config).unwrap();

    // Without either file there is no template (and no error).
    std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
    assert_eq!(Package::open(&dir).unwrap().manifest.chat_template, None);
}

/// `search` becomes the package's sampling defaults as ONNX Runtime GenAI
/// reads it (issue 18, part 3): with `do_sample` its temperature, top_k and
/// top_p; without it greedy (temperature 0, the others unused);
/// `repetition_penalty` either way. A default out of range is PKG044 naming
/// the `search` key; the same rule holds for a manifest's
/// `generation.sampling`.
#[test]
fn search_becomes_the_sampling_defaults() {
    use onnx_genai_package::manifest::SamplingDefaults;
    use onnx_genai_package::Code;
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("imported");
    build("tiny-llama-gqa", Layout::OrtGenai, &dir);
    let greedy = Package::open(&dir).unwrap().manifest.generation.sampling;
    assert_eq!(
        greedy,
        SamplingDefaults { temperature: Some(0.0), repetition_penalty: Some(1.0), ..Default::default() }
    );

    let path = dir.join("genai_config.json");
    let original: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let with_search = |search: serde_json::Value| {
        let mut config = original.clone();
        for (k, v) in search.as_object().unwrap() {
            config["search"][k] = v.clone();
        }
        std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    };
    with_search(
        serde_json::json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.1}),
    );
    let sampled = Package::open(&dir).unwrap().manifest.generation.sampling;
    assert_eq!(
        sampled,
        SamplingDefaults { temperature: Some(0.6), top_k: Some(20), top_p: Some(0.9), repetition_penalty: Some(1.1) }
    );

    for (key, value) in [("temperature", -0.5), ("top_p", 1.5), ("repetition_penalty", 0.0)] {
        with_search(
            serde_json::json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, key: value}),
        );
        let (report, _) = onnx_genai_package::validate(&dir);
        let d = report.errors().find(|d| d.code == Code::PKG044).unwrap_or_else(|| panic!("{key}: {report}"));
        assert_eq!((d.file.as_str(), d.field.as_str()), ("genai_config.json", format!("search.{key}").as_str()));
    }

    // Our own manifest: the same check on generation.sampling.
    let ours = parent.path().join("ours");
    build("tiny-llama-gqa", Layout::Native, &ours);
    let manifest = ours.join("package.yaml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let mut yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    yaml["generation"]["sampling"] = serde_yaml_ng::from_str("{temperature: 0.7, top_k: 40}").unwrap();
    std::fs::write(&manifest, serde_yaml_ng::to_string(&yaml).unwrap()).unwrap();
    let p = Package::open(&ours).unwrap();
    assert_eq!(
        p.manifest.generation.sampling,
        SamplingDefaults { temperature: Some(0.7), top_k: Some(40), ..Default::default() }
    );
    yaml["generation"]["sampling"] = serde_yaml_ng::from_str("{top_p: 1.5}").unwrap();
    std::fs::write(&manifest, serde_yaml_ng::to_string(&yaml).unwrap()).unwrap();
    let (report, _) = onnx_genai_package::validate(&ours);
    let d = report.errors().find(|d| d.code == Code::PKG044).unwrap_or_else(|| panic!("{report}"));
    assert_eq!(d.field, "generation.sampling.top_p");
}

/// A package with a tokenizer class but no `tokenizer.json` (a
/// SentencePiece `tokenizer.model` only, say) is PKG107 naming the class
/// and what to ship instead, not only the missing file's error.
#[test]
fn a_tokenizer_class_without_tokenizer_json_is_named() {
    use onnx_genai_package::Code;
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("slow-tokenizer");
    build("tiny-llama-gqa", Layout::OrtGenai, &dir);
    let (report, _) = onnx_genai_package::validate(&dir);
    assert!(report.diagnostics.iter().all(|d| d.code != Code::PKG107), "{report}");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"tokenizer_class": "LlamaTokenizer"}"#).unwrap();
    let (report, _) = onnx_genai_package::validate(&dir);
    let d = report.errors().find(|d| d.code == Code::PKG107).unwrap_or_else(|| panic!("{report}"));
    assert_eq!((d.file.as_str(), d.field.as_str()), ("tokenizer_config.json", "tokenizer_class"));
    assert!(d.message.contains("`LlamaTokenizer`") && d.hint.contains("save_pretrained"), "{d:?}");
}

/// A folder ONNX Runtime GenAI's model builder or Olive wrote opens as
/// their runtime reads it: every text decoder type (`phi3`, `smollm3`,
/// `gemma2`: refused by an allowlist of seven before; the type is a label,
/// the graph decides what runs), an unknown type with a warning naming it,
/// a multimodal type refused; ids of -1 meaning none (Olive's pad; were a
/// type error); the keys their parser knows that this runtime does not
/// read (`search.random_seed`, `decoder.run_options`, `engine`: were
/// unknown keys); and search settings it does not apply (beam search) a
/// warning naming the key.
#[test]
fn what_onnx_runtime_genai_reads_opens() {
    use onnx_genai_package::Code;
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("exported");
    build("tiny-llama-gqa", Layout::OrtGenai, &dir);
    let path = dir.join("genai_config.json");
    let original = std::fs::read_to_string(&path).unwrap();
    let opened = |config: &str| {
        std::fs::write(&path, config).unwrap();
        Package::open(&dir)
    };
    for t in ["phi3", "smollm3", "gemma2", "decoder"] {
        let p = opened(&original.replace("\"type\": \"llama\"", &format!("\"type\": \"{t}\"")));
        let p = p.unwrap_or_else(|e| panic!("type {t}: {e}"));
        assert!(p.warnings.iter().all(|w| w.code != Code::PKG109), "{t}: {:?}", p.warnings);
    }
    let unknown =
        opened(&original.replace("\"type\": \"llama\"", "\"type\": \"lama\"")).expect("an unknown type opens");
    assert!(unknown.warnings.iter().any(|w| w.code == Code::PKG109 && w.message.contains("`lama`")));
    assert!(opened(&original.replace("\"type\": \"llama\"", "\"type\": \"phi3v\"")).is_err());
    let (report, _) = onnx_genai_package::validate(&dir);
    assert!(report.errors().any(|d| d.code == Code::PKG105 && d.message.contains("phi3v")), "{report}");

    let none = original
        .replace("\"pad_token_id\": 381", "\"pad_token_id\": -1")
        .replace("\"bos_token_id\": 381", "\"bos_token_id\": -1");
    let p = opened(&none).expect("ids of -1 open");
    assert_eq!(p.manifest.generation.bos_token_id, None);

    let theirs = original
        .replace("\"top_p\": 1.0", "\"top_p\": 1.0, \"random_seed\": 42, \"batch_size\": 1")
        .replace("\"filename\": \"model.onnx\"", "\"filename\": \"model.onnx\", \"run_options\": {}")
        .replacen('{', "{\"engine\": {},", 1);
    opened(&theirs).expect("keys their runtime reads open");

    let beams = opened(&original.replace("\"num_beams\": 1", "\"num_beams\": 4")).expect("beam search opens");
    assert!(
        beams.warnings.iter().any(|w| w.code == Code::PKG108 && w.field == "search.num_beams"),
        "{:?}",
        beams.warnings
    );
}
