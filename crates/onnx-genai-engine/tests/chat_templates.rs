//! Real models' chat templates (SmolLM2, Qwen2.5, Qwen3, Llama 3.1, and one
//! written by hand that relies on `trim_blocks` and `lstrip_blocks`, stored
//! under tests/data/chat_templates) render exactly as Hugging Face's
//! renderer renders them: every template with every conversation of
//! cases.json (turns, a continued message, unicode, tools offered and a
//! tool call answered, extra variables, thinking content, a template's own
//! `raise_exception`) against expected.json (where a template does not
//! read `tools`, the engine writes them into the messages instead), which render_reference.py
//! recorded with jinja2 set up as transformers sets it up. A prompt that
//! differs from what the model was trained on by one space is a different
//! prompt, so the comparison is exact.

use std::path::{Path, PathBuf};

use onnx_genai_engine::tools::{FunctionCall, Tool, ToolCall};
use onnx_genai_engine::{render_chat_template, Chat, ChatMessage, EngineError};
use serde_json::Value;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates")
}

fn read_json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(data().join(name)).unwrap()).unwrap()
}

/// A case's message in Hugging Face's form as the engine's message.
fn message(m: &Value) -> ChatMessage {
    let text = |key: &str| m.get(key).and_then(Value::as_str).map(str::to_string);
    let calls = m.get("tool_calls").and_then(Value::as_array).cloned().unwrap_or_default();
    ChatMessage {
        tool_calls: calls
            .iter()
            .map(|c| ToolCall {
                id: c["id"].as_str().unwrap().into(),
                function: FunctionCall {
                    name: c["function"]["name"].as_str().unwrap().into(),
                    arguments: c["function"]["arguments"].to_string(),
                },
            })
            .collect(),
        tool_call_id: text("tool_call_id"),
        name: text("name"),
        ..ChatMessage::new(&text("role").unwrap(), text("content").unwrap())
    }
}

fn tool(t: &Value) -> Tool {
    let f = &t["function"];
    Tool {
        name: f["name"].as_str().unwrap().into(),
        description: f.get("description").and_then(Value::as_str).map(str::to_string),
        parameters: f["parameters"].clone(),
    }
}

#[test]
fn real_templates_render_as_hugging_face_renders_them() {
    let cases = read_json("cases.json");
    let expected = read_json("expected.json");
    let mut templates: Vec<PathBuf> = std::fs::read_dir(data())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
        .collect();
    templates.sort();
    assert_eq!(templates.len(), 5, "the four real templates and the hand-indented one");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for path in &templates {
        let name = path.file_stem().unwrap().to_str().unwrap();
        let source = std::fs::read_to_string(path).unwrap();
        let (bos, eos) =
            if name.contains("llama") { ("<|begin_of_text|>", "<|eot_id|>") } else { ("<|im_start|>", "<|im_end|>") };
        for case in cases["cases"].as_array().unwrap() {
            let key = format!("{name}/{}", case["name"].as_str().unwrap());
            let with_tools = case.get("with_tools").and_then(Value::as_bool).unwrap_or(false);
            let chat = Chat {
                messages: case["messages"].as_array().unwrap().iter().map(message).collect(),
                tools: if with_tools { cases["tools"].as_array().unwrap().iter().map(tool).collect() } else { vec![] },
                add_generation_prompt: case.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true),
                template_vars: case.get("vars").and_then(Value::as_object).cloned().unwrap_or_default(),
            };
            let want = &expected[&key];
            assert!(want.is_object(), "{key}: not in expected.json (run render_reference.py)");
            let got = render_chat_template(&source, &chat, bos, eos);
            if want.get("engine_writes_tools").is_some() {
                // A template that does not read `tools`: the engine writes
                // them into the system message (tools.rs), which Hugging
                // Face's renderer would drop.
                let text = got.unwrap_or_else(|e| panic!("{key}: {e}"));
                assert!(text.contains("<tools>") && text.contains("get_weather"), "{key}: tools not written: {text}");
                checked += 1;
                continue;
            }
            match (got, want.get("text").and_then(Value::as_str), want.get("error").and_then(Value::as_str)) {
                (Ok(text), Some(want), _) if text == want => {}
                (Err(EngineError::ChatTemplate(e)), None, Some(want)) if e.contains(want) => {}
                (got, text, error) => wrong.push(format!("{key}:\n  ours:   {got:?}\n  python: {:?}", text.or(error))),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, expected.as_object().unwrap().len(), "every recorded render was compared");
    assert!(wrong.is_empty(), "{} of {checked} renders differ:\n{}", wrong.len(), wrong.join("\n"));
}

/// Extra variables cannot replace what the renderer sets: a request that
/// tries is refused, naming the variable.
#[test]
fn template_variables_cannot_replace_the_renderers() {
    let mut chat = Chat::from(vec![ChatMessage::new("user", "hi")]);
    chat.template_vars.insert("messages".into(), serde_json::json!([]));
    let refused = render_chat_template("{{ messages | length }}", &chat, "", "");
    assert!(matches!(&refused, Err(EngineError::Request(e)) if e.contains("`messages`")), "{refused:?}");
    chat.template_vars.clear();
    chat.template_vars.insert("enable_thinking".into(), Value::Bool(false));
    let rendered = render_chat_template("{{ messages | length }} {{ enable_thinking }}", &chat, "", "").unwrap();
    assert_eq!(rendered, "1 False", "a boolean prints as Python prints it");
}
