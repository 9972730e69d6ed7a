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
