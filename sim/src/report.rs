//! What a run reports: per policy, and for the whole comparison on one trace.

use serde::Serialize;

use crate::config::StartClass;
use crate::keda::Actuation;
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
