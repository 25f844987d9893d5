//! The engine thread: one thread owns the scheduler and the backend, runs a forward
//! pass per step, samples, detokenises, and streams events to each request's channel.
//! A request whose channel is closed (client gone) is aborted and its blocks freed at
//! the next step. Sequences handed to or from another engine: [`handoff`].

mod handoff;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;

use super::exported::ExportedSequence;
use super::request::{Event, FinishReason, GenerateRequest, TokenOut, Usage};
use crate::backend::{Backend, ForwardBatch, SeqSlice};
use crate::kv::BlockId;
use crate::kv::payload::BufferPool;
use crate::metrics::EngineMetrics;
use crate::sampling::grammar::{Allowed, Constraint};
use crate::sampling::penalties;
use crate::sampling::{Rng, SamplingParams, sample_with_state};
use crate::scheduler::{Scheduler, SeqState};
use crate::tokenizer::{IncrementalDetokenizer, StopMatcher, StopOutcome, Tokenizer};
use crate::{EngineError, Result};

pub(crate) enum Command {
    Submit {
        id: u64,
        req: Box<GenerateRequest>,
        out: tmpsc::UnboundedSender<Event>,
        arrival: Instant,
        /// Prefill only, shipping the K/V under this transfer id.
        prefill_only: Option<String>,
        /// The request's grammar, compiled by the submitter.
        constraint: Option<Box<Constraint>>,
    },
    Resume {
        id: u64,
        seq: Box<ExportedSequence>,
        constraint: Option<Box<Constraint>>,
        /// Blocks reserved before the payload flowed ([`Engine::reserve`]).
        blocks: Option<Vec<BlockId>>,
        out: tmpsc::UnboundedSender<Event>,
        arrival: Instant,
    },
    Reserve {
        blocks: usize,
        reply: tokio::sync::oneshot::Sender<Option<Vec<BlockId>>>,
    },
    Release(Vec<BlockId>),
    Abort(u64),
}

/// Per-request state the scheduler does not need.
pub(crate) struct Live {
    params: SamplingParams,
    rng: Rng,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    out: tmpsc::UnboundedSender<Event>,
    arrival: Instant,
    scheduled: Option<Instant>,
    last_token: Option<Instant>,
    stopped_by_string: bool,
    prefill_only: Option<String>,
    /// The prompt's length until it is counted in `prompt_tokens_total`, with its first
    /// token; `None` for K/V resumed from a prefill worker, which counted it there.
    uncounted_prompt: Option<usize>,
    /// What the penalties read of the sequence, kept as tokens are appended.
    penalties: penalties::State,
    /// Where the output stands in its grammar (structured outputs).
    constraint: Option<Box<Constraint>>,
}

pub(crate) struct EngineLoop {
    pub(crate) kv_buffers: BufferPool,
    pub(crate) cached: Arc<std::sync::Mutex<Vec<crate::kv::BlockHash>>>,
    pub(crate) cached_at: Instant,
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) sched: Scheduler,
    pub(crate) live: HashMap<u64, Live>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) metrics: Arc<EngineMetrics>,
    pub(crate) queued: Arc<AtomicUsize>,
    pub(crate) in_flight: Arc<AtomicUsize>,
    /// Blocks held by reservations: K/V still being prefilled elsewhere or in transfer.
    pub(crate) reserved: usize,
    /// Commands handled before the coming step, and the time they took (step trace).
    pub(crate) handled: (usize, Duration),
}

impl EngineLoop {
    pub(crate) fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            let first = if self.sched.is_idle() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            let handling = Instant::now();
            let mut handled = 0usize;
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                handled += 1;
                self.handle(cmd);
            }
            self.drop_abandoned();
            self.handled = (handled, handling.elapsed());
            if let Err(e) = self.step() {
                tracing::error!(error = %e, "engine step failed; failing the batch");
                let ids: Vec<u64> = self.live.keys().copied().collect();
                for id in ids {
                    self.finish(
                        id,
                        FinishReason::Abort,
                        Some(EngineError::Internal(e.to_string())),
                    );
                }
            }
            self.update_gauges();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                id,
                req,
                out,
                arrival,
                prefill_only,
                constraint,
            } => {
                let rng = req.params.seed.map_or_else(Rng::entropy, Rng::new);
                let penalties = penalties::State::new(&req.params, &req.prompt);
                self.live.insert(
                    id,
                    Live {
                        stop: StopMatcher::new(req.params.stop.clone()),
                        params: req.params,
                        rng,
                        detok: IncrementalDetokenizer::default(),
                        out,
                        arrival,
                        scheduled: None,
                        last_token: None,
                        stopped_by_string: false,
                        prefill_only,
                        uncounted_prompt: Some(req.prompt.len()),
                        penalties,
                        constraint,
                    },
                );
                self.sched.add(SeqState::new(id, req.prompt));
            }
            Command::Resume {
                id,
                seq,
                constraint,
                blocks,
                out,
                arrival,
            } => self.resume(id, *seq, constraint, blocks, out, arrival),
            Command::Reserve { blocks, reply } => {
                // A reserved sequence runs as soon as its K/V lands: without a running
                // slot for it, it would be refused after its prompt was computed.
                let got = if self.sched.has_running_slot() {
                    self.sched.pool.allocate(blocks)
                } else {
                    None
                };
                let n = got.as_ref().map_or(0, Vec::len);
                match reply.send(got) {
                    Ok(()) => {
                        self.reserved += n;
                        if n > 0 {
                            self.sched.reserved_seqs += 1;
                        }
                    }
                    // The requester is gone: give the blocks back.
                    Err(Some(b)) => self.sched.pool.release(&b),
                    Err(None) => {}
                }
            }
            Command::Release(blocks) => {
                // Only reservations are released by command: a drift is a bug here.
                debug_assert!(self.reserved >= blocks.len(), "released more than reserved");
                self.reserved = self.reserved.saturating_sub(blocks.len());
                if !blocks.is_empty() {
                    debug_assert!(
                        self.sched.reserved_seqs > 0,
                        "released more reservations than made"
                    );
                    self.sched.reserved_seqs = self.sched.reserved_seqs.saturating_sub(1);
                }
                self.sched.pool.release(&blocks);
            }
            Command::Abort(id) => {
                if self.live.contains_key(&id) {
                    self.finish(id, FinishReason::Abort, None);
                }
            }
        }
    }

    fn drop_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| l.out.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            tracing::debug!(request = id, "client went away; aborting");
            self.finish(id, FinishReason::Abort, None);
        }
    }

    fn finish(&mut self, id: u64, reason: FinishReason, error: Option<EngineError>) {
        let Some(seq) = self.sched.remove(id) else {
            return;
        };
        let Some(mut live) = self.live.remove(&id) else {
            return;
        };
        if live.scheduled.is_none() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        let generated = seq.generated();
        // Flush text held back for a partial character or a possible stop string,
        // unless a stop string ended the request (nothing after it may be sent).
        if reason != FinishReason::Abort && error.is_none() && !live.stopped_by_string {
            let tail = live
                .detok
                .flush(&self.tokenizer, generated)
                .unwrap_or_default();
            let tail = match live.stop.push(&tail) {
                StopOutcome::Emit(t) => t + &live.stop.flush(),
                StopOutcome::Stopped(t) => t,
            };
            if !tail.is_empty() {
                let _ = live.out.send(Event::Delta {
                    tokens: Vec::new(),
                    text: tail,
                });
            }
        }
        let usage = Usage {
            prompt_tokens: seq.prompt_len,
            completion_tokens: generated.len(),
            cached_tokens: seq.cached_tokens,
        };
        let _ = live.out.send(match error {
            Some(e) => Event::Error(e),
            None => Event::Finished { reason, usage },
        });
        self.metrics.finished(reason.as_str());
        self.metrics
            .e2e
            .observe(live.arrival.elapsed().as_secs_f64());
    }

    fn step(&mut self) -> Result<()> {
        let work = self.sched.schedule();
        if work.is_empty() {
            if !self.sched.is_idle() {
                // Nothing fits right now (blocks held by others); do not spin hot.
                std::thread::sleep(Duration::from_millis(1));
            }
            return Ok(());
        }
        let now = Instant::now();
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut seq_of = Vec::new();
        let mut rows = Vec::new();
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(work.len());
        for (k, w) in work.iter().enumerate() {
            let s = self
                .sched
                .get(w.seq)
                .ok_or_else(|| EngineError::Internal("scheduled an unknown sequence".into()))?;
            tokens.extend_from_slice(&s.tokens[w.start..w.start + w.len]);
            positions.extend((w.start..w.start + w.len).map(|p| p as u32));
            seq_of.extend(std::iter::repeat_n(k as u32, w.len));
            if w.sample {
                rows.push((tokens.len() - 1) as u32);
            }
            tables.push(s.blocks.clone());
            if let Some(l) = self.live.get_mut(&w.seq)
                && l.scheduled.is_none()
            {
                l.scheduled = Some(now);
                self.queued.fetch_sub(1, Ordering::Relaxed);
                self.metrics
                    .queue_time
                    .observe((now - l.arrival).as_secs_f64());
            }
        }
        let seqs: Vec<SeqSlice<'_>> = tables.iter().map(|t| SeqSlice { block_table: t }).collect();
        let forwarding = Instant::now();
        let logits = self.backend.forward(&ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            seq_of: &seq_of,
            seqs: &seqs,
            logits_rows: &rows,
        })?;
        let forward = forwarding.elapsed();
        let vocab = self.backend.config().vocab_size as usize;
        let mut row = 0;
        for w in &work {
            self.sched.complete(w);
            if !w.sample {
                continue;
            }
            let l = &logits[row * vocab..(row + 1) * vocab];
            row += 1;
            self.emit(w.seq, l);
        }
        // Where a step's time goes, for comparing a loaded engine with its profile
        // (`RUST_LOG=preheat_engine::step=debug`).
        tracing::debug!(
            target: "preheat_engine::step",
            seqs = work.len(),
            tokens = tokens.len(),
            // Fields are computed only when the event is on.
            context = work.iter().map(|w| w.start + w.len).sum::<usize>(),
            commands = self.handled.0,
            commands_ms = self.handled.1.as_secs_f64() * 1e3,
            forward_ms = forward.as_secs_f64() * 1e3,
            sample_ms = (forwarding.elapsed() - forward).as_secs_f64() * 1e3,
            "step"
        );
        Ok(())
    }

    /// Samples the next token of `id` from `logits`, streams it, and finishes the
    /// request when a stop condition holds.
    fn emit(&mut self, id: u64, logits: &[f32]) {
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        // Tokens this sequence may still generate, this one included.
        let remaining = self.sched.get(id).map_or(1, |seq| {
            let context = (self.backend.config().max_position_embeddings as usize)
                .saturating_sub(seq.tokens.len());
            live.params
                .max_tokens
                .saturating_sub(seq.generated().len())
                .min(context.max(1))
        });
        let allowed = match live.constraint.as_mut().map(|c| c.allowed()) {
            None => None,
            Some(Ok(a)) => Some(a),
            Some(Err(e)) => {
                self.finish(id, FinishReason::Abort, Some(e));
                return;
            }
        };
        let mut s = sample_with_state(
            logits,
            &live.params,
            &mut live.rng,
            &live.penalties,
            self.tokenizer.eos_ids(),
            allowed.as_ref(),
        );
        // Near max_tokens, a token after which the grammar cannot end within the
        // budget gives way to the way to an end (its logprob the model's own).
        if let Some(t) = live
            .constraint
            .as_mut()
            .and_then(|c| c.budget_check(s.token, remaining))
        {
            s = sample_with_state(
                logits,
                &live.params,
                &mut live.rng,
                &live.penalties,
                self.tokenizer.eos_ids(),
                Some(&Allowed::only(t, logits.len())),
            );
        }
        if live.prefill_only.is_some() {
            self.ship(id, s.token, s.logprob, s.top);
            return;
        }
        self.accept(id, s.token, s.logprob, s.top);
    }

    /// Appends a sampled token to `id`, streams it, and finishes the request when a
    /// stop condition holds.
    fn accept(&mut self, id: u64, token: u32, logprob: Option<f32>, top: Vec<(u32, f32)>) {
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        let s = crate::sampling::Sampled {
            token,
            logprob,
            top,
        };
        let now = Instant::now();
        match live.last_token {
            None => self
                .metrics
                .observe_ttft((now - live.arrival).as_secs_f64()),
            Some(t) => self.metrics.itl.observe((now - t).as_secs_f64()),
        }
        // The whole prompt, once, with its first token, as vLLM counts it: prefix hits
        // are in `prefix_cache_hits_total` and readers take their share from there (the
        // scaler's prefill rate, and its mean length: prompt tokens per first token).
        // Counting computed tokens discounted the hits twice; counting at schedule time
        // counted prompts that never got a first token.
        if let Some(n) = live.uncounted_prompt.take() {
            self.metrics.prompt_tokens.inc_by(n as u64);
        }
        live.last_token = Some(now);
        self.metrics.generation_tokens.inc();
        let Some(seq) = self.sched.get_mut(id) else {
            return;
        };
        seq.tokens.push(s.token);
        live.penalties.push(s.token);
        let grammar_done = match live.constraint.as_mut().map(|c| c.accept(s.token)) {
            None => false,
            Some(Ok(())) => live.constraint.as_ref().is_some_and(|c| c.is_done()),
            Some(Err(e)) => {
                self.finish(id, FinishReason::Abort, Some(e));
                return;
            }
        };
        let n_gen = seq.generated().len();
        let at_context_end =
            seq.tokens.len() >= self.backend.config().max_position_embeddings as usize;
        let is_eos = !live.params.ignore_eos && self.tokenizer.eos_ids().contains(&s.token);
        let is_stop_token = live.params.stop_token_ids.contains(&s.token);
        let text = if is_eos || is_stop_token {
            String::new()
        } else {
            live.detok
                .next(&self.tokenizer, seq.generated())
                .unwrap_or_default()
        };
        // Stop strings count only once min_tokens are out (as vLLM).
        let (text, stopped_by_string) = if n_gen < live.params.min_tokens {
            (text, false)
        } else {
            match live.stop.push(&text) {
                StopOutcome::Emit(t) => (t, false),
                StopOutcome::Stopped(t) => (t, true),
            }
        };
        live.stopped_by_string = stopped_by_string;
        let tok = TokenOut {
            id: s.token,
            logprob: s.logprob,
            top: s.top,
        };
        let _ = live.out.send(Event::Delta {
            tokens: vec![tok],
            text,
        });
        let closed_for_budget = live
            .constraint
            .as_ref()
            .is_some_and(|c| c.closed_for_budget());
        let reason = if (is_eos || grammar_done) && closed_for_budget {
            // Ended early, complete, because max_tokens was near.
            Some(FinishReason::Length)
        } else if is_eos || is_stop_token || stopped_by_string || grammar_done {
            Some(FinishReason::Stop)
        } else if n_gen >= live.params.max_tokens || at_context_end {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(r) = reason {
            self.finish(id, r, None);
        }
    }

    fn update_gauges(&mut self) {
        // Twice a second while busy, and whenever the engine goes idle (so the last
        // prompts' blocks are reported before the thread sleeps).
        if self.sched.is_idle() || self.cached_at.elapsed() >= Duration::from_millis(500) {
            self.cached_at = Instant::now();
            let hashes: Vec<_> = self.sched.pool.cached_hashes().collect();
            *self
                .cached
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = hashes;
        }
        let m = &self.metrics;
        m.running.set(self.sched.num_running() as i64);
        m.waiting.set(self.sched.num_waiting() as i64);
        m.kv_usage.set(self.sched.pool.usage());
        m.kv_reserved
            .set(self.reserved as f64 / self.sched.pool.num_blocks().max(1) as f64);
        m.prefill_queue_tokens
            .set(self.sched.queued_prompt_tokens() as i64);
        m.prefix_queries
            .inc_by(self.sched.prefix_queries - m.prefix_queries.get());
        m.prefix_hits
            .inc_by(self.sched.prefix_hits - m.prefix_hits.get());
        m.preemptions
            .inc_by(self.sched.preemptions - m.preemptions.get());
    }
}
