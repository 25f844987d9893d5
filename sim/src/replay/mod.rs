//! The event loop: arrivals, KV-aware routing to prefill, admission to decode,
//! completions, and once a second the window the autoscalers see and their decisions.
//! What the autoscalers see is built in [`crate::observe`]; how a decision changes the
//! pools, in [`crate::actuate`]; where the gateway sends requests, in `routing`; how
//! requests are scored, in `scoring`.

mod placement;
mod routing;
mod scoring;
mod shared_host;
mod state;

use std::collections::VecDeque;

use preheat_scaler::policy::Pool;

use crate::autoscalers::{Autoscaler, PoolView};
use crate::cluster::{DecodeReplica, PrefillReplica};
use crate::config::{SimConfig, StartClass};
use crate::per_pool::{POOLS, PerPool};
use crate::prefix_index::PrefixIndex;
use crate::report::PolicyReport;
use crate::rule_of_thumb::warm_start;
use crate::trace::{MOONCAKE_BLOCK_TOKENS, TraceRequest};

pub(crate) use placement::{Placement, Start};
pub(crate) use scoring::RequestScore;
pub(crate) use state::{Counters, Outcome};
use state::{PoolCtl, ReqState};

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
    /// In a fleet: where starts go and what they take (`None`: every start takes the
    /// config's start-up time on a node of its own).
    pub(crate) placement: Option<Box<dyn Placement + 'a>>,
    /// Whether arrivals are marked when they find a pool they need with no replica
    /// serving (a fleet's cold requests; the single-model report does not ask).
    mark_cold: bool,
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
                    cold: false,
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
            placement: None,
            mark_cold: false,
        }
    }

    /// The same run with its starts placed by a fleet.
    #[must_use]
    pub(crate) fn placed(mut self, mut placement: Box<dyn Placement + 'a>) -> Self {
        // The replicas that served before the trace hold GPUs too; one the fleet has
        // no GPU for was never there.
        self.prefill
            .retain_mut(|r| placement.initial().map(|n| r.node = n).is_some());
        self.decode
            .retain_mut(|r| placement.initial().map(|n| r.node = n).is_some());
        self.placement = Some(placement);
        self
    }

    /// The same run marking the requests that arrive with no replica serving in a pool
    /// they need ([`RequestScore::cold`]).
    #[must_use]
    pub(crate) fn marking_cold(mut self) -> Self {
        self.mark_cold = true;
        self
    }

    /// Whether every request of its trace is done.
    pub(crate) fn all_done(&self) -> bool {
        self.finished == self.trace.len()
    }

    /// Advances to `t` (no earlier than [`Sim::next_event_time`]'s answer) and handles
    /// what is due then.
    pub(crate) fn step_to(&mut self, t: f64) {
        self.advance_clock(t);
        self.process();
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

    /// Charges held replicas up to `t` when the run stops there (a fleet's give-up).
    pub(crate) fn stop_at(&mut self, t: f64) {
        if t > self.t {
            self.advance_clock(t);
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

    /// When this run's next event is: at most a second away (its tick), so a fleet
    /// stepping many runs in time order keeps scaling a model's pools once its
    /// requests are done.
    pub(crate) fn next_event_time(&self) -> f64 {
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
            let on_decode = self.cfg.prefills_on_decode(r);
            if self.mark_cold {
                self.reqs[i].cold = !self.has_ready(Pool::Decode)
                    || !on_decode && !self.prefill_only && !self.has_ready(Pool::Prefill);
            }
            if on_decode {
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

    /// Whether the pool has a replica serving now.
    fn has_ready(&self, pool: Pool) -> bool {
        let t = self.t;
        match pool {
            Pool::Prefill => self.prefill.iter().any(|r| !r.draining && r.is_ready(t)),
            Pool::Decode => self.decode.iter().any(|r| !r.draining && r.is_ready(t)),
        }
    }

    pub(crate) fn retire_drained(&mut self) {
        let mut busy = 0.0;
        let index = &mut self.prefix_index;
        let placement = &mut self.placement;
        self.prefill.retain(|r| {
            let gone = r.draining && r.is_empty();
            if gone {
                busy += r.busy_s;
                if let Some(p) = placement.as_mut() {
                    p.stop(r.node);
                }
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
                if let Some(p) = placement.as_mut() {
                    p.stop(r.node);
                }
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
