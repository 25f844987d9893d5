//! A request as the engine takes it (already tokenised), what its stream carries, and
//! the checks every front applies before queueing one.

use super::ExportedSequence;
use crate::sampling::SamplingParams;
use crate::{EngineError, Result};

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Cancelled or failed.
    Abort,
}

impl FinishReason {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    pub id: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

/// What a request's stream carries.
#[derive(Debug)]
pub enum Event {
    /// New tokens and the text they complete (text may lag tokens by a held-back
    /// partial character or a possible stop string).
    Delta {
        tokens: Vec<TokenOut>,
        text: String,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Error(EngineError),
    /// Prefill-only requests: the prompt's K/V and the first token, ready to ship to a
    /// decode worker (a `Finished` follows).
    KvReady(Box<ExportedSequence>),
    /// A gateway lost the worker running this sequence (the error says how) and runs
    /// it again from the start elsewhere: what came before this event is void. A
    /// consumer that has shown none of it to its client discards it and goes on; one
    /// that has (a stream under way) ends with this error instead.
    Replayed(EngineError),
}

/// A request as the engine takes it: already tokenised.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// Checks a request against a model's vocabulary and context length: what the engine
/// and a gateway's front both refuse before anything is queued.
pub fn check(req: &GenerateRequest, vocab: usize, max_model_len: usize) -> Result<()> {
    if req.prompt.is_empty() {
        return Err(EngineError::invalid("the prompt is empty", "prompt"));
    }
    // Token ids must index the embedding table (the tokenizer may know fewer).
    if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::invalid(
            format!("token id {bad} is outside the vocabulary (size {vocab})"),
            "prompt",
        ));
    }
    req.params.check_vocab(vocab)?;
    let total = req.prompt.len() + req.params.max_tokens;
    if total > max_model_len {
        return Err(EngineError::invalid(
            format!(
                "this model's maximum context length is {} tokens; the request has {} prompt tokens and asks for {} more",
                max_model_len,
                req.prompt.len(),
                req.params.max_tokens
            ),
            "max_tokens",
        ));
    }
    Ok(())
}
