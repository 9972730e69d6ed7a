//! A request body sent to the fixture server over loopback, through its
//! listener, guard and routes to the model's driver. The first byte picks
//! the route (chat, completion, session creation, or a chat turn on a
//! session made for it and deleted after); the rest is the body.
//!
//! A finding is a connection dropped without an answer (a handler that
//! panicked), a 5xx other than 503/504 (the tiny model never fails), or a
//! lease, waiting turn or running turn left behind once the answer is in
//! (L1, L9).

use std::time::{Duration, Instant};

use onnx_genai_server::client::{call, Reply};
use onnx_genai_server::SESSION_HEADER;

use crate::fixture;

/// The model name the fixture serves (requests must name it to reach it).
pub(crate) const MODEL: &str = "fuzz-tiny";

/// The routes the first byte picks from.
pub(crate) const ROUTES: [&str; 4] = ["chat", "completions", "session", "chat-in-session"];

/// The bytes of a request to `route` (one of [`ROUTES`]) with `body`.
pub(crate) fn join(route: &str, body: &str) -> Vec<u8> {
    let index = ROUTES.iter().position(|r| *r == route).unwrap_or(0) as u8;
    [&[index][..], body.as_bytes()].concat()
}

fn checked(what: &str, reply: std::io::Result<Reply>) -> Reply {
    match reply {
        Ok(r) if r.status >= 500 && r.status != 503 && r.status != 504 => {
            panic!("{what}: the server answered {}: {}", r.status, r.body)
        }
        Ok(r) => r,
        Err(e) => panic!("{what}: no answer (a handler died?): {e}"),
    }
}

pub(crate) fn run(data: &[u8]) -> Result<(), String> {
    let Some((&pick, body)) = data.split_first() else { return Err("no route byte".into()) };
    let server = fixture::server();
    let body = String::from_utf8_lossy(body);
    let post = |path: &str, headers: &[(&str, &str)], body: &str| {
        checked(path, call(server.addr, "POST", path, headers, body))
    };
    let answer = match ROUTES[usize::from(pick) % ROUTES.len()] {
        "chat" => post("/v1/chat/completions", &[], &body),
        "completions" => post("/v1/completions", &[], &body),
        "session" => {
            let reply = post("/v1/sessions", &[], &body);
            if let Some(id) = reply.json()["id"].as_str() {
                checked("delete", call(server.addr, "DELETE", &format!("/v1/sessions/{id}"), &[], ""));
            }
            reply
        }
        _ => {
            let reply = post("/v1/sessions", &[], &format!(r#"{{"model":"{MODEL}"}}"#));
            let Some(id) = reply.json()["id"].as_str().map(str::to_string) else {
                panic!("the fixture server made no session: {} {}", reply.status, reply.body)
            };
            let reply = post("/v1/chat/completions", &[(SESSION_HEADER, &id)], &body);
            checked("delete", call(server.addr, "DELETE", &format!("/v1/sessions/{id}"), &[], ""));
            reply
        }
    };
    // The answer is in: nothing of the turn may be held any more. A stream
    // cut short settles on the driver's next step, so allow it a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let g = server.gauges();
        if g.leases == 0 && g.waiting == 0 && g.running == 0 {
            return match answer.status {
                200 => Ok(()),
                status => Err(format!("{status}: {}", answer.body)),
            };
        }
        if Instant::now() > deadline {
            panic!("after the answer the server still holds {g:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
