//! The second [`KvTransport`]: the K/V message as the body of a prefill worker's
//! `POST /internal/prefill` answer (a deployment without a KV port; never with a
//! cluster token, which an HTTP request would carry in the clear to whatever address
//! it names). [`prefill_answer`] is its prefill side.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Bytes;
use futures_util::Stream;
use preheat_edge::{ClusterToken, WithClusterToken};
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

use super::kv_message::{KvMessage, MAX_HEADER};
use super::kv_transport::{KvTransport, PullError, max_payload};
use super::messages::{PrefillBody, WireError, read_capped};

/// Most bytes read of an error answer.
const MAX_ERROR_BYTES: usize = 64 << 10;
use crate::engine::{Engine, ExportedSequence};
use crate::{EngineError, Result};

/// Pulls over HTTP, never buffering more than the largest message the request's
/// reservation could take.
#[derive(Clone, Debug)]
pub struct HttpPull {
    pub client: reqwest::Client,
    pub timeout: Duration,
    /// Sent with the request, as on every internal call.
    pub token: Option<Arc<ClusterToken>>,
}

impl KvTransport for HttpPull {
    fn pull<'a>(
        &'a self,
        endpoint: &'a str,
        req: &'a PrefillBody,
        engine: &'a Engine,
    ) -> Pin<Box<dyn Future<Output = std::result::Result<ExportedSequence, PullError>> + Send + 'a>>
    {
        Box::pin(self.fetch(endpoint, req, engine))
    }
}

impl HttpPull {
    async fn fetch(
        &self,
        url: &str,
        req: &PrefillBody,
        e: &Engine,
    ) -> std::result::Result<ExportedSequence, PullError> {
        let resp = self
            .client
            .post(format!("{url}/internal/prefill"))
            .cluster_token(self.token.as_deref())
            .json(req)
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|err| PullError::Http(err.to_string()))?;
        let status = resp.status();
        if !status.is_success() {
            let w: Option<WireError> = read_capped(resp, MAX_ERROR_BYTES)
                .await
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            return Err(PullError::Status {
                status: status.as_u16(),
                message: w.map_or_else(String::new, |w| w.message),
            });
        }
        // Bounded by the reservation the request holds (its prompt's blocks), not the
        // whole cache.
        let max_payload = max_payload(e, req);
        let cap = max_payload as usize + MAX_HEADER + 8;
        let announced = resp.content_length().unwrap_or(0) as usize;
        if announced > cap {
            return Err(PullError::Protocol(format!(
                "the K/V message ({announced} bytes) is larger than this request's reservation allows ({cap})"
            )));
        }
        // Read as the KV port's stream is: the header checked before any payload is
        // taken, the payload straight into a receive buffer, hashed as it lands.
        let mut body = BodyReader {
            body: Box::pin(resp.bytes_stream()),
            chunk: Bytes::new(),
        };
        let m = KvMessage::read_into(
            &mut body,
            e.compat(),
            &e.kv_layout(),
            max_payload,
            e.kv_buffers().take(),
        )
        .await?;
        if body.read(&mut [0u8; 1]).await? != 0 {
            return Err(PullError::Protocol(format!(
                "the K/V message is larger than this request's reservation allows ({cap} bytes)"
            )));
        }
        Ok(m.into_sequence())
    }
}

/// An HTTP body as a byte stream to read from: each chunk copied once, into the
/// reader's buffer.
struct BodyReader {
    body: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    /// What is left of the chunk last received.
    chunk: Bytes,
}

impl AsyncRead for BodyReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        while self.chunk.is_empty() {
            match ready!(self.body.as_mut().poll_next(cx)) {
                Some(Ok(c)) => self.chunk = c,
                Some(Err(e)) => {
                    return Poll::Ready(Err(std::io::Error::other(format!(
                        "transfer broke off: {e}"
                    ))));
                }
                // The end of the body.
                None => return Poll::Ready(Ok(())),
            }
        }
        let n = self.chunk.len().min(buf.remaining());
        buf.put_slice(&self.chunk[..n]);
        self.chunk = self.chunk.slice(n..);
        Poll::Ready(Ok(()))
    }
}

/// The prefill side: computes `req`'s K/V and first token on `e`, and answers with
/// the K/V message as the body.
pub async fn prefill_answer(e: &Engine, req: PrefillBody) -> Result<Vec<u8>> {
    let m = super::kv_transport::prefilled(e, req).await?;
    let mut buf = Vec::with_capacity(m.payload.len() + 4096);
    m.write_to(&mut buf)
        .await
        .map_err(|err| EngineError::Internal(err.to_string()))?;
    Ok(buf)
}
