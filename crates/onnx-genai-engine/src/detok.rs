//! The streamed text of generated tokens. Each new token's text comes from
//! decoding a short window — the last emitted tokens as context, then the
//! new ones — not the whole generation again, so a token costs the same at
//! position 10 and at 10,000 (decoding everything each step made a
//! generation quadratic in its length, on the thread that drives every
//! sequence of a batch). The context tokens decode the same way in both
//! texts (a tokenizer that drops the first token's leading space drops it
//! in both), so the new text is what follows them.

/// Where a turn's streamed text stands in its generated tokens.
#[derive(Debug, Default, Clone)]
pub(crate) struct TextStream {
    /// First token of the context window.
    context: usize,
    /// Tokens whose text has been emitted.
    emitted: usize,
}

impl TextStream {
    /// The text the newest of `tokens` adds (all of `tokens` are the
    /// generation so far), or nothing while it ends in an incomplete UTF-8
    /// sequence (held back until a later token completes it).
    pub(crate) fn next<E>(
        &mut self,
        tokens: &[u32],
        mut decode: impl FnMut(&[u32]) -> Result<String, E>,
    ) -> Result<String, E> {
        let before = decode(&tokens[self.context..self.emitted])?;
        let now = decode(&tokens[self.context..])?;
        if now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        // A tokenizer whose cleanup rewrote the context holds the text back
        // until the window decodes as an extension again.
        let Some(delta) = now.strip_prefix(before.as_str()) else { return Ok(String::new()) };
        let delta = delta.to_string();
        self.context = self.emitted;
        self.emitted = tokens.len();
        Ok(delta)
    }
}

#[cfg(test)]
mod tests {
    use super::TextStream;

    /// The streamed deltas add up to the text of the whole generation, for
    /// every tiny package's tokenizer, over token sequences that split
    /// multi-byte characters across tokens (single-byte tokens of UTF-8
    /// lead and continuation bytes, held back until complete) — and no
    /// decode ever covers more than the window: its length stays bounded
    /// while the generation grows to 600 tokens.
    #[test]
    fn windowed_deltas_add_up_to_the_whole_text() {
        for name in ["tiny-gpt2", "tiny-llama-gqa"] {
            let (_dir, package) = onnx_genai_test_support::build(name);
            let tokenizer = package.tokenizer().clone();
            let vocab = tokenizer.get_vocab_size(true) as u64;
            let (mut seed, mut tokens) = (7u64, Vec::new());
            let (mut stream, mut text, mut widest) = (TextStream::default(), String::new(), 0);
            for _ in 0..600 {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                tokens.push(((seed >> 33) % vocab) as u32);
                let delta = stream
                    .next(&tokens, |ids: &[u32]| {
                        widest = widest.max(ids.len());
                        tokenizer.decode(ids, true)
                    })
                    .unwrap();
                text.push_str(&delta);
            }
            let whole = tokenizer.decode(&tokens, true).unwrap();
            let complete = whole.trim_end_matches('\u{FFFD}');
            assert!(whole.starts_with(&text) && text.len() >= complete.len(), "{name}: {text:?}\nvs {whole:?}");
            assert!(widest < 50, "{name}: a decode covered {widest} tokens");
        }
    }
}
