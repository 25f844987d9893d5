//! The JSON bodies between the gateway and the workers (HTTP requests and answers, and
//! the lines of a decode worker's NDJSON stream), and the error body every internal
//! endpoint and the KV port answer with.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use crate::EngineError;
use crate::engine::{Event, FinishReason, TokenOut, Usage};
use crate::sampling::SamplingParams;
use crate::tokenizer::TokenizerParts;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    Prefill,
    Decode,
}

impl WorkerRole {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    pub id: String,
    pub role: WorkerRole,
    /// Base URL the gateway and other workers reach this worker at.
    pub url: String,
    pub model: String,
    pub compat: String,
    /// Prefill workers: `tcp://host:port` of their KV transport, if they serve one.
    #[serde(default)]
    pub kv: Option<String>,
    /// The KV transfer format version the worker speaks ([`FORMAT_VERSION`]); absent
    /// (0) from workers older than version 3.
    ///
    /// [`FORMAT_VERSION`]: crate::kv::payload::FORMAT_VERSION
    #[serde(default)]
    pub kv_format: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Load {
    pub running: f64,
    pub waiting: f64,
    pub kv_usage: f64,
    /// KV blocks the worker holds in all (0: not reported). Lets a router count the
    /// blocks its own requests reserve between two reports as usage.
    #[serde(default)]
    pub kv_blocks: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub id: String,
    pub load: Load,
    /// Prefill workers: block hashes in their prefix cache (bounded).
    #[serde(default)]
    pub blocks: Vec<u64>,
}

/// A worker's role, KV address and load (`GET /internal/load`): what heartbeats carry,
/// read by a gateway that discovers its workers instead of being told by them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub role: WorkerRole,
    /// Prefill workers: `tcp://host:port` of their KV transport, if they serve one.
    #[serde(default)]
    pub kv: Option<String>,
    pub load: Load,
    /// Prefill workers: block hashes in their prefix cache (bounded).
    #[serde(default)]
    pub blocks: Vec<u64>,
}

/// What the gateway needs to front a worker's model (`GET /internal/model`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub model: String,
    pub compat: String,
    pub block_size: usize,
    pub max_model_len: usize,
    pub vocab_size: usize,
    pub tokenizer: TokenizerParts,
}

/// `POST /internal/prefill` on a prefill worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PrefillBody {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// `POST /internal/generate` on a decode worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GenerateBody {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Prefill worker to pull the K/V from (`tcp://…` for the TCP transport, else its
    /// HTTP base URL); `None`: prefill here.
    pub prefill: Option<String>,
}

/// Error body of the internal endpoints.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireError {
    /// `invalid`, `overloaded`, `unavailable`, `internal`.
    pub class: String,
    pub message: String,
    /// The prefill worker failed before the first token: another one may succeed.
    #[serde(default)]
    pub prefill_failed: bool,
    /// The decode worker was not told it may pull from the named prefill worker (it
    /// restarted, or an announcement is still on its way): announce again, and the
    /// prefill worker itself is not at fault.
    #[serde(default)]
    pub unannounced: bool,
    /// The request can never run on this decode worker (its prompt and `max_tokens`
    /// exceed what the worker's cache holds): one with a larger cache may take it.
    #[serde(default)]
    pub too_large: bool,
}

impl WireError {
    #[must_use]
    pub fn from_engine(e: &EngineError, prefill_failed: bool) -> Self {
        let class = match e {
            EngineError::InvalidRequest { .. } | EngineError::UnknownModel { .. } => "invalid",
            EngineError::Overloaded { .. } => "overloaded",
            EngineError::Unavailable(_) | EngineError::NoWorkers { .. } => "unavailable",
            _ => "internal",
        };
        WireError {
            class: class.into(),
            message: e.to_string(),
            prefill_failed,
            unannounced: false,
            too_large: false,
        }
    }

    /// The HTTP status an internal endpoint answers this error with (what a
    /// [`Refusal`] is read from on the gateway's side).
    ///
    /// [`Refusal`]: super::decode_client::Refusal
    #[must_use]
    pub fn status(&self) -> StatusCode {
        if self.prefill_failed {
            return StatusCode::BAD_GATEWAY;
        }
        match self.class.as_str() {
            "invalid" => StatusCode::BAD_REQUEST,
            "overloaded" => StatusCode::TOO_MANY_REQUESTS,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    #[must_use]
    pub fn into_engine(self) -> EngineError {
        match self.class.as_str() {
            "invalid" => EngineError::InvalidRequest {
                message: self.message,
                param: None,
            },
            "overloaded" => EngineError::Overloaded {
                retry_after_secs: 1,
            },
            "unavailable" => EngineError::Unavailable(self.message),
            _ => EngineError::Internal(self.message),
        }
    }
}

impl IntoResponse for WireError {
    fn into_response(self) -> Response {
        (self.status(), Json(self)).into_response()
    }
}

/// A token on the wire: id, logprob, top alternatives.
pub type WireToken = (u32, Option<f32>, Vec<(u32, f32)>);

/// One line of a decode worker's NDJSON stream.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum WireEvent {
    Delta {
        tokens: Vec<WireToken>,
        text: String,
    },
    Finished {
        reason: String,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Error(WireError),
}

impl WireEvent {
    /// `None` for events that do not cross the wire (K/V goes its own way).
    #[must_use]
    pub fn from_event(e: Event) -> Option<Self> {
        Some(match e {
            Event::Delta { tokens, text } => WireEvent::Delta {
                tokens: tokens
                    .into_iter()
                    .map(|t| (t.id, t.logprob, t.top))
                    .collect(),
                text,
            },
            Event::Finished { reason, usage } => WireEvent::Finished {
                reason: reason.as_str().into(),
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_tokens: usage.cached_tokens,
            },
            Event::Error(e) => WireEvent::Error(WireError::from_engine(&e, false)),
            // Neither crosses the wire: K/V has its own transfer, and only a gateway
            // replays.
            Event::KvReady(_) | Event::Replayed(_) => return None,
        })
    }

    /// The event as one NDJSON line.
    #[must_use]
    pub fn to_line(&self) -> Vec<u8> {
        let mut line = serde_json::to_vec(self).unwrap_or_default();
        line.push(b'\n');
        line
    }

    #[must_use]
    pub fn into_event(self) -> Event {
        match self {
            WireEvent::Delta { tokens, text } => Event::Delta {
                tokens: tokens
                    .into_iter()
                    .map(|(id, logprob, top)| TokenOut { id, logprob, top })
                    .collect(),
                text,
            },
            WireEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => Event::Finished {
                reason: match reason.as_str() {
                    "stop" => FinishReason::Stop,
                    "length" => FinishReason::Length,
                    _ => FinishReason::Abort,
                },
                usage: Usage {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                },
            },
            WireEvent::Error(w) => Event::Error(w.into_engine()),
        }
    }
}

/// A response body of at most `cap` bytes, refused (not truncated) beyond: a peer
/// cannot make its reader buffer more.
pub(crate) async fn read_capped(
    r: reqwest::Response,
    cap: usize,
) -> std::result::Result<Vec<u8>, String> {
    if r.content_length().is_some_and(|n| n > cap as u64) {
        return Err(format!("body larger than {cap} bytes"));
    }
    let mut body = Vec::new();
    let mut stream = r.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if body.len() + chunk.len() > cap {
            return Err(format!("body larger than {cap} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
