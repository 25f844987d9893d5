//! Sequences handed between engines: a prefill-only request's prompt K/V and first
//! token go out as an [`ExportedSequence`]; one prefilled elsewhere comes in and runs
//! on as if prefilled here.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::mpsc as tmpsc;

use super::{EngineLoop, Live};
use crate::EngineError;
use crate::engine::exported::ExportedSequence;
use crate::engine::request::{Event, FinishReason};
use crate::kv::BlockId;
use crate::kv::payload::PayloadShape;
use crate::sampling::Rng;
use crate::sampling::grammar::Constraint;
use crate::sampling::penalties;
use crate::scheduler::SeqState;
use crate::tokenizer::{IncrementalDetokenizer, StopMatcher};

impl EngineLoop {
    /// Prefill-only: hands the prompt's K/V and first token to the caller, then ends
    /// the request here (its blocks stay in the prefix cache).
    pub(super) fn ship(&mut self, id: u64, token: u32, logprob: Option<f32>, top: Vec<(u32, f32)>) {
        let (Some(live), Some(seq)) = (self.live.get(&id), self.sched.get(id)) else {
            return;
        };
        let layout = self.backend.kv_layout();
        let bs = layout.block_size;
        let prompt = seq.tokens[..seq.prompt_len].to_vec();
        let n = prompt.len().div_ceil(bs);
        let mut payload = Vec::new();
        if let Err(e) = self.backend.export_kv(&seq.blocks[..n], &mut payload) {
            // The request fails by name (the device's own error); nothing is shipped
            // and no first token is counted.
            tracing::error!(error = %e, "exporting a prefilled sequence's K/V failed");
            self.finish(id, FinishReason::Abort, Some(e));
            return;
        }
        self.metrics
            .observe_ttft(live.arrival.elapsed().as_secs_f64());
        tracing::debug!(
            target: "preheat_engine::handoff",
            request = live.prefill_only.as_deref().unwrap_or_default(),
            queued_ms = live
                .scheduled
                .map_or(0.0, |s| (s - live.arrival).as_secs_f64() * 1e3),
            prefilled_ms = live.arrival.elapsed().as_secs_f64() * 1e3,
            "shipped"
        );
        self.metrics.prompt_tokens.inc_by(seq.prompt_len as u64);
        self.metrics.generation_tokens.inc();
        let exported = ExportedSequence {
            request_id: live.prefill_only.clone().unwrap_or_default(),
            compat: crate::kv::payload::compat_hash(self.backend.weights_fingerprint(), &layout),
            block_hashes: self.sched.prefix_key().block_hashes(&prompt, bs),
            prompt,
            first_token: token,
            first_logprob: logprob,
            first_top_logprobs: top,
            params: live.params.clone(),
            rng_state: live.rng.state(),
            shape: PayloadShape::of(&layout, n),
            payload,
        };
        let _ = live.out.send(Event::KvReady(Box::new(exported)));
        self.finish(id, FinishReason::Length, None);
    }

    /// Installs a transferred sequence and streams its first token.
    pub(super) fn resume(
        &mut self,
        id: u64,
        seq: ExportedSequence,
        constraint: Option<Box<Constraint>>,
        reserved: Option<Vec<BlockId>>,
        out: tmpsc::UnboundedSender<Event>,
        arrival: Instant,
    ) {
        let refuse = |this: &mut Self, e: EngineError| {
            this.in_flight.fetch_sub(1, Ordering::Relaxed);
            let _ = out.send(Event::Error(e));
        };
        let ExportedSequence {
            request_id,
            compat: _,
            prompt,
            block_hashes,
            first_token,
            first_logprob,
            first_top_logprobs,
            params,
            rng_state,
            shape,
            payload,
        } = seq;
        tracing::debug!(
            target: "preheat_engine::handoff",
            request = %request_id,
            resume_wait_ms = arrival.elapsed().as_secs_f64() * 1e3,
            "resumed"
        );
        // Reserved blocks stop being a reservation here: they hold a sequence, or go back.
        if let Some(b) = &reserved {
            debug_assert!(self.reserved >= b.len(), "resumed more than reserved");
            self.reserved = self.reserved.saturating_sub(b.len());
            if !b.is_empty() {
                debug_assert!(
                    self.sched.reserved_seqs > 0,
                    "resumed more reservations than made"
                );
                self.sched.reserved_seqs = self.sched.reserved_seqs.saturating_sub(1);
            }
        }
        let busy = EngineError::Overloaded {
            retry_after_secs: 1,
        };
        // A reserved sequence's slot was held for it; only an unreserved one can
        // find none.
        if reserved.is_none() && !self.sched.has_running_slot() {
            return refuse(self, busy);
        }
        let blocks = match reserved {
            Some(b) => b,
            None => match self.sched.pool.allocate(shape.num_blocks as usize) {
                Some(b) => b,
                None => return refuse(self, busy),
            },
        };
        let imported = self.backend.import_kv(&blocks, &payload);
        self.kv_buffers.give(payload);
        if let Err(e) = imported {
            self.sched.pool.release(&blocks);
            return refuse(self, e);
        }
        for (b, hash) in blocks.iter().zip(&block_hashes) {
            self.sched.pool.register(*b, *hash);
        }
        let penalties = penalties::State::new(&params, &prompt);
        self.live.insert(
            id,
            Live {
                penalties,
                stop: StopMatcher::new(params.stop.clone()),
                rng: Rng::from_state(rng_state),
                params,
                detok: IncrementalDetokenizer::default(),
                out,
                arrival,
                scheduled: Some(arrival),
                last_token: None,
                stopped_by_string: false,
                prefill_only: None,
                uncounted_prompt: None,
                constraint,
            },
        );
        self.sched
            .add_running(SeqState::resumed(id, prompt, blocks, block_hashes));
        self.accept(id, first_token, first_logprob, first_top_logprobs);
    }
}
