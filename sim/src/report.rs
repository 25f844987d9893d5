//! What a run reports: per policy, and for the whole comparison on one trace.

use preheat_scaler::percentile::percentile;
use serde::Serialize;

use crate::config::StartClass;
use crate::keda::Actuation;
use crate::per_pool::PerPool;
use crate::replay::{Sim, itl_of};
use crate::trace::TraceRequest;

/// One policy's results.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    pub name: String,
    /// The policy's knob setting (see [`crate::registry::knob`]); `None` for the
    /// references.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub knob: Option<f64>,
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
    /// (time, prefill replicas, decode replicas) every `sample_s`, as the scaler counts
    /// them: draining replicas are out of the count (their GPU time is in `gpu_seconds`).
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
    /// How `preheat`'s decisions reach the pools.
    pub actuation: Actuation,
    pub profile_source: String,
    /// (time, prompt tokens/s, requests/s) per `sample_s` bin.
    pub load: Vec<(f64, f64, f64)>,
    pub policies: Vec<PolicyReport>,
}

/// Prompt tokens/s and requests/s of the trace per `bin` seconds.
pub(crate) fn load_series(trace: &[TraceRequest], bin: f64) -> Vec<(f64, f64, f64)> {
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

impl Sim<'_> {
    /// The report of a run that has ended.
    pub(crate) fn report(self) -> PolicyReport {
        let mut ttft = Vec::new();
        let mut itl = Vec::new();
        let mut ok = 0usize;
        let mut unfinished = 0usize;
        for (r, st) in self.trace.iter().zip(&self.reqs) {
            if st.done.is_nan() {
                unfinished += 1;
                continue;
            }
            let tt = st.first_token - r.t;
            let it = itl_of(r, st.first_token, st.done);
            ttft.push(tt);
            if let Some(i) = it {
                itl.push(i);
            }
            if self.cfg.ttft_met(r, tt) && self.cfg.itl_met(it) {
                ok += 1;
            }
        }
        let pct = |v: &mut Vec<f64>, q: f64| percentile(v, q).unwrap_or(f64::NAN);
        let n = self.trace.len().max(1);
        let PerPool {
            prefill: p,
            decode: d,
        } = &self.ctl;
        PolicyReport {
            name: String::new(),
            knob: None,
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
        }
    }
}
