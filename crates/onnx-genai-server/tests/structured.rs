//! Structured outputs over real HTTP on loopback: OpenAI's
//! `response_format` served by constrained decoding (issue 19).

mod support;

use onnx_genai_engine::Scheduler;
use onnx_genai_server::start;
use serde_json::{json, Value};
use support::{call, chat, engine, package, post, Gate};

const M: &str = "tiny-llama-gqa";

/// The answer's text and finish reason, from a JSON answer or the events
/// of a stream.
fn answer(r: &support::Reply, streamed: bool) -> (String, String) {
    assert_eq!(r.status, 200, "{}", r.body);
    if !streamed {
        let choice = &r.json()["choices"][0];
        return (choice["message"]["content"].as_str().unwrap().to_string(), choice["finish_reason"].to_string());
    }
    let (mut text, mut finish) = (String::new(), String::new());
    for data in r.body.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let event: Value = serde_json::from_str(data).unwrap();
        let Some(choice) = event["choices"].get(0) else { continue };
        text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].to_string();
        }
    }
    (text, finish)
}

/// Issue 19, structured outputs: `json_schema` answers (`strict`, plain and
/// streamed, greedy and sampled) are JSON with exactly the schema's keys and
/// values in its enum and range, finished with `stop`; `json_object`
/// answers open an object. Bad formats (a schema the compiler refuses, no
/// schema, a bad name or `strict`, an unknown type) are 400s naming
/// `response_format`, with nothing admitted or reserved and no lease left
/// (A2, L1): the session's next turn runs.
#[test]
fn response_formats_constrain_the_answer_and_bad_ones_are_refused() {
    let gate = Gate::default();
    let (_d, p) = package(M);
    let s = start(vec![engine(&p, &gate, Scheduler::new(u64::MAX / 2))], "127.0.0.1:0", 8).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 1, "maximum": 9}
        },
        "required": ["color", "n"],
        "additionalProperties": false
    });
    let format = json!({"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": true}});
    let mut seen = std::collections::BTreeSet::new();
    for streamed in [false, true] {
        for seed in 0..4 {
            let mut body = chat(M, "Pick a color", 200);
            body["response_format"] = format.clone();
            body["stream"] = json!(streamed);
            body["seed"] = json!(seed);
            body["temperature"] = json!(if seed == 0 { 0.0 } else { 1.0 });
            let (text, finish) = answer(&post(s.addr, "/v1/chat/completions", &body), streamed);
            assert_eq!(finish, "\"stop\"", "{text}");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            let keys: Vec<&String> = value.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["color", "n"], "{text}");
            assert!(matches!(value["color"].as_str(), Some("red" | "green" | "blue")), "{text}");
            assert!(value["n"].as_u64().is_some_and(|n| (1..=9).contains(&n)), "{text}");
            seen.insert(text);
        }
    }
    assert!(seen.len() > 1, "every request wrote the same JSON: {seen:?}");
    let mut body = chat(M, "Anything", 60);
    body["response_format"] = json!({"type": "json_object"});
    let (text, _) = answer(&post(s.addr, "/v1/chat/completions", &body), false);
    assert!(text.starts_with('{'), "{text}");

    let r = post(s.addr, "/v1/sessions", &json!({"model": M}));
    assert_eq!(r.status, 200, "{}", r.body);
    let sid = r.json()["id"].as_str().unwrap().to_string();
    let before = s.gauges();
    let unsatisfiable = json!({
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["x"]
    });
    for (format, want) in [
        (json!({"type": "json_schema", "json_schema": {"name": "x", "schema": unsatisfiable}}), "cannot be used"),
        (json!({"type": "json_schema", "json_schema": {"name": "x"}}), "json_schema.schema"),
        (json!({"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}), "json_schema.name"),
        (json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}), "strict"),
        (json!({"type": "yaml"}), "not text, json_object or json_schema"),
        (json!({"json_schema": {}}), "needs a `type`"),
    ] {
        let mut body = chat(M, "hi", 4);
        body["response_format"] = format.clone();
        let r = call(s.addr, "POST", "/v1/chat/completions", &[("x-session-id", &sid)], &body.to_string());
        assert_eq!(r.status, 400, "{format}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], "response_format", "{}", r.body);
        assert!(r.body.contains(want), "expected `{want}`: {}", r.body);
    }
    let after = s.gauges();
    assert_eq!((after.admitted, after.reserved_bytes, after.leases), (before.admitted, before.reserved_bytes, 0));
    let r = call(s.addr, "POST", "/v1/chat/completions", &[("x-session-id", &sid)], &chat(M, "ok", 2).to_string());
    assert_eq!(r.status, 200, "{}", r.body);
}
