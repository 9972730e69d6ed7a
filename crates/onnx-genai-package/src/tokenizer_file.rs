//! Reading a `tokenizer.json` without trusting the library that parses it.

use std::path::Path;

/// Loads a `tokenizer.json`. The tokenizers library panics on some
/// malformed files (an `unwrap` in its decoder deserialisation, found by
/// fuzzing): a bad file must be a diagnostic, not a crash of the validator
/// or the server.
pub(crate) fn load(path: &Path) -> Result<tokenizers::Tokenizer, String> {
    match std::panic::catch_unwind(|| tokenizers::Tokenizer::from_file(path)) {
        Ok(loaded) => loaded.map_err(|e| e.to_string()),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(format!("the tokenizers library failed on it ({what})"))
        }
    }
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
}
