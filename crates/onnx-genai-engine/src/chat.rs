//! Chat prompts rendered with the package's Jinja chat template.

use onnx_genai_package::Manifest;
use serde::Serialize;
use tokenizers::Tokenizer;

use crate::EngineError;

#[derive(Clone, Debug, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub(crate) fn render(
    template: &str,
    messages: &[ChatMessage],
    tokenizer: &Tokenizer,
    manifest: &Manifest,
) -> Result<String, EngineError> {
    let token = |id: Option<u32>| id.and_then(|id| tokenizer.id_to_token(id)).unwrap_or_default();
    let mut env = minijinja::Environment::new();
    env.add_template("chat", template).map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
    let tmpl = env.get_template("chat").map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
    tmpl.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => true,
        bos_token => token(manifest.generation.bos_token_id),
        eos_token => token(manifest.generation.eos_token_ids.first().copied()),
    })
    .map_err(|e| EngineError::ChatTemplate(e.to_string()))
}

/// Turns text and chat prompts into token ids with the package's tokenizer
/// and chat template: the one tokenizer admission counts with (A7). Shared
/// (`Arc`) so a server can tokenize on its request threads, off the model's
/// driver.
pub struct Prompter {
    package: onnx_genai_package::Package,
}

impl Prompter {
    pub fn new(package: onnx_genai_package::Package) -> Self {
        Self { package }
    }

    /// Encodes text (special tokens are parsed).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.package
            .tokenizer()
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EngineError::Tokenizer { path: "encode".into(), reason: e.to_string() })
    }

    /// A prompt's token rows: text and chat prompts encoded (chat rendered
    /// with the template first), token prompts as they are.
    pub fn rows(&self, prompt: &crate::Prompt) -> Result<Vec<Vec<u32>>, EngineError> {
        let m = &self.package.manifest;
        Ok(match prompt {
            crate::Prompt::Text(text) => vec![self.encode(text)?],
            crate::Prompt::Chat(messages) => {
                let template = m
                    .chat_template
                    .as_deref()
                    .ok_or_else(|| EngineError::ChatTemplate(format!("package `{}` has no chat_template", m.name)))?;
                vec![self.encode(&render(template, messages, self.package.tokenizer(), m)?)?]
            }
            crate::Prompt::TokenIds(ids) => vec![ids.clone()],
            crate::Prompt::TokenRows(rows) => rows.clone(),
        })
    }

    /// The prompt as token ids (a single row stays `TokenIds`).
    pub fn tokenized(&self, prompt: crate::Prompt) -> Result<crate::Prompt, EngineError> {
        match prompt {
            crate::Prompt::Text(_) | crate::Prompt::Chat(_) => {
                let mut rows = self.rows(&prompt)?;
                Ok(if rows.len() == 1 {
                    crate::Prompt::TokenIds(rows.remove(0))
                } else {
                    crate::Prompt::TokenRows(rows)
                })
            }
            other => Ok(other),
        }
    }
}
