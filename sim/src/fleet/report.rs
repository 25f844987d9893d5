//! A fleet simulation's report: per policy, GPU-seconds against the share of requests
//! served in time, the starts by the tier they came from, and each model's own.

use serde::Serialize;

use crate::fleet_config::Tier;

/// Starts by the tier each found on its node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TierStarts {
    pub gpu_standby: u32,
    pub host_standby: u32,
    pub hot: u32,
    pub staged: u32,
    pub remote: u32,
}

impl TierStarts {
    pub(crate) fn from_counts(c: &[u32; 5]) -> Self {
        let at = |t: Tier| c[Tier::ALL.iter().position(|&x| x == t).unwrap_or(4)];
        TierStarts {
            gpu_standby: at(Tier::GpuStandby),
            host_standby: at(Tier::HostStandby),
            hot: at(Tier::Hot),
            staged: at(Tier::Staged),
            remote: at(Tier::Remote),
        }
    }

    pub(crate) fn add(&mut self, o: &TierStarts) {
        self.gpu_standby += o.gpu_standby;
        self.host_standby += o.host_standby;
        self.hot += o.hot;
        self.staged += o.staged;
        self.remote += o.remote;
    }
}

/// One model under one policy.
#[derive(Clone, Debug, Serialize)]
pub struct ModelReport {
    pub name: String,
    pub params_b: f64,
    pub requests: usize,
    pub gpu_seconds: f64,
    pub ttft_attainment: f64,
    pub slo_attainment: f64,
    /// Requests that arrived with no replica serving in a pool they need.
    pub cold_requests: usize,
    pub cold_ttft_p99_s: Option<f64>,
    /// p99 over those requests of their time to first token less what their prompt
    /// takes on an idle replica: the wait a start (and the queue behind it) added.
    pub cold_wait_p99_s: Option<f64>,
    pub starts: TierStarts,
    /// The warmest tier the model held anywhere, sampled over time: (seconds, level),
    /// level 0 remote, 1 staged, 2 hot, 3 parked in host memory, 4 serving.
    pub tiers: Vec<(f64, u8)>,
}

/// One policy's run over the fleet.
#[derive(Clone, Debug, Serialize)]
pub struct FleetPolicyReport {
    pub name: String,
    /// Every GPU held: serving, starting, draining (a replica on g GPUs counts g).
    pub gpu_seconds: f64,
    /// Share of all requests whose first token met their model's TTFT target
    /// (length-scaled), those that waited for a start included.
    pub ttft_attainment: f64,
    /// Share that met the TTFT target and then the ITL target.
    pub slo_attainment: f64,
    /// p99 time to first token over the requests that waited for a start.
    pub cold_ttft_p99_s: Option<f64>,
    /// The same over the models of each size (billions of parameters).
    pub cold_ttft_p99_s_by_params_b: std::collections::BTreeMap<String, f64>,
    /// p99 over the same requests of their time to first token less what their
    /// prompt takes on an idle replica (its length's share no start can remove).
    pub cold_wait_p99_s: Option<f64>,
    pub cold_wait_p99_s_by_params_b: std::collections::BTreeMap<String, f64>,
    pub cold_requests: usize,
    /// Of those, the ones that never got a first token (the p99s above are then
    /// infinite, written as null).
    pub cold_unanswered: usize,
    pub starts: TierStarts,
    /// Decisions that wanted a start and found no GPU within the fleet's budget (each
    /// decision that asks again counts again).
    pub deferred_starts: u32,
    /// Seconds this policy's run took.
    pub wall_s: f64,
    pub per_model: Vec<ModelReport>,
}

/// A fleet simulation.
#[derive(Clone, Debug, Serialize)]
pub struct FleetReport {
    pub trace: String,
    pub fleet: String,
    pub requests: usize,
    pub models: usize,
    pub trace_span_s: f64,
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub max_gpus: u32,
    pub profile_source: String,
    pub policies: Vec<FleetPolicyReport>,
}
