//! Requests with several choices (`n`, `best_of`): one prompt, many sequences.
//!
//! The first sequence is queued alone; the others follow once its first event shows
//! the prompt was prefilled. By then every full block of the prompt is in the prefix
//! cache (the scheduler registers a block as soon as it is computed), so each further
//! sequence takes references on those blocks and computes only the prompt's last,
//! partial block: the prompt's K/V are computed once and shared through the block
//! pool's reference counts, as vLLM's parallel sampling shares them. Through a
//! gateway the KV-aware router sends the followers to the prefill worker that holds
//! that prefix, so the prompt is computed once there too; each decode worker sequence
//! then holds its own copy of the shipped K/V.

use super::Front;
use crate::engine::{Event, GenerateRequest, RequestHandle};
use crate::sampling::SamplingParams;
use crate::{EngineError, Result};

/// One queued sequence, with the event already taken from it (if any).
pub(super) struct Run {
    pub(super) handle: RequestHandle,
    pub(super) pending: Option<Event>,
}

/// Queues `k` sequences of `prompt`. Waits for the first sequence's first event, so
/// a request that fails before its first token fails whole (with its HTTP status)
/// and the others find the prompt cached. With a seed, sequence `i` samples with
/// `seed + i`: the choices differ, and each is reproducible on its own.
pub(super) async fn submit(
    e: &Front,
    prompt: Vec<u32>,
    params: SamplingParams,
    k: usize,
) -> Result<Vec<Run>> {
    let mut first = e.submit(GenerateRequest {
        prompt: prompt.clone(),
        params: params.clone(),
    })?;
    let pending = match first.events.recv().await {
        Some(Event::Error(err)) => return Err(err),
        None => {
            return Err(EngineError::Internal(
                "the engine dropped the request".into(),
            ));
        }
        Some(ev) => ev,
    };
    let mut runs = Vec::with_capacity(k);
    runs.push(Run {
        handle: first,
        pending: Some(pending),
    });
    for i in 1..k {
        let mut p = params.clone();
        p.seed = p.seed.map(|s| s.wrapping_add(i as u64));
        // An error drops the runs queued so far, which cancels them.
        let handle = e.submit(GenerateRequest {
            prompt: prompt.clone(),
            params: p,
        })?;
        runs.push(Run {
            handle,
            pending: None,
        });
    }
    Ok(runs)
}

/// Indices of the `n` best of `scores` (cumulative logprobs), best first; ties keep
/// the order the sequences were queued in.
pub(super) fn best(scores: &[f64], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    order.truncate(n);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_ranks_by_cumulative_logprob_and_keeps_queue_order_on_ties() {
        assert_eq!(best(&[-3.0, -1.0, -2.0], 1), vec![1]);
        assert_eq!(best(&[-3.0, -1.0, -2.0], 3), vec![1, 2, 0]);
        assert_eq!(best(&[-1.0, -1.0, -5.0], 2), vec![0, 1]);
        // A sequence with no logprob (none generated) ranks last, not first.
        assert_eq!(best(&[f64::NEG_INFINITY, -9.0], 1), vec![1]);
    }
}
