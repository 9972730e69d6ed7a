//! Structured outputs on real tiny packages: a response format's grammar
//! masks every sampling choice, on ONNX Runtime and native-cpu, alone and
//! in batches. The tiny models' weights are random, so whatever they write
//! inside the grammar comes from the mask alone.

use std::path::Path;

use onnx_genai_engine::{
    BackendKind, Engine, EngineError, FinishReason, Flow, GenerateRequest, Prompt, ResponseFormat, Sampling, Scheduler,
    Turn, TurnState,
};
use serde_json::{json, Value};

fn package(dir: &Path) {
    onnx_genai_test_support::build_into("tiny-llama-gqa", onnx_genai_test_support::Variant::Decomposed, dir);
}

/// Every string is an enum, every number bounded and every array capped:
/// the language is finite, so each constrained turn must end by itself.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "nested": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": false
            }
        },
        "required": ["answer", "count", "tags", "nested"],
        "additionalProperties": false
    })
}

/// Checks `text` against [`schema`] by hand (not with the grammar that made
/// it): what is wrong, or `None`.
fn violation(text: &str) -> Option<String> {
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Some(format!("not JSON ({e})")),
    };
    let Some(object) = value.as_object() else { return Some("not an object".into()) };
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort_unstable();
    if keys != ["answer", "count", "nested", "tags"] {
        return Some(format!("keys {keys:?}"));
    }
    if !matches!(object["answer"].as_str(), Some("yes" | "no" | "maybe")) {
        return Some(format!("answer {}", object["answer"]));
    }
    if object["count"].as_u64().is_none_or(|n| n > 99) {
        return Some(format!("count {}", object["count"]));
    }
    let tags_ok = object["tags"]
        .as_array()
        .is_some_and(|t| t.len() <= 3 && t.iter().all(|x| matches!(x.as_str(), Some("a" | "b"))));
    if !tags_ok {
        return Some(format!("tags {}", object["tags"]));
    }
    let nested = object["nested"].as_object();
    if !nested.is_some_and(|n| n.len() == 1 && n.get("ok").is_some_and(Value::is_boolean)) {
        return Some(format!("nested {}", object["nested"]));
    }
    None
}

fn request(engine: &Engine, seed: u64, format: ResponseFormat) -> GenerateRequest {
    let prompt = engine.encode("Reply in JSON:").unwrap();
    GenerateRequest {
        max_new_tokens: Some(400),
        sampling: Sampling { temperature: if seed == 0 { 0.0 } else { 1.0 }, seed, ..Sampling::default() },
        response_format: format,
        ..GenerateRequest::new(Prompt::TokenIds(prompt))
    }
}

/// Runs `reqs` as one batch from the first step to the last.
fn together(engine: &mut Engine, reqs: &[GenerateRequest]) -> Vec<(String, FinishReason)> {
    let mut turns: Vec<Turn> = reqs.iter().map(|r| engine.admit(r, &mut |_| {}).unwrap()).collect();
    for step in 0.. {
        assert!(step < 1000, "a constrained batch never finished");
        let mut live: Vec<&mut Turn> = turns.iter_mut().filter(|t| t.state() == TurnState::Running).collect();
        if live.is_empty() {
            break;
        }
        engine.step(&mut live, &mut |_, _| Flow::Continue);
    }
    turns
        .into_iter()
        .map(|t| {
            let r = engine.finish(t).unwrap();
            (r.text, r.finish_reason)
        })
        .collect()
}

/// Structured outputs (issue 19): on both backends, a greedy turn and
/// sampled turns over twelve seeds, run four at a time, all end by
/// themselves (`Eos`: the grammar completed) with JSON that has exactly the
/// schema's keys, enum values, bounded integers and capped arrays. The same
/// requests without the format write text that is not such JSON, so the
/// mask is what makes it.
#[test]
fn json_schema_outputs_validate_on_every_backend_alone_and_together() {
    let dir = tempfile::tempdir().unwrap();
    package(dir.path());
    for kind in [BackendKind::NativeCpu, BackendKind::Ort] {
        let mut engine = Engine::open(dir.path(), kind, 1).unwrap();
        let format = ResponseFormat::JsonSchema(schema());
        let mut texts = Vec::new();
        for seeds in (0..12u64).collect::<Vec<_>>().chunks(4) {
            let reqs: Vec<_> = seeds.iter().map(|&s| request(&engine, s, format.clone())).collect();
            for ((text, finish), seed) in together(&mut engine, &reqs).into_iter().zip(seeds) {
                assert_eq!(finish, FinishReason::Eos, "{kind:?} seed {seed}: {text}");
                if let Some(v) = violation(&text) {
                    panic!("{kind:?} seed {seed}: {v}: {text}");
                }
                texts.push(text);
            }
        }
        texts.sort();
        texts.dedup();
        assert!(texts.len() > 3, "{kind:?}: sampling under the mask gave only {texts:?}");
        let free: Vec<_> = (0..4).map(|s| request(&engine, s, ResponseFormat::Text)).collect();
        let free = together(&mut engine, &free);
        assert!(
            free.iter().all(|(text, _)| violation(text).is_some()),
            "{kind:?}: the unconstrained model wrote schema JSON by itself: {free:?}"
        );
    }
}

/// `json_object`: whatever the model picks, the text is a JSON object
/// once the grammar completes (some of twelve turns must), and opens one
/// when the length ends it.
#[test]
fn json_object_outputs_are_objects() {
    let dir = tempfile::tempdir().unwrap();
    package(dir.path());
    let mut engine = Engine::open(dir.path(), BackendKind::NativeCpu, 1).unwrap();
    let reqs: Vec<_> = (0..12).map(|s| request(&engine, s, ResponseFormat::JsonObject)).collect();
    let answers = together(&mut engine, &reqs);
    let complete = answers.iter().filter(|(_, finish)| *finish == FinishReason::Eos).count();
    assert!(complete > 0, "no json_object turn completed, so nothing here was parsed: {answers:?}");
    for (text, finish) in answers {
        assert!(text.starts_with('{'), "{text}");
        if finish == FinishReason::Eos {
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(value.is_object(), "{text}");
        } else {
            assert_eq!(finish, FinishReason::Length, "{text}");
        }
    }
}

/// Bad input (issue 19), A2: a schema the compiler refuses, and one that is
/// not an object, are `ResponseFormat` errors saying why, before anything
/// is reserved.
#[test]
fn a_schema_that_cannot_compile_is_refused_before_admission() {
    let dir = tempfile::tempdir().unwrap();
    package(dir.path());
    let engine = Engine::open(dir.path(), BackendKind::NativeCpu, 1).unwrap();
    let mut engine = engine.with_scheduler(Scheduler::new(1 << 30));
    let unsatisfiable = json!({
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["x"]
    });
    for (schema, says) in
        [(unsatisfiable, "nsatisfiable"), (json!(true), "JSON object"), (json!({"type": "nope"}), "nope")]
    {
        let req = request(&engine, 0, ResponseFormat::JsonSchema(schema.clone()));
        let mut signalled = false;
        match engine.admit(&req, &mut |_| signalled = true) {
            Err(EngineError::ResponseFormat(m)) => assert!(m.contains(says), "{schema}: {m}"),
            Err(e) => panic!("{schema}: refused as {e}"),
            Ok(_) => panic!("{schema} was admitted"),
        }
        assert!(!signalled, "{schema}: admission was signalled");
        assert_eq!(engine.scheduler().reserved_bytes(), 0, "{schema}: bytes left reserved");
    }
}

/// A format compiled once serves the requests after it: a server's route
/// compiles a request's format before the request queues (refusing a bad
/// one there), and the engine's compile when it admits the request — on
/// the model's driver, where every stream of the model waits for it — is
/// a copy of that one in its start state (two sampled turns from it both
/// write schema JSON of their own). And a client's `x-guidance` options
/// are dropped, the server's compact JSON kept: greedy, a schema carrying
/// `whitespace_flexible` writes exactly what the plain schema does.
#[test]
fn a_format_compiled_before_admission_is_not_compiled_again() {
    let dir = tempfile::tempdir().unwrap();
    package(dir.path());
    let mut engine = Engine::open(dir.path(), BackendKind::NativeCpu, 1).unwrap();
    let format = ResponseFormat::JsonSchema(schema());
    engine.prompter().constraint(&format).unwrap();
    assert_eq!(engine.prompter().grammars_compiled(), 1);
    let reqs = [request(&engine, 1, format.clone()), request(&engine, 2, format.clone())];
    let answers = together(&mut engine, &reqs);
    assert_eq!(engine.prompter().grammars_compiled(), 1, "admission compiled the format again");
    for (text, finish) in &answers {
        assert_eq!(*finish, FinishReason::Eos, "{text}");
        assert_eq!(violation(text), None, "{text}");
    }

    let mut flexible = schema();
    flexible["x-guidance"] = json!({"whitespace_flexible": true});
    let greedy = |engine: &mut Engine, schema: Value| {
        together(engine, &[request(engine, 0, ResponseFormat::JsonSchema(schema))]).remove(0).0
    };
    let (plain, with_options) = (greedy(&mut engine, schema()), greedy(&mut engine, flexible));
    assert_eq!(with_options, plain, "the client's x-guidance options changed the grammar");
}
