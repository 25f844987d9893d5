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
    /// Time to send a request's whole body once its headers arrived (an absolute
    /// deadline, not an idle timer: a byte every few seconds does not extend it).
    pub body_timeout: Duration,
    /// Longest a response write may wait on a peer that does not read (a stalled
    /// stream reader holds its slot no longer).
    pub write_stall: Duration,
}

impl Limits {
    /// A client-facing listener: many long streams.
    pub const PUBLIC: Limits = Limits {
        max_connections: 4096,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(30),
        write_stall: Duration::from_secs(60),
    };
    /// A listener for our own processes: fewer peers.
    pub const INTERNAL: Limits = Limits {
        max_connections: 1024,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(30),
        write_stall: Duration::from_secs(60),
    };
}

/// After the stop, open connections (long streams the caller's drain did not wait
/// for) get this long before the listener returns anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// A request body that fails once its deadline (from when the headers arrived) has
/// passed: a handler reading it gets an error, however the bytes trickle. Nothing is
/// read until a handler reads it, so a refused request (401 at the gate) never is.
struct DeadlineBody {
    inner: axum::body::Body,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl http_body::Body for DeadlineBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self.deadline.as_mut().poll(cx).is_ready() {
            return std::task::Poll::Ready(Some(Err(axum::Error::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "request body not sent in time",
            )))));
        }
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

async fn body_deadline(
    axum::extract::State(limit): axum::extract::State<Duration>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let req = req.map(|inner| {
        axum::body::Body::new(DeadlineBody {
            inner,
            deadline: Box::pin(tokio::time::sleep(limit)),
        })
    });
    next.run(req).await
}

/// A connection whose writes fail once the peer has not taken a byte for `limit`.
struct StallGuard<S> {
    inner: S,
    limit: Duration,
    stalled_since: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S> StallGuard<S> {
    /// `r` as the write side saw it: progress resets the clock; a wait starts it and,
    /// once it has run `limit`, fails the write.
    fn settle<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        if r.is_ready() {
            self.stalled_since = None;
            return r;
        }
        let limit = self.limit;
        let sleep = self
            .stalled_since
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the peer stopped reading",
            ))),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for StallGuard<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for StallGuard<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        self.settle(cx, r)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_flush(cx);
        self.settle(cx, r)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serves `app` on `listener` until `stop` resolves, then waits for open requests to
/// finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    stop: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let app = app.layer(axum::middleware::from_fn_with_state(
        limits.body_timeout,
        body_deadline,
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
        let io = StallGuard {
            inner: stream,
            limit: limits.write_stall,
            stalled_since: None,
        };
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(io), svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    // New connections are refused from here on (not left in the backlog unserved).
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "connections still open {} s after the stop; closing",
            SHUTDOWN_GRACE.as_secs()
        );
    }
    Ok(())
}

/// A listener for our own processes: the cluster token on every path but the open ones
/// ([`crate::routes::internal`]), under [`Limits::INTERNAL`]. Every internal listener
/// of every part starts through it, so none can be started without the gate or with
/// other bounds.
#[must_use]
pub struct InternalServer {
    listener: tokio::net::TcpListener,
    app: Router,
    open: bool,
}

impl std::fmt::Debug for InternalServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InternalServer")
            .field("listener", &self.listener.local_addr().ok())
            .finish_non_exhaustive()
    }
}

impl InternalServer {
    /// `routes` behind `token` (without one, the listener answers anyone).
    pub fn new(
        listener: tokio::net::TcpListener,
        routes: Router,
        token: Option<Arc<crate::ClusterToken>>,
    ) -> Self {
        InternalServer {
            listener,
            open: token.is_none(),
            app: crate::routes::internal(routes, token),
        }
    }

    /// Says once, naming `what` it serves (e.g. "the agent's API"), when the listener
    /// answers anyone for want of a token.
    pub fn warn_if_open(self, what: &str) -> Self {
        if self.open {
            tracing::warn!(
                addr = ?self.listener.local_addr().ok(),
                "no cluster token: {what} answers anyone who reaches it (give --cluster-token-file)"
            );
        }
        self
    }

    /// Serves until `stop` resolves (then lets requests in flight finish).
    pub async fn serve(self, stop: impl Future<Output = ()> + Send) -> std::io::Result<()> {
        serve(self.listener, self.app, Limits::INTERNAL, stop).await
    }
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
            write_stall: Duration::from_millis(300),
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
        // A body that trickles (a byte every 100 ms, never idle for the deadline):
        // refused at the deadline, not waited on forever.
        let mut slow_body = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow_body
            .write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
            .await
            .unwrap();
        let (mut rd, mut wr) = slow_body.into_split();
        tokio::spawn(async move {
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if wr.write_all(b"x").await.is_err() {
                    break;
                }
            }
        });
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
        let mut answer = vec![0u8; 64];
        let t0 = std::time::Instant::now();
        let n = tokio::time::timeout(Duration::from_secs(3), rd.read(&mut answer))
            .await
            .expect("the trickled body was waited on past its deadline")
            .unwrap_or(0);
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 4"), "{answer}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
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

    #[tokio::test]
    async fn a_peer_that_stops_reading_is_cut_off_and_frees_its_slot() {
        use futures_util::StreamExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        // An endless stream, as a long completion is to a client that stopped reading.
        let app = Router::new().route(
            "/",
            axum::routing::get(|| async {
                let chunk = axum::body::Bytes::from(vec![b'x'; 64 << 10]);
                let s = futures_util::stream::repeat(chunk).map(Ok::<_, std::io::Error>);
                axum::body::Body::from_stream(s)
            }),
        );
        let limits = Limits {
            max_connections: 1,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(5),
            write_stall: Duration::from_millis(300),
        };
        tokio::spawn(serve(l, app, limits, std::future::pending()));
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        // Never read: once the socket buffers are full the server gives up on it and
        // the one slot serves the next peer.
        let t0 = std::time::Instant::now();
        loop {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let mut b = [0u8; 16];
            if matches!(
                tokio::time::timeout(Duration::from_millis(500), s.read(&mut b)).await,
                Ok(Ok(n)) if n > 0
            ) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the stalled reader kept its slot"
            );
        }
        drop(idle);
    }
}
