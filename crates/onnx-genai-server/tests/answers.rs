//! What an answer carries over real HTTP on loopback (issue 19): text
//! under OpenAI's `response_format` (constrained decoding), and each
//! token's log-probability (`logprobs`).

mod support;

use onnx_genai_engine::Scheduler;
use onnx_genai_server::start;
use serde_json::{json, Value};
use support::{call, chat, engine, package, post, Gate};

const M: &str = "tiny-llama-gqa";

/// A server of `M` with an ample budget.
fn serve() -> (tempfile::TempDir, onnx_genai_server::RunningServer) {
    let (dir, p) = package(M);
    (dir, start(vec![engine(&p, &Gate::default(), Scheduler::new(u64::MAX / 2))], "127.0.0.1:0", 8).unwrap())
}

/// The first choice of every event of a stream's body.
fn stream_choices(r: &support::Reply) -> Vec<Value> {
    r.body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"].get(0).cloned())
        .collect()
}

/// The answer's text and finish reason, from a JSON answer or the events
/// of a stream.
fn answer(r: &support::Reply, streamed: bool) -> (String, String) {
    assert_eq!(r.status, 200, "{}", r.body);
    if !streamed {
        let choice = &r.json()["choices"][0];
        return (choice["message"]["content"].as_str().unwrap().to_string(), choice["finish_reason"].to_string());
    }
    let (mut text, mut finish) = (String::new(), String::new());
    for choice in stream_choices(r) {
        text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].to_string();
        }
    }
    (text, finish)
}

/// Issue 19, structured outputs: `json_schema` answers (`strict`, plain and
/// streamed, greedy and sampled) are JSON with exactly the schema's keys and
/// values in its enum and range, finished with `stop`; `json_object`
/// answers open an object. Bad formats (a schema the compiler refuses, no
/// schema, a bad name or `strict`, an unknown type) are 400s naming
/// `response_format`, with nothing admitted or reserved and no lease left
/// (A2, L1): the session's next turn runs.
#[test]
fn response_formats_constrain_the_answer_and_bad_ones_are_refused() {
    let (_d, s) = serve();
    let schema = json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 1, "maximum": 9}
        },
        "required": ["color", "n"],
        "additionalProperties": false
    });
    let format = json!({"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": true}});
    let mut seen = std::collections::BTreeSet::new();
    for streamed in [false, true] {
        for seed in 0..4 {
            let mut body = chat(M, "Pick a color", 200);
            body["response_format"] = format.clone();
            body["stream"] = json!(streamed);
            body["seed"] = json!(seed);
            body["temperature"] = json!(if seed == 0 { 0.0 } else { 1.0 });
            let (text, finish) = answer(&post(s.addr, "/v1/chat/completions", &body), streamed);
            assert_eq!(finish, "\"stop\"", "{text}");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            let keys: Vec<&String> = value.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["color", "n"], "{text}");
            assert!(matches!(value["color"].as_str(), Some("red" | "green" | "blue")), "{text}");
            assert!(value["n"].as_u64().is_some_and(|n| (1..=9).contains(&n)), "{text}");
            seen.insert(text);
        }
    }
    assert!(seen.len() > 1, "every request wrote the same JSON: {seen:?}");
    let mut body = chat(M, "Anything", 60);
    body["response_format"] = json!({"type": "json_object"});
    let (text, _) = answer(&post(s.addr, "/v1/chat/completions", &body), false);
    assert!(text.starts_with('{'), "{text}");

    let r = post(s.addr, "/v1/sessions", &json!({"model": M}));
    assert_eq!(r.status, 200, "{}", r.body);
    let sid = r.json()["id"].as_str().unwrap().to_string();
    let before = s.gauges();
    let unsatisfiable = json!({
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["x"]
    });
    for (format, want) in [
        (json!({"type": "json_schema", "json_schema": {"name": "x", "schema": unsatisfiable}}), "cannot be used"),
        (json!({"type": "json_schema", "json_schema": {"name": "x"}}), "json_schema.schema"),
        (json!({"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}), "json_schema.name"),
        (json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}), "strict"),
        (json!({"type": "yaml"}), "not text, json_object or json_schema"),
        (json!({"json_schema": {}}), "needs a `type`"),
    ] {
        let mut body = chat(M, "hi", 4);
        body["response_format"] = format.clone();
        let r = call(s.addr, "POST", "/v1/chat/completions", &[("x-session-id", &sid)], &body.to_string());
        assert_eq!(r.status, 400, "{format}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], "response_format", "{}", r.body);
        assert!(r.body.contains(want), "expected `{want}`: {}", r.body);
    }
    let after = s.gauges();
    assert_eq!((after.admitted, after.reserved_bytes, after.leases), (before.admitted, before.reserved_bytes, 0));
    let r = call(s.addr, "POST", "/v1/chat/completions", &[("x-session-id", &sid)], &chat(M, "ok", 2).to_string());
    assert_eq!(r.status, 200, "{}", r.body);
}

/// The chat `logprobs` entries of a JSON answer or a stream's chunks.
fn chat_entries(r: &support::Reply, streamed: bool) -> Vec<Value> {
    assert_eq!(r.status, 200, "{}", r.body);
    if !streamed {
        return r.json()["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    }
    let mut entries = Vec::new();
    for choice in stream_choices(r) {
        if let Some(content) = choice["logprobs"]["content"].as_array() {
            entries.extend(content.iter().cloned());
        }
    }
    entries
}

/// Issue 19, logprobs: a greedy chat answer with `logprobs` and
/// `top_logprobs: 3` has one entry per generated token whose bytes spell
/// the answer exactly, each a log-probability ≤ 0 that is the first of its
/// three alternatives (greedy takes the likeliest) in descending order; a
/// stream carries the same entries across its chunks; the completions
/// endpoint's shape has tokens found at their text offsets and at most `logprobs`
/// alternatives; without `logprobs` the field is null; out-of-range counts
/// and `top_logprobs` without `logprobs` are 400s naming the field.
#[test]
fn logprobs_score_every_token_in_both_shapes() {
    let (_d, s) = serve();
    let mut body = chat(M, "Once upon a time", 6);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let r = post(s.addr, "/v1/chat/completions", &body);
    let entries = chat_entries(&r, false);
    let content = r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(entries.len(), 6, "{}", r.body);
    let spelled: Vec<u8> =
        entries.iter().flat_map(|e| e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8)).collect();
    assert_eq!(String::from_utf8_lossy(&spelled), content, "the tokens' bytes spell the answer");
    for e in &entries {
        let lp = e["logprob"].as_f64().unwrap();
        let top = e["top_logprobs"].as_array().unwrap();
        assert!(lp <= 0.0 && top.len() == 3, "{e}");
        assert_eq!((&top[0]["token"], top[0]["logprob"].as_f64().unwrap()), (&e["token"], lp), "{e}");
        assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()), "{e}");
    }
    body["stream"] = json!(true);
    assert_eq!(chat_entries(&post(s.addr, "/v1/chat/completions", &body), true), entries);
    let plain = post(s.addr, "/v1/chat/completions", &chat(M, "Once upon a time", 2));
    assert!(plain.json()["choices"][0]["logprobs"].is_null(), "{}", plain.body);

    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"model": M, "prompt": "Once upon", "max_tokens": 5, "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let choice = &r.json()["choices"][0];
    let scores = &choice["logprobs"];
    let tokens: Vec<&str> = scores["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len(), 5, "{scores}");
    // Each token's text starts at its offset (a token holding part of a
    // character starts where the character does, and reads as U+FFFD).
    let text = choice["text"].as_str().unwrap();
    let offsets: Vec<usize> =
        scores["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap() as usize).collect();
    assert_eq!(offsets.first(), Some(&0), "{scores}");
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{scores}");
    for (token, &offset) in tokens.iter().zip(&offsets) {
        assert!(token.contains('\u{FFFD}') || text[offset..].starts_with(token), "{token:?} at {offset}: {scores}");
    }
    for (lp, alternatives) in
        scores["token_logprobs"].as_array().unwrap().iter().zip(scores["top_logprobs"].as_array().unwrap())
    {
        let alternatives = alternatives.as_object().unwrap();
        assert!(!alternatives.is_empty() && alternatives.len() <= 2, "{scores}");
        let best = alternatives.values().filter_map(Value::as_f64).fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(lp.as_f64().unwrap(), best, "greedy took the likeliest: {scores}");
    }
    for (path, extra, param) in [
        ("/v1/chat/completions", json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        ("/v1/chat/completions", json!({"top_logprobs": 2}), "top_logprobs"),
        ("/v1/completions", json!({"logprobs": 6}), "logprobs"),
    ] {
        let mut body = if path.ends_with("chat/completions") {
            chat(M, "hi", 2)
        } else {
            json!({"model": M, "prompt": "hi", "max_tokens": 2})
        };
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let r = post(s.addr, path, &body);
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
}

/// The completions `logprobs` of a JSON answer or a stream's chunks:
/// (text, tokens).
fn completion_scores(r: &support::Reply, streamed: bool) -> (String, Vec<String>) {
    assert_eq!(r.status, 200, "{}", r.body);
    let strings = |v: &Value| -> Vec<String> {
        v.as_array().map(|a| a.iter().map(|t| t.as_str().unwrap().to_string()).collect()).unwrap_or_default()
    };
    if !streamed {
        let choice = &r.json()["choices"][0];
        return (choice["text"].as_str().unwrap().to_string(), strings(&choice["logprobs"]["tokens"]));
    }
    let (mut text, mut tokens) = (String::new(), Vec::new());
    for choice in stream_choices(r) {
        text.push_str(choice["text"].as_str().unwrap_or(""));
        tokens.extend(strings(&choice["logprobs"]["tokens"]));
    }
    (text, tokens)
}

/// Where each token of a completions answer starts in its text.
fn text_offsets(r: &support::Reply) -> Vec<usize> {
    r.json()["choices"][0]["logprobs"]["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect()
}

/// Issue 19, logprobs under a stop string: an answer cut where a token's
/// own text begins carries exactly the tokens before it — the text the
/// client gets — in JSON and in a stream (where that token was held back
/// as a possible stop string).
#[test]
fn a_stop_string_keeps_the_logprobs_of_the_text_the_client_gets() {
    let (_d, s) = serve();
    let body = json!({"model": M, "prompt": "Once upon", "max_tokens": 12, "temperature": 0, "logprobs": 0});
    let full = post(s.addr, "/v1/completions", &body);
    let (text, tokens) = completion_scores(&full, false);
    let offsets = text_offsets(&full);
    // A later token whose own text first occurs where that token starts.
    let (cut, stop) = (1..tokens.len())
        .find(|&i| {
            let t = &tokens[i];
            !t.trim().is_empty() && !t.contains('\u{FFFD}') && text.find(t.as_str()) == Some(offsets[i])
        })
        .map(|i| (i, tokens[i].clone()))
        .unwrap_or_else(|| panic!("no token to stop at in {tokens:?}"));
    for streamed in [false, true] {
        let mut stopped = body.clone();
        stopped["stop"] = json!([stop]);
        stopped["stream"] = json!(streamed);
        let (cut_text, kept) = completion_scores(&post(s.addr, "/v1/completions", &stopped), streamed);
        assert_eq!(cut_text, text[..offsets[cut]], "streamed {streamed}, stop {stop:?}");
        assert_eq!(kept, tokens[..cut], "streamed {streamed}, stop {stop:?}");
    }
}

/// Issue 19 (stop strings): a session's history ends where the client's
/// text ends. After a turn a stop string cut at a token boundary (token
/// `i`), the next turn carries the prompt and exactly `i` generated tokens;
/// cut one character into token `j`, it carries `j` tokens and that
/// character — never the tokens the client did not get. JSON and streamed.
/// (The prompt is the first of a few whose greedy answer opens with whole
/// ASCII tokens, so the expected counts are plain.)
#[test]
fn a_stop_string_cuts_the_session_history_where_the_text_ends() {
    let (_d, s) = serve();
    let turn = |sid: &str, body: &Value| {
        let r = call(s.addr, "POST", "/v1/completions", &[("x-session-id", sid)], &body.to_string());
        assert_eq!(r.status, 200, "{}", r.body);
        r
    };
    let session = || post(s.addr, "/v1/sessions", &json!({"model": M})).json()["id"].as_str().unwrap().to_string();
    let next = json!({"model": M, "prompt": " and then", "max_tokens": 1});
    let prompt_of = |r: &support::Reply| r.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let clean = |t: &str| !t.trim().is_empty() && t.is_ascii() && !t.contains(char::is_control);
    let mut tried = Vec::new();
    for prompt in ["Once upon", "Hello", "The", "In the", "It was", "We", "A", "One day"] {
        let body = json!({"model": M, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0});
        let whole = session();
        let full = turn(&whole, &body);
        let (text, tokens) = completion_scores(&full, false);
        let offsets = text_offsets(&full);
        // A stop string first found where token `i` begins, or one
        // character into it, after whole ASCII tokens only.
        let plain_before = |i: usize| tokens[..=i].iter().all(|t| clean(t));
        let boundary =
            (1..tokens.len()).find(|&i| plain_before(i) && text.find(tokens[i].as_str()) == Some(offsets[i]));
        let inside = (1..tokens.len())
            .find(|&j| plain_before(j) && tokens[j].len() > 1 && text.find(&tokens[j][1..]) == Some(offsets[j] + 1));
        let (Some(boundary), Some(inside)) = (boundary, inside) else {
            tried.push(tokens);
            continue;
        };
        let first = prompt_of(&full);
        let new = prompt_of(&turn(&whole, &next)) - first - tokens.len();
        for streamed in [false, true] {
            for (stop, kept, carried) in [
                (tokens[boundary].clone(), offsets[boundary], boundary),
                (tokens[inside][1..].to_string(), offsets[inside] + 1, inside + 1),
            ] {
                let cut = session();
                let mut stopped = body.clone();
                stopped["stop"] = json!([stop]);
                stopped["stream"] = json!(streamed);
                let (cut_text, _) = completion_scores(&turn(&cut, &stopped), streamed);
                assert_eq!(cut_text, text[..kept], "streamed {streamed}, stop {stop:?}");
                let carried_now = prompt_of(&turn(&cut, &next)) - first - new;
                assert_eq!(carried_now, carried, "streamed {streamed}, stop {stop:?} in {tokens:?}");
            }
        }
        return;
    }
    panic!("no prompt's answer opens with whole ASCII tokens: {tried:?}");
}

/// Issue 19 (`n`): a request's choices come back as `choices[0..n]`, each
/// exactly the single request with seed + its index (they share the
/// prefill; each samples its own way), `usage` counting the prompt once and
/// every choice's tokens; a stream carries every choice's text under its
/// index, one finish per choice, the same texts; a stop string cuts each
/// choice on its own; completions too. `n` outside 1–16 or with a session
/// is a 400 naming `n` with nothing held, and nothing stays reserved after
/// the choices end; a server started with `max_choices` 2 refuses 3 (and
/// one cannot be started with more than 16).
#[test]
fn choices_answer_as_their_single_requests_would() {
    let (_d, s) = serve();
    let ask = |seed: u64, n: usize, streamed: bool| {
        let mut body = chat(M, "Once upon a time", 8);
        body["n"] = json!(n);
        body["seed"] = json!(seed);
        body["temperature"] = json!(1.0);
        body["stream"] = json!(streamed);
        body["stream_options"] = if streamed { json!({"include_usage": true}) } else { Value::Null };
        post(s.addr, "/v1/chat/completions", &body)
    };
    let r = ask(5, 3, false);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let texts: Vec<String> = (0..3)
        .map(|k| {
            assert_eq!(v["choices"][k]["index"], k);
            v["choices"][k]["message"]["content"].as_str().unwrap().to_string()
        })
        .collect();
    let mut single_tokens = 0;
    for (k, text) in texts.iter().enumerate() {
        let one = ask(5 + k as u64, 1, false).json();
        assert_eq!(one["choices"][0]["message"]["content"].as_str().unwrap(), text, "choice {k}");
        assert_eq!(one["usage"]["prompt_tokens"], v["usage"]["prompt_tokens"]);
        single_tokens += one["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(single_tokens));
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "choices sample apart: {texts:?}");

    let streamed = ask(5, 3, true);
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let mut parts = vec![String::new(); 3];
    let mut finishes = vec![0; 3];
    let mut usage = Value::Null;
    for line in streamed.body.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let event: Value = serde_json::from_str(line).unwrap();
        if !event["usage"].is_null() {
            usage = event["usage"].clone();
        }
        for choice in event["choices"].as_array().unwrap() {
            let k = choice["index"].as_u64().unwrap() as usize;
            parts[k].push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            finishes[k] += usize::from(!choice["finish_reason"].is_null());
        }
    }
    assert_eq!(parts, texts, "a stream carries the same choices");
    assert_eq!(finishes, [1, 1, 1], "one finish per choice");
    assert_eq!(usage, v["usage"]);

    // A stop string cuts each choice where its own text meets it.
    let stop = texts[1].chars().nth(2).map(String::from).unwrap();
    let mut body = chat(M, "Once upon a time", 8);
    body["n"] = json!(3);
    body["seed"] = json!(5);
    body["temperature"] = json!(1.0);
    body["stop"] = json!([stop]);
    let cut = post(s.addr, "/v1/chat/completions", &body).json();
    for (k, text) in texts.iter().enumerate() {
        let want = text.find(stop.as_str()).map_or(text.as_str(), |at| &text[..at]);
        assert_eq!(cut["choices"][k]["message"]["content"], want, "choice {k}, stop {stop:?}");
    }
    assert_eq!(cut["choices"][1]["finish_reason"], "stop");

    let text = post(s.addr, "/v1/completions", &json!({"model": M, "prompt": "Once", "max_tokens": 4, "n": 2})).json();
    assert_eq!(text["choices"].as_array().map(Vec::len), Some(2), "{text}");
    assert_eq!(text["choices"][1]["index"], 1);

    let sid = post(s.addr, "/v1/sessions", &json!({"model": M})).json()["id"].as_str().unwrap().to_string();
    let before = s.gauges();
    for (n, session) in [(0, None), (17, None), (2, Some(sid.as_str()))] {
        let mut body = chat(M, "hi", 2);
        body["n"] = json!(n);
        let headers: Vec<(&str, &str)> = session.map(|id| ("x-session-id", id)).into_iter().collect();
        let r = call(s.addr, "POST", "/v1/chat/completions", &headers, &body.to_string());
        assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("n")), "{}", r.body);
    }
    let after = s.gauges();
    assert_eq!((after.admitted, after.leases), (before.admitted, 0));
    assert_eq!(after.reserved_bytes, before.reserved_bytes, "the choices released every share");

    // A server configured for fewer choices refuses more, naming `n`.
    let (_d2, p) = package(M);
    let options = onnx_genai_server::ServerOptions { max_choices: 2, ..Default::default() };
    let small = onnx_genai_server::start_with(
        vec![engine(&p, &Gate::default(), Scheduler::unlimited())],
        "127.0.0.1:0",
        options,
    )
    .unwrap();
    let mut body = chat(M, "hi", 2);
    body["n"] = json!(3);
    let r = post(small.addr, "/v1/chat/completions", &body);
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("n")), "{}", r.body);
    assert!(r.body.contains("at most 2 choices"), "{}", r.body);
    body["n"] = json!(2);
    assert_eq!(post(small.addr, "/v1/chat/completions", &body).status, 200);
    let bad = onnx_genai_server::ServerOptions { max_choices: 17, ..Default::default() };
    let refused =
        onnx_genai_server::start_with(vec![engine(&p, &Gate::default(), Scheduler::unlimited())], "127.0.0.1:0", bad);
    assert!(matches!(refused, Err(onnx_genai_server::ServeError::MaxChoices(17))));
}

/// A package's sampling defaults apply to what a request leaves unset
/// (issue 18, part 3): with the package's default temperature 0 two
/// requests that name no temperature and no seed give the same (greedy)
/// text; without it they sample at OpenAI's default temperature 1 with
/// seeds of their own and part; a request's own temperature still wins.
#[test]
fn the_packages_sampling_defaults_fill_what_a_request_leaves_unset() {
    let texts = |greedy_default: bool, body: Value| {
        let (_dir, mut p) = package(M);
        if greedy_default {
            p.manifest.generation.sampling.temperature = Some(0.0);
        }
        let s = start(vec![engine(&p, &Gate::default(), Scheduler::new(u64::MAX / 2))], "127.0.0.1:0", 8).unwrap();
        (0..3)
            .map(|_| {
                let r = post(s.addr, "/v1/chat/completions", &body);
                assert_eq!(r.status, 200, "{}", r.body);
                r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string()
            })
            .collect::<Vec<_>>()
    };
    let unset = json!({"model": M, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24});
    let greedy = texts(true, unset.clone());
    assert!(greedy.iter().all(|t| *t == greedy[0]), "{greedy:?}");
    let sampled = texts(false, unset.clone());
    assert!(sampled.iter().any(|t| *t != sampled[0]), "{sampled:?}");
    let mut hot = unset;
    hot["temperature"] = json!(1.0);
    let asked = texts(true, hot);
    assert!(asked.iter().any(|t| *t != asked[0]), "{asked:?}");
}
