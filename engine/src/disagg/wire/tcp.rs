//! The KV port: a [`KvTransport`] of one TCP connection per transfer, carrying a small
//! request frame one way and the K/V message ([`super::kv_message`]) back in large
//! writes; [`serve_tcp`] is its prefill side.
//!
//! Frames: decode → prefill `u32 LE length | PrefillBody JSON`; prefill → decode
//! `b'K' | KV message` or `b'E' | u32 LE length | WireError JSON`.
//!
//! With a cluster token, a mutual challenge-response comes first, so that neither
//! side reads, allocates or sends anything of substance for a peer without the token,
//! and the token itself never crosses the wire: decode → `b"PHK1" | nonce_d[16]`;
//! prefill → `nonce_p[16] | HMAC(token, "kv-server", nonce_d, nonce_p)`; decode checks
//! it, then → `HMAC(token, "kv-client", nonce_p, nonce_d)` and the request frame,
//! which prefill reads only once that proof checks out.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use preheat_edge::ClusterToken;
use preheat_edge::token::nonce;

use super::kv_message::KvMessage;
use super::kv_transport::{KvTransport, PullError, max_payload, prefilled};
use super::messages::{PrefillBody, WireError};
use crate::EngineError;
use crate::engine::{Engine, ExportedSequence};

/// Largest request frame: a prompt's token ids and bounded sampling parameters as
/// JSON (a 128k-token prompt is under 1 MiB).
const MAX_REQUEST: usize = 8 << 20;
/// A peer has this long to send its whole request frame (a stalled or slow-loris
/// peer holds a connection slot no longer).
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A peer has this long to take the K/V (held in memory until it does).
const ANSWER_WRITE_TIMEOUT: Duration = Duration::from_secs(120);
/// Transfers served at once; further connections are closed at once (the decode
/// worker then prefills elsewhere or itself).
pub const MAX_KV_CONNECTIONS: usize = 64;

/// First bytes of an authenticated transfer.
const HELLO: &[u8; 4] = b"PHK1";

/// One TCP connection per transfer.
#[derive(Clone, Debug)]
pub struct TcpTransport {
    pub timeout: Duration,
    /// The deployment's cluster token: the prefill side must prove it holds it before
    /// anything is sent, and this side proves it in turn.
    pub token: Option<Arc<ClusterToken>>,
}

/// The receive buffer a decode worker asks for on a KV-port connection.
const RECEIVE_BUFFER: u64 = 4 << 20;

/// Opens a connection to a KV port as a decode worker does: no Nagle delay, and a
/// receive buffer of 4 MiB where the host allows at least 1 MiB (`net.core.rmem_max`,
/// up to which it is granted). Left to itself the kernel sizes the buffer from how
/// fast the reader drained it so far, and a reader that stops to check a header
/// before the payload flows got a buffer that held the whole transfer to about half
/// the rate of the same bytes read without that pause (`bench kv`). A fixed size turns
/// that tuning off, hence none where only a small one would be granted.
pub async fn connect(
    addr: impl tokio::net::ToSocketAddrs,
) -> std::io::Result<tokio::net::TcpStream> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let sock = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        if let Some(size) = receive_buffer() {
            sock.set_recv_buffer_size(size)?;
        }
        match sock.connect(a).await {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolves to none",
        )
    }))
}

/// [`RECEIVE_BUFFER`], or as much of it as the host grants, where that is 1 MiB or
/// more.
fn receive_buffer() -> Option<u32> {
    static SIZE: OnceLock<Option<u32>> = OnceLock::new();
    *SIZE.get_or_init(|| {
        let max: u64 = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .ok()?
            .trim()
            .parse()
            .ok()?;
        (max >= 1 << 20).then(|| u32::try_from(max.min(RECEIVE_BUFFER)).unwrap_or(u32::MAX))
    })
}

/// Decode side of the handshake: true once the peer proved it holds the token.
async fn authenticate_peer(
    s: &mut tokio::net::TcpStream,
    token: &ClusterToken,
) -> Result<(), PullError> {
    let mine = nonce();
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&mine);
    s.write_all(&hello).await?;
    let mut answer = [0u8; 48];
    s.read_exact(&mut answer)
        .await
        .map_err(PullError::NoHandshake)?;
    let (theirs, proof) = answer.split_at(16);
    if !token.verify("kv-server", &[&mine, theirs], proof) {
        return Err(PullError::Unauthenticated);
    }
    s.write_all(&token.prove("kv-client", &[theirs, &mine]))
        .await?;
    Ok(())
}

/// Prefill side of the handshake, before anything of the request is read.
async fn authenticate_client(
    s: &mut tokio::net::TcpStream,
    token: &ClusterToken,
) -> std::io::Result<()> {
    let mut hello = [0u8; 20];
    s.read_exact(&mut hello).await?;
    if &hello[..4] != HELLO {
        return Err(std::io::Error::other(
            "the peer did not authenticate (no cluster-token handshake)",
        ));
    }
    let theirs = &hello[4..];
    let mine = nonce();
    let mut answer = mine.to_vec();
    answer.extend_from_slice(&token.prove("kv-server", &[theirs, &mine]));
    s.write_all(&answer).await?;
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).await?;
    if token.verify("kv-client", &[&mine, theirs], &proof) {
        Ok(())
    } else {
        Err(std::io::Error::other(
            "the peer's cluster-token proof is wrong",
        ))
    }
}

impl KvTransport for TcpTransport {
    fn pull<'a>(
        &'a self,
        endpoint: &'a str,
        req: &'a PrefillBody,
        engine: &'a Engine,
    ) -> Pin<Box<dyn Future<Output = Result<ExportedSequence, PullError>> + Send + 'a>> {
        Box::pin(async move {
            let addr = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
            let work = async {
                let mut s = connect(addr).await.map_err(|source| PullError::Connect {
                    addr: addr.to_owned(),
                    source,
                })?;
                if let Some(t) = &self.token {
                    authenticate_peer(&mut s, t).await?;
                }
                let body =
                    serde_json::to_vec(req).map_err(|e| PullError::Protocol(e.to_string()))?;
                let mut frame = Vec::with_capacity(4 + body.len());
                frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
                frame.extend_from_slice(&body);
                s.write_all(&frame).await?;
                let kind = s
                    .read_u8()
                    .await
                    .map_err(|e| PullError::Protocol(format!("no answer: {e}")))?;
                match kind {
                    // Bounded by the reservation the request holds (its prompt's
                    // blocks), checked from the header before any payload is read.
                    b'K' => Ok(KvMessage::read_into(
                        &mut s,
                        engine.compat(),
                        &engine.kv_layout(),
                        max_payload(engine, req),
                        engine.kv_buffers().take(),
                    )
                    .await?
                    .into_sequence()),
                    b'E' => {
                        let n = s.read_u32_le().await? as usize;
                        if n > MAX_REQUEST {
                            return Err(PullError::Protocol("oversized error frame".to_owned()));
                        }
                        let mut b = vec![0u8; n];
                        s.read_exact(&mut b).await?;
                        let w: WireError = serde_json::from_slice(&b)
                            .map_err(|e| PullError::Protocol(e.to_string()))?;
                        Err(PullError::Refused(w.message))
                    }
                    other => Err(PullError::Protocol(format!("unknown frame {other:#x}"))),
                }
            };
            tokio::time::timeout(self.timeout, work)
                .await
                .map_err(|_| PullError::Timeout(self.timeout.as_secs()))?
        })
    }
}

async fn answer(
    engine: &OnceLock<Engine>,
    token: Option<&ClusterToken>,
    mut s: tokio::net::TcpStream,
) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let read = async {
        if let Some(t) = token {
            authenticate_client(&mut s, t).await?;
        }
        let n = s.read_u32_le().await? as usize;
        // Refused before anything of its size is allocated.
        if n > MAX_REQUEST {
            return Err(std::io::Error::other(format!(
                "oversized request frame ({n} bytes)"
            )));
        }
        let mut b = vec![0u8; n];
        s.read_exact(&mut b).await?;
        Ok(b)
    };
    let b = tokio::time::timeout(REQUEST_READ_TIMEOUT, read)
        .await
        .map_err(|_| std::io::Error::other("no handshake and request frame within 10 s"))??;
    let result = async {
        let req: PrefillBody =
            serde_json::from_slice(&b).map_err(|e| EngineError::invalid(e.to_string(), "body"))?;
        req.params.check()?;
        let e = engine
            .get()
            .ok_or_else(|| EngineError::Unavailable("the model is still loading".into()))?;
        prefilled(e, req).await
    }
    .await;
    match result {
        Ok(m) => {
            let write = async {
                s.write_u8(b'K').await?;
                m.write_to(&mut s).await.map_err(std::io::Error::other)
            };
            tokio::time::timeout(ANSWER_WRITE_TIMEOUT, write)
                .await
                .map_err(|_| std::io::Error::other("the peer did not take the K/V in time"))??;
        }
        Err(err) => {
            let body = serde_json::to_vec(&WireError::from_engine(&err, false))?;
            let mut frame = vec![b'E'];
            frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
            frame.extend_from_slice(&body);
            s.write_all(&frame).await?;
        }
    }
    s.shutdown().await
}

/// Prefill side: answers transfers on `listener` until the task is dropped.
pub async fn serve_tcp(
    listener: tokio::net::TcpListener,
    engine: Arc<OnceLock<Engine>>,
    token: Option<Arc<ClusterToken>>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_KV_CONNECTIONS));
    loop {
        let Ok((s, peer)) = listener.accept().await else {
            continue;
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!(%peer, "KV port at its connection limit; connection closed");
            drop(s);
            continue;
        };
        let engine = Arc::clone(&engine);
        let token = token.clone();
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = answer(&engine, token.as_deref(), s).await {
                tracing::warn!(%peer, error = %e, "KV transfer to a decode worker failed");
            }
        });
    }
}
