//! How a decode worker gets a prompt's K/V from a prefill worker: a [`KvTransport`]
//! pulls one K/V message ([`super::kv_message`]) and hands back the sequence it
//! carries, checked (compatibility, sizes, digest); [`check_matches`] then takes it
//! only for the request it was asked for. Two transports: the KV port
//! ([`super::tcp::TcpTransport`]) and the worker's HTTP endpoint
//! ([`super::http_pull::HttpPull`]); an RDMA or NVLink fabric would be a third.

use std::future::Future;
use std::pin::Pin;

use super::kv_message::{KvMessage, TransferError};
use super::messages::PrefillBody;
use crate::engine::{Engine, ExportedSequence, GenerateRequest};
use crate::kv::PrefixKey;

/// Why a pull brought no K/V. Every case is a prefill failure to the gateway, which
/// then prefills elsewhere; the kinds are kept apart for logs and tests.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("connect {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("no handshake answer (is the peer a prefill worker of this deployment?): {0}")]
    NoHandshake(std::io::Error),
    #[error("the peer could not prove it holds the cluster token")]
    Unauthenticated,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The prefill worker answered with an error (its message).
    #[error("{0}")]
    Refused(String),
    /// The peer broke the framing.
    #[error("{0}")]
    Protocol(String),
    #[error("{0}")]
    Message(#[from] TransferError),
    #[error("no K/V within {0} s")]
    Timeout(u64),
    /// The HTTP path: the request or the body's stream failed.
    #[error("{0}")]
    Http(String),
    /// The HTTP path: the prefill worker answered with an error status.
    #[error("HTTP {status}: {message}")]
    Status { status: u16, message: String },
    /// The K/V came for another request, prompt or sampling parameters.
    #[error("{0}")]
    Mismatch(String),
}

/// Pulls one sequence's K/V from a prefill endpoint, checked against `engine` (its
/// compatibility hash and layout, and the blocks `req`'s prompt needs at most).
pub trait KvTransport: Send + Sync {
    fn pull<'a>(
        &'a self,
        endpoint: &'a str,
        req: &'a PrefillBody,
        engine: &'a Engine,
    ) -> Pin<Box<dyn Future<Output = Result<ExportedSequence, PullError>> + Send + 'a>>;
}

/// Payload bytes a pull for `req` may bring into `engine`: the blocks its prompt
/// needs (what the decode worker reserved), not the whole cache.
#[must_use]
pub fn max_payload(engine: &Engine, req: &PrefillBody) -> u64 {
    engine.kv_payload_for(req.prompt.len().div_ceil(engine.kv_layout().block_size))
}

/// Takes a pulled sequence only for the request it was asked for: the same request
/// id, prompt and sampling parameters (the sender's are what decoding then uses).
/// Block hashes, which key the prefix cache other requests share, are computed here
/// from the prompt, never taken from the wire.
pub fn check_matches(
    seq: &mut ExportedSequence,
    req: &PrefillBody,
    block_size: usize,
    key: PrefixKey,
) -> Result<(), PullError> {
    if seq.request_id != req.request_id {
        return Err(PullError::Mismatch(format!(
            "K/V for request {:?}, asked for {:?}",
            seq.request_id, req.request_id
        )));
    }
    if seq.prompt != req.prompt {
        return Err(PullError::Mismatch("K/V for another prompt".into()));
    }
    if seq.params != req.params {
        return Err(PullError::Mismatch(
            "K/V carries other sampling parameters than the request's".into(),
        ));
    }
    seq.block_hashes = key.block_hashes(&req.prompt, block_size);
    Ok(())
}

/// The prefill side of either transport: `req`'s prompt prefilled by `e`, as the K/V
/// message that carries it.
pub(crate) async fn prefilled(e: &Engine, req: PrefillBody) -> crate::Result<KvMessage> {
    let seq = e
        .prefill_sequence(
            GenerateRequest {
                prompt: req.prompt,
                params: req.params,
            },
            &req.request_id,
        )
        .await?;
    Ok(KvMessage::of_sequence(seq, e.compat()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::payload::PayloadShape;
    use crate::sampling::SamplingParams;

    fn seq(request_id: &str, prompt: Vec<u32>, params: SamplingParams) -> ExportedSequence {
        ExportedSequence {
            request_id: request_id.into(),
            compat: String::new(),
            // Forged: hashes that would file this K/V under another prefix.
            block_hashes: vec![42; prompt.len() / 4],
            prompt,
            first_token: 1,
            first_logprob: None,
            first_top_logprobs: Vec::new(),
            params,
            rng_state: 0,
            shape: PayloadShape {
                num_layers: 1,
                num_blocks: 1,
                block_bytes: 1,
            },
            payload: Vec::new(),
        }
    }

    #[test]
    fn kv_is_taken_only_for_its_request_and_hashed_here() {
        let params = SamplingParams::default();
        let req = PrefillBody {
            request_id: "r1".into(),
            prompt: (1..=8).collect(),
            params: params.clone(),
        };
        let other_params = SamplingParams {
            temperature: 0.0,
            ..params.clone()
        };
        for (why, mut s) in [
            (
                "another request",
                seq("r2", req.prompt.clone(), params.clone()),
            ),
            (
                "another prompt",
                seq("r1", (2..=9).collect(), params.clone()),
            ),
            (
                "other parameters",
                seq("r1", req.prompt.clone(), other_params),
            ),
        ] {
            assert!(
                check_matches(&mut s, &req, 4, PrefixKey::UNKEYED).is_err(),
                "{why} accepted"
            );
        }
        let mut s = seq("r1", req.prompt.clone(), params);
        check_matches(&mut s, &req, 4, PrefixKey::UNKEYED).unwrap();
        assert_eq!(
            s.block_hashes,
            PrefixKey::UNKEYED.block_hashes(&req.prompt, 4),
            "the wire's block hashes were kept"
        );
    }
}
