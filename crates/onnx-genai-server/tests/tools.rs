//! Tool calling over real HTTP on loopback (issue 19): a required or named
//! call is drawn under its arguments' schema and answered as `tool_calls`,
//! plain and streamed; the call and its result go back in the next turn;
//! bad tools and choices are 400s naming the field, with nothing held; an
//! answer sent back as the client dumps it is taken.

mod support;

use onnx_genai_engine::Scheduler;
use onnx_genai_server::start;
use serde_json::{json, Value};
use support::{call, chat, engine, package, post, Gate, TOOLS_TEMPLATE};

const M: &str = "tiny-llama-gqa";

fn serve() -> (tempfile::TempDir, onnx_genai_server::RunningServer) {
    let (dir, mut p) = package(M);
    p.manifest.chat_template = Some(TOOLS_TEMPLATE.into());
    (dir, start(vec![engine(&p, &Gate::default(), Scheduler::new(u64::MAX / 2))], "127.0.0.1:0", 8).unwrap())
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"],
                "additionalProperties": false
            }
        }},
        {"type": "function", "function": {"name": "time"}}
    ])
}

/// A call's name and arguments, checked against `tools()`.
fn checked(call: &Value) -> (String, Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
    let name = call["function"]["name"].as_str().unwrap().to_string();
    let arguments: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    let object = arguments.as_object().unwrap();
    match name.as_str() {
        "weather" => {
            assert_eq!(object.keys().collect::<Vec<_>>(), ["city", "days"], "{arguments}");
            assert!(matches!(arguments["city"].as_str(), Some("Paris" | "Rome")), "{arguments}");
            assert!(arguments["days"].as_u64().is_some_and(|d| (1..=7).contains(&d)), "{arguments}");
        }
        "time" => {}
        other => panic!("a call to `{other}`"),
    }
    (name, arguments)
}

/// The calls of a JSON answer, or of a stream's deltas appended by index
/// as clients do; with the answer's text and finish reason.
fn calls_of(r: &support::Reply, streamed: bool) -> (Vec<Value>, Value, String) {
    assert_eq!(r.status, 200, "{}", r.body);
    if !streamed {
        let choice = &r.json()["choices"][0];
        let calls = choice["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
        return (calls, choice["message"]["content"].clone(), choice["finish_reason"].to_string());
    }
    let (mut calls, mut text, mut finish) = (Vec::<Value>::new(), String::new(), String::new());
    for line in r.body.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let event: Value = serde_json::from_str(line).unwrap();
        let Some(choice) = event["choices"].get(0) else { continue };
        text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        for delta in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = delta["index"].as_u64().unwrap() as usize;
            if index == calls.len() {
                calls.push(json!({"id": delta["id"], "type": delta["type"], "function": {"name": delta["function"]["name"], "arguments": ""}}));
            }
            let arguments = calls[index]["function"]["arguments"].as_str().unwrap().to_string();
            calls[index]["function"]["arguments"] =
                json!(arguments + delta["function"]["arguments"].as_str().unwrap_or(""));
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].to_string();
        }
    }
    let text = if text.is_empty() { Value::Null } else { json!(text) };
    (calls, text, finish)
}

/// Issue 19, tools: `tool_choice: "required"` and a named function answer
/// with exactly one call (no text, `finish_reason: "tool_calls"`) to an
/// offered function, its arguments valid against that function's schema,
/// whether sampled or greedy, plain or streamed (deltas reassembled by
/// index); the call and its result are accepted in the next turn.
#[test]
fn required_calls_follow_the_schema_and_go_back_in_the_next_turn() {
    let (_d, s) = serve();
    let mut names = std::collections::BTreeSet::new();
    for streamed in [false, true] {
        for seed in 0..4 {
            for choice in [json!("required"), json!({"type": "function", "function": {"name": "weather"}})] {
                let mut body = chat(M, "Weather in Paris for three days?", 120);
                body["tools"] = tools();
                body["tool_choice"] = choice.clone();
                body["stream"] = json!(streamed);
                body["seed"] = json!(seed);
                body["temperature"] = json!(if seed == 0 { 0.0 } else { 1.0 });
                let (calls, text, finish) = calls_of(&post(s.addr, "/v1/chat/completions", &body), streamed);
                assert_eq!(finish, "\"tool_calls\"", "{choice}: {calls:?} {text}");
                assert_eq!(calls.len(), 1, "{calls:?}");
                assert_eq!(text, Value::Null, "a required call writes no text");
                let (name, _) = checked(&calls[0]);
                if choice.is_object() {
                    assert_eq!(name, "weather");
                }
                names.insert(calls[0]["function"]["arguments"].to_string());
            }
        }
    }
    assert!(names.len() > 1, "every request made the same call: {names:?}");

    let mut body = chat(M, "Weather in Rome?", 120);
    body["tools"] = tools();
    body["tool_choice"] = json!("required");
    let first = post(s.addr, "/v1/chat/completions", &body);
    let message = first.json()["choices"][0]["message"].clone();
    let id = message["tool_calls"][0]["id"].clone();
    body["messages"] = json!([
        {"role": "user", "content": "Weather in Rome?"},
        message,
        {"role": "tool", "tool_call_id": id, "content": "{\"sky\": \"clear\"}"}
    ]);
    body["tool_choice"] = json!("auto");
    body["max_tokens"] = json!(4);
    let prompt_tokens = |body: &Value| {
        let r = post(s.addr, "/v1/chat/completions", body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let with_result = prompt_tokens(&body);
    // The template renders the tools, the call and its result: `none`
    // drops the tools, and without the result the prompt is shorter still.
    body["tool_choice"] = json!("none");
    let without_tools = prompt_tokens(&body);
    body["messages"].as_array_mut().unwrap().pop();
    let without_result = prompt_tokens(&body);
    assert!(
        with_result > without_tools && without_tools > without_result,
        "{with_result} {without_tools} {without_result}"
    );
}

/// Issue 19, tools (bad input): malformed tools, an unknown or unsatisfiable
/// choice, a response format beside tools (required or auto), and malformed tool
/// messages are 400s naming the field, refused before anything is admitted,
/// reserved or leased (A2, L1): the session's next turn runs.
#[test]
fn bad_tools_and_tool_messages_are_refused_naming_the_field() {
    let (_d, s) = serve();
    let r = post(s.addr, "/v1/sessions", &json!({"model": M}));
    let sid = r.json()["id"].as_str().unwrap().to_string();
    let before = s.gauges();
    let named = |name: &str| json!({"type": "function", "function": {"name": name}});
    let user = json!({"role": "user", "content": "hi"});
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"tools": tools(), "tool_choice": named("news")}), "tool_choice", "not among the tools"),
        (json!({"tool_choice": "required"}), "tool_choice", "no tools"),
        (json!({"tools": tools(), "tool_choice": "sometimes"}), "tool_choice", "\\\"required\\\""),
        (json!({"tools": [named("a"), named("a")]}), "tools[1].function", "named twice"),
        (json!({"tools": [named("has space")]}), "tools[0].function", "letters, digits"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type", "\\\"function\\\""),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools[0].function",
            "JSON Schema",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["x"]}}}], "tool_choice": "required"}),
            "tools",
            "cannot be compiled",
        ),
        (
            json!({"tools": tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
            "drop response_format",
        ),
        // Under `auto` the JSON grammar leaves no room for a call either.
        (
            json!({"tools": tools(), "response_format": {"type": "json_object"}}),
            "response_format",
            "no way to call the tools",
        ),
        (json!({"messages": [user, {"role": "tool", "content": "x"}]}), "messages[1].tool_call_id", "names the call"),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls",
            "only an assistant",
        ),
        (json!({"messages": [{"role": "user", "content": null}]}), "messages[0].content", "needs content"),
        (json!({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role", "not system"),
        (json!({"chat_template_kwargs": 5}), "chat_template_kwargs", "an object"),
        (json!({"chat_template_kwargs": {"messages": []}}), "chat_template_kwargs", "`messages` is set by the server"),
        (
            json!({"chat_template_kwargs": (0..33).map(|i| (format!("v{i}"), json!(i))).collect::<serde_json::Map<_, _>>()}),
            "chat_template_kwargs",
            "at most 32",
        ),
    ];
    for (extra, param, want) in cases {
        let mut body = chat(M, "hi", 4);
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = call(s.addr, "POST", "/v1/chat/completions", &[("x-session-id", &sid)], &body.to_string());
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{extra}: {}", r.body);
        assert!(r.body.contains(want), "expected `{want}`: {}", r.body);
    }
    let after = s.gauges();
    assert_eq!((after.admitted, after.reserved_bytes, after.leases), (before.admitted, before.reserved_bytes, 0));
    let r = call(s.addr, "POST", "/v1/chat/completions", &[("x-session-id", &sid)], &chat(M, "ok", 2).to_string());
    assert_eq!(r.status, 200, "{}", r.body);
}

/// `chat_template_kwargs` reach the template as variables (vLLM's
/// extension): a template that writes `persona` when it is set renders a
/// longer prompt with it, and the same one without it otherwise.
#[test]
fn template_variables_reach_the_chat_template() {
    let (_dir, mut p) = package(M);
    p.manifest.chat_template = Some(
        "{% if persona is defined %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n".into(),
    );
    let s = start(vec![engine(&p, &Gate::default(), Scheduler::new(u64::MAX / 2))], "127.0.0.1:0", 8).unwrap();
    let prompt_tokens = |body: Value| {
        let r = post(s.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let plain = prompt_tokens(chat(M, "hi", 1));
    let mut with = chat(M, "hi", 1);
    with["chat_template_kwargs"] = json!({"persona": "a pirate who answers in rhymes"});
    assert!(prompt_tokens(with) > plain + 5, "the variable was not rendered");
    let mut unrelated = chat(M, "hi", 1);
    unrelated["chat_template_kwargs"] = json!({"enable_thinking": false});
    assert_eq!(prompt_tokens(unrelated), plain);
}

/// An assistant message sent back with the fields OpenAI's answers carry
/// (`refusal`, `audio`, `function_call`, `annotations`) is served where
/// they are empty — the Python client's `model_dump()` writes them as
/// null, and was refused as unknown fields — and refused naming the field
/// where one holds a value the server would not read.
#[test]
fn echoed_assistant_fields_are_taken_empty_and_refused_with_a_value() {
    let (_d, s) = serve();
    let with = |extra: serde_json::Value| {
        let mut answer = json!({"role": "assistant", "content": "yo"});
        answer.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let messages = json!([{"role": "user", "content": "hi"}, answer, {"role": "user", "content": "again"}]);
        post(s.addr, "/v1/chat/completions", &json!({"model": M, "messages": messages, "max_tokens": 2}))
    };
    let empty = json!({"refusal": null, "audio": null, "function_call": null, "annotations": null});
    assert_eq!(with(empty).status, 200);
    assert_eq!(with(json!({"annotations": []})).status, 200);
    for (extra, field) in [
        (json!({"refusal": "I cannot"}), "refusal"),
        (json!({"audio": {"id": "a"}}), "audio"),
        (json!({"function_call": {"name": "f", "arguments": "{}"}}), "function_call"),
        (json!({"annotations": [{"type": "url_citation"}]}), "annotations"),
    ] {
        let r = with(extra);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], format!("messages[1].{field}"), "{}", r.body);
    }
}
