//! The package's tokenizer file: checked against the manifest, and read
//! without trusting the library that parses it.

use std::path::Path;

use crate::confine;
use crate::diagnostics::{Code, Diagnostic, Report};
use crate::manifest::Manifest;
use crate::validate::{Ctx, Dialect};

/// Resolves, loads and checks the manifest's tokenizer against the model
/// (vocabulary size, special token ids).
pub(crate) fn check(ctx: &Ctx, m: &Manifest, report: &mut Report) -> Option<tokenizers::Tokenizer> {
    let file = ctx.manifest_file();
    let field = match ctx.dialect {
        Dialect::Native => "tokenizer.file",
        Dialect::GenaiConfig => "",
    };
    let vocab = m.architecture.vocab_size;
    let special = m
        .generation
        .eos_token_ids
        .iter()
        .map(|id| ("generation.eos_token_ids", *id))
        .chain(m.generation.bos_token_id.map(|id| ("generation.bos_token_id", id)));
    for (key, id) in special {
        if id >= vocab {
            report.push(Diagnostic::error(
                Code::PKG043,
                file,
                key,
                format!("token id {id} is outside the vocabulary (vocab_size {vocab})"),
                "use the tokenizer's id for the special token",
            ));
        }
    }
    let path = match confine::resolve(ctx.root, &m.tokenizer.file, file, field) {
        Ok(p) => p,
        Err(d) => {
            report.push(d);
            return None;
        }
    };
    match load(&path) {
        Ok(tokenizer) => {
            // Its largest id, not its count: ids may be sparse (an added
            // token numbered past the rest), and every id a prompt encodes
            // to indexes the embedding and every sampled one the logits.
            if let Some((token, id)) = tokenizer.get_vocab(true).into_iter().max_by_key(|(_, id)| *id) {
                if id >= vocab {
                    // (A token's text is the tokenizer's: shown clipped.)
                    let shown: String = token.chars().take(40).collect();
                    report.push(Diagnostic::error(
                        Code::PKG041,
                        &m.tokenizer.file,
                        "",
                        format!(
                            "the tokenizer's token {shown:?} has id {id} but the model's vocab_size is {vocab} (ids must lie below it)"
                        ),
                        "use the model's own tokenizer, or raise vocab_size to the logits width",
                    ));
                }
            }
            Some(tokenizer)
        }
        Err(e) => {
            report.push(Diagnostic::error(
                Code::PKG042,
                &m.tokenizer.file,
                "",
                format!("the tokenizer does not load: {e}"),
                "ship a Hugging Face `tokenizer.json` (tokenizers format)",
            ));
            None
        }
    }
}

/// Loads a `tokenizer.json`. The tokenizers library panics on some
/// malformed files (an `unwrap` in its decoder deserialisation, found by
/// fuzzing): a bad file must be a diagnostic, not a crash of the validator
/// or the server.
///
/// A generative model's prompt is encoded whole, so the file's padding
/// and truncation are dropped: padding makes every encoding a fixed
/// length (a length of 10^12 aborted the process at the first prompt),
/// and truncation would cut prompts without a word.
pub(crate) fn load(path: &Path) -> Result<tokenizers::Tokenizer, String> {
    match std::panic::catch_unwind(|| tokenizers::Tokenizer::from_file(path)) {
        Ok(loaded) => {
            let mut tokenizer = loaded.map_err(|e| e.to_string())?;
            tokenizer.with_padding(None);
            tokenizer.with_truncation(None).map_err(|e| e.to_string())?;
            Ok(tokenizer)
        }
        Err(panic) => Err(format!("the tokenizers library failed on it ({})", panic_message(panic.as_ref()))),
    }
}

/// The text of token ids, as `Tokenizer::decode` gives it — or an error
/// where the tokenizers library panics decoding them: its `Strip`
/// decoder slices out of range on a token that is only the stripped
/// character with both `start` and `stop` set (`[1..0]`), or on an empty
/// one with `stop` set. A package's tokenizer must not take down the
/// engine (or the server's model) that decodes what it generates.
pub fn decode(tokenizer: &tokenizers::Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Result<String, String> {
    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tokenizer.decode(ids, skip_special_tokens)));
    match decoded {
        Ok(text) => text.map_err(|e| e.to_string()),
        Err(panic) => {
            Err(format!("the tokenizers library failed decoding {ids:?} ({})", panic_message(panic.as_ref())))
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("no message")
}

#[cfg(test)]
mod tests {
    /// A `tokenizer.json` whose decoder is malformed in the way that makes
    /// the tokenizers library panic (found by the `package` fuzz target) is
    /// refused with a message, and the validator lives on.
    #[test]
    fn a_tokenizer_that_panics_the_library_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, "{\"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true\n  2}}").unwrap();
        let err = super::load(&path).unwrap_err();
        assert!(err.contains("tokenizers library failed"), "{err}");
    }

    /// A `Strip` decoder with `start` and `stop` both 1 panics the library
    /// on a token that is only its character: decoding that token is an
    /// error naming it, and the other tokens still decode.
    #[test]
    fn a_decode_that_panics_the_library_is_an_error() {
        let json = r#"{
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Strip", "content": " ", "start": 1, "stop": 1},
            "model": {"type": "WordLevel", "vocab": {" ": 0, "a": 1}, "unk_token": "a"}
        }"#;
        let tokenizer: tokenizers::Tokenizer = json.parse().unwrap();
        let err = super::decode(&tokenizer, &[0], false).unwrap_err();
        assert!(err.contains("failed decoding [0]"), "{err}");
        assert_eq!(super::decode(&tokenizer, &[1], false).unwrap(), "a");
    }

    /// A file's padding (to a fixed 10^12 tokens) and truncation (to 1
    /// token) do not reach a prompt: it is encoded whole, as its own tokens.
    #[test]
    fn a_tokenizers_padding_and_truncation_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let json = r#"{
            "version": "1.0", "added_tokens": [],
            "truncation": {"direction": "Right", "max_length": 1, "strategy": "LongestFirst", "stride": 0},
            "padding": {"strategy": {"Fixed": 1000000000000}, "direction": "Right", "pad_to_multiple_of": null,
                        "pad_id": 0, "pad_type_id": 0, "pad_token": "a"},
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, "unk_token": "a"}
        }"#;
        std::fs::write(&path, json).unwrap();
        let tokenizer = super::load(&path).unwrap();
        assert_eq!(tokenizer.encode("b a b", false).unwrap().get_ids(), &[1, 0, 1]);
    }
}
