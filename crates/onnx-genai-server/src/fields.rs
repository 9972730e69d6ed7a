//! Which fields of OpenAI's request bodies this server serves and which it
//! refuses: nothing is accepted and then ignored. A field is served, served
//! only at its default (`n` of 1, `echo` false — what the server does
//! anyway), or refused with 400 `invalid_request_error` naming it; a field
//! OpenAI does not define is refused as unrecognized, as OpenAI does, except
//! the sampling extensions vLLM also serves (`top_k`, `min_p`,
//! `repetition_penalty`). The
//! README's table is generated from these lists (a test keeps them equal)
//! and another test walks them over HTTP.

use serde_json::Value;

use crate::error::ApiError;

/// How a field is treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    Served,
    /// Accepted only with this JSON value (or `null`); refused otherwise.
    DefaultOnly(&'static str),
    Refused,
}

#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub support: Support,
    /// What the server does with it, or why it refuses it.
    pub note: &'static str,
    /// A value for the tests: one that is served (`Served`), or one that is
    /// refused (`DefaultOnly`, `Refused`).
    pub example: &'static str,
}

const fn served(name: &'static str, note: &'static str, example: &'static str) -> Field {
    Field { name, support: Support::Served, note, example }
}

const fn default_only(name: &'static str, default: &'static str, note: &'static str, example: &'static str) -> Field {
    Field { name, support: Support::DefaultOnly(default), note, example }
}

const fn refused(name: &'static str, note: &'static str, example: &'static str) -> Field {
    Field { name, support: Support::Refused, note, example }
}

/// Fields both endpoints share.
const COMMON: [Field; 17] = [
    served("model", "the package name", "\"m\""),
    served("max_tokens", "new tokens at most", "2"),
    served("temperature", "0 to 2; 0 is greedy", "0.5"),
    served("top_p", "nucleus sampling, [0, 1] (0 keeps the likeliest token)", "0.9"),
    served("seed", "reproducible sampling (any int64); without it each request draws its own", "-7"),
    served("stop", "up to 4 strings of up to 256 characters; a stream holds back text that may begin one", "[\"zzz\"]"),
    served("stream", "server-sent events", "false"),
    served("stream_options", "`include_usage` (`include_obfuscation` only false); only with `stream`", "{\"include_usage\": true}"),
    served("user", "an end-user id, written to the request's log line", "\"u-1\""),
    served(
        "n",
        "1 to 16 choices of one prompt, sharing its prefill (the KV copied once the prompt has run); choice k samples with seed + k; not with a session",
        "2",
    ),
    served("frequency_penalty", "-2 to 2, subtracted per time a token was generated", "0.5"),
    served("presence_penalty", "-2 to 2, subtracted once from every generated token", "0.5"),
    served(
        "logit_bias",
        "token id to a bias in -100 to 100, added before sampling (greedy too); ids outside the vocabulary are refused",
        "{\"1\": 5}",
    ),
    served("top_k", "extension (as vLLM): keep the k likeliest tokens; 0 keeps all", "40"),
    served("min_p", "extension (as vLLM): drop tokens below min_p times the likeliest's probability", "0.05"),
    served(
        "repetition_penalty",
        "extension (as vLLM): a prompt or generated token's logit is divided (or, when negative, multiplied) by it",
        "1.1",
    ),
    refused("service_tier", "one tier", "\"flex\""),
];

const CHAT_ONLY: [Field; 17] = [
    served(
        "messages",
        "system (or developer), user, assistant (with `tool_calls`) and tool (with `tool_call_id`) messages; text content or text parts, and for a vision-language package one `image_url` part per request: an inline PNG or JPEG `data:` URL",
        "[{\"role\": \"user\", \"content\": \"hi\"}]",
    ),
    served("max_completion_tokens", "as `max_tokens` (wins over it)", "2"),
    served(
        "logprobs",
        "chat: `true` reports each generated token's log-probability under the model's own distribution (before penalties, bias, a format's mask and temperature), streamed too",
        "true",
    ),
    served("top_logprobs", "0 to 20 likeliest alternatives per token; needs `logprobs: true`", "2"),
    served(
        "response_format",
        "`text`, `json_object`, or `json_schema` (`strict` or not): every token is drawn under a mask from the schema's grammar (llguidance), JSON written compactly; a schema it cannot compile is refused, and so is any format but `text` beside tools the model may call (its grammar leaves no room for a call)",
        "{\"type\": \"json_object\"}",
    ),
    served(
        "tools",
        "up to 128 functions, rendered by a chat template that reads `tools`, else described in the system message; calls are read from the model's `<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>` blocks (the Hermes form)",
        "[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]",
    ),
    served(
        "tool_choice",
        "`auto` (default with tools), `none` (tools not rendered), `required` or a named function: one call drawn under its arguments' schema (llguidance)",
        "\"none\"",
    ),
    served("parallel_tool_calls", "`false`: at most the first call is returned", "false"),
    served(
        "chat_template_kwargs",
        "extension (as vLLM): up to 32 extra variables the chat template reads (`enable_thinking`, `date_string`, ...); not `messages`, `tools`, `add_generation_prompt`, `bos_token` or `eos_token`",
        "{\"enable_thinking\": false}",
    ),
    refused("functions", "deprecated by OpenAI; no tool calling", "[]"),
    refused("function_call", "deprecated by OpenAI; no tool calling", "\"auto\""),
    default_only("store", "false", "nothing is stored", "true"),
    refused("metadata", "nothing is stored", "{}"),
    default_only("modalities", "[\"text\"]", "text out only", "[\"audio\"]"),
    refused("audio", "text out only", "{}"),
    refused("prediction", "no predicted outputs", "{}"),
    refused("reasoning_effort", "not a reasoning model server", "\"low\""),
];

const COMPLETION_ONLY: [Field; 5] = [
    served("prompt", "one string", "\"hi\""),
    default_only("echo", "false", "the prompt is not echoed", "true"),
    default_only("best_of", "1", "one candidate", "2"),
    served(
        "logprobs",
        "completions: 0 to 5, each token's log-probability with that many likeliest alternatives and its text offset",
        "2",
    ),
    refused("suffix", "no insertion", "\"end\""),
];

/// The fields both completion endpoints share (`api::Sampling`'s).
pub fn common() -> &'static [Field] {
    &COMMON
}

/// The fields of `POST /v1/chat/completions`.
pub fn chat() -> Vec<Field> {
    COMMON.iter().chain(&CHAT_ONLY).copied().collect()
}

/// The fields of `POST /v1/completions`.
pub fn completions() -> Vec<Field> {
    COMMON.iter().chain(&COMPLETION_ONLY).copied().collect()
}

/// The fields of `POST /v1/sessions`.
pub fn sessions() -> Vec<Field> {
    vec![served("model", "the package name", "\"m\"")]
}

/// Numbers compare by value (`0` and `0.0` are one default).
fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// Refuses a body naming a field `fields` does not serve (at the value
/// given).
pub fn check(body: &Value, fields: &[Field]) -> Result<(), ApiError> {
    let Some(object) = body.as_object() else { return Ok(()) };
    for (key, value) in object {
        let Some(field) = fields.iter().find(|f| f.name == key) else {
            return Err(ApiError::param(key, format!("unrecognized request argument supplied: {key}")));
        };
        // `null` is how clients say "not given".
        if value.is_null() {
            continue;
        }
        match field.support {
            Support::Served => {}
            Support::DefaultOnly(default) => {
                let default: Value = serde_json::from_str(default).unwrap_or(Value::Null);
                if !same(value, &default) {
                    return Err(ApiError::param(
                        key,
                        format!("`{key}` is served only at its default {default} on this server ({})", field.note),
                    ));
                }
            }
            Support::Refused => {
                return Err(ApiError::param(key, format!("`{key}` is not supported by this server ({})", field.note)))
            }
        }
    }
    Ok(())
}

/// The README's table of both endpoints' fields.
pub fn markdown() -> String {
    let mut out = String::from("| field | chat | completions | what the server does |\n|---|---|---|---|\n");
    let (chat, text) = (chat(), completions());
    let mut names: Vec<&str> = chat.iter().chain(&text).map(|f| f.name).collect();
    names.dedup();
    let mut seen = std::collections::BTreeSet::new();
    for name in names {
        if !seen.insert(name) {
            continue;
        }
        let status = |list: &[Field]| match list.iter().find(|f| f.name == name) {
            None => "—".to_string(),
            Some(f) => match f.support {
                Support::Served => "served".into(),
                Support::DefaultOnly(d) => format!("only `{d}`"),
                Support::Refused => "refused (400)".into(),
            },
        };
        let note = chat.iter().chain(&text).filter(|f| f.name == name).map(|f| f.note).collect::<Vec<_>>();
        let mut note = note;
        note.dedup();
        out.push_str(&format!("| `{name}` | {} | {} | {} |\n", status(&chat), status(&text), note.join("; ")));
    }
    out
}

#[cfg(test)]
mod tests {
    /// The README's table is the one these lists make: change a field
    /// here, then paste `markdown()` between the README's markers.
    #[test]
    fn the_readme_table_matches_the_lists() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
        let start = readme.find("<!-- request-fields:begin -->\n").expect("README marker") + 30;
        let end = readme.find("<!-- request-fields:end -->").expect("README marker");
        assert_eq!(&readme[start..end], super::markdown(), "README's request-field table differs from fields.rs");
    }

    /// Every example parses, and every default is JSON.
    #[test]
    fn examples_and_defaults_are_json() {
        for f in super::chat().into_iter().chain(super::completions()) {
            assert!(serde_json::from_str::<serde_json::Value>(f.example).is_ok(), "{}", f.name);
            if let super::Support::DefaultOnly(d) = f.support {
                assert!(serde_json::from_str::<serde_json::Value>(d).is_ok(), "{}", f.name);
            }
        }
    }
}
