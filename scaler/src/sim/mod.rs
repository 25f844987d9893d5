//! A discrete-event simulator of a disaggregated deployment under a request trace, to
//! compare autoscaling policies: the scaler's own ([`crate::policy::PreheatPolicy`],
//! the same code the KEDA scaler runs) and the baselines in [`autoscalers`].
//!
//! The model: requests arrive at a gateway; a KV-aware router sends each to the ready
//! prefill replica that would finish it first (its backlog plus the part of the prompt
//! not in that replica's prefix cache); the first token comes out of prefill; a decode
//! replica with room (batch and KV) takes the sequence and decodes the rest under
//! continuous batching. A pool with no ready replica holds requests at the gateway.
//! New replicas serve after the profile's start-up time; removed replicas drain what
//! they hold. GPU-seconds count every replica from its start to its exit. Everything is
//! deterministic: the same trace and settings give the same report.

pub mod autoscalers;
pub mod clairvoyant;
pub mod cluster;
pub mod trace;

use std::cell::OnceCell;
use std::collections::VecDeque;

use serde::Serialize;

use self::autoscalers::{
    Autoscaler, Capacity, HpaUtilization, KedaQueue, Kpa, POLICIES, PoolView, Preheat, SlaPlanner,
    Static,
};
use self::cluster::{DecodeReplica, PrefillJob, PrefillReplica, Seq};
use self::trace::{MOONCAKE_BLOCK_TOKENS, TraceRequest};
use crate::policy::{Pool, PoolPolicy};
use crate::profile::Profile;
use crate::signals::PoolSignals;

/// How warm a new replica's node is, which sets its start-up time from the profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StartClass {
    Cold,
    Staged,
    Hot,
    Standby,
}

impl StartClass {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "cold" => StartClass::Cold,
            "staged" => StartClass::Staged,
            "hot" => StartClass::Hot,
            "standby" => StartClass::Standby,
            _ => return None,
        })
    }

    fn seconds(self, p: &Profile) -> f64 {
        let s = &p.startup_s;
        match self {
            StartClass::Cold => s.cold,
            StartClass::Staged => s.staged,
            StartClass::Hot => s.hot,
            StartClass::Standby => s.standby,
        }
    }
}

/// Simulation settings.
#[derive(Clone, Debug)]
#[must_use]
pub struct SimConfig {
    pub prefill: PoolPolicy,
    pub decode: PoolPolicy,
    pub profile: Profile,
    pub start: StartClass,
    /// The preheat scaler's decision interval.
    pub interval_s: f64,
    /// The scaler's metric window.
    pub window_s: f64,
    /// How long after the last arrival unfinished requests may still complete.
    pub max_drain_s: f64,
    /// Timeline resolution of the report.
    pub sample_s: f64,
    /// With `start` = `Standby`: parked standbys kept per pool. A scale-up promotes
    /// them first (the profile's standby time) and starts the rest hot; each promoted
    /// one is replaced by a hot start. Parked standbys hold a GPU, so their time counts
    /// in GPU-seconds.
    pub standbys: u32,
}

impl SimConfig {
    pub fn new(prefill: PoolPolicy, decode: PoolPolicy, profile: Profile) -> Self {
        SimConfig {
            prefill,
            decode,
            profile,
            start: StartClass::Hot,
            interval_s: 5.0,
            window_s: 60.0,
            max_drain_s: 1800.0,
            sample_s: 10.0,
            standbys: 1,
        }
    }

    fn startup_s(&self) -> f64 {
        self.start.seconds(&self.profile)
    }

    fn max_batch(&self) -> usize {
        self.profile
            .decode_itl_s
            .last()
            .map_or(1, |p| p.0.max(1.0) as usize)
    }

    /// Whether a finished request met both SLOs.
    fn attained(&self, r: &TraceRequest, ttft: f64, itl: Option<f64>) -> bool {
        ttft <= self.prefill.ttft_slo_for(f64::from(r.input_tokens)) + 1e-9
            && itl.is_none_or(|i| i <= self.decode.slo_itl_s + 1e-9)
    }
}

/// One policy's results.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    pub name: String,
    pub slo_attainment: f64,
    pub gpu_seconds: f64,
    pub prefill_gpu_seconds: f64,
    pub decode_gpu_seconds: f64,
    /// Of `gpu_seconds`, what parked standbys held (`--start standby`).
    pub standby_gpu_seconds: f64,
    /// Replicas started (each pays the start-up time).
    pub cold_starts: u32,
    /// Decisions that changed a pool's replica count.
    pub scale_events: u32,
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub itl_p50: f64,
    pub itl_p99: f64,
    pub requests: usize,
    /// Requests still unanswered when the simulation gave up on them.
    pub unfinished: usize,
    pub prefix_hit_rate: f64,
    pub max_prefill_replicas: u32,
    pub max_decode_replicas: u32,
    /// For `static-peak`: the replica counts it found.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixed_replicas: Option<(u32, u32)>,
    /// (time, prefill replicas, decode replicas) every `sample_s`.
    pub timeline: Vec<(f64, u32, u32)>,
}

/// Results of every policy run on one trace.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub trace: String,
    pub requests: usize,
    pub trace_span_s: f64,
    pub slo_ttft_s: f64,
    pub slo_ttft_ref_tokens: f64,
    pub slo_itl_s: f64,
    pub start_class: StartClass,
    pub startup_s: f64,
    /// Parked standbys per pool (`start_class` standby only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub standbys: Option<u32>,
    pub profile_source: String,
    /// (time, prompt tokens/s, requests/s) per `sample_s` bin.
    pub load: Vec<(f64, f64, f64)>,
    pub policies: Vec<PolicyReport>,
}

/// Unknown policy name.
#[derive(Debug, thiserror::Error)]
#[error("unknown policy {0:?} (expected one of: {list}, or all)", list = POLICIES.join(", "))]
pub struct UnknownPolicy(pub String);

/// A policy's (prefill, decode) autoscalers, and its fixed sizes if it has them.
type PolicyPair = (Box<dyn Autoscaler>, Box<dyn Autoscaler>, Option<(u32, u32)>);

/// Builds a policy's pair of autoscalers (prefill, decode). `peak` holds the
/// `static-peak` sizes once searched, shared by the policies that need them.
fn autoscalers(
    name: &str,
    cfg: &SimConfig,
    trace: &[TraceRequest],
    peak: &OnceCell<(u32, u32)>,
) -> Result<PolicyPair, UnknownPolicy> {
    let peak = || *peak.get_or_init(|| static_peak(cfg, trace));
    let prof = &cfg.profile;
    let (cp, cd) = (
        Capacity::new(prof, &cfg.prefill),
        Capacity::new(prof, &cfg.decode),
    );
    let (mp, md) = (cfg.prefill.max_replicas, cfg.decode.max_replicas);
    Ok(match name {
        "preheat" => (
            Box::new(Preheat::new(
                Pool::Prefill,
                cfg.prefill.clone(),
                prof.clone(),
                cfg.interval_s,
            )),
            Box::new(Preheat::new(
                Pool::Decode,
                cfg.decode.clone(),
                prof.clone(),
                cfg.interval_s,
            )),
            None,
        ),
        "static-peak" => {
            let (p, d) = peak();
            (Box::new(Static(p)), Box::new(Static(d)), Some((p, d)))
        }
        "clairvoyant" => {
            let (p, d) = peak();
            let plan = clairvoyant::prefill_plan(cfg, trace, p, d);
            (Box::new(plan), Box::new(Static(d)), None)
        }
        "hpa-utilization" => (
            Box::new(HpaUtilization::new(mp)),
            Box::new(HpaUtilization::new(md)),
            None,
        ),
        "keda-queue" => (
            Box::new(KedaQueue::new(Pool::Prefill, cp, mp)),
            Box::new(KedaQueue::new(Pool::Decode, cd, md)),
            None,
        ),
        "kpa" => (
            Box::new(Kpa::new(Pool::Prefill, cp, mp)),
            Box::new(Kpa::new(Pool::Decode, cd, md)),
            None,
        ),
        "sla-planner" => (
            Box::new(SlaPlanner::new(
                Pool::Prefill,
                cp,
                prof.clone(),
                &cfg.prefill,
            )),
            Box::new(SlaPlanner::new(Pool::Decode, cd, prof.clone(), &cfg.decode)),
            None,
        ),
        other => return Err(UnknownPolicy(other.to_owned())),
    })
}

/// Runs one named policy over the trace.
pub fn run_policy(
    name: &str,
    cfg: &SimConfig,
    trace: &[TraceRequest],
) -> Result<PolicyReport, UnknownPolicy> {
    run_policy_sharing(name, cfg, trace, &OnceCell::new())
}

fn run_policy_sharing(
    name: &str,
    cfg: &SimConfig,
    trace: &[TraceRequest],
    peak: &OnceCell<(u32, u32)>,
) -> Result<PolicyReport, UnknownPolicy> {
    let (p, d, fixed) = autoscalers(name, cfg, trace, peak)?;
    let mut r = Sim::new(cfg, trace, p, d).run();
    r.name = name.to_owned();
    r.fixed_replicas = fixed;
    Ok(r)
}

/// Runs the named policies (or all) and assembles the report; `progress` is told each
/// policy's name as it starts.
pub fn run(
    names: &[String],
    cfg: &SimConfig,
    trace: &[TraceRequest],
    trace_name: &str,
    mut progress: impl FnMut(&str),
) -> Result<SimReport, UnknownPolicy> {
    let list: Vec<String> = if names.iter().any(|n| n == "all") {
        POLICIES.iter().map(|s| (*s).to_owned()).collect()
    } else {
        names.to_vec()
    };
    // Fail on a bad name before minutes of simulation.
    if let Some(bad) = list.iter().find(|n| !POLICIES.contains(&n.as_str())) {
        return Err(UnknownPolicy(bad.clone()));
    }
    let mut policies = Vec::new();
    // `static-peak` and `clairvoyant` both need the static search: done once.
    let peak = OnceCell::new();
    for n in &list {
        progress(n);
        policies.push(run_policy_sharing(n, cfg, trace, &peak)?);
    }
    Ok(SimReport {
        trace: trace_name.to_owned(),
        requests: trace.len(),
        trace_span_s: trace.last().map_or(0.0, |r| r.t),
        slo_ttft_s: cfg.prefill.slo_ttft_s,
        slo_ttft_ref_tokens: cfg.prefill.slo_ttft_ref_tokens,
        slo_itl_s: cfg.decode.slo_itl_s,
        start_class: cfg.start,
        startup_s: cfg.startup_s(),
        standbys: (cfg.start == StartClass::Standby).then_some(cfg.standbys),
        profile_source: cfg.profile.source.clone(),
        load: load_series(trace, cfg.sample_s),
        policies,
    })
}

fn load_series(trace: &[TraceRequest], bin: f64) -> Vec<(f64, f64, f64)> {
    let span = trace.last().map_or(0.0, |r| r.t);
    let n = (span / bin).floor() as usize + 1;
    let mut tokens = vec![0.0; n];
    let mut reqs = vec![0.0; n];
    for r in trace {
        let i = ((r.t / bin) as usize).min(n - 1);
        tokens[i] += f64::from(r.input_tokens);
        reqs[i] += 1.0;
    }
    (0..n)
        .map(|i| (i as f64 * bin, tokens[i] / bin, reqs[i] / bin))
        .collect()
}

/// The fewest fixed (prefill, decode) replicas meeting 99% SLO attainment on the whole
/// trace: prefill sized with decode plentiful, then decode with that prefill, then both
/// raised together if the pair falls short; the maxima when nothing reaches 99%.
fn static_peak(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32) {
    const TARGET: f64 = 0.99;
    let run = |p: u32, d: u32| {
        Sim::new(cfg, trace, Box::new(Static(p)), Box::new(Static(d)))
            .run()
            .slo_attainment
    };
    let (mp, md) = (cfg.prefill.max_replicas, cfg.decode.max_replicas);
    let smallest = |max: u32, ok: &dyn Fn(u32) -> bool| {
        let (mut lo, mut hi) = (1, max);
        if !ok(hi) {
            return max;
        }
        while lo < hi {
            let mid = (lo + hi) / 2;
            if ok(mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    };
    let plenty_d = md.min(16);
    let p = smallest(mp, &|p| run(p, plenty_d) >= TARGET);
    let d = smallest(md, &|d| run(p, d) >= TARGET);
    let (mut p, mut d) = (p, d);
    while run(p, d) < TARGET && (p < mp || d < md) {
        p = (p + 1).min(mp);
        d = (d + 1).min(md);
    }
    (p, d)
}

/// Replicas a deployment already serving the trace's opening load would have: the
/// first minute's prompt tokens/s over one replica's rate at 70%, and its concurrent
/// sequences (Little's law) over one replica's batch at the ITL SLO. Every dynamic
/// policy starts from here, so none pays for a trace that opens at full load.
fn warm_start(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32) {
    let first: Vec<&TraceRequest> = trace.iter().take_while(|r| r.t < 60.0).collect();
    if first.is_empty() {
        return (1, 1);
    }
    let n = first.len() as f64;
    let tokens: f64 = first.iter().map(|r| f64::from(r.input_tokens)).sum();
    let out: f64 = first.iter().map(|r| f64::from(r.output_tokens)).sum();
    let p = cfg.profile.prefill_rate(tokens / n);
    let prefill = (tokens / 60.0 / (0.7 * p)).ceil().max(1.0);
    let batch = cfg.profile.max_batch_at(cfg.decode.slo_itl_s);
    let seqs = out / 60.0 * cfg.profile.itl(batch);
    let decode = (seqs / batch).ceil().max(1.0);
    let cap = |x: f64, max: u32| (x as u32).clamp(1, max.max(1));
    (
        cap(prefill, cfg.prefill.max_replicas),
        cap(decode, cfg.decode.max_replicas),
    )
}

/// Cumulative counters, snapshotted every second for window rates.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    t: f64,
    arrived: f64,
    prompt_tokens: f64,
    output_tokens: f64,
    prefix_queries: f64,
    prefix_hits: f64,
    generated: f64,
}

#[derive(Clone, Copy, Debug)]
struct ReqState {
    first_token: f64,
    done: f64,
}

struct PoolCtl {
    scaler: Box<dyn Autoscaler>,
    next_decision: f64,
    last_busy: (f64, f64),
    starts: u32,
    events: u32,
    max_replicas: u32,
    /// Busy seconds of replicas already gone.
    retired_busy: f64,
    gpu_s: f64,
    measured_startup: Option<f64>,
    /// Parked standbys, and the times replacements being started will park.
    parked: u32,
    refilling: Vec<f64>,
    /// Of `gpu_s`, seconds standbys spent parked or starting to park.
    standby_gpu_s: f64,
}

impl PoolCtl {
    fn new(scaler: Box<dyn Autoscaler>) -> Self {
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

struct Sim<'a> {
    cfg: &'a SimConfig,
    trace: &'a [TraceRequest],
    t: f64,
    next_arrival: usize,
    reqs: Vec<ReqState>,
    prefill: Vec<PrefillReplica>,
    decode: Vec<DecodeReplica>,
    held: VecDeque<usize>,
    decode_wait: VecDeque<usize>,
    ctl: [PoolCtl; 2],
    now: Counters,
    history: VecDeque<Counters>,
    recent_ttft: VecDeque<(f64, f64)>,
    recent_itl: VecDeque<(f64, f64)>,
    timeline: Vec<(f64, u32, u32)>,
    next_second: f64,
    next_sample: f64,
    finished: usize,
    startup: f64,
    max_batch: usize,
    cache_blocks: usize,
    done_buf: Vec<(usize, f64)>,
}

const PREFILL: usize = 0;
const DECODE: usize = 1;

impl<'a> Sim<'a> {
    fn new(
        cfg: &'a SimConfig,
        trace: &'a [TraceRequest],
        prefill: Box<dyn Autoscaler>,
        decode: Box<dyn Autoscaler>,
    ) -> Self {
        let cache_blocks = (cfg.profile.kv_tokens / f64::from(MOONCAKE_BLOCK_TOKENS)) as usize;
        let mut ctl = [PoolCtl::new(prefill), PoolCtl::new(decode)];
        let (wp, wd) = warm_start(cfg, trace);
        let p0 = ctl[PREFILL].scaler.initial().unwrap_or(wp);
        let d0 = ctl[DECODE].scaler.initial().unwrap_or(wd);
        ctl[PREFILL].max_replicas = p0;
        ctl[DECODE].max_replicas = d0;
        // The replicas that served before the trace have exported their start phases.
        for c in &mut ctl {
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
                    done: f64::NAN
                };
                trace.len()
            ],
            prefill: (0..p0)
                .map(|_| PrefillReplica::new(0.0, cache_blocks))
                .collect(),
            decode: (0..d0).map(|_| DecodeReplica::new(0.0)).collect(),
            held: VecDeque::new(),
            decode_wait: VecDeque::new(),
            ctl,
            now: Counters::default(),
            history: VecDeque::new(),
            recent_ttft: VecDeque::new(),
            recent_itl: VecDeque::new(),
            timeline: Vec::new(),
            next_second: 0.0,
            next_sample: 0.0,
            finished: 0,
            startup: cfg.startup_s(),
            max_batch: cfg.max_batch(),
            cache_blocks,
            done_buf: Vec::new(),
        }
    }

    fn run(self) -> PolicyReport {
        self.run_detailed().0
    }

    /// Runs to the end; the report and, per request, whether it attained its SLOs.
    fn run_detailed(mut self) -> (PolicyReport, Vec<bool>) {
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
            if self.finished == self.trace.len() {
                break;
            }
        }
        self.report_detailed()
    }

    fn next_event_time(&self) -> f64 {
        let mut next = self.next_second;
        if let Some(r) = self.trace.get(self.next_arrival) {
            next = next.min(r.t);
        }
        for r in &self.prefill {
            next = next.min(r.next_event(self.t));
        }
        for r in &self.decode {
            next = next.min(r.next_event(self.t, &self.cfg.profile));
        }
        next.max(self.t)
    }

    fn advance_clock(&mut self, to: f64) {
        let dt = (to - self.t).max(0.0);
        self.ctl[PREFILL].gpu_s += dt * self.prefill.len() as f64;
        self.ctl[DECODE].gpu_s += dt * self.decode.len() as f64;
        for c in &mut self.ctl {
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
        for r in &mut self.decode {
            if r.is_ready(t) {
                r.advance(t, &self.cfg.profile, &mut done);
            }
        }
        for (req, at) in done.drain(..) {
            self.finish(req, at);
        }
        self.done_buf = done;
        // Prefill completions and newly ready replicas.
        for i in 0..self.prefill.len() {
            if !self.prefill[i].is_ready(t) {
                continue;
            }
            while let Some(req) = self.prefill[i].step(t) {
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
            self.held.push_back(i);
            for pool in [PREFILL, DECODE] {
                let current = self.current(pool);
                if current == 0 && self.ctl[pool].scaler.wakes_on_arrival() {
                    self.decide(pool);
                }
            }
        }
        self.route_held();
        self.admit_decode();
        self.retire_drained();
        if t >= self.next_second {
            self.second();
        }
    }

    fn first_token(&mut self, req: usize, t: f64) {
        let r = &self.trace[req];
        self.reqs[req].first_token = t;
        self.now.generated += 1.0;
        let ttft = t - r.t;
        self.recent_ttft.push_back((t, ttft));
        if r.output_tokens <= 1 {
            self.finish(req, t);
        } else {
            self.decode_wait.push_back(req);
        }
    }

    fn finish(&mut self, req: usize, at: f64) {
        let r = &self.trace[req];
        let st = &mut self.reqs[req];
        st.done = at;
        self.finished += 1;
        if r.output_tokens > 1 {
            let itl = (at - st.first_token) / f64::from(r.output_tokens - 1);
            self.recent_itl.push_back((at, itl));
            self.now.generated += f64::from(r.output_tokens - 1);
        }
    }

    /// Routes requests held at the gateway to ready prefill replicas (KV-aware).
    fn route_held(&mut self) {
        let t = self.t;
        let profile = &self.cfg.profile;
        while let Some(&req) = self.held.front() {
            let r = &self.trace[req];
            let len = f64::from(r.input_tokens);
            let rate = profile.prefill_rate(len);
            let mut best: Option<(f64, usize, f64)> = None;
            for (i, rep) in self.prefill.iter().enumerate() {
                if rep.draining || !rep.is_ready(t) {
                    continue;
                }
                let cached = (rep.cache.overlap(&r.blocks) as f64
                    * f64::from(MOONCAKE_BLOCK_TOKENS))
                .min(len - 1.0);
                let work = (len - cached) / rate;
                let cost = rep.backlog_s(t) + work;
                if best.is_none_or(|b| cost < b.0) {
                    best = Some((cost, i, cached));
                }
            }
            let Some((_, i, cached)) = best else { break };
            self.held.pop_front();
            self.now.prefix_queries += len;
            self.now.prefix_hits += cached;
            let rep = &mut self.prefill[i];
            rep.cache.touch(&r.blocks);
            rep.queue.push_back(PrefillJob {
                req,
                tokens: len - cached,
                service_s: (len - cached) / rate,
            });
            if rep.running.is_none() {
                // Idle: starts the job; nothing can finish in the same instant.
                rep.step(t);
            }
        }
    }

    fn admit_decode(&mut self) {
        let t = self.t;
        let kv_cap = self.cfg.profile.kv_tokens;
        while let Some(&req) = self.decode_wait.front() {
            let r = &self.trace[req];
            let kv = f64::from(r.input_tokens) + f64::from(r.output_tokens);
            let best = self
                .decode
                .iter()
                .enumerate()
                .filter(|(_, d)| !d.draining && d.is_ready(t) && d.fits(kv, self.max_batch, kv_cap))
                .min_by(|a, b| a.1.kv_used.total_cmp(&b.1.kv_used))
                .map(|(i, _)| i);
            let Some(i) = best else { break };
            self.decode_wait.pop_front();
            self.decode[i].admit(
                t,
                Seq {
                    req,
                    remaining: r.output_tokens - 1,
                    kv_tokens: kv,
                },
            );
        }
    }

    fn retire_drained(&mut self) {
        let mut busy = 0.0;
        self.prefill.retain(|r| {
            let gone = r.draining && r.is_empty();
            if gone {
                busy += r.busy_s;
            }
            !gone
        });
        self.ctl[PREFILL].retired_busy += busy;
        let mut busy = 0.0;
        self.decode.retain(|r| {
            let gone = r.draining && r.seqs.is_empty();
            if gone {
                busy += r.busy_s;
            }
            !gone
        });
        self.ctl[DECODE].retired_busy += busy;
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
        while self.recent_itl.front().is_some_and(|x| x.0 < t - w) {
            self.recent_itl.pop_front();
        }
        for pool in [PREFILL, DECODE] {
            if t >= self.ctl[pool].next_decision {
                self.decide(pool);
            }
        }
        if t >= self.next_sample {
            self.timeline
                .push((t, self.prefill.len() as u32, self.decode.len() as u32));
            self.next_sample += self.cfg.sample_s;
        }
        self.next_second = t.floor() + 1.0;
    }

    fn current(&self, pool: usize) -> u32 {
        let n = if pool == PREFILL {
            self.prefill.iter().filter(|r| !r.draining).count()
        } else {
            self.decode.iter().filter(|r| !r.draining).count()
        };
        n as u32
    }

    fn view(&self, pool: usize) -> PoolView {
        let t = self.t;
        let oldest = self.history.front().copied().unwrap_or_default();
        let span = (t - oldest.t).max(1.0);
        let d = |f: fn(&Counters) -> f64| (f(&self.now) - f(&oldest)) / span;
        let quant = |xs: &VecDeque<(f64, f64)>, q: f64| {
            let mut v: Vec<f64> = xs.iter().map(|x| x.1).collect();
            crate::percentile::percentile(&mut v, q)
        };
        let arrived = self.now.arrived - oldest.arrived;
        let mean_prompt_len =
            (arrived > 0.0).then(|| (self.now.prompt_tokens - oldest.prompt_tokens) / arrived);
        let current = self.current(pool);
        let (ready, busy, mut signals, held, mean_seq_tokens);
        if pool == PREFILL {
            let reps: Vec<&PrefillReplica> =
                self.prefill.iter().filter(|r| r.is_ready(t)).collect();
            ready = reps.len();
            busy =
                self.ctl[PREFILL].retired_busy + self.prefill.iter().map(|r| r.busy_s).sum::<f64>();
            let queries = self.now.prefix_queries - oldest.prefix_queries;
            signals = PoolSignals {
                endpoints_ok: ready,
                waiting: reps.iter().map(|r| r.queue.len() as f64).sum(),
                running: reps.iter().filter(|r| r.running.is_some()).count() as f64,
                queued_prompt_tokens: reps
                    .iter()
                    .flat_map(|r| r.queue.iter())
                    .map(|j| j.tokens)
                    .sum(),
                prompt_rate: d(|c| c.prompt_tokens),
                prompt_rate_peak: self.peak_prompt_rate(),
                peak_span_s: self.cfg.interval_s.max(1.0),
                prefix_hit_rate: if queries > 0.0 {
                    (self.now.prefix_hits - oldest.prefix_hits) / queries
                } else {
                    0.0
                },
                ttft_p50: quant(&self.recent_ttft, 0.5),
                ttft_p90: quant(&self.recent_ttft, 0.9),
                ..PoolSignals::default()
            };
            held = self.held.len() as f64;
            mean_seq_tokens = None;
        } else {
            let reps: Vec<&DecodeReplica> = self.decode.iter().filter(|r| r.is_ready(t)).collect();
            ready = reps.len();
            busy =
                self.ctl[DECODE].retired_busy + self.decode.iter().map(|r| r.busy_s).sum::<f64>();
            let running: f64 = reps.iter().map(|r| r.seqs.len() as f64).sum();
            let kv: f64 = reps.iter().map(|r| r.kv_used).sum();
            signals = PoolSignals {
                endpoints_ok: ready,
                running,
                kv_usage: if ready > 0 {
                    kv / (ready as f64 * self.cfg.profile.kv_tokens)
                } else {
                    0.0
                },
                generation_rate: d(|c| c.generated),
                itl_p50: quant(&self.recent_itl, 0.5),
                itl_p90: quant(&self.recent_itl, 0.9),
                ..PoolSignals::default()
            };
            // With decode replicas up, prefilled requests queue in the pool; at zero,
            // everything in the system is held at the gateway for it.
            if ready > 0 {
                signals.waiting = self.decode_wait.len() as f64;
                held = 0.0;
            } else {
                held = (self.trace.len().min(self.next_arrival) - self.finished) as f64;
            }
            mean_seq_tokens = (running > 0.0).then(|| kv / running);
        }
        let (t0, b0) = self.ctl[pool].last_busy;
        let utilization = if ready > 0 && t > t0 {
            ((busy - b0) / (ready as f64 * (t - t0))).clamp(0.0, 1.0)
        } else {
            0.0
        };
        PoolView {
            t,
            current,
            ready: ready as u32,
            held,
            waiting: signals.waiting,
            running: signals.running,
            utilization,
            signals,
            mean_prompt_len,
            mean_seq_tokens,
            measured_startup_s: self.ctl[pool].measured_startup,
            arrived_requests: self.now.arrived,
            arrived_input_tokens: self.now.prompt_tokens,
            arrived_output_tokens: self.now.output_tokens,
        }
    }

    /// Highest prompt-token rate between the scaler's scrapes (every `interval_s`)
    /// within the window, as the real scaler sees it.
    fn peak_prompt_rate(&self) -> f64 {
        let step = self.cfg.interval_s.max(1.0);
        let mut peak = 0.0f64;
        let mut prev: Option<&Counters> = None;
        for c in &self.history {
            match prev {
                None => prev = Some(c),
                Some(p) if c.t - p.t >= step - 1e-9 => {
                    peak = peak.max((c.prompt_tokens - p.prompt_tokens) / (c.t - p.t));
                    prev = Some(c);
                }
                Some(_) => {}
            }
        }
        peak
    }

    fn decide(&mut self, pool: usize) {
        let v = self.view(pool);
        let desired = self.ctl[pool].scaler.decide(&v);
        tracing::trace!(
            t = v.t,
            pool,
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
        let ctl = &mut self.ctl[pool];
        ctl.last_busy = (
            v.t,
            ctl.retired_busy
                + if pool == PREFILL {
                    self.prefill.iter().map(|r| r.busy_s).sum::<f64>()
                } else {
                    self.decode.iter().map(|r| r.busy_s).sum::<f64>()
                },
        );
        ctl.next_decision = v.t + ctl.scaler.period_s();
        self.apply(pool, desired, v.current);
    }

    fn apply(&mut self, pool: usize, desired: u32, current: u32) {
        let t = self.t;
        if desired == current {
            return;
        }
        let ctl = &mut self.ctl[pool];
        ctl.events += 1;
        if desired > current {
            let add = desired - current;
            ctl.starts += add;
            let standby = self.cfg.start == StartClass::Standby && ctl.scaler.keeps_standbys();
            let hot = self.cfg.profile.startup_s.hot;
            ctl.parked += ctl.refilling.iter().filter(|&&r| r <= t).count() as u32;
            ctl.refilling.retain(|&r| r > t);
            for _ in 0..add {
                let ready_at = if !standby {
                    t + self.startup
                } else if ctl.parked > 0 {
                    ctl.parked -= 1;
                    ctl.refilling.push(t + hot);
                    t + self.startup
                } else {
                    t + hot
                };
                if pool == PREFILL {
                    self.prefill
                        .push(PrefillReplica::new(ready_at, self.cache_blocks));
                } else {
                    self.decode.push(DecodeReplica::new(ready_at));
                }
            }
        } else {
            let mut remove = current - desired;
            // Replicas still starting go first (nothing to drain), newest first; then
            // the least loaded ready ones drain.
            if pool == PREFILL {
                remove_replicas(
                    &mut self.prefill,
                    &mut remove,
                    |r| r.draining,
                    |r| r.is_ready(t),
                    |r| r.backlog_s(t),
                    |r| r.draining = true,
                    &mut ctl.retired_busy,
                    |r| r.busy_s,
                );
            } else {
                remove_replicas(
                    &mut self.decode,
                    &mut remove,
                    |r| r.draining,
                    |r| r.is_ready(t),
                    |r| r.kv_used + r.seqs.len() as f64,
                    |r| r.draining = true,
                    &mut ctl.retired_busy,
                    |r| r.busy_s,
                );
            }
        }
        let n = self.current(pool);
        let ctl = &mut self.ctl[pool];
        ctl.max_replicas = ctl.max_replicas.max(n);
        self.retire_drained();
    }

    /// The report and, per request, whether it attained its SLOs.
    fn report_detailed(self) -> (PolicyReport, Vec<bool>) {
        let mut ttft = Vec::new();
        let mut itl = Vec::new();
        let mut ok = 0usize;
        let mut unfinished = 0usize;
        let mut attained = vec![false; self.trace.len()];
        for (i, (r, st)) in self.trace.iter().zip(&self.reqs).enumerate() {
            if st.done.is_nan() {
                unfinished += 1;
                continue;
            }
            let tt = st.first_token - r.t;
            let it = (r.output_tokens > 1)
                .then(|| (st.done - st.first_token) / f64::from(r.output_tokens - 1));
            ttft.push(tt);
            if let Some(i) = it {
                itl.push(i);
            }
            if self.cfg.attained(r, tt, it) {
                ok += 1;
                attained[i] = true;
            }
        }
        let pct =
            |v: &mut Vec<f64>, q: f64| crate::percentile::percentile(v, q).unwrap_or(f64::NAN);
        let n = self.trace.len().max(1);
        let [p, d] = &self.ctl;
        let report = PolicyReport {
            name: String::new(),
            slo_attainment: ok as f64 / n as f64,
            gpu_seconds: p.gpu_s + d.gpu_s,
            standby_gpu_seconds: p.standby_gpu_s + d.standby_gpu_s,
            prefill_gpu_seconds: p.gpu_s,
            decode_gpu_seconds: d.gpu_s,
            cold_starts: p.starts + d.starts,
            scale_events: p.events + d.events,
            ttft_p50: pct(&mut ttft, 0.5),
            ttft_p99: pct(&mut ttft, 0.99),
            itl_p50: pct(&mut itl, 0.5),
            itl_p99: pct(&mut itl, 0.99),
            requests: self.trace.len(),
            unfinished,
            prefix_hit_rate: if self.now.prefix_queries > 0.0 {
                self.now.prefix_hits / self.now.prefix_queries
            } else {
                0.0
            },
            max_prefill_replicas: p.max_replicas,
            max_decode_replicas: d.max_replicas,
            fixed_replicas: None,
            timeline: self.timeline,
        };
        (report, attained)
    }
}

/// Removes `remove` replicas: starting ones outright (newest first), then marks the
/// least loaded ready ones draining.
#[allow(clippy::too_many_arguments)]
fn remove_replicas<R>(
    reps: &mut Vec<R>,
    remove: &mut u32,
    draining: impl Fn(&R) -> bool,
    ready: impl Fn(&R) -> bool,
    load: impl Fn(&R) -> f64,
    mut drain: impl FnMut(&mut R),
    retired_busy: &mut f64,
    busy: impl Fn(&R) -> f64,
) {
    while *remove > 0 {
        let Some(i) = reps.iter().rposition(|r| !draining(r) && !ready(r)) else {
            break;
        };
        *retired_busy += busy(&reps[i]);
        reps.remove(i);
        *remove -= 1;
    }
    while *remove > 0 {
        let Some(i) = reps
            .iter()
            .enumerate()
            .filter(|(_, r)| !draining(r))
            .min_by(|a, b| load(a.1).total_cmp(&load(b.1)))
            .map(|(i, _)| i)
        else {
            break;
        };
        drain(&mut reps[i]);
        *remove -= 1;
    }
}

#[cfg(test)]
mod tests;
