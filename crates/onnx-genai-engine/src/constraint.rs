//! Structured outputs: a request's response format compiled by llguidance
//! into a grammar over this tokenizer's vocabulary, applied as a token mask
//! before every sampling choice, so the text cannot leave the grammar
//! whatever the backend, the batch or the sampling options.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;
use tokenizers::Tokenizer;

/// What the generated text must be.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ResponseFormat {
    /// Anything the model writes.
    #[default]
    Text,
    /// One JSON object (any keys and values).
    JsonObject,
    /// One JSON value valid against this schema (a JSON object).
    JsonSchema(Value),
}

impl ResponseFormat {
    /// The grammar this format compiles to, `None` for text. JSON is written
    /// compactly with one space after `,` and `:`: a grammar that allowed
    /// any whitespace between tokens would let a model pad forever.
    fn grammar(&self) -> Result<Option<TopLevelGrammar>, String> {
        let mut schema = match self {
            ResponseFormat::Text => return Ok(None),
            ResponseFormat::JsonObject => serde_json::json!({"type": "object"}),
            ResponseFormat::JsonSchema(schema) => schema.clone(),
        };
        let Some(object) = schema.as_object_mut() else {
            return Err(format!("a JSON schema is a JSON object, got {schema}"));
        };
        // The compiler's options are the server's, not the client's: a
        // schema's own `x-guidance` (llguidance's options key) could turn
        // flexible whitespace back on, and the padding with it.
        object.remove("x-guidance");
        let options = JsonCompileOptions {
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        options.apply_to(&mut schema);
        Ok(Some(TopLevelGrammar::from_json_schema(schema)))
    }
}

/// The grammar compiler of one tokenizer: built on the first constrained
/// request (its token trie takes a moment for a large vocabulary), then
/// shared by every request of the model.
pub(crate) struct Grammars {
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
    /// Grammars compiled so far (formats other than text).
    compiled: std::sync::atomic::AtomicU64,
    /// The formats compiled last, each in its start state, most recent
    /// first. A server's route compiles a request's format (refusing a bad
    /// one before it queues) and the engine compiles it again when it
    /// admits the request, on the model's driver, where every stream of
    /// the model waits for it: that second one is a copy from here — a
    /// deep one, its lexer's caches its own (llguidance's `clone` shares
    /// them, which a request's choices may, but requests must not: one
    /// request's lexer error would stick to every later one's, and the
    /// shared caches would grow for as long as the format is used).
    recent: std::sync::Mutex<std::collections::VecDeque<(ResponseFormat, Constraint)>>,
}

/// How many compiled formats [`Grammars`] keeps: enough for the requests
/// between a route's compile and its admission under a burst.
const RECENT_GRAMMARS: usize = 8;

impl Grammars {
    pub(crate) fn new() -> Self {
        Self { factory: OnceLock::new(), compiled: Default::default(), recent: Default::default() }
    }

    pub(crate) fn compiled(&self) -> u64 {
        self.compiled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `format` compiled for one request: `None` for text; a schema the
    /// compiler refuses is an error saying why.
    pub(crate) fn compile(
        &self,
        format: &ResponseFormat,
        words: &Result<Vec<Vec<u8>>, String>,
        eos: &[u32],
    ) -> Result<Option<Constraint>, String> {
        if *format == ResponseFormat::Text {
            return Ok(None);
        }
        let recent = || self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, fresh)) = recent().iter().find(|(f, _)| f == format) {
            return Ok(Some(fresh.detached()));
        }
        let Some(grammar) = format.grammar()? else { return Ok(None) };
        self.compiled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let factory = self.factory.get_or_init(|| build_factory(words, eos).map(Arc::new)).clone()?;
        let parser = factory.create_parser(grammar).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        let tok_eos = factory.tok_env().tok_trie().eos_token();
        let fresh = Constraint { matcher, tok_eos, allowed: Vec::new() };
        let mut recent = recent();
        recent.push_front((format.clone(), fresh.detached()));
        recent.truncate(RECENT_GRAMMARS);
        Ok(Some(fresh))
    }
}

/// The bytes each token id spells, over the `vocab` ids the model's logits
/// cover (ids the tokenizer lacks spell nothing, so no grammar allows them).
/// A special token's bytes start with [`SPECIAL_TOKEN_MARKER`], so that no
/// grammar text spells it.
pub(crate) fn token_bytes(tokenizer: &Tokenizer, vocab: usize) -> Result<Vec<Vec<u8>>, String> {
    let unreadable = |e: &dyn std::fmt::Display| format!("the tokenizer's tokens cannot be read as bytes: {e}");
    let json = tokenizer.to_string(false).map_err(|e| unreadable(&e))?;
    let json: Value = serde_json::from_str(&json).map_err(|e| unreadable(&e))?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| unreadable(&e))?;
    if words.len() < vocab {
        words.resize(vocab, Vec::new());
    }
    Ok(words)
}

/// Marks a special token's bytes (llguidance's convention).
pub(crate) const SPECIAL_TOKEN_MARKER: u8 = TokTrie::SPECIAL_TOKEN_MARKER;

/// The token trie over `words` and its grammar compiler.
fn build_factory(words: &Result<Vec<Vec<u8>>, String>, eos: &[u32]) -> Result<ParserFactory, String> {
    let unusable = |e: &dyn std::fmt::Display| format!("the tokenizer cannot drive constrained decoding: {e}");
    let words = words.as_ref().map_err(|e| unusable(e))?;
    let tok_eos = *eos.first().ok_or_else(|| unusable(&"the package declares no end-of-sequence token"))?;
    let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, tok_eos), words);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| unusable(&e))?;
    factory.quiet();
    Ok(factory)
}

/// One request's grammar state: which tokens may come next. A clone goes
/// on from the same state (the choices of one request start alike).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// The end-of-sequence id the grammar knows; the package's other
    /// end-of-sequence ids follow it.
    tok_eos: u32,
    /// Scratch: the allowed flags of the last mask.
    allowed: Vec<bool>,
}

impl Constraint {
    /// A copy that shares nothing with this one (a `clone` shares the
    /// lexer's caches, as a request's choices may).
    fn detached(&self) -> Constraint {
        Constraint { matcher: self.matcher.deep_clone(), tok_eos: self.tok_eos, allowed: Vec::new() }
    }

    /// Sets the logit of every token the grammar forbids next to -inf. The
    /// package's end-of-sequence tokens are allowed exactly when the text
    /// may end here.
    pub fn mask(&mut self, logits: &mut [f32], eos: &[u32]) -> Result<(), String> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let may_end = mask.is_allowed(self.tok_eos);
        self.allowed.clear();
        self.allowed.extend((0..logits.len()).map(|id| id < mask.len() && mask.is_allowed(id as u32)));
        for &id in eos {
            if let Some(a) = self.allowed.get_mut(id as usize) {
                *a = may_end;
            }
        }
        if !self.allowed.contains(&true) {
            return Err("the grammar allows no token of this vocabulary here".into());
        }
        for (logit, allowed) in logits.iter_mut().zip(&self.allowed) {
            if !allowed {
                *logit = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances the grammar over a chosen token (not an end-of-sequence).
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A schema that is not an object, and one llguidance cannot compile,
    /// are refused with the reason; text compiles to no constraint.
    #[test]
    fn formats_compile_or_say_why() {
        assert!(ResponseFormat::Text.grammar().unwrap().is_none());
        assert!(ResponseFormat::JsonObject.grammar().unwrap().is_some());
        let err = ResponseFormat::JsonSchema(serde_json::json!(true)).grammar().unwrap_err();
        assert!(err.contains("JSON object"), "{err}");
    }
}
