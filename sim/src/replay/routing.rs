//! The gateway's part: KV-aware routing of held prompts to prefill with the prompt's KV
//! reserved on decode, the hand-over to decode when a prompt is done, and admission of
//! the requests waiting for a decode replica.

use crate::cluster::{DecodeReplica, PrefillJob, PrefillReplica, Seq};
use crate::prefix_index::SLOTS;
use crate::trace::MOONCAKE_BLOCK_TOKENS;

use super::Sim;

impl Sim<'_> {
    /// The prefill pool finished a prompt: its first token streams from decode, or
    /// from here when decode is not simulated or nothing follows it.
    pub(super) fn first_token(&mut self, req: usize, t: f64) {
        self.reqs[req].prompt_done = t;
        // The prefill engine's TTFT, which its scaler reads: at the prompt's end.
        let r = &self.trace[req];
        self.recent_ttft.push_back((t, t - r.t));
        let reserved = self.reqs[req].decode.take();
        if self.prefill_only {
            self.record_first_token(req, t);
            self.finished += 1;
        } else if r.output_tokens <= 1 {
            self.record_first_token(req, t);
            self.finish(req, t);
        } else if let Some(i) =
            reserved.and_then(|id| self.decode.iter().position(|d| d.id() == id))
        {
            // Its blocks were reserved: it lands on that replica, draining or not, ahead
            // of any request still waiting for room, and its first token streams from
            // there once the step under way ends.
            let seq = self.seq_of(req);
            let d = &mut self.decode[i];
            d.unreserve(f64::from(r.input_tokens));
            let at = d.resume(t, seq, &self.cfg.profile);
            self.record_first_token(req, at);
        } else {
            // No decode replica had room when it was routed (the real gateway would
            // have held it, or answered 429): it waits here for one, its first token
            // counted now.
            self.record_first_token(req, t);
            self.decode_wait.push_back(req);
        }
    }

    fn seq_of(&self, req: usize) -> Seq {
        let r = &self.trace[req];
        Seq {
            req,
            remaining: r.output_tokens.saturating_sub(1),
            kv_tokens: f64::from(r.input_tokens) + f64::from(r.output_tokens),
        }
    }

    /// Routes requests held at the gateway to ready prefill replicas (KV-aware).
    pub(super) fn route_held(&mut self) {
        let t = self.t;
        let profile = &self.cfg.profile;
        let mut overlap = [0u32; SLOTS];
        while let Some(&req) = self.held.front() {
            let r = &self.trace[req];
            let len = f64::from(r.input_tokens);
            let rate = profile.prefill_rate(len);
            let eligible = |rep: &PrefillReplica| !rep.draining && rep.is_ready(t);
            let asked = self
                .prefill
                .iter()
                .filter(|rep| eligible(rep))
                .filter_map(|rep| rep.slot)
                .fold(0u128, |m, s| m | 1u128 << s);
            self.prefix_index.overlaps(&r.blocks, asked, &mut overlap);
            let mut best: Option<(f64, usize, f64)> = None;
            for (i, rep) in self.prefill.iter().enumerate() {
                if !eligible(rep) {
                    continue;
                }
                let blocks = match rep.slot {
                    Some(s) => overlap[usize::from(s)] as usize,
                    None => rep.cache.overlap(&r.blocks),
                };
                let cached = (blocks as f64 * f64::from(MOONCAKE_BLOCK_TOKENS)).min(len - 1.0);
                let work = (len - cached) / rate;
                let cost = rep.backlog_s(t) + work;
                if best.is_none_or(|b| cost < b.0) {
                    best = Some((cost, i, cached));
                }
            }
            let Some((_, i, cached)) = best else { break };
            // The decode worker reserves the prompt's blocks; the tokens it generates
            // take blocks as they come.
            if !self.prefill_only && r.output_tokens > 1 {
                let prompt = f64::from(r.input_tokens);
                self.reqs[req].decode =
                    reserve_decode(&mut self.decode, t, prompt, profile.kv_tokens);
            }
            self.held.pop_front();
            self.now.prefix_queries += len;
            self.now.prefix_hits += cached;
            let rep = &mut self.prefill[i];
            // Only a replica with nothing cached takes a slot: blocks it cached the slow
            // way (while all slots were taken) would be missing from the index.
            if rep.slot.is_none() && rep.cache.is_empty() {
                rep.slot = self.prefix_index.take_slot();
            }
            let index = &mut self.prefix_index;
            match rep.slot {
                Some(slot) => rep.cache.touch(&r.blocks, |b, added| {
                    if added {
                        index.add(slot, b);
                    } else {
                        index.remove(slot, b);
                    }
                }),
                None => rep.cache.touch(&r.blocks, |_, _| {}),
            }
            rep.enqueue(PrefillJob {
                req,
                tokens: len - cached,
                service_s: (len - cached) / rate,
            });
            if rep.running.is_none() {
                // Idle: starts the job; nothing can finish in the same instant (the
                // event loop handed out every finished prompt before routing).
                let done = rep.step(t, self.cfg.prefill_batch_tokens.map(|b| (b, profile)));
                debug_assert!(done.is_none(), "a prompt finished while routing");
            }
        }
    }

    pub(super) fn admit_decode(&mut self) {
        let t = self.t;
        let kv_cap = self.cfg.profile.kv_tokens;
        while let Some(&req) = self.decode_wait.front() {
            let r = &self.trace[req];
            let seq = self.seq_of(req);
            let best = self
                .decode
                .iter()
                .enumerate()
                .filter(|(_, d)| {
                    !d.draining && d.is_ready(t) && d.fits(seq.kv_tokens, self.max_batch, kv_cap)
                })
                .min_by(|a, b| a.1.kv_held().total_cmp(&b.1.kv_held()))
                .map(|(i, _)| i);
            let Some(i) = best else { break };
            self.decode_wait.pop_front();
            if self.cfg.prefills_on_decode(r) {
                let len = f64::from(r.input_tokens.max(1));
                let prefill_s = len / self.cfg.profile.prefill_rate(len);
                self.decode[i].admit_prefilling(t, seq, prefill_s);
            } else {
                self.decode[i].admit(t, seq);
            }
        }
    }
}

/// The gateway's choice of a decode replica for a prompt going to the prefill pool (the
/// least KV held, reservations included), which reserves the prompt's KV there now;
/// `None` where none is ready with room (the request then takes the first replica with
/// room once its prompt is done). Like the engine's reservation, it holds blocks only,
/// not a place in the batch.
fn reserve_decode(
    decode: &mut [DecodeReplica],
    t: f64,
    prompt: f64,
    kv_capacity: f64,
) -> Option<u64> {
    let d = decode
        .iter_mut()
        .filter(|d| !d.draining && d.is_ready(t) && d.has_room(prompt, kv_capacity))
        .min_by(|a, b| a.kv_held().total_cmp(&b.kv_held()))?;
    d.reserve(prompt);
    Some(d.id())
}
