//! A chat template rendered over messages, then tokenized — what a chat
//! request does with a package's `chat_template`. The input is the
//! template, a NUL byte, then the messages: a JSON array of
//! `{"role", "content"}` objects, or any other text as one user message.

use onnx_genai_engine::{ChatMessage, Prompt, Prompter};

use crate::fixture;

/// The bytes of a template and its messages, the inverse of [`split`].
pub(crate) fn join(template: &str, messages: &str) -> Vec<u8> {
    [template.as_bytes(), &[0], messages.as_bytes()].concat()
}

/// The template and the messages in `data`.
pub(crate) fn split(data: &[u8]) -> (String, Vec<ChatMessage>) {
    let (template, rest) = match data.iter().position(|b| *b == 0) {
        Some(nul) => (&data[..nul], &data[nul + 1..]),
        None => (data, &data[data.len()..]),
    };
    let text = String::from_utf8_lossy(rest);
    let messages = match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(serde_json::Value::Array(items)) => items
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap_or("user"), m["content"].as_str().unwrap_or_default()))
            .collect(),
        _ => vec![ChatMessage::new("user", text.into_owned())],
    };
    (String::from_utf8_lossy(template).into_owned(), messages)
}

pub(crate) fn run(data: &[u8]) -> Result<(), String> {
    let (template, messages) = split(data);
    let mut package = fixture::package().clone();
    package.manifest.chat_template = Some(template);
    Prompter::new(package).rows(&Prompt::Chat(messages.into())).map(drop).map_err(|e| e.to_string())
}
