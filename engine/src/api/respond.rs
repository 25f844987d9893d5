//! How a queued request is answered: whole or as server-sent events, with logprobs,
//! usage and the completions API's echo, in the OpenAI chat or completions shape.

use std::convert::Infallible;

use axum::Json;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{Value, json};

use super::error::ApiError;
use super::{Front, now, openai, request_id};
use crate::engine::{Event, FinishReason, GenerateRequest, RequestHandle, TokenOut, Usage};
use crate::frontend::Frontend;
use crate::{EngineError, Result};

/// How a response presents tokens.
#[derive(Clone, Copy, Debug)]
pub(super) struct Style {
    pub(super) chat: bool,
    pub(super) logprobs: bool,
    pub(super) token_ids: bool,
    pub(super) include_usage: bool,
}

impl Style {
    pub(super) fn new(chat: bool, logprobs: bool, c: &openai::Common) -> Self {
        Style {
            chat,
            logprobs,
            token_ids: c.return_tokens_as_token_ids,
            include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        }
    }
}

/// Queues a validated request and answers it, streamed or whole.
pub(super) async fn generate(
    e: &Front,
    prompt: Vec<u32>,
    params: crate::sampling::SamplingParams,
    style: Style,
    stream: bool,
) -> Result<Response> {
    let handle = e.submit(GenerateRequest { prompt, params })?;
    respond(e.clone(), handle, style, stream, None).await
}

pub(super) fn token_str(e: &dyn Frontend, id: u32, style: Style) -> String {
    if style.token_ids {
        format!("token_id:{id}")
    } else {
        e.tokenizer().id_to_token(id)
    }
}

/// Logprobs of `tokens` in the completions (legacy) or chat form.
pub(super) fn logprobs_json(
    e: &dyn Frontend,
    tokens: &[TokenOut],
    style: Style,
    text_offset: &mut usize,
) -> Value {
    if style.chat {
        let content: Vec<Value> = tokens
            .iter()
            .map(|t| {
                let s = token_str(e, t.id, style);
                json!({
                    "token": s, "logprob": t.logprob, "bytes": s.as_bytes(),
                    "top_logprobs": t.top.iter().map(|(id, lp)| {
                        let s = token_str(e, *id, style);
                        json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
                    }).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({"content": content})
    } else {
        let mut toks = Vec::new();
        let mut lps = Vec::new();
        let mut tops = Vec::new();
        let mut offs = Vec::new();
        for t in tokens {
            let s = token_str(e, t.id, style);
            offs.push(*text_offset);
            *text_offset += s.len();
            toks.push(s);
            lps.push(t.logprob);
            let m: serde_json::Map<String, Value> = t
                .top
                .iter()
                .map(|(id, lp)| (token_str(e, *id, style), json!(lp)))
                .collect();
            tops.push(Value::Object(m));
        }
        json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
    }
}

pub(super) fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Answers a queued request; `echo` (completions' `echo`: the prompt's text) comes
/// before the generated text.
pub(super) async fn respond(
    e: Front,
    mut handle: RequestHandle,
    style: Style,
    stream: bool,
    echo: Option<String>,
) -> Result<Response> {
    let id = request_id(if style.chat { "chatcmpl" } else { "cmpl" }, handle.id);
    if stream {
        // Headers wait for the first event, so a request that fails before its first
        // token (held at a gateway until the hold time ran out, refused by a worker)
        // gets an HTTP error with its status and Retry-After, not a 200 stream
        // holding an error.
        let first = match handle.events.recv().await {
            Some(Event::Error(err)) => return Err(err),
            None => {
                return Err(EngineError::Internal(
                    "the engine dropped the request".into(),
                ));
            }
            Some(ev) => ev,
        };
        Ok(Sse::new(sse_stream(e, handle, first, style, id, echo)).into_response())
    } else {
        collect(e, handle, style, id, echo).await
    }
}

pub(super) async fn collect(
    e: Front,
    mut handle: RequestHandle,
    style: Style,
    id: String,
    echo: Option<String>,
) -> Result<Response> {
    let mut text = echo.unwrap_or_default();
    let mut tokens = Vec::new();
    loop {
        match handle.events.recv().await {
            Some(Event::Delta { tokens: t, text: s }) => {
                text.push_str(&s);
                tokens.extend(t);
            }
            Some(Event::Finished { reason, usage }) => {
                let mut off = 0;
                let lp = if style.logprobs {
                    logprobs_json(&*e, &tokens, style, &mut off)
                } else {
                    Value::Null
                };
                let choice = if style.chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": reason.as_str()})
                } else {
                    json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": reason.as_str()})
                };
                return Ok(Json(json!({
                    "id": id, "object": if style.chat { "chat.completion" } else { "text_completion" },
                    "created": now(), "model": e.model_name(), "choices": [choice], "usage": usage_json(&usage),
                }))
                .into_response());
            }
            Some(Event::Error(err)) => return Err(err),
            // Only prefill-only requests ship K/V; nothing to show a client.
            Some(Event::KvReady(_)) => {}
            None => {
                return Err(EngineError::Internal(
                    "the engine dropped the request".into(),
                ));
            }
        }
    }
}

/// One SSE chunk of a stream.
pub(super) fn chunk(
    e: &dyn Frontend,
    id: &str,
    style: Style,
    text: Option<&str>,
    first: bool,
    lp: Value,
    finish: Option<FinishReason>,
) -> Value {
    let reason = finish.map(FinishReason::as_str);
    let choice = if style.chat {
        let mut delta = serde_json::Map::new();
        if first {
            delta.insert("role".into(), json!("assistant"));
        }
        if let Some(t) = text {
            delta.insert("content".into(), json!(t));
        }
        json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason})
    } else {
        json!({"index": 0, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": reason})
    };
    json!({
        "id": id, "object": if style.chat { "chat.completion.chunk" } else { "text_completion" },
        "created": now(), "model": e.model_name(), "choices": [choice],
    })
}

pub(super) fn sse_stream(
    e: Front,
    handle: RequestHandle,
    first_event: Event,
    style: Style,
    id: String,
    echo: Option<String>,
) -> impl Stream<Item = std::result::Result<SseEvent, Infallible>> {
    struct St {
        e: Front,
        handle: RequestHandle,
        /// The event already taken to decide the status.
        pending: Option<Event>,
        style: Style,
        id: String,
        first: bool,
        off: usize,
        done: bool,
        /// Not sent yet: goes before the first text.
        echo: Option<String>,
    }
    let st = St {
        e,
        handle,
        pending: Some(first_event),
        style,
        id,
        first: true,
        off: 0,
        done: false,
        echo,
    };
    stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out: Vec<Value> = Vec::new();
        let next = match st.pending.take() {
            Some(ev) => Some(ev),
            None => st.handle.events.recv().await,
        };
        match next {
            Some(Event::Delta { tokens, text }) => {
                let lp = if st.style.logprobs { logprobs_json(&*st.e, &tokens, st.style, &mut st.off) } else { Value::Null };
                let text = st.echo.take().unwrap_or_default() + &text;
                out.push(chunk(&*st.e, &st.id, st.style, Some(&text), st.first, lp, None));
                st.first = false;
            }
            Some(Event::Finished { reason, usage }) => {
                let echo = st.echo.take().unwrap_or_default();
                let text = if st.style.chat { None } else { Some(echo.as_str()) };
                out.push(chunk(&*st.e, &st.id, st.style, text, st.first, Value::Null, Some(reason)));
                if st.style.include_usage {
                    out.push(json!({
                        "id": st.id, "object": if st.style.chat { "chat.completion.chunk" } else { "text_completion" },
                        "created": now(), "model": st.e.model_name(), "choices": [], "usage": usage_json(&usage),
                    }));
                }
                st.done = true;
            }
            Some(Event::Error(err)) => {
                out.push(ApiError(err).body());
                st.done = true;
            }
            Some(Event::KvReady(_)) => {}
            None => {
                out.push(ApiError(EngineError::Internal("the engine dropped the request".into())).body());
                st.done = true;
            }
        }
        let mut events: Vec<std::result::Result<SseEvent, Infallible>> =
            out.into_iter().map(|v| Ok(SseEvent::default().data(v.to_string()))).collect();
        if st.done {
            events.push(Ok(SseEvent::default().data("[DONE]")));
        }
        Some((stream::iter(events), st))
    })
    .flatten()
}
