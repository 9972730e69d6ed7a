//! A chat request's `messages` as the engine's: roles checked, text parts
//! joined, images taken from `image_url` parts (`data:` URLs, decoded
//! later off the async workers), assistant `tool_calls` and `tool` results
//! kept for the template.

use base64::Engine as _;
use onnx_genai_engine::tools::{FunctionCall, ToolCall};
use onnx_genai_engine::ChatMessage;

use crate::api;
use crate::error::ApiError;

/// An image a message sends: the encoded bytes, and the request field that
/// carries them (what an error names).
pub struct SentImage {
    pub param: String,
    pub encoded: Vec<u8>,
}

/// Images one request may send: a vision-language package's workflow
/// encodes one image per turn.
pub const MAX_IMAGES: usize = 1;

/// The engine's messages and the images they send. `developer` is the
/// system role; an image sits in its message's text where its part is.
pub fn read(wire: Vec<api::ChatMessage>) -> Result<(Vec<ChatMessage>, Vec<SentImage>), ApiError> {
    let mut out = Vec::with_capacity(wire.len());
    let mut images = Vec::new();
    for (i, m) in wire.into_iter().enumerate() {
        let at = |field: &str| format!("messages[{i}].{field}");
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => {
                return Err(ApiError::param(
                    &at("role"),
                    format!("role `{other}` is not system, developer, user, assistant or tool"),
                ))
            }
        };
        let unread = [("refusal", &m.refusal), ("audio", &m.audio), ("function_call", &m.function_call)];
        let given = unread.into_iter().find(|(_, v)| v.is_some());
        let annotated = m.annotations.as_ref().is_some_and(|a| a.as_array().is_none_or(|a| !a.is_empty()));
        if let Some((field, _)) = given.or(annotated.then_some(("annotations", &m.annotations))) {
            let instead = if field == "function_call" { "; send `tool_calls`" } else { "" };
            return Err(ApiError::param(&at(field), format!("`{field}` is not read: send it as null{instead}")));
        }
        let calls = m.tool_calls.unwrap_or_default();
        let mut image_at = Vec::new();
        let content = match m.content {
            Some(api::Content::Text(t)) => t,
            Some(api::Content::Parts(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.into_iter().enumerate() {
                    let served = matches!(part.kind.as_str(), "text" | "image_url");
                    if let (true, Some(key)) = (served, part.other.keys().next()) {
                        return Err(ApiError::param(
                            &at(&format!("content[{j}].{key}")),
                            format!("a `{}` part has no field `{key}`", part.kind),
                        ));
                    }
                    match (part.kind.as_str(), part.text, part.image_url) {
                        ("text", Some(t), None) => text.push_str(&t),
                        ("image_url", None, Some(url)) if role == "user" => {
                            let param = at(&format!("content[{j}].image_url"));
                            if images.len() == MAX_IMAGES {
                                return Err(ApiError::param(
                                    &param,
                                    format!(
                                        "at most {MAX_IMAGES} image per request (the workflow encodes one per turn)"
                                    ),
                                ));
                            }
                            if let Some(detail) = url.detail.filter(|d| !["auto", "low", "high"].contains(&d.as_str()))
                            {
                                return Err(ApiError::param(
                                    &format!("{param}.detail"),
                                    format!("detail is auto, low or high, got {detail:?}"),
                                ));
                            }
                            let encoded = data_url(&url.url).map_err(|m| ApiError::param(&param, m))?;
                            image_at.push(text.len());
                            images.push(SentImage { param, encoded });
                        }
                        ("image_url", _, _) if role != "user" => {
                            return Err(ApiError::param(
                                &at(&format!("content[{j}]")),
                                "only a user message sends images",
                            ))
                        }
                        (kind @ ("text" | "image_url"), _, _) => {
                            let needs = if kind == "text" { "`text`" } else { "`image_url` with a `url`" };
                            return Err(ApiError::param(
                                &at(&format!("content[{j}]")),
                                format!("a `{kind}` part needs {needs} and nothing else"),
                            ));
                        }
                        (other, _, _) => {
                            return Err(ApiError::param(
                                &at(&format!("content[{j}].type")),
                                format!("content part type `{other}` is not supported (text and image_url are)"),
                            ))
                        }
                    }
                }
                text
            }
            None if role == "assistant" && !calls.is_empty() => String::new(),
            None => return Err(ApiError::param(&at("content"), "a message needs content")),
        };
        if !calls.is_empty() && role != "assistant" {
            return Err(ApiError::param(&at("tool_calls"), "only an assistant message makes tool calls"));
        }
        let mut tool_calls = Vec::with_capacity(calls.len());
        for (j, c) in calls.into_iter().enumerate() {
            if c.kind != "function" {
                return Err(ApiError::param(
                    &at(&format!("tool_calls[{j}].type")),
                    "a tool call's type is \"function\"",
                ));
            }
            tool_calls.push(ToolCall {
                id: c.id,
                function: FunctionCall { name: c.function.name, arguments: c.function.arguments },
            });
        }
        let tool_call_id = match (role, m.tool_call_id) {
            ("tool", None) => {
                return Err(ApiError::param(&at("tool_call_id"), "a tool message names the call it answers"))
            }
            ("tool", id) => id,
            (_, Some(_)) => return Err(ApiError::param(&at("tool_call_id"), "only a tool message answers a call")),
            (_, None) => None,
        };
        out.push(ChatMessage { role: role.to_string(), content, tool_calls, tool_call_id, image_at, name: m.name });
    }
    if out.is_empty() {
        return Err(ApiError::param("messages", "messages must not be empty"));
    }
    Ok((out, images))
}

/// The bytes of a `data:image/png;base64,...` (or `image/jpeg`) URL; any
/// other URL is refused saying why (this server fetches nothing).
fn data_url(url: &str) -> Result<Vec<u8>, String> {
    let Some(rest) = url.strip_prefix("data:") else {
        let shown: String = url.chars().take(40).collect();
        return Err(format!(
            "images are sent inline as `data:image/png;base64,...` or `data:image/jpeg;base64,...` URLs; this server fetches no URL (got {shown:?})"
        ));
    };
    let (header, data) = rest.split_once(',').ok_or("a data: URL needs a `,` before its data")?;
    let Some(mime) = header.strip_suffix(";base64") else {
        return Err(format!("a data: URL's data must be base64 (`;base64,`), got `data:{header},`"));
    };
    if !matches!(mime, "image/png" | "image/jpeg" | "image/jpg") {
        return Err(format!("images are PNG or JPEG (`image/png`, `image/jpeg`), got `{mime}`"));
    }
    base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| format!("the data: URL's base64 does not decode: {e}"))
}

#[cfg(test)]
mod tests {
    use super::data_url;

    /// Issue 19, images: only inline PNG or JPEG `data:` URLs are read; a
    /// remote URL, another type, or bad base64 is refused saying which.
    #[test]
    fn only_inline_png_and_jpeg_urls_are_read() {
        assert_eq!(data_url("data:image/png;base64,iVBORw=="), Ok(vec![0x89, 0x50, 0x4e, 0x47]));
        assert!(data_url("data:image/jpeg;base64,/9g=").is_ok());
        for (url, want) in [
            ("https://example.com/cat.png", "fetches no URL"),
            ("data:image/gif;base64,R0lG", "PNG or JPEG"),
            ("data:image/png,rawbytes", "must be base64"),
            ("data:image/png;base64,***", "does not decode"),
            ("data:image/png;base64", "needs a `,`"),
        ] {
            let err = data_url(url).unwrap_err();
            assert!(err.contains(want), "{url}: {err}");
        }
    }
}
