//! KV transports: how a decode worker gets a prompt's K/V from a prefill worker. The
//! TCP transport is one connection per transfer carrying a small request frame one
//! way and the KV message ([`crate::kv::transfer`]) back in large writes; an RDMA or
//! NVLink fabric would implement [`KvTransport`] the same way.
//!
//! Frames: decode → prefill `u32 LE length | PrefillBody JSON`; prefill → decode
//! `b'K' | KV message` or `b'E' | u32 LE length | WireError JSON`.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::protocol::{PrefillBody, WireError};
use crate::EngineError;
use crate::engine::{Engine, GenerateRequest};
use crate::kv::transfer::KvMessage;

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

/// Pulls one sequence's K/V from a prefill endpoint.
pub trait KvTransport: Send + Sync {
    fn pull<'a>(
        &'a self,
        endpoint: &'a str,
        req: &'a PrefillBody,
        engine: &'a Engine,
    ) -> Pin<Box<dyn Future<Output = Result<KvMessage, String>> + Send + 'a>>;
}

/// One TCP connection per transfer.
#[derive(Clone, Copy, Debug)]
pub struct TcpTransport {
    pub timeout: Duration,
}

impl KvTransport for TcpTransport {
    fn pull<'a>(
        &'a self,
        endpoint: &'a str,
        req: &'a PrefillBody,
        engine: &'a Engine,
    ) -> Pin<Box<dyn Future<Output = Result<KvMessage, String>> + Send + 'a>> {
        Box::pin(async move {
            let addr = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
            let work = async {
                let mut s = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|e| format!("connect {addr}: {e}"))?;
                s.set_nodelay(true).map_err(|e| e.to_string())?;
                let body = serde_json::to_vec(req).map_err(|e| e.to_string())?;
                let mut frame = Vec::with_capacity(4 + body.len());
                frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
                frame.extend_from_slice(&body);
                s.write_all(&frame).await.map_err(|e| e.to_string())?;
                let kind = s.read_u8().await.map_err(|e| format!("no answer: {e}"))?;
                match kind {
                    // Bounded by the reservation the request holds (its prompt's
                    // blocks), checked from the header before any payload is read.
                    b'K' => KvMessage::read_into(
                        &mut s,
                        engine.compat(),
                        &engine.kv_layout(),
                        engine.kv_payload_for(
                            req.prompt.len().div_ceil(engine.kv_layout().block_size),
                        ),
                        engine.kv_buffers().take(),
                    )
                    .await
                    .map_err(|e| e.to_string()),
                    b'E' => {
                        let n = s.read_u32_le().await.map_err(|e| e.to_string())? as usize;
                        if n > MAX_REQUEST {
                            return Err("oversized error frame".to_owned());
                        }
                        let mut b = vec![0u8; n];
                        s.read_exact(&mut b).await.map_err(|e| e.to_string())?;
                        let w: WireError = serde_json::from_slice(&b).map_err(|e| e.to_string())?;
                        Err(w.message)
                    }
                    other => Err(format!("unknown frame {other:#x}")),
                }
            };
            tokio::time::timeout(self.timeout, work)
                .await
                .map_err(|_| format!("no K/V within {} s", self.timeout.as_secs()))?
        })
    }
}

async fn answer(engine: &OnceLock<Engine>, mut s: tokio::net::TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let read = async {
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
        .map_err(|_| std::io::Error::other("no whole request frame within 10 s"))??;
    let result = async {
        let req: PrefillBody =
            serde_json::from_slice(&b).map_err(|e| EngineError::invalid(e.to_string(), "body"))?;
        req.params.check()?;
        let e = engine
            .get()
            .ok_or_else(|| EngineError::Unavailable("the model is still loading".into()))?;
        e.prefill_message(
            GenerateRequest {
                prompt: req.prompt,
                params: req.params,
            },
            &req.request_id,
        )
        .await
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
pub async fn serve_tcp(listener: tokio::net::TcpListener, engine: Arc<OnceLock<Engine>>) {
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
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = answer(&engine, s).await {
                tracing::warn!(%peer, error = %e, "KV transfer to a decode worker failed");
            }
        });
    }
}
