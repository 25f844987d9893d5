//! The event loop: arrivals, KV-aware routing to prefill, admission to decode,
//! completions, and once a second the window the autoscalers see and their decisions.
//! What the autoscalers see is built in [`crate::observe`]; how a decision changes the
//! pools, in [`crate::actuate`].

use std::collections::VecDeque;

use preheat_scaler::policy::Pool;

use crate::autoscalers::{Autoscaler, PoolView};
use crate::cluster::{DecodeReplica, PrefillJob, PrefillReplica, Seq};
use crate::config::{SimConfig, StartClass};
use crate::itl_histogram::ItlCounts;
use crate::per_pool::{POOLS, PerPool};
use crate::prefix_index::{PrefixIndex, SLOTS};
use crate::report::PolicyReport;
use crate::sizing::warm_start;
use crate::trace::{MOONCAKE_BLOCK_TOKENS, TraceRequest};

/// A request's mean inter-token latency; `None` with a single output token.
pub(crate) fn itl_of(r: &TraceRequest, first_token: f64, done: f64) -> Option<f64> {
    (r.output_tokens > 1).then(|| (done - first_token) / f64::from(r.output_tokens - 1))
}

/// Cumulative counters, snapshotted every second for window rates.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counters {
    pub(crate) t: f64,
    pub(crate) arrived: f64,
    pub(crate) prompt_tokens: f64,
    /// Of those, the requests and prompt tokens routed to the prefill pool: a prompt a
    /// decode replica computes counts in the decode pool's metrics, not the prefill
    /// pool's, so the prefill scaler never sees it.
    pub(crate) prefill_arrived: f64,
    pub(crate) prefill_prompt_tokens: f64,
    pub(crate) output_tokens: f64,
    pub(crate) prefix_queries: f64,
    pub(crate) prefix_hits: f64,
    /// Tokens generated, counted as the engine counts them: first tokens when they
    /// come, the rest at the end of each decode step.
    pub(crate) generated: f64,
    /// The decode pool's inter-token gaps, observed at each step as the engine does.
    pub(crate) itl: ItlCounts,
}

/// Whether one request met its targets, as `clairvoyant` tallies them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Outcome {
    /// Its prompt was done within the TTFT SLO (by the prefill pool, or by decode for a
    /// prompt computed there).
    pub(crate) prompt: bool,
    /// Its first token came within the TTFT SLO.
    pub(crate) first: bool,
    /// It then decoded within the ITL SLO.
    pub(crate) decoded: bool,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct ReqState {
    pub(crate) first_token: f64,
    /// When the prefill pool finished its prompt (NaN for a prompt computed on decode):
    /// the prefill engines' TTFT; its K/V lands on decode at the next step boundary,
    /// where the first token streams.
    pub(crate) prompt_done: f64,
    pub(crate) done: f64,
    /// The decode replica that reserved this request's KV when its prompt went to the
    /// prefill pool.
    pub(crate) decode: Option<u64>,
}

pub(crate) struct PoolCtl {
    pub(crate) scaler: Box<dyn Autoscaler>,
    pub(crate) next_decision: f64,
    pub(crate) last_busy: (f64, f64),
    pub(crate) starts: u32,
    pub(crate) events: u32,
    pub(crate) max_replicas: u32,
    /// Busy seconds of replicas already gone.
    pub(crate) retired_busy: f64,
    pub(crate) gpu_s: f64,
    pub(crate) measured_startup: Option<f64>,
    /// Parked standbys, and the times replacements being started will park.
    pub(crate) parked: u32,
    pub(crate) refilling: Vec<f64>,
    /// Of `gpu_s`, seconds standbys spent parked or starting to park.
    pub(crate) standby_gpu_s: f64,
}

impl PoolCtl {
    pub(crate) fn new(scaler: Box<dyn Autoscaler>) -> Self {
        PoolCtl {
            scaler,
            next_decision: 0.0,
            last_busy: (0.0, 0.0),
            starts: 0,
            events: 0,
            max_replicas: 0,
            retired_busy: 0.0,
            gpu_s: 0.0,
            measured_startup: None,
            parked: 0,
            refilling: Vec::new(),
            standby_gpu_s: 0.0,
        }
    }
}

pub(crate) struct Sim<'a> {
    pub(crate) cfg: &'a SimConfig,
    pub(crate) trace: &'a [TraceRequest],
    pub(crate) t: f64,
    pub(crate) next_arrival: usize,
    pub(crate) reqs: Vec<ReqState>,
    pub(crate) prefill: Vec<PrefillReplica>,
    pub(crate) decode: Vec<DecodeReplica>,
    /// The id the next decode replica gets.
    pub(crate) next_decode_id: u64,
    pub(crate) held: VecDeque<usize>,
    pub(crate) decode_wait: VecDeque<usize>,
    pub(crate) ctl: PerPool<PoolCtl>,
    pub(crate) now: Counters,
    pub(crate) history: VecDeque<Counters>,
    pub(crate) recent_ttft: VecDeque<(f64, f64)>,
    pub(crate) timeline: Vec<(f64, u32, u32)>,
    pub(crate) next_second: f64,
    pub(crate) next_sample: f64,
    pub(crate) finished: usize,
    pub(crate) startup: f64,
    pub(crate) max_batch: usize,
    pub(crate) cache_blocks: usize,
    pub(crate) done_buf: Vec<(usize, f64)>,
    pub(crate) first_buf: Vec<(usize, f64)>,
    pub(crate) prefix_index: PrefixIndex,
    /// The attainment below which the run stops as soon as it cannot reach it (the
    /// fixed-size search asks only whether a size passes), the requests known to have
    /// missed their SLOs so far, and whether the run stopped for that.
    fail_below: Option<f64>,
    missed: usize,
    hopeless: bool,
    /// Requests leave at their first token, and prompts computed on decode at their
    /// arrival: the prefill pool alone is simulated (see [`Sim::prefill_only`]).
    prefill_only: bool,
}

impl<'a> Sim<'a> {
    pub(crate) fn new(
        cfg: &'a SimConfig,
        trace: &'a [TraceRequest],
        prefill: Box<dyn Autoscaler>,
        decode: Box<dyn Autoscaler>,
    ) -> Self {
        let cache_blocks = (cfg.profile.kv_tokens / f64::from(MOONCAKE_BLOCK_TOKENS)) as usize;
        let mut ctl = PerPool {
            prefill: PoolCtl::new(prefill),
            decode: PoolCtl::new(decode),
        };
        let (wp, wd) = if cfg.warm_start {
            warm_start(cfg, trace)
        } else {
            (cfg.prefill.min_replicas, cfg.decode.min_replicas)
        };
        let p0 = ctl.prefill.scaler.initial().unwrap_or(wp);
        let d0 = ctl.decode.scaler.initial().unwrap_or(wd);
        ctl.prefill.max_replicas = p0;
        ctl.decode.max_replicas = d0;
        // The replicas that served before the trace have exported their start phases.
        for c in ctl.iter_mut() {
            c.measured_startup = Some(cfg.startup_s());
            if cfg.start == StartClass::Standby && c.scaler.keeps_standbys() {
                c.parked = cfg.standbys;
            }
        }
        Sim {
            cfg,
            trace,
            t: 0.0,
            next_arrival: 0,
            reqs: vec![
                ReqState {
                    first_token: f64::NAN,
                    prompt_done: f64::NAN,
                    done: f64::NAN,
                    decode: None,
                };
                trace.len()
            ],
            prefill: (0..p0)
                .map(|_| PrefillReplica::new(0.0, cache_blocks))
                .collect(),
            decode: (0..d0)
                .map(|id| DecodeReplica::new(0.0).with_id(u64::from(id)))
                .collect(),
            next_decode_id: u64::from(d0),
            held: VecDeque::new(),
            decode_wait: VecDeque::new(),
            ctl,
            now: Counters::default(),
            history: VecDeque::new(),
            recent_ttft: VecDeque::new(),
            timeline: Vec::new(),
            next_second: 0.0,
            next_sample: 0.0,
            finished: 0,
            startup: cfg.startup_s(),
            max_batch: cfg.max_batch(),
            cache_blocks,
            done_buf: Vec::new(),
            first_buf: Vec::new(),
            prefix_index: PrefixIndex::default(),
            fail_below: None,
            missed: 0,
            hopeless: false,
            prefill_only: false,
        }
    }

    /// Simulates the prefill pool alone: a request leaves at its first token and one
    /// whose prompt a decode replica would compute leaves on arrival, so no decode
    /// replica ever runs. The prefill pool's prompts are then done when the full run's
    /// are, at a fraction of its cost (what `clairvoyant`'s prefill search asks; the
    /// full run's first tokens come as each prompt's K/V lands on decode, at most one
    /// decode step later), when nothing in the prefill pool depends on decode:
    /// - no shared host (there busy decode replicas slow prefill);
    /// - a prefill scaler that does not observe (its window holds decode's signals);
    /// - no prompt ever held at the gateway: a held prompt is routed at the next event
    ///   of any kind, decode's included. `clairvoyant`'s schedules keep one replica,
    ///   ready at once, so every prompt is routed on arrival (checked in debug builds).
    #[must_use]
    pub(crate) fn prefill_only(mut self) -> Self {
        debug_assert!(
            self.cfg.shared_host.is_none(),
            "on a shared host decode slows prefill"
        );
        debug_assert!(
            !self.ctl.prefill.scaler.observes(),
            "an observing prefill scaler sees decode"
        );
        self.prefill_only = true;
        self
    }

    /// Runs to the end and reports, or returns `None` as soon as so many requests have
    /// missed their SLOs that the run's attainment cannot reach `target` (the report it
    /// would give has `slo_attainment < target`).
    pub(crate) fn run_unless_below(mut self, target: f64) -> Option<PolicyReport> {
        self.fail_below = Some(target);
        self.run_to_end();
        (!self.hopeless).then(|| self.report())
    }

    /// Counts a request that missed its SLO, and stops a run that can no longer reach
    /// its `fail_below` target (as the report computes attainment: met over all).
    fn count_miss(&mut self) {
        self.missed += 1;
        if let Some(target) = self.fail_below {
            let n = self.trace.len().max(1);
            let best = n.saturating_sub(self.missed) as f64 / n as f64;
            self.hopeless |= best < target;
        }
    }

    pub(crate) fn run(mut self) -> PolicyReport {
        self.run_to_end();
        self.report()
    }

    /// Runs to the end; each request's first token time (NaN if none came).
    #[cfg(test)]
    pub(crate) fn run_first_tokens(mut self) -> Vec<f64> {
        self.run_to_end();
        self.reqs.iter().map(|r| r.first_token).collect()
    }

    /// Runs to the end; each request's (prompt done, first token) times.
    #[cfg(test)]
    pub(crate) fn run_prompts_done(mut self) -> Vec<(f64, f64)> {
        self.run_to_end();
        self.reqs
            .iter()
            .map(|r| (r.prompt_done, r.first_token))
            .collect()
    }

    /// Runs to the end; per request, whether its prompt was done and its first token
    /// came within the TTFT SLO, and whether it then decoded within the ITL SLO.
    pub(crate) fn run_outcomes(mut self) -> Vec<Outcome> {
        self.run_to_end();
        self.trace
            .iter()
            .zip(&self.reqs)
            .map(|(r, st)| {
                let in_time = |at: f64| !at.is_nan() && self.cfg.ttft_met(r, at - r.t);
                let first = in_time(st.first_token);
                Outcome {
                    // A prompt computed on decode is done when its first token comes.
                    prompt: if st.prompt_done.is_nan() {
                        first
                    } else {
                        in_time(st.prompt_done)
                    },
                    first,
                    decoded: !st.done.is_nan()
                        && self.cfg.itl_met(itl_of(r, st.first_token, st.done)),
                }
            })
            .collect()
    }

    fn run_to_end(&mut self) {
        let last_arrival = self.trace.last().map_or(0.0, |r| r.t);
        let give_up = last_arrival + self.cfg.max_drain_s;
        loop {
            let next = self.next_event_time();
            if !next.is_finite() || next > give_up {
                self.advance_clock(next.min(give_up));
                break;
            }
            self.advance_clock(next);
            self.process();
            if self.finished == self.trace.len() || self.hopeless {
                break;
            }
        }
    }

    fn next_event_time(&self) -> f64 {
        // Plain comparisons, not `f64::min`, whose NaN handling cost a tenth of the event
        // loop; they skip a NaN just as it does (`next` starts at a whole second).
        let mut next = self.next_second;
        let mut sooner = |at: f64| {
            if at < next {
                next = at;
            }
        };
        if let Some(r) = self.trace.get(self.next_arrival) {
            sooner(r.t);
        }
        for r in &self.prefill {
            sooner(r.next_event(self.t));
        }
        for r in &self.decode {
            sooner(r.next_event(self.t, &self.cfg.profile));
        }
        next.max(self.t)
    }

    fn advance_clock(&mut self, to: f64) {
        let dt = (to - self.t).max(0.0);
        self.ctl.prefill.gpu_s += dt * self.prefill.len() as f64;
        self.ctl.decode.gpu_s += dt * self.decode.len() as f64;
        for c in self.ctl.iter_mut() {
            let held = dt * f64::from(c.parked + c.refilling.len() as u32);
            c.gpu_s += held;
            c.standby_gpu_s += held;
        }
        self.t = to;
    }

    fn process(&mut self) {
        let t = self.t;
        // Decode first: completions free room for sequences prefilled now.
        let mut done = std::mem::take(&mut self.done_buf);
        let mut first = std::mem::take(&mut self.first_buf);
        for r in &mut self.decode {
            if r.is_ready(t) {
                let stepped = r.advance(t, &self.cfg.profile, &mut first, &mut done);
                self.now.generated += stepped.tokens;
                self.now.itl.observe(stepped.gap_s, stepped.gaps);
                self.now.itl.observe(stepped.long_gap_s, stepped.long_gaps);
            }
        }
        // First tokens before completions: a one-token request gives both at once.
        for (req, at) in first.drain(..) {
            self.record_first_token(req, at);
        }
        for (req, at) in done.drain(..) {
            self.finish(req, at);
        }
        self.done_buf = done;
        self.first_buf = first;
        // Prefill completions and newly ready replicas: only those with something due
        // (a step of any other is a no-op, and there are tens of them at every event).
        let cfg = self.cfg;
        let batching = cfg.prefill_batch_tokens.map(|b| (b, &cfg.profile));
        for i in 0..self.prefill.len() {
            if self.prefill[i].next_event(t) > t {
                continue;
            }
            while let Some(req) = self.prefill[i].step(t, batching) {
                self.first_token(req, t);
            }
        }
        // Arrivals.
        while let Some(r) = self.trace.get(self.next_arrival)
            && r.t <= t
        {
            let i = self.next_arrival;
            self.next_arrival += 1;
            self.now.arrived += 1.0;
            self.now.prompt_tokens += f64::from(r.input_tokens);
            self.now.output_tokens += f64::from(r.output_tokens);
            if self.cfg.prefills_on_decode(r) {
                if self.prefill_only {
                    self.finished += 1;
                } else {
                    self.decode_wait.push_back(i);
                }
            } else {
                self.now.prefill_arrived += 1.0;
                self.now.prefill_prompt_tokens += f64::from(r.input_tokens);
                self.held.push_back(i);
            }
            for pool in POOLS {
                let current = self.current(pool);
                if current == 0 && self.ctl[pool].scaler.wakes_on_arrival() {
                    self.decide(pool);
                }
            }
        }
        self.route_held();
        debug_assert!(
            !self.prefill_only || self.held.is_empty(),
            "a prompt held while decode is not simulated would be routed at other times"
        );
        self.admit_decode();
        self.retire_drained();
        if let Some(slots) = self.cfg.shared_host {
            self.share_host(slots);
        }
        if t >= self.next_second {
            self.second();
        }
    }

    /// On a shared host, every replica's speed from now: its share of the compute
    /// among the replicas computing at this moment.
    fn share_host(&mut self, slots: f64) {
        let t = self.t;
        let busy = self
            .prefill
            .iter()
            .filter(|r| r.is_ready(t) && r.is_busy())
            .count()
            + self
                .decode
                .iter()
                .filter(|r| r.is_ready(t) && !r.is_empty())
                .count();
        // A NaN share would stop every replica for ever: the floor instead.
        let share = slots / busy.max(1) as f64;
        let speed = if share.is_nan() {
            1e-3
        } else {
            // The measured slowdown is beyond the share of the cores, which is at most
            // all of one replica's.
            (share.min(1.0) / slowdown_at(&self.cfg.shared_host_slowdown, busy as f64))
                .clamp(1e-3, 1.0)
        };
        for r in &mut self.prefill {
            r.set_speed(t, speed);
        }
        for r in &mut self.decode {
            r.set_speed(t, speed);
        }
    }

    /// The prefill pool finished a prompt: its first token streams from decode, or
    /// from here when decode is not simulated or nothing follows it.
    fn first_token(&mut self, req: usize, t: f64) {
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

    fn record_first_token(&mut self, req: usize, t: f64) {
        let r = &self.trace[req];
        self.reqs[req].first_token = t;
        self.now.generated += 1.0;
        if self.fail_below.is_some() && !self.cfg.ttft_met(r, t - r.t) {
            self.count_miss();
        }
    }

    fn finish(&mut self, req: usize, at: f64) {
        let r = &self.trace[req];
        let st = &mut self.reqs[req];
        st.done = at;
        self.finished += 1;
        // A late first token was counted when it came.
        if self.fail_below.is_some()
            && self.cfg.ttft_met(r, st.first_token - r.t)
            && !self.cfg.itl_met(itl_of(r, st.first_token, at))
        {
            self.count_miss();
        }
    }

    /// Routes requests held at the gateway to ready prefill replicas (KV-aware).
    fn route_held(&mut self) {
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

    fn admit_decode(&mut self) {
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

    pub(crate) fn retire_drained(&mut self) {
        let mut busy = 0.0;
        let index = &mut self.prefix_index;
        self.prefill.retain(|r| {
            let gone = r.draining && r.is_empty();
            if gone {
                busy += r.busy_s;
                if let Some(slot) = r.slot {
                    index.release(slot, r.cache.blocks());
                }
            }
            !gone
        });
        self.ctl.prefill.retired_busy += busy;
        let mut busy = 0.0;
        self.decode.retain(|r| {
            let gone = r.draining && r.is_idle();
            if gone {
                busy += r.busy_s;
            }
            !gone
        });
        self.ctl.decode.retired_busy += busy;
    }

    /// Once a second: window snapshot, due decisions, timeline sample.
    fn second(&mut self) {
        let t = self.t;
        self.now.t = t;
        self.history.push_back(self.now);
        let w = self.cfg.window_s;
        while self.history.front().is_some_and(|c| c.t < t - w) {
            self.history.pop_front();
        }
        while self.recent_ttft.front().is_some_and(|x| x.0 < t - w) {
            self.recent_ttft.pop_front();
        }
        for pool in POOLS {
            if t >= self.ctl[pool].next_decision {
                self.decide(pool);
            }
        }
        if t >= self.next_sample {
            // The pools' sizes as the scaler and HPA count them (and `preheat up`
            // reports them): draining replicas, still finishing what they hold, are
            // already gone from the count, though their GPU time is charged.
            self.timeline
                .push((t, self.current(Pool::Prefill), self.current(Pool::Decode)));
            self.next_sample += self.cfg.sample_s;
        }
        self.next_second = t.floor() + 1.0;
    }

    fn decide(&mut self, pool: Pool) {
        let v = if self.ctl[pool].scaler.observes() {
            self.view(pool)
        } else {
            PoolView {
                t: self.t,
                current: self.current(pool),
                ..PoolView::default()
            }
        };
        let desired = self.ctl[pool].scaler.decide(&v);
        tracing::trace!(
            t = v.t,
            pool = pool.as_str(),
            current = v.current,
            ready = v.ready,
            held = v.held,
            waiting = v.waiting,
            running = v.running,
            prompt_rate = v.signals.prompt_rate,
            peak = v.signals.prompt_rate_peak,
            hit = v.signals.prefix_hit_rate,
            queued = v.signals.queued_prompt_tokens,
            ttft_p90 = ?v.signals.ttft_p90,
            kv = v.signals.kv_usage,
            desired,
            "decision"
        );
        let busy = self.busy_s(pool);
        let ctl = &mut self.ctl[pool];
        ctl.last_busy = (v.t, busy);
        ctl.next_decision = v.t + ctl.scaler.period_s();
        self.apply(pool, desired, v.current);
    }
}

/// `points`' slowdown at `busy` replicas computing: 1.0 for one replica or none,
/// linear from there to the first point and between the points, and the last one's
/// beyond it. A factor under 1.0 (faster than the share of the cores, which
/// compute-bound replicas cannot be) or not a number counts as 1.0.
pub(crate) fn slowdown_at(points: &[(f64, f64)], busy: f64) -> f64 {
    let f = |v: f64| if v.is_finite() && v >= 1.0 { v } else { 1.0 };
    // One replica alone runs at its share: the curve starts at (1, 1.0).
    let mut prev = (1.0, 1.0);
    for &(k, v) in points {
        let v = f(v);
        if busy <= k {
            if busy <= prev.0 {
                return prev.1;
            }
            return prev.1 + (v - prev.1) * (busy - prev.0) / (k - prev.0);
        }
        prev = (k, v);
    }
    prev.1
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
