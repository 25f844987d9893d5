//! What a replay keeps per request and per pool, and the counters its windows are
//! cut from.

use crate::autoscalers::Autoscaler;
use crate::itl_histogram::ItlCounts;

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
    /// It arrived with no replica serving in a pool it needs: it waited for a start.
    pub(crate) cold: bool,
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
