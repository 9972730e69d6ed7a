//! Test support: packages, a gate that holds a turn inside the backend, and
//! a small HTTP/1.1 client over a real loopback socket.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use onnx_genai_backend::{BackendError, DecodeBackend};
use onnx_genai_engine::{BackendFactory, BackendKind, Engine, Scheduler};
use onnx_genai_package::Package;

pub fn package(name: &str) -> (tempfile::TempDir, Package) {
    let dir = tempfile::tempdir().unwrap();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../packages/{name}/spec.yaml"));
    onnx_genai_build::build_package(&onnx_genai_build::read_spec(&spec).unwrap(), dir.path()).unwrap();
    let package = Package::open(dir.path()).unwrap();
    (dir, package)
}

/// Holds every backend call while closed, so a turn stays mid-flight (its
/// lease and reservation held) for as long as a test needs.
#[derive(Clone, Default)]
pub struct Gate(Arc<(Mutex<(bool, usize)>, Condvar)>);

impl Gate {
    pub fn close(&self) {
        self.0 .0.lock().unwrap().0 = true;
    }
    pub fn open(&self) {
        self.0 .0.lock().unwrap().0 = false;
        self.0 .1.notify_all();
    }
    /// Waits (bounded) until `n` calls have been held at the gate in total.
    pub fn wait_held(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut g = self.0 .0.lock().unwrap();
        while g.1 < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no turn reached the gate");
            g = self.0 .1.wait_timeout(g, left).unwrap().0;
        }
    }
    fn pass(&self) {
        let mut g = self.0 .0.lock().unwrap();
        if g.0 {
            g.1 += 1;
            self.0 .1.notify_all();
            while g.0 {
                g = self.0 .1.wait(g).unwrap();
            }
        }
    }
}

struct Gated {
    inner: Box<dyn DecodeBackend>,
    gate: Gate,
}

impl DecodeBackend for Gated {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn kv_len(&self) -> usize {
        self.inner.kv_len()
    }
    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, BackendError> {
        self.gate.pass();
        self.inner.forward(tokens)
    }
    fn truncate(&mut self, len: usize) -> Result<(), BackendError> {
        self.inner.truncate(len)
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
}

/// An engine on real ONNX Runtime whose backend calls pass `gate`.
pub fn engine(package: &Package, gate: &Gate, scheduler: Scheduler) -> Engine {
    let (pk, g) = (package.clone(), gate.clone());
    let factory: BackendFactory = Box::new(move || {
        Ok(Box::new(Gated { inner: BackendKind::Ort.load(&pk, 1)?, gate: g.clone() }) as Box<dyn DecodeBackend>)
    });
    Engine::new(package.clone(), factory).unwrap().with_scheduler(scheduler)
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    /// The error type of an OpenAI error body.
    pub fn error_type(&self) -> String {
        self.json()["error"]["type"].as_str().unwrap_or_default().to_string()
    }
}

fn send(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    s
}

fn head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_lowercase(), v.trim().to_string()));
        }
    }
    (status, headers)
}

/// Reads a whole body, chunked or not.
fn body(r: &mut BufReader<TcpStream>, headers: &[(String, String)]) -> String {
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut out = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            if r.read_line(&mut size).unwrap_or(0) == 0 {
                break;
            }
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).unwrap();
            out.extend_from_slice(&chunk[..n]);
        }
    } else {
        r.read_to_end(&mut out).unwrap();
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn call(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body_text: &str) -> Reply {
    let mut r = BufReader::new(send(addr, method, path, headers, body_text));
    let (status, headers) = head(&mut r);
    let body = body(&mut r, &headers);
    Reply { status, headers, body }
}

pub fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Reply {
    call(addr, "POST", path, &[], &body.to_string())
}

/// A streaming response read incrementally; dropping it disconnects.
pub struct Stream {
    pub status: u16,
    reader: BufReader<TcpStream>,
}

impl Stream {
    pub fn open(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> Self {
        let mut reader = BufReader::new(send(addr, "POST", path, headers, &body.to_string()));
        let (status, _) = head(&mut reader);
        Self { status, reader }
    }

    /// The next `data:` payload (chunk framing lines are skipped).
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if let Some(d) = line.trim_end().strip_prefix("data: ") {
                return Some(d.to_string());
            }
        }
    }
}

/// Polls `f` until it holds or `limit` passes (L9: releases may trail the
/// response).
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    f()
}
