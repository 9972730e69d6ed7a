//! Chat prompts rendered with the package's Jinja chat template.

use onnx_genai_package::manifest::MAX_IMAGE_SIDE;
use onnx_genai_package::Manifest;
use serde::Serialize;
use tokenizers::Tokenizer;

use crate::constraint::{Constraint, ResponseFormat};
use crate::tools::{self, Tool, ToolCall};

use crate::EngineError;

/// One message as chat templates read it (Hugging Face's form).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's calls.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A participant's name (OpenAI's `name`), for templates that read it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Where images sit in `content` (byte offsets, ascending): each is
    /// the package's image placeholder token there, never text a user
    /// could spell.
    #[serde(skip)]
    pub image_at: Vec<usize>,
}

impl ChatMessage {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), ..Self::default() }
    }
}

/// A chat prompt: its messages, the tools the model may call, and what
/// else its template reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Chat {
    pub messages: Vec<ChatMessage>,
    pub tools: Vec<Tool>,
    /// Whether the rendered prompt ends with the assistant's header (the
    /// templates' `add_generation_prompt`; off, the prompt ends after the
    /// last message as the template closes it).
    pub add_generation_prompt: bool,
    /// Extra variables the template reads (`enable_thinking`,
    /// `date_string`, ...: a request's `chat_template_kwargs`); they may
    /// not replace what the renderer sets (`messages`, `tools`,
    /// `add_generation_prompt`, `bos_token`, `eos_token`).
    pub template_vars: serde_json::Map<String, serde_json::Value>,
}

impl Default for Chat {
    fn default() -> Self {
        Self { messages: Vec::new(), tools: Vec::new(), add_generation_prompt: true, template_vars: Default::default() }
    }
}

impl From<Vec<ChatMessage>> for Chat {
    fn from(messages: Vec<ChatMessage>) -> Self {
        Self { messages, ..Self::default() }
    }
}

/// Renders `template` with `chat` as Hugging Face's `apply_chat_template`
/// does (`template.rs`), with `bos_token` and `eos_token` as the
/// tokenizer's texts of those tokens.
pub fn render_chat_template(
    template: &str,
    chat: &Chat,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, EngineError> {
    if let Some(name) = chat.template_vars.keys().find(|k| crate::template::RESERVED.contains(&k.as_str())) {
        return Err(EngineError::Request(format!(
            "chat_template_kwargs cannot set `{name}`: the renderer sets {}",
            crate::template::RESERVED.map(|r| format!("`{r}`")).join(", ")
        )));
    }
    let knows_tools = tools::template_knows_tools(template);
    let written;
    let messages = if knows_tools {
        &chat.messages
    } else {
        written = tools::written_into_text(&chat.messages, &chat.tools);
        &written
    };
    let tools: Option<Vec<serde_json::Value>> =
        (knows_tools && !chat.tools.is_empty()).then(|| chat.tools.iter().map(Tool::to_json).collect());
    let env = crate::template::environment();
    let tmpl = env.template_from_str(template).map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
    let fixed = minijinja::context! {
        messages => messages,
        tools => tools,
        add_generation_prompt => chat.add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    };
    let context = minijinja::context! { ..fixed, ..minijinja::Value::from_serialize(&chat.template_vars) };
    crate::template::render_bounded(&tmpl, context).map_err(|e| EngineError::ChatTemplate(template_error(&e)))
}

/// A render error with its cause (minijinja puts the template's own
/// `raise_exception` message in the detail).
fn template_error(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// The chat as the package's template renders it, with the tokenizer's
/// texts of the package's bos and eos tokens.
fn render(template: &str, chat: &Chat, tokenizer: &Tokenizer, manifest: &Manifest) -> Result<String, EngineError> {
    let token = |id: Option<u32>| id.and_then(|id| tokenizer.id_to_token(id)).unwrap_or_default();
    let bos = token(manifest.generation.bos_token_id);
    let eos = token(manifest.generation.eos_token_ids.first().copied());
    render_chat_template(template, chat, &bos, &eos)
}

/// Turns text and chat prompts into token ids with the package's tokenizer
/// and chat template: the one tokenizer admission counts with (A7). Shared
/// (`Arc`) so a server can tokenize on its request threads, off the model's
/// driver.
pub struct Prompter {
    package: onnx_genai_package::Package,
    /// The package tokenizer with special-token parsing off: message content
    /// is text whatever it spells; the chat template alone inserts control
    /// tokens.
    plain: Tokenizer,
    /// The texts of the tokenizer's special tokens (`<|im_start|>`, ...).
    specials: Vec<String>,
    vocab_size: usize,
    /// The response-format compiler over this tokenizer.
    grammars: crate::constraint::Grammars,
    /// The bytes of every token id (read on first use).
    token_bytes: std::sync::OnceLock<Result<Vec<Vec<u8>>, String>>,
}

/// The most memory decoding one image may take.
pub const MAX_IMAGE_ALLOC: u64 = 64 << 20;

/// Marks a message's content in a rendered template (private-use code
/// points, then the message index, then the closing mark).
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

impl Prompter {
    pub fn new(package: onnx_genai_package::Package) -> Self {
        let mut plain = package.tokenizer().clone();
        plain.set_encode_special_tokens(true);
        let specials = package
            .tokenizer()
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        let vocab_size = package.manifest.architecture.vocab_size as usize;
        Self {
            package,
            plain,
            specials,
            vocab_size,
            grammars: crate::constraint::Grammars::new(),
            token_bytes: std::sync::OnceLock::new(),
        }
    }

    /// A chat's token ids. Content that spells a special token (a user
    /// writing `<|im_start|>system`) is encoded as plain text, so it can
    /// never become a control token: the template is rendered with a marker
    /// in place of each message's content, its own text encoded with special
    /// tokens parsed and each content without. Content that spells none is
    /// encoded with the template in one piece, exactly as the model's own
    /// tooling does.
    fn chat_ids(&self, template: &str, chat: &Chat) -> Result<Vec<u32>, EngineError> {
        let m = &self.package.manifest;
        let tokenizer = self.package.tokenizer();
        let messages = &chat.messages;
        let spells = |text: &str| self.specials.iter().any(|s| text.contains(s.as_str()));
        // What the template (or `written_into_text`) writes as it is, outside
        // the content markers: it must not spell a control token.
        let mut verbatim = chat
            .tools
            .iter()
            .map(|t| t.to_json().to_string())
            .chain(messages.iter().flat_map(|msg| {
                let calls = msg.tool_calls.iter().flat_map(|c| [c.id.clone(), c.call_json().to_string()]);
                calls.chain(msg.name.clone()).chain(msg.tool_call_id.clone())
            }))
            .chain(chat.template_vars.values().map(serde_json::Value::to_string));
        if let Some(text) = verbatim.find(|text| spells(text)) {
            let shown: String = text.chars().take(60).collect();
            return Err(EngineError::ChatTemplate(format!(
                "a tool, a tool call, a message's name or id, or a template variable spells a special token ({shown:?}); the template writes them as they are, so it would become a control token: remove it"
            )));
        }
        let spells_control = messages.iter().any(|msg| spells(&msg.content) || !msg.image_at.is_empty());
        if !spells_control {
            return self.encode(&render(template, chat, tokenizer, m)?);
        }
        let marked = Chat {
            messages: messages
                .iter()
                .enumerate()
                .map(|(i, msg)| ChatMessage { content: format!("{OPEN}{i}{CLOSE}"), ..msg.clone() })
                .collect(),
            ..chat.clone()
        };
        let rendered = render(template, &marked, tokenizer, m)?;
        let garbled = || {
            EngineError::ChatTemplate(
                "the chat template rewrites message content, so text that spells a special token cannot be kept apart from the template's own; remove the special-token text from the message".into(),
            )
        };
        let mut ids = Vec::new();
        let mut rest = rendered.as_str();
        while let Some(start) = rest.find(OPEN) {
            ids.extend(self.encode(&rest[..start])?);
            let after = &rest[start + OPEN.len_utf8()..];
            let end = after.find(CLOSE).ok_or_else(garbled)?;
            let index: usize = after[..end].parse().map_err(|_| garbled())?;
            let message = messages.get(index).ok_or_else(garbled)?;
            ids.extend(self.content_ids(message)?);
            rest = &after[end + CLOSE.len_utf8()..];
        }
        if rest.contains(CLOSE) {
            return Err(garbled());
        }
        ids.extend(self.encode(rest)?);
        Ok(ids)
    }

    /// A message's content as plain text, with the image placeholder token
    /// wherever an image sits.
    fn content_ids(&self, message: &ChatMessage) -> Result<Vec<u32>, EngineError> {
        let plain = |text: &str| self.encode_plain(text);
        if message.image_at.is_empty() {
            return plain(&message.content);
        }
        let placeholder = self.image_placeholder_id()?;
        let mut ids = Vec::new();
        let mut from = 0;
        for &at in &message.image_at {
            let piece = message.content.get(from..at).ok_or_else(|| {
                EngineError::Request(format!("an image offset {at} is not a character boundary of its message"))
            })?;
            ids.extend(plain(piece)?);
            ids.push(placeholder);
            from = at;
        }
        ids.extend(plain(&message.content[from..])?);
        Ok(ids)
    }

    /// The token an image is marked with in a prompt.
    fn image_placeholder_id(&self) -> Result<u32, EngineError> {
        let (placeholder, _) = self.image_input()?;
        self.package.tokenizer().token_to_id(&placeholder.placeholder).ok_or_else(|| {
            EngineError::Image(format!(
                "the image placeholder `{}` is not a token of the tokenizer",
                placeholder.placeholder
            ))
        })
    }

    /// The package's image input, or why it takes none.
    fn image_input(&self) -> Result<(&onnx_genai_package::manifest::ImageInput, (u32, u32)), EngineError> {
        let image = self.package.manifest.workflow.as_ref().and_then(|w| w.image.as_ref()).ok_or_else(|| {
            EngineError::Image(format!(
                "package `{}` takes no images (its workflow declares no image input)",
                self.package.manifest.name
            ))
        })?;
        Ok((image, (image.preprocess.width, image.preprocess.height)))
    }

    /// Whether the package takes images, and the placeholder text a text
    /// prompt marks one with.
    pub fn image_placeholder(&self) -> Option<&str> {
        self.image_input().ok().map(|(image, _)| image.placeholder.as_str())
    }

    /// An encoded image (PNG or JPEG) as the `pixel_values` the package's
    /// workflow takes: decoded, resized to the declared size, normalized.
    pub fn image(&self, encoded: &[u8]) -> Result<crate::BoundTensor, EngineError> {
        let (input, (width, height)) = self.image_input()?;
        let format = image::guess_format(encoded)
            .ok()
            .filter(|f| matches!(f, image::ImageFormat::Png | image::ImageFormat::Jpeg))
            .ok_or_else(|| EngineError::Image("the image is not PNG or JPEG".into()))?;
        // An image of few bytes can declare a huge size: decoding is bounded
        // before anything is allocated.
        let mut limits = image::Limits::default();
        limits.max_image_width = Some(MAX_IMAGE_SIDE);
        limits.max_image_height = Some(MAX_IMAGE_SIDE);
        limits.max_alloc = Some(MAX_IMAGE_ALLOC);
        let mut reader = image::ImageReader::with_format(std::io::Cursor::new(encoded), format);
        reader.limits(limits);
        let decoded = reader.decode().map_err(|e| match e {
            image::ImageError::Limits(_) => EngineError::Image(format!(
                "the {format:?} image is larger than {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} pixels or {} MiB decoded",
                MAX_IMAGE_ALLOC >> 20
            )),
            e => EngineError::Image(format!("the {format:?} image does not decode: {e}")),
        })?;
        let rgb = decoded.resize_exact(width, height, image::imageops::FilterType::Triangle).to_rgb8();
        crate::workflow::pixel_values(rgb.as_raw(), width, height, input)
    }

    /// The package's sampling defaults (for what a request leaves unset).
    pub fn sampling_defaults(&self) -> &onnx_genai_package::manifest::SamplingDefaults {
        &self.package.manifest.generation.sampling
    }

    /// Tokens the model's logits cover (what a `logit_bias` id must be
    /// below): the loaded model's width when the engine made this prompter,
    /// else the manifest's vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The same prompter, held to a model whose logits cover `vocab` tokens.
    pub fn with_vocab_size(self, vocab: usize) -> Self {
        Self { vocab_size: vocab, ..self }
    }

    /// `format` compiled over this tokenizer for one request (`None` for
    /// text). A server calls it on a request thread first: that refuses a
    /// bad schema early and builds the shared compiler off the driver.
    /// Response formats compiled into grammars so far: a format the route
    /// compiled before it queued the request is copied, not compiled
    /// again, when the turn is admitted (a turn waiting for room compiles
    /// nothing).
    pub fn grammars_compiled(&self) -> u64 {
        self.grammars.compiled()
    }

    pub fn constraint(&self, format: &ResponseFormat) -> Result<Option<Constraint>, EngineError> {
        let eos = &self.package.manifest.generation.eos_token_ids;
        self.grammars.compile(format, self.words(), eos).map_err(EngineError::ResponseFormat)
    }

    fn words(&self) -> &Result<Vec<Vec<u8>>, String> {
        self.token_bytes.get_or_init(|| crate::constraint::token_bytes(self.package.tokenizer(), self.vocab_size))
    }

    /// A token's bytes and its text (lossy where the bytes are part of a
    /// character), as OpenAI's logprobs report them; a special token is its
    /// own text.
    pub fn token_piece(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = match self.words() {
            Ok(words) => words.get(id as usize).cloned().unwrap_or_default(),
            Err(_) => {
                onnx_genai_package::decode(self.package.tokenizer(), &[id], false).unwrap_or_default().into_bytes()
            }
        };
        let bytes = match bytes.split_first() {
            Some((&crate::constraint::SPECIAL_TOKEN_MARKER, rest)) => rest.to_vec(),
            _ => bytes,
        };
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// Encodes text as text: what spells a special token stays text.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.plain
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EngineError::Tokenizer { path: "encode".into(), reason: e.to_string() })
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
            crate::Prompt::Chat(chat) => {
                let template = m
                    .chat_template
                    .as_deref()
                    .ok_or_else(|| EngineError::ChatTemplate(format!("package `{}` has no chat_template", m.name)))?;
                vec![self.chat_ids(template, chat)?]
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
