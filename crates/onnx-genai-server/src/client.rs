//! A minimal blocking HTTP/1.1 client over `std::net` for loopback use: the
//! server's tests and `cargo xtask load` drive real sockets with it (JSON
//! bodies and SSE streams, `connection: close`).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The `type` of an OpenAI error body.
    pub fn error_type(&self) -> String {
        self.json()["error"]["type"].as_str().unwrap_or_default().to_string()
    }
}

fn send(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> io::Result<TcpStream> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    // Defaults the caller may replace (tests send foreign hosts and types).
    let host = addr.to_string();
    for (k, v) in [("host", host.as_str()), ("content-type", "application/json")] {
        if !headers.iter().any(|(h, _)| h.eq_ignore_ascii_case(k)) {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    // The server may answer before it has read the whole body (413 for one
    // over the limit) and close: the write then fails, yet the answer is
    // waiting to be read. A client that gave up here would turn the
    // server's right answer into a failure of its own.
    match s.write_all(body.as_bytes()) {
        Err(e) if !matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => Err(e),
        _ => Ok(s),
    }
}

fn head(r: &mut BufReader<TcpStream>) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l)?;
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_lowercase(), v.trim().to_string()));
        }
    }
    Ok((status, headers))
}

/// Reads a whole body, chunked or not.
fn body(r: &mut BufReader<TcpStream>, headers: &[(String, String)]) -> io::Result<String> {
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut out = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            if r.read_line(&mut size)? == 0 {
                break;
            }
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk)?;
            out.extend_from_slice(&chunk[..n]);
        }
    } else {
        r.read_to_end(&mut out)?;
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// One request, its whole reply.
pub fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body_text: &str,
) -> io::Result<Reply> {
    let mut r = BufReader::new(send(addr, method, path, headers, body_text)?);
    let (status, headers) = head(&mut r)?;
    let body = body(&mut r, &headers)?;
    Ok(Reply { status, headers, body })
}

/// A streaming reply read incrementally; dropping it disconnects.
pub struct Stream {
    pub status: u16,
    reader: BufReader<TcpStream>,
}

impl Stream {
    pub fn open(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> io::Result<Self> {
        let mut reader = BufReader::new(send(addr, "POST", path, headers, &body.to_string())?);
        let (status, _) = head(&mut reader)?;
        Ok(Self { status, reader })
    }

    /// The next `data:` payload (chunk framing lines are skipped); `None` at
    /// the end of the stream.
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A server may answer before it has read the whole body and close (a
    /// 413 for a body over the limit): the client reads that answer rather
    /// than failing on its own write. (A CI run failed
    /// `bad_requests_get_openai_errors` on "Broken pipe" this way.)
    #[test]
    fn an_answer_sent_before_the_body_was_read_is_read() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap() == 1 {
                head.push(byte[0]);
            }
            s.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 9\r\nconnection: close\r\n\r\ntoo large")
                .unwrap();
            // Dropped with the body unread: the kernel resets the connection.
        });
        let reply = call(addr, "POST", "/", &[], &"x".repeat(16 << 20)).unwrap();
        server.join().unwrap();
        assert_eq!((reply.status, reply.body.as_str()), (413, "too large"));
    }
}
