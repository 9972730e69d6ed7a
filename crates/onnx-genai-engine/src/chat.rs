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
