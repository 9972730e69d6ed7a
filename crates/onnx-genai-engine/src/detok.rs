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

/// Tokens held back at most: a UTF-8 character spans at most 4 bytes, so a
/// window still incomplete after this many never completes (a model that
/// samples stray byte tokens). Past it the held text goes out as it
/// decodes, replacement characters and all, and the window moves on;
/// unbounded, each token decoded the whole growing window again, on the
/// thread that drives every sequence of the batch.
const HOLD_AT_MOST: usize = 8;

impl TextStream {
    /// The text the newest of `tokens` adds (all of `tokens` are the
    /// generation so far), or nothing while it ends in an incomplete UTF-8
    /// sequence (held back until a later token completes it, for up to
    /// [`HOLD_AT_MOST`] tokens).
    pub(crate) fn next<E>(
        &mut self,
        tokens: &[u32],
        mut decode: impl FnMut(&[u32]) -> Result<String, E>,
    ) -> Result<String, E> {
        let before = decode(&tokens[self.context..self.emitted])?;
        let now = decode(&tokens[self.context..])?;
        let held_long = tokens.len() - self.emitted >= HOLD_AT_MOST;
        // A tokenizer whose cleanup rewrote the context holds the text back
        // until the window decodes as an extension again.
        let delta = match now.strip_prefix(before.as_str()) {
            Some(delta) if !now.ends_with('\u{FFFD}') => delta.to_string(),
            Some(delta) if held_long => delta.to_string(),
            None if held_long => decode(&tokens[self.emitted..])?,
            _ => return Ok(String::new()),
        };
        self.context = self.emitted;
        self.emitted = tokens.len();
        Ok(delta)
    }
}

#[cfg(test)]
mod tests {
    use super::TextStream;

    /// `tokens` generated one at a time and streamed: the deltas joined, and
    /// the most tokens one decode covered.
    fn streamed(tokenizer: &tokenizers::Tokenizer, tokens: &[u32]) -> (String, usize) {
        let (mut stream, mut text, mut widest) = (TextStream::default(), String::new(), 0);
        for end in 1..=tokens.len() {
            let delta = stream
                .next(&tokens[..end], |ids: &[u32]| {
                    widest = widest.max(ids.len());
                    tokenizer.decode(ids, true)
                })
                .unwrap();
            text.push_str(&delta);
        }
        (text, widest)
    }

    /// `check` on the tokenizer of each tiny package with its own kind of
    /// tokenizer (byte-level BPE with and without a llama-style template).
    fn each_tokenizer(check: impl Fn(&str, &tokenizers::Tokenizer)) {
        for name in ["tiny-gpt2", "tiny-llama-gqa"] {
            let (_dir, package) = onnx_genai_test_support::build(name);
            check(name, package.tokenizer());
        }
    }

    /// The streamed deltas add up to the text of the whole generation, for
    /// every tiny package's tokenizer, over token sequences that split
    /// multi-byte characters across tokens (single-byte tokens of UTF-8
    /// lead and continuation bytes, held back until complete) — and no
    /// decode ever covers more than the window: its length stays bounded
    /// while the generation grows to 600 tokens.
    #[test]
    fn windowed_deltas_add_up_to_the_whole_text() {
        each_tokenizer(|name, tokenizer| {
            let vocab = tokenizer.get_vocab_size(true) as u64;
            let mut seed = 7u64;
            let tokens: Vec<u32> = (0..600)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 33) % vocab) as u32
                })
                .collect();
            let (text, widest) = streamed(tokenizer, &tokens);
            let whole = tokenizer.decode(&tokens, true).unwrap();
            let complete = whole.trim_end_matches('\u{FFFD}');
            assert!(whole.starts_with(&text) && text.len() >= complete.len(), "{name}: {text:?}\nvs {whole:?}");
            assert!(widest < 50, "{name}: a decode covered {widest} tokens");
        });
    }

    /// A generation of stray byte tokens that never complete a UTF-8
    /// character (a lone continuation byte, again and again) is still
    /// streamed — replacement characters, at least one every
    /// `HOLD_AT_MOST` tokens — and no decode covers more than two windows'
    /// worth of tokens, however long it runs (held back for good, each
    /// token decoded the whole generation again).
    #[test]
    fn stray_bytes_are_streamed_and_the_window_stays_bounded() {
        each_tokenizer(|name, tokenizer| {
            let vocab = tokenizer.get_vocab_size(true) as u32;
            // A token whose text alone is a replacement character and stays
            // one when repeated: a byte that never completes a character.
            let stray = (0..vocab)
                .find(|&id| {
                    tokenizer.decode(&[id; 3], true).is_ok_and(|t| !t.is_empty() && t.chars().all(|c| c == '\u{FFFD}'))
                })
                .unwrap_or_else(|| panic!("{name}: no stray byte token"));
            let (text, widest) = streamed(tokenizer, &[stray; 600]);
            assert!(widest <= 2 * super::HOLD_AT_MOST, "{name}: a decode covered {widest} tokens");
            let sent = text.chars().filter(|c| *c == '\u{FFFD}').count();
            assert!(
                sent >= 600 / super::HOLD_AT_MOST - 1,
                "{name}: {sent} replacement characters streamed for 600 stray bytes"
            );
        });
    }
}
