//! OpenAI's `logprobs` shapes: chat's `{"content": [{token, logprob, bytes,
//! top_logprobs}]}` and completions' `{tokens, token_logprobs,
//! top_logprobs, text_offset}`, for the tokens an answer or a stream chunk
//! carries.

use onnx_genai_engine::{Prompter, TokenLogprob};
use serde_json::{json, Map, Value};

/// A generated token's log-probability and where its text starts in the
/// answer.
pub struct Scored {
    pub logprob: TokenLogprob,
    pub offset: usize,
}

/// Takes from `pending` the tokens whose text starts before byte `end` of
/// the answer: what a chunk sending the text up to `end` carries, or what
/// an answer cut by a stop string at `end` keeps.
pub fn take_before(pending: &mut Vec<Scored>, end: usize) -> Vec<Scored> {
    let split = pending.iter().position(|s| s.offset >= end).unwrap_or(pending.len());
    let rest = pending.split_off(split);
    std::mem::replace(pending, rest)
}

/// Chat's shape.
pub fn chat(prompter: &Prompter, scored: &[Scored]) -> Value {
    let piece = |id: u32, logprob: f32| {
        let (token, bytes) = prompter.token_piece(id);
        json!({"token": token, "logprob": logprob, "bytes": bytes})
    };
    let content: Vec<Value> = scored
        .iter()
        .map(|s| {
            let mut entry = piece(s.logprob.token, s.logprob.logprob);
            entry["top_logprobs"] = s.logprob.top.iter().map(|&(id, lp)| piece(id, lp)).collect();
            entry
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The completions endpoint's shape (alternatives as a token text →
/// logprob map; where two alternatives read alike, such as two pieces of
/// characters, the likelier one is kept).
pub fn completion(prompter: &Prompter, scored: &[Scored]) -> Value {
    let text = |id: u32| prompter.token_piece(id).0;
    let top: Vec<Value> = scored
        .iter()
        .map(|s| {
            let mut alternatives = Map::new();
            for &(id, lp) in &s.logprob.top {
                alternatives.entry(text(id)).or_insert(json!(lp));
            }
            Value::Object(alternatives)
        })
        .collect();
    json!({
        "tokens": scored.iter().map(|s| text(s.logprob.token)).collect::<Vec<_>>(),
        "token_logprobs": scored.iter().map(|s| s.logprob.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": scored.iter().map(|s| s.offset).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored(offset: usize) -> Scored {
        Scored { logprob: TokenLogprob { token: 1, logprob: -0.5, top: Vec::new() }, offset }
    }

    /// A chunk carries exactly the tokens whose text starts inside what it
    /// sends; the rest wait for the next one.
    #[test]
    fn take_before_splits_at_the_sent_text() {
        let mut pending = vec![scored(0), scored(3), scored(3), scored(7)];
        let sent: Vec<usize> = take_before(&mut pending, 4).iter().map(|s| s.offset).collect();
        assert_eq!(sent, [0, 3, 3]);
        assert_eq!(pending.iter().map(|s| s.offset).collect::<Vec<_>>(), [7]);
        assert!(take_before(&mut pending, 7).is_empty());
        assert_eq!(take_before(&mut pending, 8).len(), 1);
        assert!(pending.is_empty());
    }
}
