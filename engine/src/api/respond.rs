//! How a queued request is answered: whole or as server-sent events, with logprobs,
//! usage and the completions API's echo, in the OpenAI chat or completions shape.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{Value, json};

use super::choices::{self, Run};
use super::error::ApiError;
use super::tools::{CallIds, Piece, ToolCall, ToolChoice, ToolStream, Tools};
use super::{Front, now, openai, request_id};
use crate::engine::{Event, FinishReason, TokenOut, Usage};
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

/// Queues a validated request with `choices` and answers it, streamed or whole;
/// `tools` (chat) turns the model's calls into `tool_calls`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn generate(
    e: &Front,
    prompt: Vec<u32>,
    mut params: crate::sampling::SamplingParams,
    choices: openai::Choices,
    style: Style,
    stream: bool,
    echo: Option<String>,
    tools: Option<Arc<Tools>>,
) -> Result<Response> {
    // Ranking needs each sampled token's logprob, shown only when asked for.
    if choices.best_of > choices.n && params.logprobs.is_none() {
        params.logprobs = Some(0);
    }
    let runs = choices::submit(e, prompt, params, choices.best_of).await?;
    let id = request_id(
        if style.chat { "chatcmpl" } else { "cmpl" },
        runs[0].handle.id,
    );
    if stream {
        Ok(Sse::new(sse_stream(e.clone(), runs, style, id, echo, tools)).into_response())
    } else {
        collect(e.clone(), runs, choices.n, style, id, echo, tools).await
    }
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

/// What one sequence produced.
struct Output {
    text: String,
    tokens: Vec<TokenOut>,
    reason: FinishReason,
    usage: Usage,
}

async fn collect_one(mut run: Run) -> Result<Output> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    loop {
        let ev = match run.pending.take() {
            Some(ev) => Some(ev),
            None => run.handle.events.recv().await,
        };
        match ev {
            Some(Event::Delta { tokens: t, text: s }) => {
                text.push_str(&s);
                tokens.extend(t);
            }
            Some(Event::Finished { reason, usage }) => {
                return Ok(Output {
                    text,
                    tokens,
                    reason,
                    usage,
                });
            }
            Some(Event::Error(err)) => return Err(err),
            // Only prefill-only requests ship K/V; nothing to show a client.
            Some(Event::KvReady(_)) => {}
            // Nothing has reached the client yet: the sequence starts over.
            Some(Event::Replayed(_)) => {
                text.clear();
                tokens.clear();
            }
            None => {
                return Err(EngineError::Internal(
                    "the engine dropped the request".into(),
                ));
            }
        }
    }
}

/// The usage of a request whose sequences share one prompt: its tokens (and those
/// found cached for the first sequence) count once, every generated token counts.
fn total_usage<'a>(all: impl IntoIterator<Item = &'a Usage>) -> Usage {
    let mut total = Usage::default();
    for (i, u) in all.into_iter().enumerate() {
        if i == 0 {
            total.prompt_tokens = u.prompt_tokens;
            total.cached_tokens = u.cached_tokens;
        }
        total.completion_tokens += u.completion_tokens;
    }
    total
}

/// The finish reason a client sees: a sequence that ended by making calls finished
/// with `tool_calls` (OpenAI: `stop` when the call was forced by name).
fn finish_reason(reason: FinishReason, calls: usize, tools: Option<&Tools>) -> &'static str {
    match tools {
        Some(t) if calls > 0 && reason == FinishReason::Stop => match t.choice {
            ToolChoice::Named(_) => "stop",
            _ => "tool_calls",
        },
        _ => reason.as_str(),
    }
}

/// A whole answer's message: its text, or its content and tool calls.
fn message(text: &str, tools: Option<ToolStream>) -> (Value, usize) {
    let Some(mut stream) = tools else {
        return (json!({"role": "assistant", "content": text}), 0);
    };
    let mut pieces = stream.push(text);
    pieces.extend(stream.finish());
    let mut content = String::new();
    let mut calls: Vec<Value> = Vec::new();
    for p in pieces {
        match p {
            Piece::Content(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c.to_json(false)),
        }
    }
    let n = calls.len();
    let mut m = json!({"role": "assistant", "content": content});
    if n > 0 {
        if content.trim().is_empty() {
            m["content"] = Value::Null;
        }
        m["tool_calls"] = Value::Array(calls);
    }
    (m, n)
}

/// Waits for every sequence, keeps the `n` best (all of them unless `best_of`
/// asked for more) and answers with them; `echo` (completions' `echo`: the prompt's
/// text) comes before each choice's text.
async fn collect(
    e: Front,
    runs: Vec<Run>,
    n: usize,
    style: Style,
    id: String,
    echo: Option<String>,
    tools: Option<Arc<Tools>>,
) -> Result<Response> {
    // The first error drops the other sequences, which cancels them.
    let outs = futures_util::future::try_join_all(runs.into_iter().map(collect_one)).await?;
    let usage = total_usage(outs.iter().map(|o| &o.usage));
    let picked: Vec<usize> = if outs.len() > n {
        let scores: Vec<f64> = outs
            .iter()
            .map(|o| {
                o.tokens
                    .iter()
                    .map(|t| t.logprob.map_or(f64::NEG_INFINITY, f64::from))
                    .sum()
            })
            .collect();
        choices::best(&scores, n)
    } else {
        (0..outs.len()).collect()
    };
    let echo = echo.unwrap_or_default();
    let choices: Vec<Value> = picked
        .iter()
        .enumerate()
        .map(|(index, &i)| {
            let o = &outs[i];
            let mut off = 0;
            let lp = if style.logprobs {
                logprobs_json(&*e, &o.tokens, style, &mut off)
            } else {
                Value::Null
            };
            if style.chat {
                let stream = tools.as_deref().map(|t| t.stream(CallIds::new(&id, index)));
                let (message, calls) = message(&o.text, stream);
                let reason = finish_reason(o.reason, calls, tools.as_deref());
                json!({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
            } else {
                let reason = o.reason.as_str();
                json!({"index": index, "text": format!("{echo}{}", o.text), "logprobs": lp, "finish_reason": reason})
            }
        })
        .collect();
    Ok(Json(json!({
        "id": id, "object": if style.chat { "chat.completion" } else { "text_completion" },
        "created": now(), "model": e.model_name(), "choices": choices, "usage": usage_json(&usage),
    }))
    .into_response())
}

/// What one chunk carries for its choice.
pub(super) enum Delta<'a> {
    Nothing,
    Text(&'a str),
    /// A whole tool call (chat).
    Call(&'a ToolCall),
}

/// One SSE chunk of a stream, for choice `index`.
#[allow(clippy::too_many_arguments)]
pub(super) fn chunk(
    e: &dyn Frontend,
    id: &str,
    style: Style,
    index: usize,
    body: Delta<'_>,
    first: bool,
    lp: Value,
    finish: Option<&str>,
) -> Value {
    let reason = finish;
    let choice = if style.chat {
        let mut delta = serde_json::Map::new();
        if first {
            delta.insert("role".into(), json!("assistant"));
        }
        match body {
            Delta::Nothing => {}
            Delta::Text(t) => {
                delta.insert("content".into(), json!(t));
            }
            Delta::Call(c) => {
                delta.insert("tool_calls".into(), json!([c.to_json(true)]));
            }
        }
        json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason})
    } else {
        let text = match body {
            Delta::Text(t) => t,
            Delta::Nothing | Delta::Call(_) => "",
        };
        json!({"index": index, "text": text, "logprobs": lp, "finish_reason": reason})
    };
    json!({
        "id": id, "object": if style.chat { "chat.completion.chunk" } else { "text_completion" },
        "created": now(), "model": e.model_name(), "choices": [choice],
    })
}

fn piece_delta(p: &Piece) -> Delta<'_> {
    match p {
        Piece::Content(t) => Delta::Text(t),
        Piece::Call(c) => Delta::Call(c),
    }
}

/// The events of one sequence, tagged with its choice index; the stream owns the
/// handle, so dropping it cancels the sequence.
fn tagged(index: usize, run: Run) -> impl Stream<Item = (usize, Event)> {
    stream::unfold(run, move |mut run| async move {
        let ev = match run.pending.take() {
            Some(ev) => ev,
            None => run.handle.events.recv().await?,
        };
        Some(((index, ev), run))
    })
}

/// Server-sent events of every sequence as they come, each chunk naming its choice;
/// the usage chunk (when asked for) and `[DONE]` once all have finished.
pub(super) fn sse_stream(
    e: Front,
    runs: Vec<Run>,
    style: Style,
    id: String,
    echo: Option<String>,
    tools: Option<Arc<Tools>>,
) -> impl Stream<Item = std::result::Result<SseEvent, Infallible>> {
    /// Where one choice's stream stands.
    struct Choice {
        /// No chunk sent yet (chat's first carries the role).
        first: bool,
        /// Logprobs' text offset (completions).
        off: usize,
        /// Not sent yet: goes before the first text.
        echo: Option<String>,
        usage: Option<Usage>,
        /// Chat with tools: the model's text turned into content and calls.
        tools: Option<ToolStream>,
    }
    struct St<S> {
        e: Front,
        events: S,
        choices: Vec<Choice>,
        style: Style,
        id: String,
        done: bool,
        tools: Option<Arc<Tools>>,
    }
    let choices = (0..runs.len())
        .map(|i| Choice {
            first: true,
            off: 0,
            echo: echo.clone(),
            usage: None,
            tools: tools.as_deref().map(|t| t.stream(CallIds::new(&id, i))),
        })
        .collect();
    let events = stream::select_all(
        runs.into_iter()
            .enumerate()
            .map(|(i, r)| Box::pin(tagged(i, r))),
    );
    let st = St {
        e,
        events,
        choices,
        style,
        id,
        done: false,
        tools,
    };
    stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out: Vec<Value> = Vec::new();
        match st.events.next().await {
            Some((i, Event::Delta { tokens, text })) => {
                let c = &mut st.choices[i];
                let lp = if st.style.logprobs { logprobs_json(&*st.e, &tokens, st.style, &mut c.off) } else { Value::Null };
                let text = c.echo.take().unwrap_or_default() + &text;
                match c.tools.as_mut() {
                    None => {
                        out.push(chunk(&*st.e, &st.id, st.style, i, Delta::Text(&text), c.first, lp, None));
                        c.first = false;
                    }
                    Some(ts) => {
                        let pieces = ts.push(&text);
                        let mut lp = Some(lp);
                        for p in &pieces {
                            let lp = lp.take().unwrap_or(Value::Null);
                            out.push(chunk(&*st.e, &st.id, st.style, i, piece_delta(p), c.first, lp, None));
                            c.first = false;
                        }
                        // Text held back (it may begin a call): its logprobs still go out.
                        if let Some(lp) = lp.filter(|lp| !lp.is_null()) {
                            out.push(chunk(&*st.e, &st.id, st.style, i, Delta::Nothing, c.first, lp, None));
                            c.first = false;
                        }
                    }
                }
            }
            Some((i, Event::Finished { reason, usage })) => {
                let c = &mut st.choices[i];
                let echo = c.echo.take().unwrap_or_default();
                let mut calls = 0;
                if let Some(ts) = c.tools.as_mut() {
                    for p in ts.finish() {
                        out.push(chunk(&*st.e, &st.id, st.style, i, piece_delta(&p), c.first, Value::Null, None));
                        c.first = false;
                    }
                    calls = ts.calls();
                }
                let body = if st.style.chat { Delta::Nothing } else { Delta::Text(&echo) };
                let reason = finish_reason(reason, calls, st.tools.as_deref());
                out.push(chunk(&*st.e, &st.id, st.style, i, body, c.first, Value::Null, Some(reason)));
                c.first = false;
                c.usage = Some(usage);
                if st.choices.iter().all(|c| c.usage.is_some()) {
                    if st.style.include_usage {
                        let usage = total_usage(st.choices.iter().filter_map(|c| c.usage.as_ref()));
                        out.push(json!({
                            "id": st.id, "object": if st.style.chat { "chat.completion.chunk" } else { "text_completion" },
                            "created": now(), "model": st.e.model_name(), "choices": [], "usage": usage_json(&usage),
                        }));
                    }
                    st.done = true;
                }
            }
            Some((_, Event::Error(err))) => {
                out.push(ApiError(err).body());
                st.done = true;
            }
            Some((_, Event::KvReady(_))) => {}
            // A choice that has sent nothing yet starts over; one whose chunks the
            // client has cannot take them back, and the stream ends with the error.
            Some((i, Event::Replayed(err))) => {
                let c = &mut st.choices[i];
                if c.first {
                    c.off = 0;
                    c.tools = st.tools.as_deref().map(|t| t.stream(CallIds::new(&st.id, i)));
                } else {
                    out.push(ApiError(err).body());
                    st.done = true;
                }
            }
            // Every sequence's events ended, some before it finished.
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
