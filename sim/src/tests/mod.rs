//! Whole runs of the simulator: what it serves at fixed sizes, how each policy sizes
//! the pools, sweeps over settings, its fast paths, and what an observing scaler sees.

mod fast_paths;
mod observed;
mod policies;
mod serving;
mod sweeps;

use preheat_scaler::policy::PoolPolicy;
use preheat_scaler::profile::Profile;

use super::autoscalers::{Autoscaler, POLICIES, Static};
use super::replay::Sim;
use super::sizing::static_peak;
use super::trace::TraceRequest;
use super::*;

fn cfg() -> SimConfig {
    let pol = PoolPolicy {
        scale_down_stabilization_s: 60.0,
        idle_grace_s: 120.0,
        ..PoolPolicy::default()
    };
    SimConfig::new(pol.clone(), pol, Profile::default())
}

/// `n` requests every `gap` seconds from `start`.
fn steady(start: f64, n: usize, gap: f64, input: u32, output: u32) -> Vec<TraceRequest> {
    (0..n)
        .map(|i| TraceRequest {
            t: start + i as f64 * gap,
            input_tokens: input,
            output_tokens: output,
            blocks: Vec::new(),
        })
        .collect()
}

fn run_fixed(cfg: &SimConfig, trace: &[TraceRequest], p: u32, d: u32) -> PolicyReport {
    Sim::new(cfg, trace, Box::new(Static(p)), Box::new(Static(d))).run()
}

/// Quiet, then a 10-minute step to ~5 prefill replicas' worth, then quiet.
fn step_trace() -> Vec<TraceRequest> {
    let mut trace = steady(0.0, 120, 1.0, 2048, 20);
    trace.extend(steady(120.0, 24_000, 0.025, 2048, 20));
    trace.extend(steady(720.0, 300, 1.0, 2048, 20));
    trace
}
