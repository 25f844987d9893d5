//! Pulling a prompt's K/V over HTTP from a prefill worker (the TCP transport is in
//! [`crate::disagg::transport`]), and taking it only for the request it was asked for.

use futures_util::StreamExt;
use preheat_edge::WithClusterToken;

use super::WorkerState;
use crate::disagg::protocol::{GenerateBody, PrefillBody, WireError};
use crate::disagg::transport::PullError;
use crate::engine::Engine;
use crate::kv::transfer::KvMessage;

/// Pulls one KV message from a prefill worker, never buffering more than the
/// largest message this engine could accept.
pub(super) async fn fetch_kv(
    st: &WorkerState,
    e: &Engine,
    url: &str,
    b: &GenerateBody,
) -> std::result::Result<KvMessage, PullError> {
    let resp = st
        .client
        .post(format!("{url}/internal/prefill"))
        .cluster_token(st.token.as_deref())
        .json(&PrefillBody {
            request_id: b.request_id.clone(),
            prompt: b.prompt.clone(),
            params: b.params.clone(),
        })
        .timeout(st.transfer_timeout)
        .send()
        .await
        .map_err(|err| PullError::Http(err.to_string()))?;
    let status = resp.status();
    if !status.is_success() {
        let w: Option<WireError> = resp.json().await.ok();
        return Err(PullError::Status {
            status: status.as_u16(),
            message: w.map_or_else(String::new, |w| w.message),
        });
    }
    // Bounded by the reservation the request holds (its prompt's blocks), not the
    // whole cache.
    let max_payload = e.kv_payload_for(b.prompt.len().div_ceil(e.kv_layout().block_size));
    let cap = max_payload as usize + crate::kv::transfer::MAX_HEADER + 8;
    let announced = resp.content_length().unwrap_or(0) as usize;
    if announced > cap {
        return Err(PullError::Protocol(format!(
            "the K/V message ({announced} bytes) is larger than this request's reservation allows ({cap})"
        )));
    }
    // Sized once from Content-Length: no regrowth copies of a large payload.
    let mut buf = Vec::with_capacity(announced);
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|err| PullError::Http(format!("transfer broke off: {err}")))?;
        if buf.len() + chunk.len() > cap {
            return Err(PullError::Protocol(format!(
                "the K/V message is larger than this request's reservation allows ({cap} bytes)"
            )));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(KvMessage::from_vec(
        buf,
        e.compat(),
        &e.kv_layout(),
        max_payload,
    )?)
}

/// Takes a pulled K/V message only for the request it was asked for: the same
/// request id, prompt and sampling parameters (the sender's are what decoding then
/// uses). Block hashes, which key the prefix cache other requests share, are computed
/// here from the prompt, never taken from the wire.
pub(super) fn check_matches(
    msg: &mut KvMessage,
    b: &GenerateBody,
    block_size: usize,
    key: crate::kv::PrefixKey,
) -> Result<(), PullError> {
    let h = &msg.header;
    if h.request_id != b.request_id {
        return Err(PullError::Mismatch(format!(
            "K/V for request {:?}, asked for {:?}",
            h.request_id, b.request_id
        )));
    }
    if h.prompt != b.prompt {
        return Err(PullError::Mismatch("K/V for another prompt".into()));
    }
    if h.params != b.params {
        return Err(PullError::Mismatch(
            "K/V carries other sampling parameters than the request's".into(),
        ));
    }
    msg.header.block_hashes = key.block_hashes(&b.prompt, block_size);
    Ok(())
}
