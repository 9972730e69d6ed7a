//! A deterministic byte-level BPE tokenizer, trained in code on a small fixed
//! corpus and written in Hugging Face `tokenizer.json` format with the
//! `tokenizers` crate.
//!
//! Ids: 0..256 are the byte symbols (GPT-2's byte-to-unicode map, in byte
//! order), then merges in the order learned, then the special tokens last.

use std::collections::{BTreeMap, HashMap};

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer};

use crate::BuildError;

pub const BYTE_TOKENS: u32 = 256;
/// End of text (also beginning), then chat turn markers.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

const CORPUS: &str = include_str!("corpus.txt");

/// A ChatML template matching [`SPECIAL_TOKENS`].
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// GPT-2's reversible map from bytes to printable characters.
pub fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('?');
            next += 1;
            c
        };
    }
    map
}

/// The placeholder a vision-language prompt marks an image with.
pub const IMAGE_TOKEN: &str = "<|image|>";

/// Builds the tokenizer with exactly `vocab_size` tokens.
pub fn build(vocab_size: u32) -> Result<Tokenizer, BuildError> {
    build_with(vocab_size, &[])
}

/// [`build`] with `extra` special tokens after the standard ones.
pub fn build_with(vocab_size: u32, extra: &[&str]) -> Result<Tokenizer, BuildError> {
    let merges_wanted = vocab_size - BYTE_TOKENS - (SPECIAL_TOKENS.len() + extra.len()) as u32;
    let alphabet = byte_to_char();
    let mut vocab: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
    let merges = train(merges_wanted as usize)?;
    for (a, b) in &merges {
        vocab.push(format!("{a}{b}"));
    }
    let vocab_map: ahash::AHashMap<String, u32> =
        vocab.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe =
        BPE::builder().vocab_and_merges(vocab_map, merges).build().map_err(|e| BuildError::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS.iter().chain(extra).map(|t| AddedToken::from(*t, true)).collect();
    tokenizer.add_special_tokens(&specials);
    // A vocabulary larger than the corpus has pairs (a real model's shapes
    // with random weights) ends in reserved tokens no text encodes to.
    let have = tokenizer.get_vocab_size(true);
    if have < vocab_size as usize {
        let reserved: Vec<AddedToken> =
            (have..vocab_size as usize).map(|i| AddedToken::from(format!("<|reserved_{i}|>"), true)).collect();
        tokenizer.add_special_tokens(&reserved);
    }
    if tokenizer.get_vocab_size(true) != vocab_size as usize {
        return Err(BuildError::Tokenizer(format!(
            "built {} tokens, expected {vocab_size} (the corpus has too few distinct pairs)",
            tokenizer.get_vocab_size(true)
        )));
    }
    Ok(tokenizer)
}

/// Learns `count` merges from the corpus: the most frequent adjacent pair
/// wins, ties go to the lexicographically smallest pair (determinism).
fn train(count: usize) -> Result<Vec<(String, String)>, BuildError> {
    let mut pre = PreTokenizedString::from(CORPUS);
    ByteLevel::new(false, true, true).pre_tokenize(&mut pre).map_err(|e| BuildError::Tokenizer(e.to_string()))?;
    let mut words: BTreeMap<Vec<String>, u64> = BTreeMap::new();
    for (word, _, _) in pre.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        *words.entry(word.chars().map(|c| c.to_string()).collect()).or_default() += 1;
    }
    let mut merges = Vec::with_capacity(count);
    while merges.len() < count {
        let mut pairs: HashMap<(&str, &str), u64> = HashMap::new();
        for (symbols, freq) in &words {
            for w in symbols.windows(2) {
                *pairs.entry((w[0].as_str(), w[1].as_str())).or_default() += freq;
            }
        }
        let Some(((a, b), _)) = pairs.into_iter().max_by(|(pa, ca), (pb, cb)| ca.cmp(cb).then(pb.cmp(pa))) else {
            break;
        };
        let (a, b) = (a.to_string(), b.to_string());
        let joined = format!("{a}{b}");
        words = words
            .into_iter()
            .map(|(symbols, freq)| {
                let mut out = Vec::with_capacity(symbols.len());
                let mut i = 0;
                while i < symbols.len() {
                    if i + 1 < symbols.len() && symbols[i] == a && symbols[i + 1] == b {
                        out.push(joined.clone());
                        i += 2;
                    } else {
                        out.push(symbols[i].clone());
                        i += 1;
                    }
                }
                (out, freq)
            })
            .fold(BTreeMap::new(), |mut acc, (s, f)| {
                *acc.entry(s).or_default() += f;
                acc
            });
        merges.push((a, b));
    }
    Ok(merges)
}
