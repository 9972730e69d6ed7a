//! Tool calling on the wire: a chat request's `tools`, `tool_choice` and
//! `parallel_tool_calls` read into the tools the template renders and what
//! the turn does with calls; the answer split into text and `tool_calls`. The
//! engine's `tools` module owns the Hermes form the model writes.

use onnx_genai_engine::tools::{self, Calls, FunctionCall, Tool};
use onnx_genai_engine::ResponseFormat;
use serde_json::{json, Value};

use crate::api::ChatRequest;
use crate::error::ApiError;

/// What a turn does with calls: `None` when the request offers no tools or
/// says `tool_choice: "none"` (then the answer is text, as without tools).
#[derive(Clone, Debug)]
pub struct ToolUse {
    pub tools: Vec<Tool>,
    /// `required`, or the one function named: the whole answer is one
    /// call, drawn under its grammar.
    pub required: Option<Required>,
    /// `parallel_tool_calls: false`: at most one call is returned.
    pub parallel: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Required {
    Any,
    Named(String),
}

impl ToolUse {
    /// The grammar a required call is drawn under.
    pub fn format(&self) -> Option<ResponseFormat> {
        let named = match self.required.as_ref()? {
            Required::Any => None,
            Required::Named(name) => Some(name.as_str()),
        };
        Some(tools::call_format(&self.tools, named))
    }

    /// The calls in an answer, and the text around them.
    pub fn calls(&self, text: &str) -> Option<Calls> {
        let mut calls = match self.required {
            Some(_) => {
                let call = tools::parse_call(text, &self.tools)?;
                Calls { calls: vec![call], before: 0, after: text.len() }
            }
            None => tools::parse_calls(text, &self.tools)?,
        };
        if !self.parallel {
            calls.calls.truncate(1);
        }
        Some(calls)
    }

    /// How much of an answer being written may be streamed as text: none
    /// of a required call, up to the first call of a free answer.
    pub fn sendable(&self, text: &str) -> usize {
        match self.required {
            Some(_) => 0,
            None => tools::sendable(text),
        }
    }
}

/// The tools the template renders and what the turn does with calls.
pub fn read(req: &ChatRequest) -> Result<(Vec<Tool>, Option<ToolUse>), ApiError> {
    let offered = offered(req.tools.as_ref())?;
    let choice = req.tool_choice.as_ref();
    let required = match choice {
        None => None,
        Some(Value::String(s)) if s == "auto" || s == "none" => None,
        Some(Value::String(s)) if s == "required" => Some(Required::Any),
        Some(v) if v.get("type").and_then(Value::as_str) == Some("function") => {
            let name = v.pointer("/function/name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::param("tool_choice", "a function tool_choice needs `function: {\"name\": ...}`")
            })?;
            if !offered.iter().any(|t| t.name == name) {
                let names: Vec<&str> = offered.iter().map(|t| t.name.as_str()).collect();
                return Err(ApiError::param(
                    "tool_choice",
                    format!("tool_choice names `{name}`, which is not among the tools ({})", names.join(", ")),
                ));
            }
            Some(Required::Named(name.to_string()))
        }
        Some(other) => {
            return Err(ApiError::param(
                "tool_choice",
                format!(
                    "tool_choice is \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {other}"
                ),
            ))
        }
    };
    if required.is_some() && offered.is_empty() {
        return Err(ApiError::param("tool_choice", "tool_choice requires a call but the request has no tools"));
    }
    if choice.and_then(Value::as_str) == Some("none") || offered.is_empty() {
        return Ok((Vec::new(), None));
    }
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    Ok((offered.clone(), Some(ToolUse { tools: offered, required, parallel })))
}

/// The request's `tools`, each `{"type": "function", "function": {"name",
/// "description"?, "parameters"?, "strict"?}}`.
fn offered(value: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let Some(value) = value else { return Ok(Vec::new()) };
    let items = value.as_array().ok_or_else(|| ApiError::param("tools", "tools is a list of functions"))?;
    if items.len() > MAX_TOOLS {
        return Err(ApiError::param("tools", format!("at most {MAX_TOOLS} tools, got {}", items.len())));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = |field: &str| format!("tools[{i}]{field}");
        if item.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::param(&at(".type"), "a tool's type is \"function\""));
        }
        let function = item
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::param(&at(".function"), "a tool needs a `function` object"))?;
        if let Some(key) =
            function.keys().find(|k| !["name", "description", "parameters", "strict"].contains(&k.as_str()))
        {
            return Err(ApiError::param(&at(".function"), format!("unrecognized function field `{key}`")));
        }
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::param(&at(".function.name"), "a function needs a `name`"))?;
        let description = match function.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => return Err(ApiError::param(&at(".function.description"), "a description is text")),
        };
        let parameters = match function.get("parameters") {
            // No parameters: no arguments (an open object would let a model
            // write keys until its length runs out).
            None | Some(Value::Null) => json!({"type": "object", "properties": {}, "additionalProperties": false}),
            Some(p) => p.clone(),
        };
        if let Some(strict) = function.get("strict").filter(|v| !v.is_null() && !v.is_boolean()) {
            return Err(ApiError::param(&at(".function.strict"), format!("strict is true or false, got {strict}")));
        }
        out.push(Tool { name: name.to_string(), description, parameters });
    }
    tools::check(&out).map_err(|(i, m)| ApiError::param(&format!("tools[{i}].function"), m))?;
    Ok(out)
}

/// Tools one request may offer (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// The calls as an answer's `tool_calls`, each with a fresh id.
pub fn wire_calls(calls: &[FunctionCall]) -> Vec<Value> {
    calls
        .iter()
        .map(|c| {
            json!({
                "id": format!("call_{}", crate::sessions::random_hex()),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}
            })
        })
        .collect()
}

/// The stream deltas of the calls: per call one naming it (with its id)
/// and one with its arguments, which the client appends by `index`.
pub fn call_deltas(calls: &[FunctionCall]) -> Vec<Value> {
    wire_calls(calls)
        .into_iter()
        .enumerate()
        .flat_map(|(index, call)| {
            let named = json!({"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}});
            let arguments = json!({"index": index, "function": {"arguments": call["function"]["arguments"]}});
            [json!({"tool_calls": [named]}), json!({"tool_calls": [arguments]})]
        })
        .collect()
}
