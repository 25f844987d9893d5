//! Connections to the gRPC endpoint, capped: KEDA holds a few long-lived connections
//! (one per operator replica), so a peer that opens thousands is refused at accept
//! instead of holding a task and buffers each; and one that sends nothing (no TLS
//! hello, no HTTP/2 preface) is closed at a deadline instead of holding its slot.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Most connections open to the gRPC endpoint at once.
pub const MAX_CONNECTIONS: usize = 256;
/// Longest a new connection may stay silent before its first byte.
pub const FIRST_BYTE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// An accepted connection holding one of the listener's slots until it closes.
#[derive(Debug)]
pub struct Slotted {
    inner: TcpStream,
    _slot: OwnedSemaphorePermit,
    /// Until the peer's first byte arrives: past it, reads fail and the connection ends.
    silent_until: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// Accepted connections of `listener`, at most `max` open at once: one past the cap is
/// closed as it is accepted (logged once per burst).
pub fn capped(listener: TcpListener, max: usize) -> impl Stream<Item = std::io::Result<Slotted>> {
    let slots = Arc::new(Semaphore::new(max));
    futures_util::stream::unfold(
        (listener, slots, false),
        move |(listener, slots, mut refused_logged)| async move {
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: pause rather than spin.
                        tracing::warn!(error = %e, "gRPC accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    if !refused_logged {
                        tracing::warn!(%peer, max, "gRPC connection limit reached; closing new connections");
                        refused_logged = true;
                    }
                    continue;
                };
                refused_logged = false;
                let _ = stream.set_nodelay(true);
                let conn = Slotted {
                    inner: stream,
                    _slot: slot,
                    silent_until: Some(Box::pin(tokio::time::sleep(FIRST_BYTE_TIMEOUT))),
                };
                return Some((Ok(conn), (listener, slots, refused_logged)));
            }
        },
    )
}

impl Connected for Slotted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl AsyncRead for Slotted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.silent_until = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let expired = this
                    .silent_until
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the peer sent nothing before the first-byte deadline",
                    )));
                }
                Poll::Pending
            }
            other => other,
        }
    }
}

impl AsyncWrite for Slotted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
