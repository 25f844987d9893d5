//! The gateway's side of `POST /internal/generate`: asks a decode worker to run a
//! request and gets either its stream of events (NDJSON lines, [`DecodeStream`]) or a
//! [`Refusal`] that says what went wrong before any event, read from what the worker
//! answered (its status and [`WireError`]) or from how the connection failed.

use std::pin::Pin;
use std::time::Duration;

use axum::http::StatusCode;
use futures_util::{Stream, StreamExt};
use preheat_edge::{ClusterToken, WithClusterToken};

use super::messages::{GenerateBody, WireError, WireEvent, read_capped};
use crate::EngineError;
use crate::engine::Event;

/// Longest line of a decode worker's event stream (a token with 20 top logprobs is
/// a few KiB): a peer cannot make the gateway buffer without end.
const MAX_EVENT_LINE: usize = 1 << 20;
/// Most bytes of a worker's error body.
const MAX_ERROR_BYTES: usize = 64 << 10;

/// Why a decode worker did not take a request: nothing of it reached the client.
#[derive(Debug)]
pub enum Refusal {
    /// No room now (429): its cache, its batch or its queue is full. Another worker
    /// may take it, or this one after a pause.
    Busy,
    /// Not taking work (503): draining for a scale-down, or still loading. The request
    /// has not started: another worker may take it.
    Unavailable(WireError),
    /// The request can never run there (400: its prompt and `max_tokens` exceed the
    /// worker's cache); one with a larger cache may take it.
    TooLarge(WireError),
    /// The prefill worker it named failed before the first token (502): another
    /// prefill worker, or a prefill on the decode worker itself, may succeed.
    PrefillFailed(WireError),
    /// The worker was not told it may pull from the prefill worker it was named (502;
    /// it restarted, or the announcement is on its way): announce again. The prefill
    /// worker is not at fault.
    Unannounced(WireError),
    /// Any other error answer (a bad request, an internal error): the client's too.
    Failed(WireError),
    /// No connection: nothing was sent.
    Unreachable(String),
    /// The connection failed with the request sent: the worker died with it in hand.
    Gone(String),
    /// No answer within the idle time. Headers come once the worker has the request in
    /// hand (its K/V pulled, or its own prefill queued), so a worker pulling from a
    /// backlogged prefill worker is silent as long as a dead one.
    Silent,
}

impl Refusal {
    /// What a worker's error answer means: read from its body, with the status
    /// deciding where the body does not.
    fn of_answer(status: StatusCode, w: WireError) -> Self {
        if w.too_large {
            Refusal::TooLarge(w)
        } else if w.prefill_failed {
            if w.unannounced {
                Refusal::Unannounced(w)
            } else {
                Refusal::PrefillFailed(w)
            }
        } else if status == StatusCode::SERVICE_UNAVAILABLE {
            Refusal::Unavailable(w)
        } else if status == StatusCode::TOO_MANY_REQUESTS {
            Refusal::Busy
        } else {
            Refusal::Failed(w)
        }
    }
}

/// Asks decode workers to generate.
#[derive(Clone, Copy, Debug)]
pub struct DecodeClient<'a> {
    pub http: &'a reqwest::Client,
    pub token: Option<&'a ClusterToken>,
    /// Longest silence: before the answer (see [`Refusal::Silent`]) and between two
    /// events of its stream.
    pub idle: Duration,
}

impl DecodeClient<'_> {
    /// Sends `body` to the decode worker at `url`: its events, or why there are none.
    pub async fn generate(&self, url: &str, body: &GenerateBody) -> Result<DecodeStream, Refusal> {
        let sent = self
            .http
            .post(format!("{url}/internal/generate"))
            .cluster_token(self.token)
            .json(body)
            .send();
        let resp = match tokio::time::timeout(self.idle, sent).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) if e.is_connect() => return Err(Refusal::Unreachable(e.to_string())),
            Ok(Err(e)) => return Err(Refusal::Gone(e.to_string())),
            Err(_) => return Err(Refusal::Silent),
        };
        let status = resp.status();
        if !status.is_success() {
            // Bounded in time as the headers were: a worker that stalls mid-answer
            // must not hold the request.
            let w = match tokio::time::timeout(self.idle, read_capped(resp, MAX_ERROR_BYTES)).await
            {
                Ok(Ok(b)) => serde_json::from_slice(&b).ok(),
                _ => None,
            }
            .unwrap_or(WireError {
                class: "internal".into(),
                message: format!("decode worker answered HTTP {status}"),
                prefill_failed: false,
                unannounced: false,
                too_large: false,
            });
            return Err(Refusal::of_answer(status, w));
        }
        Ok(DecodeStream {
            url: url.to_owned(),
            idle: self.idle,
            body: Box::pin(resp.bytes_stream()),
            buf: Vec::new(),
        })
    }
}

/// How a decode worker's stream broke before its last event.
#[derive(Debug)]
pub enum StreamFault {
    /// The worker went away: the stream broke, ended early or stalled (`why`, for
    /// the worker's removal).
    Lost {
        why: &'static str,
        error: EngineError,
    },
    /// An event line longer than any event.
    Oversized(EngineError),
    /// A line that is no event.
    Garbage(EngineError),
}

type Body = Pin<Box<dyn Stream<Item = reqwest::Result<axum::body::Bytes>> + Send>>;

/// A decode worker's events for one request.
pub struct DecodeStream {
    url: String,
    idle: Duration,
    body: Body,
    buf: Vec<u8>,
}

impl std::fmt::Debug for DecodeStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStream")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl DecodeStream {
    /// The next event. The stream's last is `Finished` or `Error`; reading past it
    /// finds the stream ended.
    pub async fn next(&mut self) -> Result<Event, StreamFault> {
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return match serde_json::from_slice::<WireEvent>(&line) {
                    Ok(w) => Ok(w.into_event()),
                    Err(e) => Err(StreamFault::Garbage(EngineError::Internal(format!(
                        "decode worker sent garbage: {e}"
                    )))),
                };
            }
            let lost = |why, what: String| StreamFault::Lost {
                why,
                error: EngineError::Unavailable(format!("decode worker {} {what}", self.url)),
            };
            let chunk = match tokio::time::timeout(self.idle, self.body.next()).await {
                Ok(Some(Ok(c))) => c,
                Ok(Some(Err(e))) => {
                    return Err(lost("stream broke", format!("failed mid-stream: {e}")));
                }
                Ok(None) => {
                    return Err(lost("stream ended early", "ended the stream early".into()));
                }
                Err(_) => return Err(lost("stream stalled", "stalled".into())),
            };
            self.buf.extend_from_slice(&chunk);
            if self.buf.len() > MAX_EVENT_LINE && !self.buf.contains(&b'\n') {
                return Err(StreamFault::Oversized(EngineError::Internal(format!(
                    "decode worker {} sent an event line over {MAX_EVENT_LINE} bytes",
                    self.url
                ))));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(class: &str) -> WireError {
        WireError {
            class: class.into(),
            message: "m".into(),
            prefill_failed: false,
            unannounced: false,
            too_large: false,
        }
    }

    /// Each refusal is read back from the answer the worker gives for it.
    #[test]
    fn a_workers_answers_read_back_as_their_refusals() {
        let answer = |w: WireError| Refusal::of_answer(w.status(), w);
        assert!(matches!(answer(error("overloaded")), Refusal::Busy));
        assert!(matches!(
            answer(error("unavailable")),
            Refusal::Unavailable(_)
        ));
        assert!(matches!(answer(error("invalid")), Refusal::Failed(_)));
        assert!(matches!(answer(error("internal")), Refusal::Failed(_)));
        let too_large = WireError {
            too_large: true,
            ..error("invalid")
        };
        assert!(matches!(answer(too_large), Refusal::TooLarge(_)));
        let prefill = WireError {
            prefill_failed: true,
            ..error("unavailable")
        };
        assert_eq!(prefill.status(), StatusCode::BAD_GATEWAY);
        assert!(matches!(answer(prefill.clone()), Refusal::PrefillFailed(_)));
        let unannounced = WireError {
            unannounced: true,
            ..prefill
        };
        assert!(matches!(answer(unannounced), Refusal::Unannounced(_)));
        // A body that is no error (a proxy's page): the status decides.
        let other = error("internal");
        assert!(matches!(
            Refusal::of_answer(StatusCode::TOO_MANY_REQUESTS, other),
            Refusal::Busy
        ));
    }
}
