//! A turn's answer as the client gets it: the driver's events gathered per
//! choice into one JSON body or an SSE stream — stop strings cut (a stream
//! holds back text that may begin one, or a tool call), log-probabilities
//! carried with the text they score, tool calls split out, `usage` summed
//! over the choices.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::Event as SseEvent;
use futures_util::stream::{self, Stream, StreamExt};
use onnx_genai_engine::{FinishReason, TokenLogprob};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api;
use crate::driver::{Command, Driver, Event};
use crate::error::ApiError;
use crate::logprobs::{self, Scored};
use crate::metrics::TokenClock;
use crate::tool_calls::{self, ToolUse};

/// Which wire format a turn answers in.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Text,
}

impl Kind {
    pub fn prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        }
    }
}

/// What shapes a turn's answer.
pub struct Reply {
    pub id: String,
    pub model: String,
    pub kind: Kind,
    /// What admission counted (the `usage` of every answer, one prompt
    /// for all choices).
    pub prompt_tokens: u64,
    pub stops: Vec<String>,
    /// Shapes token log-probabilities, when the request asked for them.
    pub scorer: Option<Arc<onnx_genai_engine::Prompter>>,
    pub tools: Option<ToolUse>,
    /// Choices the request asked for.
    pub n: usize,
}

impl Reply {
    /// A token's log-probability with where its own text starts in the
    /// answer: at the end of its text delta when the delta ends with it (a
    /// delta may also carry bytes held back from earlier tokens that ended
    /// inside a character), else where the delta starts.
    fn scored(&self, before: usize, delta: &str, logprob: TokenLogprob) -> Scored {
        let own = self.scorer.as_ref().map(|p| p.token_piece(logprob.token).0).unwrap_or_default();
        let offset = if !own.is_empty() && delta.ends_with(&own) { before + delta.len() - own.len() } else { before };
        Scored { logprob, offset }
    }

    /// The calls in an answer, when the turn offers tools and it makes any.
    fn calls(&self, text: &str) -> Option<onnx_genai_engine::tools::Calls> {
        self.tools.as_ref()?.calls(text)
    }

    /// How much of the answer so far a stream may send: not what may still
    /// become a stop string, nor a tool call.
    fn sendable(&self, text: &str) -> usize {
        let ready = text.len() - undecided_tail(text, &self.stops);
        self.tools.as_ref().map_or(ready, |t| ready.min(t.sendable(text)))
    }

    /// The `logprobs` value of a choice: `null` when not asked for.
    fn logprobs(&self, scored: &[Scored]) -> Value {
        match (&self.scorer, self.kind) {
            (None, _) => Value::Null,
            (Some(p), Kind::Chat) => logprobs::chat(p, scored),
            (Some(p), Kind::Text) => logprobs::completion(p, scored),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::Eos | FinishReason::Stopped => "stop",
    }
}

/// Cuts `text` at the first stop string; `true` when one was found.
/// `text[..before]` holds none (it was searched when it grew), so a stop
/// string there must end past `before`: only the bytes from the longest
/// one's length before it are searched. (Searching the whole answer after
/// every token was quadratic in its length, times the choices and stops.)
fn apply_stops(text: &mut String, before: usize, stops: &[String]) -> bool {
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let mut from = before.min(text.len()).saturating_sub(longest.saturating_sub(1));
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    let cut = stops.iter().filter_map(|s| text[from..].find(s.as_str())).min();
    if let Some(at) = cut {
        text.truncate(from + at);
        return true;
    }
    false
}

/// A running turn as its route sees it.
pub struct Turn {
    pub rx: mpsc::Receiver<Event>,
    /// Resolves when the driver no longer holds anything for the turn.
    pub ended: tokio::sync::oneshot::Receiver<()>,
    pub clock: TokenClock,
    /// Where each generated token's text ends in the answer (`None` while
    /// its bytes are part of a character a later token completes).
    pub ends: Vec<Option<usize>>,
    /// The session whose history a stop string's cut must reach.
    pub session: Option<Box<SessionCut>>,
}

/// What cutting a session's history needs.
pub struct SessionCut {
    pub driver: Driver,
    pub id: onnx_genai_engine::SessionId,
    pub prompter: Arc<onnx_genai_engine::Prompter>,
    /// The session's tokens when the turn's generation began.
    pub history: usize,
}

impl Turn {
    /// Stops the generation early (stop strings cut every choice still
    /// running) and waits until its lease and reservation are released, so
    /// the answer never outruns them (issue 20: the session is free when
    /// the client hears the end). A session's history is then cut where the
    /// client's text ends: the tokens whose text lies wholly within it,
    /// then the rest of it encoded (issue 19) — sent to the driver before
    /// the answer goes out, so it precedes the client's next turn.
    async fn stop(self, text: &str) {
        drop(self.rx);
        let _ = self.ended.await;
        let Some(cut) = self.session else { return };
        let whole = self.ends.iter().rposition(|end| end.is_some_and(|end| end <= text.len())).map_or(0, |i| i + 1);
        let said = self.ends[..whole].iter().rev().find_map(|end| *end).unwrap_or(0);
        match cut.prompter.encode_plain(&text[said..]) {
            Ok(tail) => {
                let _ = cut.driver.send(Command::TrimSession { id: cut.id, start: cut.history, keep: whole, tail });
            }
            Err(e) => tracing::warn!("cannot encode the end of a cut answer: {e}"),
        }
    }
}

/// One choice's answer as it arrives.
#[derive(Default)]
struct Choice {
    text: String,
    /// Tokens generated (up to a stop string's cut).
    tokens: usize,
    /// Log-probabilities of tokens whose text has not gone out.
    scored: Vec<Scored>,
    /// A stream: bytes of `text` sent, and whether the role went out.
    sent: usize,
    spoke: bool,
    /// How it ended, once it has.
    finish: Option<&'static str>,
    /// A stop string ended it: the engine's later tokens are not its.
    cut: bool,
}

/// Every choice of a turn, and what the driver's events do to them.
struct Choices {
    all: Vec<Choice>,
}

/// What one event did to a choice.
enum Took {
    /// New text (a stream sends what of it is decided).
    Text(usize),
    /// A stop string cut it: `text` is final.
    Cut(usize),
    /// The engine ended it.
    Ended(usize),
    /// Nothing the client sees (a token after a choice's cut).
    Nothing,
}

impl Choices {
    fn new(n: usize) -> Self {
        Self { all: (0..n.max(1)).map(|_| Choice::default()).collect() }
    }

    fn done(&self) -> bool {
        self.all.iter().all(|c| c.finish.is_some())
    }

    /// Whether a stop string cut a choice the engine has not ended (the
    /// turn must then be stopped).
    fn any_cut(&self) -> bool {
        self.all.iter().any(|c| c.cut)
    }

    fn completion_tokens(&self) -> usize {
        self.all.iter().map(|c| c.tokens).sum()
    }

    /// Applies a delta or an ending to its choice.
    fn take(&mut self, reply: &Reply, turn: &mut Turn, event: Event) -> Result<Took, ApiError> {
        match event {
            Event::Delta(k, d, logprob) => {
                turn.clock.token();
                let Some(c) = self.all.get_mut(k).filter(|c| c.finish.is_none()) else { return Ok(Took::Nothing) };
                c.tokens += 1;
                c.scored.extend(logprob.map(|logprob| reply.scored(c.text.len(), &d, logprob)));
                let before = c.text.len();
                c.text.push_str(&d);
                if k == 0 {
                    turn.ends.push((!d.is_empty()).then_some(c.text.len()));
                }
                if apply_stops(&mut c.text, before, &reply.stops) {
                    c.finish = Some("stop");
                    c.cut = true;
                    return Ok(Took::Cut(k));
                }
                Ok(Took::Text(k))
            }
            Event::Finished(result) => {
                let Some(c) = self.all.get_mut(result.choice) else { return Ok(Took::Nothing) };
                if c.finish.is_some() {
                    // Cut by a stop string before: that ending stands.
                    c.cut = false;
                    return Ok(Took::Nothing);
                }
                c.finish = Some(finish_reason(result.finish_reason));
                c.tokens = result.token_ids.len();
                Ok(Took::Ended(result.choice))
            }
            Event::Failed(e) => Err(e),
        }
    }
}

/// The whole answer as one JSON body.
pub async fn collect(reply: Reply, mut turn: Turn) -> Result<Value, ApiError> {
    let mut choices = Choices::new(reply.n);
    while let Some(event) = turn.rx.recv().await {
        let took = choices.take(&reply, &mut turn, event)?;
        if let Took::Cut(k) = took {
            // The tokens whose text the client gets.
            let c = &mut choices.all[k];
            c.scored = logprobs::take_before(&mut c.scored, c.text.len());
        }
        if choices.done() {
            if choices.any_cut() {
                turn.stop(&choices.all[0].text).await;
            }
            return Ok(body(&reply, &choices));
        }
    }
    Err(ApiError::internal())
}

fn body(reply: &Reply, choices: &Choices) -> Value {
    let list: Vec<Value> = choices
        .all
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let finish = c.finish.unwrap_or("stop");
            let logprobs = reply.logprobs(&c.scored);
            match reply.kind {
                Kind::Chat => {
                    let (message, finish) = match reply.calls(&c.text) {
                        None => (json!({"role": "assistant", "content": c.text}), finish),
                        Some(calls) => {
                            let said = format!("{}{}", &c.text[..calls.before], &c.text[calls.after..]);
                            let content = if said.trim().is_empty() { Value::Null } else { json!(said) };
                            let calls = tool_calls::wire_calls(&calls.calls);
                            (json!({"role": "assistant", "content": content, "tool_calls": calls}), "tool_calls")
                        }
                    };
                    json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
                }
                Kind::Text => json!({"index": index, "text": c.text, "finish_reason": finish, "logprobs": logprobs}),
            }
        })
        .collect();
    let usage = api::usage(reply.prompt_tokens as usize, choices.completion_tokens());
    json!({"id": reply.id, "object": reply.object(false), "created": api::now(), "model": reply.model, "choices": list, "usage": usage})
}

/// A chunk of choice `index` carrying text (and the log-probabilities of
/// the tokens whose text it sends, when the request asked for them).
fn text_chunk(
    reply: &Reply,
    index: usize,
    text: Option<&str>,
    finish: Option<&str>,
    role: bool,
    scored: &[Scored],
) -> Value {
    let d = match text {
        Some(t) => json!({"content": t}),
        None => json!({}),
    };
    chunk(reply, index, d, text, finish, role, scored)
}

/// A chunk with a chat `delta` object (`text` for completions).
fn chunk(
    reply: &Reply,
    index: usize,
    mut d: Value,
    text: Option<&str>,
    finish: Option<&str>,
    role: bool,
    scored: &[Scored],
) -> Value {
    let logprobs = if scored.is_empty() { Value::Null } else { reply.logprobs(scored) };
    let choice = match reply.kind {
        Kind::Chat => {
            if role {
                d["role"] = json!("assistant");
            }
            json!({"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish})
        }
        Kind::Text => {
            json!({"index": index, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": logprobs})
        }
    };
    json!({"id": reply.id, "object": reply.object(true), "created": api::now(), "model": reply.model, "choices": [choice]})
}

/// Bytes at the end of `text` that could begin a stop string: held back
/// from a stream until the next tokens decide, so a stop string split
/// across tokens never leaks its first part.
fn undecided_tail(text: &str, stops: &[String]) -> usize {
    stops.iter().map(|stop| onnx_genai_engine::tools::pending_prefix(text, stop)).max().unwrap_or(0)
}

/// A choice's last chunks once its answer is whole: the text not sent yet
/// (held back as a possible stop string or tool call, and no longer), the
/// tool calls it makes, and the finish reason.
fn closing(reply: &Reply, index: usize, c: &mut Choice) -> Vec<Value> {
    let mut out = Vec::new();
    let text = &c.text;
    let calls = reply.calls(text);
    let sent = c.sent.min(text.len());
    let rest = match &calls {
        Some(calls) => format!("{}{}", &text[sent.min(calls.before)..calls.before], &text[calls.after..]),
        None => text[sent..].to_string(),
    };
    let scored = std::mem::take(&mut c.scored);
    let mut role = !c.spoke;
    if !rest.is_empty() || !scored.is_empty() {
        out.push(text_chunk(reply, index, Some(&rest), None, role, &scored));
        role = false;
    }
    let finish = match calls {
        None => c.finish.unwrap_or("stop"),
        Some(calls) => {
            for delta in tool_calls::call_deltas(&calls.calls) {
                out.push(chunk(reply, index, delta, None, None, role, &[]));
                role = false;
            }
            "tool_calls"
        }
    };
    out.push(text_chunk(reply, index, None, Some(finish), role, &[]));
    c.sent = text.len();
    c.spoke = true;
    out
}

/// What of a choice's new text a stream sends now. Only the unsent text
/// is looked at: what was sent holds no stop string or call, nor the start
/// of one (`sendable` held those back), so the answer is the same as over
/// the whole text, without scanning it all after every token.
fn progress(reply: &Reply, index: usize, c: &mut Choice) -> Option<Value> {
    let sent = c.sent.min(c.text.len());
    let ready = sent + reply.sendable(&c.text[sent..]);
    if ready <= c.sent {
        // All of it may yet be a stop string or a call: nothing to send.
        return None;
    }
    let piece = c.text[c.sent..ready].to_string();
    let carried = logprobs::take_before(&mut c.scored, ready);
    let out = text_chunk(reply, index, Some(&piece), None, !c.spoke, &carried);
    c.sent = ready;
    c.spoke = true;
    Some(out)
}

/// The stream's last chunk when the client asked for usage.
fn usage_chunk(reply: &Reply, completion: usize) -> Value {
    let mut u = text_chunk(reply, 0, None, None, false, &[]);
    u["choices"] = json!([]);
    u["usage"] = api::usage(reply.prompt_tokens as usize, completion);
    u
}

enum StreamState {
    Open { turn: Turn, choices: Choices },
    Done,
}

/// The answer as server-sent events: each choice's text as it is decided,
/// its closing chunks when it ends, then (when asked) the usage, then
/// `[DONE]`.
pub fn stream_events(
    reply: Reply,
    turn: Turn,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let reply = Arc::new(reply);
    let start = StreamState::Open { turn, choices: Choices::new(reply.n) };
    stream::unfold(start, move |state| {
        let reply = reply.clone();
        async move {
            let StreamState::Open { mut turn, mut choices } = state else { return None };
            let data = |v: Value| SseEvent::default().data(v.to_string());
            let done = SseEvent::default().data("[DONE]");
            // The driver let go of the turn before it ended (a driver that
            // died; a stalled client's last events given up on): the
            // stream ends as a failure does, with an error event and
            // `[DONE]`, not cut off mid-answer.
            let Some(event) = turn.rx.recv().await else {
                return Some((stream::iter(vec![Ok(data(ApiError::internal().body())), Ok(done)]), StreamState::Done));
            };
            let mut events = Vec::new();
            match choices.take(&reply, &mut turn, event) {
                Err(e) => return Some((stream::iter(vec![Ok(data(e.body())), Ok(done)]), StreamState::Done)),
                Ok(Took::Nothing) => {}
                Ok(Took::Text(k)) => events.extend(progress(&reply, k, &mut choices.all[k]).map(|v| Ok(data(v)))),
                Ok(Took::Cut(k)) => {
                    let c = &mut choices.all[k];
                    c.scored = logprobs::take_before(&mut c.scored, c.text.len());
                    events.extend(closing(&reply, k, c).into_iter().map(|v| Ok(data(v))));
                }
                Ok(Took::Ended(k)) => {
                    events.extend(closing(&reply, k, &mut choices.all[k]).into_iter().map(|v| Ok(data(v))))
                }
            }
            if !choices.done() {
                return Some((stream::iter(events), StreamState::Open { turn, choices }));
            }
            if choices.any_cut() {
                turn.stop(&choices.all[0].text).await;
            }
            if include_usage {
                events.push(Ok(data(usage_chunk(&reply, choices.completion_tokens()))));
            }
            events.push(Ok(done));
            Some((stream::iter(events), StreamState::Done))
        }
    })
    .flat_map(|s| s)
}

#[cfg(test)]
mod tests {
    use super::apply_stops;

    /// Issue 19: a stream holds back exactly the end of the text that could
    /// still become a stop string.
    #[test]
    fn the_undecided_tail_is_the_longest_stop_prefix_at_the_end() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(super::undecided_tail("hello E", &stops), 1);
        assert_eq!(super::undecided_tail("hello EN", &stops), 2);
        assert_eq!(super::undecided_tail("hello\n", &stops), 1);
        assert_eq!(super::undecided_tail("hello", &stops), 0);
        assert_eq!(super::undecided_tail("héé", &["éé!".to_string()]), 4, "whole characters");
    }

    fn tool_reply() -> super::Reply {
        let tool = onnx_genai_engine::tools::Tool {
            name: "now".into(),
            description: None,
            parameters: serde_json::json!({"type": "object"}),
        };
        super::Reply {
            id: "chatcmpl-1".into(),
            model: "m".into(),
            kind: super::Kind::Chat,
            prompt_tokens: 1,
            stops: Vec::new(),
            scorer: None,
            tools: Some(crate::tool_calls::ToolUse { tools: vec![tool], required: None, parallel: true }),
            n: 1,
        }
    }

    /// Issue 19, tools (`auto`): an answer with calls is its text around
    /// them plus `tool_calls`, finished `tool_calls`, as one JSON body and
    /// as a stream's closing chunks (the text before the call was sent
    /// already: only the text after it follows, then the call's two
    /// deltas); an answer whose block is no call is all text.
    #[test]
    fn a_free_answer_with_a_call_closes_with_it() {
        let reply = tool_reply();
        let text = "Sure.<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call> ok";
        let answered = |text: &str| {
            let mut choices = super::Choices::new(1);
            choices.all[0].text = text.to_string();
            choices.all[0].finish = Some("stop");
            choices
        };
        let sent_five = |text: &str| {
            let mut c = super::Choice { text: text.to_string(), sent: 5, spoke: true, ..Default::default() };
            c.finish = Some("stop");
            c
        };
        let body = super::body(&reply, &answered(text));
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], "Sure. ok");
        assert_eq!(choice["message"]["tool_calls"][0]["function"]["name"], "now");
        assert_eq!(choice["message"]["tool_calls"][0]["function"]["arguments"], "{}");

        assert_eq!(reply.sendable(text), 5, "text up to the call streams");
        let chunks = super::closing(&reply, 0, &mut sent_five(text));
        let deltas: Vec<_> = chunks.iter().map(|c| c["choices"][0]["delta"].clone()).collect();
        assert_eq!(deltas[0]["content"], " ok");
        assert_eq!(deltas[1]["tool_calls"][0]["function"]["name"], "now");
        assert_eq!(deltas[2]["tool_calls"][0]["function"]["arguments"], "{}");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(chunks.len(), 4);

        let not_a_call = "Sure.<tool_call>{\"name\": \"later\"}</tool_call>";
        let body = super::body(&reply, &answered(not_a_call));
        assert_eq!(body["choices"][0]["message"]["content"], not_a_call);
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        let chunks = super::closing(&reply, 0, &mut sent_five(not_a_call));
        assert_eq!(chunks[0]["choices"][0]["delta"]["content"], &not_a_call[5..], "the held text goes out as text");
    }

    /// `stop` cuts at the earliest stop string, and only when one occurs;
    /// after text that held none (`before`), a stop string straddling the
    /// old end is found and one wholly inside the old text is not searched
    /// for (it cannot be there: it was cut when that text came). Grown one
    /// character at a time, every split of a stop string across tokens
    /// (multi-byte characters included) cuts where a whole search does.
    #[test]
    fn stop_strings_cut_at_the_earliest_match() {
        let mut t = "one two. three\nfour".to_string();
        assert!(apply_stops(&mut t, 0, &["\n".into(), ".".into()]));
        assert_eq!(t, "one two");
        let mut u = "no stops here".to_string();
        assert!(!apply_stops(&mut u, 0, &["###".into()]));
        assert_eq!(u, "no stops here");
        // `before` is trusted: a match wholly before the searched tail
        // (impossible in a stream) is not looked for.
        let mut old = "a### and more".to_string();
        assert!(!apply_stops(&mut old, 9, &["###".into()]));

        let stops: Vec<String> = vec!["<|é末|>".into(), "zz".into()];
        for answer in ["abc<|é末|>def", "ab<|é<|é末|>", "é末zz<|", "a<|é末|", "zzz"] {
            let mut whole = answer.to_string();
            let cut = apply_stops(&mut whole, 0, &stops);
            let mut grown = String::new();
            let mut grown_cut = false;
            for ch in answer.chars() {
                let before = grown.len();
                grown.push(ch);
                if apply_stops(&mut grown, before, &stops) {
                    grown_cut = true;
                    break;
                }
            }
            assert_eq!((grown_cut, &grown), (cut, &whole), "{answer}");
        }
    }
}
