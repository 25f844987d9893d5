//! Connections to the gRPC endpoint, capped: KEDA holds a few long-lived connections
//! (one per operator replica), so a peer that opens thousands is refused at accept
//! instead of holding a task and buffers each.

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

/// An accepted connection holding one of the listener's slots until it closes.
#[derive(Debug)]
pub struct Slotted {
    inner: TcpStream,
    _slot: OwnedSemaphorePermit,
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
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
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
