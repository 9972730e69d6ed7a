//! Tool calling in the Hermes form (Qwen 2.5, Hermes, SmolLM3 and others
//! write calls this way): the model writes each call as
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A chat
//! template that knows tools renders them itself (it is given `tools`,
//! assistant `tool_calls` and `tool` messages as Hugging Face passes them);
//! for one that does not, the tools are described in the system message
//! and calls and results are written into message text in that same form.
//! A call the client requires is drawn under a grammar (the call's JSON
//! schema), so it always parses.

use serde::Serialize;
use serde_json::{json, Value};

use crate::chat::ChatMessage;
use crate::constraint::ResponseFormat;

/// Opens a call in the model's text.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes a call in the model's text.
pub const CALL_CLOSE: &str = "</tool_call>";

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema object for the arguments.
    pub parameters: Value,
}

impl Tool {
    /// The tool as OpenAI's request (and chat templates) spell it.
    pub fn to_json(&self) -> Value {
        // In the order clients send and templates were trained on: name,
        // description, parameters.
        let mut function = json!({"name": self.name});
        if let Some(d) = &self.description {
            function["description"] = json!(d);
        }
        function["parameters"] = self.parameters.clone();
        json!({"type": "function", "function": function})
    }
}

/// A call the model made: the function's name and its arguments as JSON
/// text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// A call in a conversation's history, with the id its result names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub function: FunctionCall,
}

impl ToolCall {
    /// `{"name": ..., "arguments": {...}}`: the arguments as an object when
    /// they are JSON (templates write them with `tojson`), else as text.
    pub(crate) fn call_json(&self) -> Value {
        let arguments =
            serde_json::from_str::<Value>(&self.function.arguments).unwrap_or(json!(self.function.arguments));
        json!({"name": self.function.name, "arguments": arguments})
    }
}

/// As Hugging Face chat templates read an assistant message's calls.
impl Serialize for ToolCall {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        json!({"id": self.id, "type": "function", "function": self.call_json()}).serialize(s)
    }
}

/// Checks a request's tools: names of 1 to 64 letters, digits, `_` or `-`,
/// each once, parameters a JSON Schema object. The error names the tool.
pub fn check(tools: &[Tool]) -> Result<(), (usize, String)> {
    for (i, tool) in tools.iter().enumerate() {
        let name_ok = (1..=64).contains(&tool.name.len())
            && tool.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !name_ok {
            return Err((i, format!("a function name is 1 to 64 letters, digits, `_` or `-`, got {:?}", tool.name)));
        }
        if tools[..i].iter().any(|t| t.name == tool.name) {
            return Err((i, format!("function `{}` is named twice", tool.name)));
        }
        if !tool.parameters.is_object() {
            return Err((i, format!("parameters must be a JSON Schema object, got {}", tool.parameters)));
        }
    }
    Ok(())
}

/// The format a required call is drawn under: one JSON object naming one
/// of `tools` (or only `named`) with arguments valid against its schema.
pub fn call_format(tools: &[Tool], named: Option<&str>) -> ResponseFormat {
    let options: Vec<Value> = tools
        .iter()
        .filter(|t| named.is_none_or(|n| n == t.name))
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false
            })
        })
        .collect();
    let schema = match <[Value; 1]>::try_from(options) {
        Ok([one]) => one,
        Err(many) => json!({"anyOf": many}),
    };
    ResponseFormat::JsonSchema(schema)
}

/// One call's JSON (`{"name": ..., "arguments": ...}`) read against the
/// tools: `None` unless it names one of them with object arguments (or
/// none, read as `{}`; arguments written as JSON text are read too).
pub fn parse_call(text: &str, tools: &[Tool]) -> Option<FunctionCall> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    let name = value.get("name")?.as_str()?;
    if !tools.iter().any(|t| t.name == name) {
        return None;
    }
    let arguments = match value.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
        Some(v) if v.is_object() => v.clone(),
        Some(_) => return None,
    };
    Some(FunctionCall { name: name.to_string(), arguments: arguments.to_string() })
}

/// The calls in a model's answer and the text around them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Calls {
    pub calls: Vec<FunctionCall>,
    /// The answer's text is `text[..before]` and `text[after..]`.
    pub before: usize,
    pub after: usize,
}

/// The calls a free answer makes: text, then one or more `<tool_call>`
/// blocks with only whitespace between them, then text. `None` (the
/// answer is all text) when there is no block or any block is not a call
/// to one of `tools`. The last block may lack its closing tag (the model
/// ended the turn right after its JSON).
pub fn parse_calls(text: &str, tools: &[Tool]) -> Option<Calls> {
    let before = text.find(CALL_OPEN)?;
    let mut at = before;
    let mut calls = Vec::new();
    while text[at..].trim_start().starts_with(CALL_OPEN) {
        let open = at + (text[at..].len() - text[at..].trim_start().len()) + CALL_OPEN.len();
        let (body, next) = match block_end(&text[open..]) {
            Some((end, next)) => (&text[open..open + end], open + next),
            None => (&text[open..], text.len()),
        };
        calls.push(parse_call(body, tools)?);
        at = next;
    }
    Some(Calls { calls, before, after: at })
}

/// Where a call block's body ends, and where the text after its closing
/// tag begins, in `rest` (what follows `<tool_call>`): after the one JSON
/// value the block holds — a `</tool_call>` inside one of its strings is
/// text of the call's (found by its first occurrence, it cut the call in
/// two and the whole answer became text) — else at the first closing tag.
/// `None`: no closing tag (the model ended the turn after its JSON).
fn block_end(rest: &str) -> Option<(usize, usize)> {
    let mut values = serde_json::Deserializer::from_str(rest).into_iter::<serde::de::IgnoredAny>();
    if let Some(Ok(_)) = values.next() {
        let end = values.byte_offset();
        let after = rest[end..].trim_start();
        if let Some(tail) = after.strip_prefix(CALL_CLOSE) {
            return Some((end, rest.len() - tail.len()));
        }
    }
    let end = rest.find(CALL_CLOSE)?;
    Some((end, end + CALL_CLOSE.len()))
}

/// Where a free answer's text may be sent while it is still being
/// written: up to the first call, and never into what could be the start
/// of one.
pub fn sendable(text: &str) -> usize {
    match text.find(CALL_OPEN) {
        Some(at) => at,
        None => text.len() - pending_prefix(text, CALL_OPEN),
    }
}

/// Bytes at the end of `text` that begin `pattern` without completing it
/// (whole characters): what a stream holds back until the next tokens
/// decide.
pub fn pending_prefix(text: &str, pattern: &str) -> usize {
    pattern
        .char_indices()
        .skip(1)
        .map(|(i, _)| &pattern[..i])
        .filter(|p| text.ends_with(p))
        .map(str::len)
        .max()
        .unwrap_or(0)
}

/// Whether the template renders tools itself (it reads `tools`).
pub(crate) fn template_knows_tools(template: &str) -> bool {
    template.contains("tools")
}

/// The conversation as a template that does not know tools can render it:
/// the tools described at the end of the system message (one is added when
/// there is none), each assistant call written in its text as a
/// `<tool_call>` block, each result sent back as a user message in a
/// `<tool_response>` block.
pub(crate) fn written_into_text(messages: &[ChatMessage], tools: &[Tool]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            if m.role == "tool" {
                return ChatMessage::new("user", format!("<tool_response>\n{}\n</tool_response>", m.content));
            }
            let mut content = m.content.clone();
            for call in &m.tool_calls {
                if !content.is_empty() {
                    content.push('\n');
                }
                content.push_str(&format!("{CALL_OPEN}\n{}\n{CALL_CLOSE}", call.call_json()));
            }
            ChatMessage::new(&m.role, content)
        })
        .collect();
    if tools.is_empty() {
        return out;
    }
    let listed: Vec<String> = tools.iter().map(|t| t.to_json().to_string()).collect();
    let described = format!(
        "# Tools\n\nFunctions you may call, as JSON signatures:\n<tools>\n{}\n</tools>\n\nTo call one, write its name and arguments as JSON inside {CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n{CALL_CLOSE}",
        listed.join("\n")
    );
    match out.first_mut() {
        Some(first) if first.role == "system" => first.content = format!("{}\n\n{described}", first.content),
        _ => out.insert(0, ChatMessage::new("system", described)),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Vec<Tool> {
        vec![
            Tool {
                name: "get_weather".into(),
                description: Some("Weather in a city".into()),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            },
            Tool { name: "now".into(), description: None, parameters: json!({"type": "object"}) },
        ]
    }

    /// Issue 19 (tools): calls are read from Hermes blocks with the text
    /// around them; a block that is not a call to a known tool makes the
    /// whole answer text.
    #[test]
    fn calls_are_read_from_blocks_and_anything_else_is_text() {
        let tools = weather();
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\"}</tool_call> done";
        let parsed = parse_calls(text, &tools).expect("two calls");
        assert_eq!(parsed.calls.len(), 2);
        assert_eq!(parsed.calls[0].name, "get_weather");
        assert_eq!(serde_json::from_str::<Value>(&parsed.calls[0].arguments).unwrap(), json!({"city": "Paris"}));
        assert_eq!(parsed.calls[1], FunctionCall { name: "now".into(), arguments: "{}".into() });
        assert_eq!(&text[..parsed.before], "Let me look.\n");
        assert_eq!(&text[parsed.after..], " done");

        // A closing tag inside an argument's string is the argument's.
        let quoted =
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a</tool_call>b\"}}</tool_call> ok";
        let parsed = parse_calls(quoted, &tools).expect("one call");
        assert_eq!(
            serde_json::from_str::<Value>(&parsed.calls[0].arguments).unwrap(),
            json!({"city": "a</tool_call>b"})
        );
        assert_eq!(&quoted[parsed.after..], " ok");

        let unclosed = "<tool_call>{\"name\": \"now\", \"arguments\": \"{}\"}";
        assert_eq!(parse_calls(unclosed, &tools).map(|c| c.calls.len()), Some(1));
        for text in [
            "no calls at all",
            "<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": [1]}</tool_call>",
            "<tool_call>{\"name\": \"now\", \"arguments\": {</tool_call>",
            "<tool_call>not json</tool_call>",
        ] {
            assert_eq!(parse_calls(text, &tools), None, "{text}");
        }
    }

    /// A stream sends text up to a call and holds back what may begin one.
    #[test]
    fn a_stream_holds_back_what_may_begin_a_call() {
        assert_eq!(sendable("hello"), 5);
        assert_eq!(sendable("hello <tool"), 6);
        assert_eq!(sendable("hello <"), 6);
        assert_eq!(sendable("hi <tool_call>{\"name\""), 3);
        assert_eq!(sendable("a < b"), 5);
    }

    /// A required call's grammar is one object naming the tool; `named`
    /// keeps only that tool.
    #[test]
    fn a_required_call_is_an_object_naming_a_tool() {
        let tools = weather();
        let ResponseFormat::JsonSchema(any) = call_format(&tools, None) else { panic!("a schema") };
        assert_eq!(any["anyOf"].as_array().map(Vec::len), Some(2));
        let ResponseFormat::JsonSchema(one) = call_format(&tools, Some("now")) else { panic!("a schema") };
        assert_eq!(one["properties"]["name"]["const"], "now");
        assert_eq!(one["required"], json!(["name", "arguments"]));
    }

    /// Bad tools are refused naming the tool.
    #[test]
    fn tools_are_checked() {
        let mut tools = weather();
        assert_eq!(check(&tools), Ok(()));
        tools[1].name = "get_weather".into();
        assert_eq!(check(&tools).map_err(|e| e.0), Err(1));
        tools[1].name = "has space".into();
        assert!(check(&tools).is_err());
        tools[1].name = "ok".into();
        tools[1].parameters = json!("object");
        assert!(check(&tools).is_err());
    }

    /// A template without tools gets them described in the system message,
    /// calls and results written into message text.
    #[test]
    fn tools_are_written_into_text_for_a_template_without_them() {
        let call =
            ToolCall { id: "call_1".into(), function: FunctionCall { name: "now".into(), arguments: "{}".into() } };
        let messages = vec![
            ChatMessage::new("user", "time?"),
            ChatMessage { tool_calls: vec![call], ..ChatMessage::new("assistant", "") },
            ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::new("tool", "12:00") },
        ];
        let out = written_into_text(&messages, &weather());
        assert_eq!(out.len(), 4);
        assert_eq!(out[0].role, "system");
        assert!(out[0].content.contains("\"get_weather\"") && out[0].content.contains(CALL_OPEN));
        assert_eq!(out[2].content, "<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>");
        assert_eq!(
            (out[3].role.as_str(), out[3].content.as_str()),
            ("user", "<tool_response>\n12:00\n</tool_response>")
        );
    }
}
