//! What a simulation run is given: the two pools' policies, the replica profile, how
//! replicas start, and the scaler's timing.

use preheat_scaler::policy::PoolPolicy;
use preheat_scaler::profile::Profile;
use serde::Serialize;

use crate::keda::Actuation;
use crate::trace::TraceRequest;

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
    pub(crate) fn seconds(self, p: &Profile) -> f64 {
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
    /// How `preheat`'s decisions reach the pools (the baselines model their own).
    pub actuation: Actuation,
    /// The wall clock (Unix seconds, UTC) at the trace's t = 0, for scheduled floors;
    /// 0 is 1970-01-01T00:00Z, a Thursday midnight.
    pub start_unix: f64,
    /// Whether the pools open at the size a deployment already serving the trace's
    /// first minute would have (the default: no policy pays for a trace that opens at
    /// full load), or at their policies' minimum, as a stack started idle does.
    pub warm_start: bool,
    /// Every replica on one host (`preheat up`): busy replicas share its compute, so
    /// with `k` of them computing at once each runs at `min(1, slots / k)` of the
    /// profile's speed, where `slots` replicas run at full speed together (1 when the
    /// profile was measured with the whole host). `None`: a GPU each, as deployed.
    pub shared_host: Option<f64>,
    /// On a shared host, how much slower than that share each replica computes with
    /// `k` computing at once, as `(k, factor)` measured on the host, in increasing `k`
    /// (caches, memory bandwidth and the scheduler's switches are shared too): 1.0
    /// alone, linear from there to the first point and between the points, the last
    /// one's past it. Empty: sharing costs cores only.
    pub shared_host_slowdown: Vec<(f64, f64)>,
    /// Prefill batching: a replica computes the prompts queued at once together, up to
    /// this many tokens per batch, at the profile's rate for the batch's length (the
    /// bundled engine's scheduler budget). `None`: one prompt at a time.
    pub prefill_batch_tokens: Option<f64>,
    /// Prompts shorter than this many tokens skip the prefill pool: the decode replica
    /// that takes the request computes the prompt in one of its steps, as the bundled
    /// gateway does below its `--disagg-min-tokens`. `None`: every prompt is prefilled
    /// on the prefill pool.
    pub local_prefill_below: Option<u32>,
}

impl SimConfig {
    pub fn new(prefill: PoolPolicy, decode: PoolPolicy, profile: Profile) -> Self {
        // The scaler's own tick and window, so that a run with a config file (which
        // carries them) and one without read the same signals.
        let scaler = preheat_scaler::config::Config::default();
        SimConfig {
            prefill,
            decode,
            profile,
            start: StartClass::Hot,
            interval_s: scaler.interval_s,
            window_s: scaler.window_s,
            max_drain_s: 1800.0,
            sample_s: 10.0,
            standbys: 1,
            actuation: Actuation::default(),
            start_unix: 0.0,
            warm_start: true,
            shared_host: None,
            shared_host_slowdown: Vec::new(),
            prefill_batch_tokens: None,
            local_prefill_below: None,
        }
    }

    /// The same settings with replicas of this start class starting in `seconds`.
    pub fn with_startup_s(mut self, seconds: f64) -> Self {
        let s = &mut self.profile.startup_s;
        *match self.start {
            StartClass::Cold => &mut s.cold,
            StartClass::Staged => &mut s.staged,
            StartClass::Hot => &mut s.hot,
            StartClass::Standby => &mut s.standby,
        } = seconds;
        self
    }

    pub(crate) fn startup_s(&self) -> f64 {
        self.start.seconds(&self.profile)
    }

    pub(crate) fn max_batch(&self) -> usize {
        self.profile
            .decode_itl_s
            .last()
            .map_or(1, |p| p.0.max(1.0) as usize)
    }

    /// Whether the decode replica serving this request computes its prompt.
    #[must_use]
    pub fn prefills_on_decode(&self, r: &TraceRequest) -> bool {
        self.local_prefill_below.is_some_and(|n| r.input_tokens < n)
    }

    /// Whether a request's first token came within its TTFT target.
    pub(crate) fn ttft_met(&self, r: &TraceRequest, ttft: f64) -> bool {
        ttft <= self.prefill.ttft_slo_for(f64::from(r.input_tokens)) + 1e-9
    }

    /// Whether a finished request's mean inter-token latency met the ITL target.
    pub(crate) fn itl_met(&self, itl: Option<f64>) -> bool {
        itl.is_none_or(|i| i <= self.decode.slo_itl_s + 1e-9)
    }
}
