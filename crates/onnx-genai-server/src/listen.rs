//! The accept loop: HTTP/1.1 connections with a header-read timeout that
//! also closes keep-alive connections left idle, and a cap on open
//! connections. `axum::serve` has neither (hyper's header timeout needs a
//! timer it does not set), so a client that sends half its headers, or
//! thousands that connect and wait, would hold sockets and tasks forever.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// How long an over-the-limit client gets to take its 503.
const REFUSAL_GRACE: Duration = Duration::from_secs(1);

/// Serves `app` on `listener` until `shutdown` resolves. At most
/// `max_connections` connections are served at once; one more is answered
/// 503 (with `Retry-After`) and closed without reaching the router.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    max_connections: usize,
    header_timeout: Duration,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(max_connections.max(1)));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or a reset before accept: back off
                    // instead of spinning on the error.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.connection_refused();
            tokio::spawn(refuse(stream, max_connections));
            continue;
        };
        // A client that stops reading must be noticed while it holds little:
        // the kernel grows an unbounded send buffer to megabytes (thousands
        // of streamed tokens), and until it and hyper's buffer fill, the
        // driver sees a reader. Bounded, its turn parks after ~a thousand.
        if let Err(e) = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER_BYTES) {
            tracing::debug!("cannot bound a connection's send buffer: {e}");
        }
        // Requests carry their peer address (a client's identity on a
        // server without API keys).
        let service = TowerToHyperService::new(app.clone().layer(axum::Extension(crate::guard::Peer(peer))));
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let _open = metrics.connection_opened();
            let mut builder = hyper::server::conn::http1::Builder::new();
            // The header timer restarts whenever the connection waits for a
            // request head, so it is the keep-alive idle timeout too.
            builder.timer(TokioTimer::new()).header_read_timeout(header_timeout).max_buf_size(SEND_BUFFER_BYTES);
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!("connection closed: {e}");
            }
            drop(permit);
        });
    }
}

/// The kernel send buffer of a connection (Linux doubles it) and hyper's
/// own write buffer: what a client that stops reading can hold back before
/// its turn is parked.
const SEND_BUFFER_BYTES: usize = 64 << 10;

/// Answers 503 in OpenAI's error shape and closes. The request is drained
/// briefly first: closing a socket with unread input resets it, and the
/// client would lose the answer.
async fn refuse(mut stream: TcpStream, max_connections: usize) {
    let body =
        ApiError::unavailable(format!("the server has {max_connections} connections open, its limit; retry shortly"))
            .body()
            .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::time::timeout(REFUSAL_GRACE, answer).await;
}
