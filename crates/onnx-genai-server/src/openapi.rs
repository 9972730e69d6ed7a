//! The OpenAPI 3.0 document served at `GET /openapi.json`: one operation
//! per route of [`crate::ROUTES`] (the list the router is built from), each
//! request body's properties the fields `fields.rs` serves — at the values
//! it serves, `additionalProperties: false`, since anything else is a 400
//! — and each answer's status codes and shapes. A property-based fuzzer
//! (schemathesis, the `api-fuzz` lane) drives the server from it.

use serde_json::{json, Map, Value};

use crate::fields::{self, Field, Support};

/// Statuses every route may answer besides its own: a refused request, a
/// body past the limit, a Host or key the guard refuses, a JSON content
/// type missing, a request past its time.
const GUARD_STATUSES: [&str; 6] = ["401", "403", "408", "413", "415", "504"];

/// What the document describes of a running server.
pub struct Served<'a> {
    /// The only values `model` takes.
    pub models: &'a [&'a str],
    /// The most choices (`n`) a request may ask for.
    pub max_choices: usize,
}

/// The document of a server.
pub fn document(served: &Served) -> Value {
    let mut paths = Map::new();
    for (method, path) in crate::ROUTES {
        let entry = paths.entry(path.to_string()).or_insert_with(|| json!({}));
        entry[method.to_ascii_lowercase()] = operation(method, path, served);
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "onnx-genai server",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "OpenAI-compatible chat and text completions over ONNX model packages, with sessions."
        },
        "paths": paths,
        "components": {"schemas": {
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {"error": {
                    "type": "object",
                    "required": ["message", "type"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": "string", "nullable": true},
                        "code": {"type": "string", "nullable": true}
                    }
                }}
            },
            "Usage": {
                "type": "object",
                "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                "properties": {
                    "prompt_tokens": {"type": "integer", "minimum": 0},
                    "completion_tokens": {"type": "integer", "minimum": 0},
                    "total_tokens": {"type": "integer", "minimum": 0}
                }
            }
        }}
    })
}

/// One route's operation.
fn operation(method: &str, path: &str, served: &Served) -> Value {
    let models = served.models;
    let (summary, body, answer, own): (&str, Option<Value>, Value, &[&str]) = match (method, path) {
        ("GET", "/health") => (
            "Whether every model's driver runs",
            None,
            object(
                &["status"],
                json!({"status": {"type": "string"}, "models_down": {"type": "array", "items": {"type": "string"}}}),
            ),
            &["503"],
        ),
        ("GET", "/metrics") => ("Prometheus metrics", None, json!({"type": "string"}), &[]),
        ("GET", "/openapi.json") => ("This document", None, json!({"type": "object"}), &[]),
        ("GET", "/v1/models") => (
            "The served models",
            None,
            object(
                &["object", "data"],
                json!({"object": {"type": "string"}, "data": {"type": "array", "items": object(&["id", "object"], json!({"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"}, "owned_by": {"type": "string"}}))}}),
            ),
            &[],
        ),
        ("POST", "/v1/chat/completions") => (
            "A chat completion, as JSON or server-sent events",
            Some(request(&fields::chat(), &["model", "messages"], served)),
            completion(true),
            &["400", "404", "409", "429", "503"],
        ),
        ("POST", "/v1/completions") => (
            "A text completion, as JSON or server-sent events",
            Some(request(&fields::completions(), &["model", "prompt"], served)),
            completion(false),
            &["400", "404", "409", "429", "503"],
        ),
        ("POST", "/v1/sessions") => (
            "A session whose KV cache carries over its turns (name it with X-Session-Id)",
            Some(request(&fields::sessions(), &["model"], served)),
            object(
                &["id", "object", "model"],
                json!({"id": {"type": "string"}, "object": {"type": "string"}, "model": {"type": "string"}}),
            ),
            &["400", "404", "503"],
        ),
        ("DELETE", "/v1/sessions/{id}") => (
            "Closes a session",
            None,
            object(
                &["id", "object", "deleted"],
                json!({"id": {"type": "string"}, "object": {"type": "string"}, "deleted": {"type": "boolean"}}),
            ),
            &["404", "409"],
        ),
        _ => ("Undocumented", None, json!({}), &[]),
    };
    let mut responses = Map::new();
    let ok = match (method, path) {
        ("GET", "/metrics") => {
            json!({"description": "OK", "content": {crate::metrics::CONTENT_TYPE: {"schema": answer}}})
        }
        ("POST", p) if p.ends_with("completions") => json!({"description": "OK", "content": {
            "application/json": {"schema": answer},
            "text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
        }}),
        _ => json!({"description": "OK", "content": {"application/json": {"schema": answer}}}),
    };
    responses.insert("200".into(), ok);
    for status in own.iter().chain(&GUARD_STATUSES) {
        let error = json!({"description": "An OpenAI-shaped error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
        responses.insert(status.to_string(), error);
    }
    let mut op = json!({"summary": summary, "operationId": operation_id(method, path), "responses": responses});
    if let Some(body) = body {
        op["requestBody"] = json!({"required": true, "content": {"application/json": {"schema": body, "example": example(path, models)}}});
    }
    if (method, path) == ("POST", "/v1/sessions") {
        // What a fuzzer's stateful phase follows: close the session made.
        op["responses"]["200"]["links"] = json!({"CloseSession": {
            "operationId": operation_id("DELETE", "/v1/sessions/{id}"),
            "parameters": {"id": "$response.body#/id"}
        }});
    }
    if path.contains("{id}") {
        op["parameters"] = json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}]);
    }
    if path.contains("completions") {
        op["parameters"] =
            json!([{"name": "X-Session-Id", "in": "header", "required": false, "schema": {"type": "string"}}]);
    }
    op
}

fn operation_id(method: &str, path: &str) -> String {
    let words: Vec<&str> = path.split(['/', '.', '{', '}']).filter(|w| !w.is_empty()).collect();
    format!("{}_{}", method.to_ascii_lowercase(), words.join("_"))
}

fn object(required: &[&str], properties: Value) -> Value {
    json!({"type": "object", "required": required, "properties": properties})
}

/// A request that works, for a route with a body.
fn example(path: &str, models: &[&str]) -> Value {
    let model = models.first().copied().unwrap_or("model");
    match path {
        "/v1/chat/completions" => {
            json!({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        }
        "/v1/completions" => json!({"model": model, "prompt": "Once upon a time", "max_tokens": 8}),
        _ => json!({"model": model}),
    }
}

/// A request body: the fields served, each at the values served, and
/// nothing else.
fn request(table: &[Field], required: &[&str], served: &Served) -> Value {
    let mut properties = Map::new();
    for field in table {
        if let Some(mut schema) = field_schema(field) {
            match field.name {
                "model" => schema = json!({"enum": served.models}),
                "n" => schema["maximum"] = json!(served.max_choices),
                _ => {}
            }
            schema["nullable"] = json!(!required.contains(&field.name));
            schema["description"] = json!(field.note);
            properties.insert(field.name.to_string(), schema);
        }
    }
    json!({"type": "object", "required": required, "properties": properties, "additionalProperties": false})
}

/// A field's schema: `None` for a refused one (sending it is a 400).
pub(crate) fn field_schema(field: &Field) -> Option<Value> {
    let default = match field.support {
        Support::Refused => return None,
        Support::DefaultOnly(default) => Some(default),
        Support::Served => None,
    };
    if let Some(default) = default {
        let value: Value = serde_json::from_str(default).unwrap_or(Value::Null);
        return Some(json!({"enum": [value]}));
    }
    let number = |min: f64, max: f64| json!({"type": "number", "minimum": min, "maximum": max});
    let integer = |min: i64, max: i64| json!({"type": "integer", "minimum": min, "maximum": max});
    Some(match field.name {
        "model" | "user" => json!({"type": "string"}),
        "prompt" => json!({"type": "string", "minLength": 1}),
        "max_tokens" | "max_completion_tokens" => integer(1, i64::from(u32::MAX)),
        "temperature" => number(0.0, 2.0),
        "top_p" => json!({"type": "number", "minimum": 0, "maximum": 1}),
        "seed" => integer(i64::MIN, i64::MAX),
        "stop" => json!({"oneOf": [
            {"type": "string", "maxLength": crate::api::MAX_STOP_CHARS},
            {"type": "array", "maxItems": crate::api::MAX_STOPS, "items": {"type": "string", "maxLength": crate::api::MAX_STOP_CHARS}}
        ]}),
        "stream" | "parallel_tool_calls" => json!({"type": "boolean"}),
        "chat_template_kwargs" => json!({"type": "object", "maxProperties": crate::api::MAX_TEMPLATE_VARS}),
        "stream_options" => json!({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
        "frequency_penalty" | "presence_penalty" => number(-2.0, 2.0),
        "logit_bias" => json!({"type": "object", "maxProperties": crate::api::MAX_LOGIT_BIAS,
            "additionalProperties": number(-100.0, 100.0)}),
        "top_k" => json!({"type": "integer", "minimum": -1}),
        "n" => integer(1, onnx_genai_engine::MAX_CHOICES as i64),
        "min_p" => number(0.0, 1.0),
        "repetition_penalty" => json!({"type": "number", "minimum": 0, "exclusiveMinimum": true}),
        "messages" => json!({"type": "array", "minItems": 1, "items": message()}),
        "logprobs" if field.note.starts_with("chat") => json!({"type": "boolean"}),
        "logprobs" => integer(0, crate::api::MAX_COMPLETION_LOGPROBS as i64),
        "top_logprobs" => integer(0, onnx_genai_engine::sampling::MAX_TOP_LOGPROBS as i64),
        "response_format" => json!({"oneOf": [
            object(&["type"], json!({"type": {"enum": ["text", "json_object"]}})),
            object(&["type", "json_schema"], json!({
                "type": {"enum": ["json_schema"]},
                "json_schema": object(&["name", "schema"], json!({
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "schema": {"type": "object"},
                    "strict": {"type": "boolean", "nullable": true}
                }))
            }))
        ]}),
        "tools" => {
            json!({"type": "array", "maxItems": crate::tool_calls::MAX_TOOLS, "items": object(&["type", "function"], json!({
                "type": {"enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": false,
                    "properties": {
                        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                        "description": {"type": "string"},
                        "parameters": {"type": "object"},
                        "strict": {"type": "boolean"}
                    }
                }
            }))})
        }
        "tool_choice" => json!({"oneOf": [
            {"enum": ["none", "auto", "required"]},
            object(&["type", "function"], json!({"type": {"enum": ["function"]}, "function": object(&["name"], json!({"name": {"type": "string"}}))}))
        ]}),
        _ => json!({}),
    })
}

/// A chat message: a role, text or typed parts, an assistant's calls, the
/// call a tool result answers.
fn message() -> Value {
    let part = json!({"oneOf": [
        object(&["type", "text"], json!({"type": {"enum": ["text"]}, "text": {"type": "string"}})),
        object(&["type", "image_url"], json!({"type": {"enum": ["image_url"]}, "image_url": object(&["url"], json!({
            "url": {"type": "string"},
            "detail": {"enum": ["auto", "low", "high"]}
        }))}))
    ]});
    let call = object(
        &["id", "type", "function"],
        json!({
            "id": {"type": "string"},
            "type": {"enum": ["function"]},
            "function": object(&["name", "arguments"], json!({"name": {"type": "string"}, "arguments": {"type": "string"}}))
        }),
    );
    object(
        &["role"],
        json!({
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "name": {"type": "string"},
            "content": {"nullable": true, "oneOf": [{"type": "string"}, {"type": "array", "items": part}]},
            "tool_calls": {"type": "array", "items": call},
            "tool_call_id": {"type": "string"}
        }),
    )
}

/// A completion answer (chat or text), as JSON.
fn completion(chat: bool) -> Value {
    let logprobs = json!({"type": "object", "nullable": true});
    let finish = json!({"enum": ["stop", "length", "tool_calls"]});
    let choice = if chat {
        object(
            &["index", "message", "finish_reason"],
            json!({
                "index": {"type": "integer"},
                "message": object(&["role"], json!({
                    "role": {"enum": ["assistant"]},
                    "content": {"type": "string", "nullable": true},
                    "tool_calls": {"type": "array", "items": {"type": "object"}}
                })),
                "logprobs": logprobs,
                "finish_reason": finish
            }),
        )
    } else {
        object(
            &["index", "text", "finish_reason"],
            json!({
                "index": {"type": "integer"},
                "text": {"type": "string"},
                "logprobs": logprobs,
                "finish_reason": finish
            }),
        )
    };
    object(
        &["id", "object", "created", "model", "choices"],
        json!({
            "id": {"type": "string"},
            "object": {"enum": [if chat { "chat.completion" } else { "text_completion" }]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": {"$ref": "#/components/schemas/Usage"}
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 19 (OpenAPI): the document has exactly one operation per
    /// route the router is built from, each documented; every served field
    /// of both completion endpoints is a property of its body and every
    /// refused one is not (so sending it is outside the schema, as it is a
    /// 400 on the wire).
    #[test]
    fn the_document_matches_the_routes_and_the_fields() {
        let doc = document(&Served { models: &["m"], max_choices: 3 });
        let mut documented = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                assert_ne!(op["summary"], "Undocumented", "{method} {path}");
                documented.push((method.to_ascii_uppercase(), path.clone()));
            }
        }
        let mut routes: Vec<(String, String)> =
            crate::ROUTES.iter().map(|(m, p)| (m.to_string(), p.to_string())).collect();
        routes.sort();
        documented.sort();
        assert_eq!(documented, routes);
        for (path, table) in [("/v1/chat/completions", fields::chat()), ("/v1/completions", fields::completions())] {
            let props =
                &doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"];
            for f in table {
                let listed = props.get(f.name).is_some();
                assert_eq!(listed, f.support != Support::Refused, "{path} {}", f.name);
                if listed {
                    assert_ne!(props[f.name].as_object().map(|o| o.len()), Some(2), "{path} {}: no schema", f.name);
                }
            }
            assert_eq!(props["n"]["maximum"], 3, "the configured limit");
            assert_eq!(props["model"]["enum"], json!(["m"]));
        }
    }
}
