//! Serving an axum app on a TCP listener with the limits every listener of ours has:
//! a cap on open connections (one over it is closed at once, before a byte is read),
//! a deadline for a request's headers (a slow-loris peer is cut off) and for its body,
//! and a graceful stop that lets open requests finish.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

/// What one listener allows.
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct Limits {
    /// Connections open at once; further ones are closed on accept.
    pub max_connections: usize,
    /// Time to send a request's headers (and, on a kept-alive connection, to start
    /// the next request).
    pub header_timeout: Duration,
    /// Time to send a request's whole body once its headers arrived.
    pub body_timeout: Duration,
}

impl Limits {
    /// A client-facing listener: many long streams.
    pub const PUBLIC: Limits = Limits {
        max_connections: 4096,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(30),
    };
    /// A listener for our own processes: fewer peers.
    pub const INTERNAL: Limits = Limits {
        max_connections: 1024,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(30),
    };
}

/// Serves `app` on `listener` until `stop` resolves, then waits for open requests to
/// finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    stop: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let app = app.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        limits.body_timeout,
    ));
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    let mut refused_logged = false;
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut stop => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            if !refused_logged {
                tracing::warn!(%peer, max = limits.max_connections, "connection limit reached; closing new connections");
                refused_logged = true;
            }
            drop(stream);
            continue;
        };
        refused_logged = false;
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn closed_within(s: &mut tokio::net::TcpStream, d: Duration) -> bool {
        let mut b = [0u8; 256];
        loop {
            match tokio::time::timeout(d, s.read(&mut b)).await {
                Ok(Ok(0) | Err(_)) => return true,
                Ok(Ok(_)) => {}
                Err(_) => return false,
            }
        }
    }

    #[tokio::test]
    async fn slow_peers_are_cut_off_and_connections_capped() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let app = Router::new().route("/", axum::routing::post(|body: String| async move { body }));
        let limits = Limits {
            max_connections: 2,
            header_timeout: Duration::from_millis(300),
            body_timeout: Duration::from_millis(300),
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(l, app, limits, async {
            let _ = rx.await;
        }));
        // Headers that never finish: cut off after the header deadline.
        let mut loris = tokio::net::TcpStream::connect(addr).await.unwrap();
        loris
            .write_all(b"POST / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        // A body that never finishes: answered with an error, not waited on forever.
        let mut slow_body = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow_body
            .write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
            .await
            .unwrap();
        // Both slots taken: a third connection is closed at once.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(
            closed_within(&mut third, Duration::from_millis(200)).await,
            "no cap"
        );
        assert!(
            closed_within(&mut loris, Duration::from_secs(3)).await,
            "slow headers kept"
        );
        let mut answer = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(3), slow_body.read_to_end(&mut answer)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 408")
                || answer.starts_with("HTTP/1.1 400")
                || answer.is_empty(),
            "{answer}"
        );
        // The slots are free again: a normal request is served.
        let mut ok = tokio::net::TcpStream::connect(addr).await.unwrap();
        ok.write_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
        )
        .await
        .unwrap();
        let mut answer = Vec::new();
        ok.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("hi"),
            "{answer}"
        );
        let _ = tx.send(());
        server.await.unwrap().unwrap();
    }
}
