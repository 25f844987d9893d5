//! The policies the simulator compares: `preheat` (the scaler's own [`PreheatPolicy`],
//! unchanged) and the baselines an operator would otherwise deploy. Each baseline is
//! configured from the same profile and SLOs the way an operator would set it up, so the
//! comparison is between control strategies, not between tuned and untuned targets.

use std::collections::VecDeque;

use preheat_scaler::policy::{Observation, Pool, PoolPolicy, PreheatPolicy};
use preheat_scaler::profile::Profile;
use preheat_scaler::signals::PoolSignals;

use crate::hpa::{Hpa, HpaBehavior};

/// What an autoscaler sees of one pool when it decides.
#[derive(Clone, Debug, Default)]
pub struct PoolView {
    pub t: f64,
    /// Replicas that exist and are not draining (ready or starting).
    pub current: u32,
    pub ready: u32,
    /// Requests held at the gateway because the pool has no replica.
    pub held: f64,
    /// Requests queued in the pool, and being processed.
    pub waiting: f64,
    pub running: f64,
    /// Busy fraction of ready replicas since the previous decision of this policy
    /// (what a GPU-utilisation metric reports).
    pub utilization: f64,
    /// Signals as the scaler computes them over its window.
    pub signals: PoolSignals,
    pub mean_prompt_len: Option<f64>,
    pub mean_seq_tokens: Option<f64>,
    pub measured_startup_s: Option<f64>,
    /// Cumulative counts of requests that reached this pool, and their tokens.
    pub arrived_requests: f64,
    pub arrived_input_tokens: f64,
    pub arrived_output_tokens: f64,
}

impl PoolView {
    fn inflight(&self) -> f64 {
        self.waiting + self.running + self.held
    }
}

/// A pool autoscaler: desired replicas at each of its decision times.
pub trait Autoscaler: Send {
    /// Seconds between decisions.
    fn period_s(&self) -> f64;
    /// Whether a request arriving at a pool with no replica triggers a decision at once
    /// (the gateway holds it and pushes activation), rather than at the next period.
    fn wakes_on_arrival(&self) -> bool {
        true
    }
    fn decide(&mut self, v: &PoolView) -> u32;
    /// Whether decisions read the pool's signals. A plan fixed in advance reads only
    /// the clock and the replicas, and building a whole view every second (latency
    /// quantiles over the window) would cost more than its decisions.
    fn observes(&self) -> bool {
        true
    }
    /// Replicas up when the trace starts, if the policy fixes them; otherwise the
    /// simulator starts every policy alike, sized for the trace's first minute.
    fn initial(&self) -> Option<u32> {
        None
    }
    /// Whether the deployment keeps parked standbys (`--start standby`): a policy that
    /// never reacts to load has no use for them and is not charged for them.
    fn keeps_standbys(&self) -> bool {
        true
    }
}

/// Names accepted by `--policy`, in report order.
pub const POLICIES: [&str; 7] = [
    "preheat",
    "static-peak",
    "clairvoyant",
    "hpa-utilization",
    "keda-queue",
    "kpa",
    "sla-planner",
];

/// Per-replica capacities an operator derives from the profile to set baseline targets.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    /// Prompts one prefill replica completes within the TTFT SLO at the reference
    /// prompt length.
    pub prefill_requests: f64,
    /// Prefill tokens/s at the reference prompt length.
    pub prefill_tokens_per_s: f64,
    /// Sequences one decode replica runs within the ITL SLO.
    pub decode_seqs: f64,
    /// Decode tokens/s of one replica at that batch.
    pub decode_tokens_per_s: f64,
}

impl Capacity {
    #[must_use]
    pub fn new(profile: &Profile, cfg: &PoolPolicy) -> Self {
        let len = cfg.default_prompt_len;
        let rate = profile.prefill_rate(len);
        let batch = profile.max_batch_at(cfg.slo_itl_s);
        Capacity {
            prefill_requests: (cfg.slo_ttft_s * rate / len).max(1.0),
            prefill_tokens_per_s: rate,
            decode_seqs: batch,
            decode_tokens_per_s: batch / profile.itl(batch),
        }
    }

    fn per_replica(&self, pool: Pool) -> f64 {
        match pool {
            Pool::Prefill => self.prefill_requests,
            Pool::Decode => self.decode_seqs,
        }
    }
}

/// The scaler's own policy, driven from the simulated metrics.
#[derive(Debug)]
pub struct Preheat {
    policy: PreheatPolicy,
    period: f64,
    /// The wall clock at the trace's t = 0 (scheduled floors).
    start_unix: f64,
}

impl Preheat {
    #[must_use]
    pub fn new(
        pool: Pool,
        cfg: PoolPolicy,
        profile: Profile,
        interval_s: f64,
        start_unix: f64,
    ) -> Self {
        Preheat {
            policy: PreheatPolicy::new(pool, cfg, profile),
            period: interval_s,
            start_unix,
        }
    }
}

impl Autoscaler for Preheat {
    fn period_s(&self) -> f64 {
        self.period
    }

    fn decide(&mut self, v: &PoolView) -> u32 {
        let obs = Observation {
            signals: v.signals.clone(),
            current: v.current,
            held_requests: v.held,
            measured_startup_s: v.measured_startup_s,
            mean_prompt_len: v.mean_prompt_len,
            mean_seq_tokens: v.mean_seq_tokens,
            unix_time: Some(self.start_unix + v.t),
        };
        let d = self.policy.decide(v.t, &obs);
        tracing::trace!(
            t = v.t,
            reason = d.reason,
            desired = d.desired,
            "preheat decision"
        );
        d.desired
    }
}

/// A fixed replica count.
#[derive(Debug)]
pub struct Static(pub u32);

impl Autoscaler for Static {
    fn period_s(&self) -> f64 {
        3600.0
    }
    fn wakes_on_arrival(&self) -> bool {
        false
    }
    fn decide(&mut self, _: &PoolView) -> u32 {
        self.0
    }
    fn observes(&self) -> bool {
        false
    }
    fn initial(&self) -> Option<u32> {
        Some(self.0)
    }
    fn keeps_standbys(&self) -> bool {
        false
    }
}

/// The replicas HPA's metric asks for: `ceil(current × ratio)`, or at zero replicas
/// the metric's total over its target.
fn hpa_proposal(current: u32, ratio: f64, total_over_target: f64) -> u32 {
    let x = if current == 0 {
        total_over_target
    } else {
        f64::from(current) * ratio
    };
    x.ceil().max(0.0) as u32
}

/// HPA on GPU utilisation (busy fraction), target 70% unless given; HPA cannot scale
/// to zero.
#[derive(Debug)]
pub struct HpaUtilization {
    hpa: Hpa,
    target: f64,
}

impl HpaUtilization {
    /// The target an operator would start from.
    pub const DEFAULT_TARGET: f64 = 0.7;

    #[must_use]
    pub fn new(max: u32, target: f64) -> Self {
        HpaUtilization {
            hpa: Hpa::new(HpaBehavior::KUBERNETES_DEFAULT, 1, max),
            target,
        }
    }
}

impl Autoscaler for HpaUtilization {
    fn period_s(&self) -> f64 {
        15.0
    }
    fn wakes_on_arrival(&self) -> bool {
        false
    }
    fn decide(&mut self, v: &PoolView) -> u32 {
        let ratio = v.utilization / self.target;
        let proposal = hpa_proposal(v.current, ratio, ratio);
        self.hpa.sync(v.t, v.current, ratio, proposal)
    }
}

/// KEDA with a Prometheus trigger on waiting requests (`vllm:num_requests_waiting`),
/// target a fraction (half unless given) of a replica's in-SLO capacity per replica,
/// activation above zero and the default 300 s cooldown to zero.
#[derive(Debug)]
pub struct KedaQueue {
    pool: Pool,
    cap: Capacity,
    hpa: Hpa,
    last_active: f64,
    fraction: f64,
}

impl KedaQueue {
    /// The fraction an operator would start from.
    pub const DEFAULT_FRACTION: f64 = 0.5;

    #[must_use]
    pub fn new(pool: Pool, cap: Capacity, max: u32, fraction: f64) -> Self {
        KedaQueue {
            pool,
            cap,
            hpa: Hpa::new(HpaBehavior::KUBERNETES_DEFAULT, 1, max),
            last_active: f64::NEG_INFINITY,
            fraction,
        }
    }
}

impl Autoscaler for KedaQueue {
    fn period_s(&self) -> f64 {
        15.0
    }
    fn decide(&mut self, v: &PoolView) -> u32 {
        const COOLDOWN_S: f64 = 300.0;
        if v.inflight() > 0.0 {
            self.last_active = v.t;
        }
        if v.t - self.last_active > COOLDOWN_S {
            self.hpa.reset();
            return 0;
        }
        let target = (self.cap.per_replica(self.pool) * self.fraction).max(1.0);
        let waiting = v.waiting + v.held;
        let total = waiting / target;
        let ratio = if v.current == 0 {
            total
        } else {
            total / f64::from(v.current)
        };
        let proposal = hpa_proposal(v.current, ratio, total);
        self.hpa.sync(v.t, v.current, ratio, proposal).max(1)
    }
}

/// Knative's KPA on concurrency (in-flight requests), target a fraction (70% unless
/// given) of a replica's in-SLO capacity: 60 s stable window, 6 s panic window, panic at 2× current, no scale-down
/// while panicking, scale to zero after the stable window plus a 30 s grace.
#[derive(Debug)]
pub struct Kpa {
    pool: Pool,
    cap: Capacity,
    max: u32,
    samples: VecDeque<(f64, f64)>,
    panic_until: f64,
    zero_since: Option<f64>,
    fraction: f64,
}

impl Kpa {
    /// The fraction an operator would start from (Knative's default utilisation).
    pub const DEFAULT_FRACTION: f64 = 0.7;

    #[must_use]
    pub fn new(pool: Pool, cap: Capacity, max: u32, fraction: f64) -> Self {
        Kpa {
            pool,
            cap,
            max,
            samples: VecDeque::new(),
            panic_until: f64::NEG_INFINITY,
            zero_since: None,
            fraction,
        }
    }
}

impl Autoscaler for Kpa {
    fn period_s(&self) -> f64 {
        2.0
    }
    fn decide(&mut self, v: &PoolView) -> u32 {
        const STABLE_S: f64 = 60.0;
        const PANIC_S: f64 = 6.0;
        const GRACE_S: f64 = 30.0;
        let target = (self.cap.per_replica(self.pool) * self.fraction).max(1.0);
        self.samples.push_back((v.t, v.inflight()));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| *t < v.t - STABLE_S)
        {
            self.samples.pop_front();
        }
        let avg = |span: f64| {
            let xs: Vec<f64> = self
                .samples
                .iter()
                .filter(|(t, _)| *t >= v.t - span)
                .map(|s| s.1)
                .collect();
            xs.iter().sum::<f64>() / xs.len().max(1) as f64
        };
        let stable = (avg(STABLE_S) / target).ceil() as u32;
        let panic = (avg(PANIC_S) / target).ceil() as u32;
        let ready = v.ready.max(1);
        if f64::from(panic) >= 2.0 * f64::from(ready) {
            self.panic_until = v.t + STABLE_S;
        }
        let mut desired = if v.t < self.panic_until {
            panic.max(stable).max(v.current)
        } else {
            stable
        };
        if v.held > 0.0 {
            desired = desired.max(1);
        }
        if desired == 0 {
            let since = *self.zero_since.get_or_insert(v.t);
            if v.t - since < GRACE_S {
                desired = v.current.min(1);
            }
        } else {
            self.zero_since = None;
        }
        desired.min(self.max)
    }
}

/// NVIDIA Dynamo's SLA planner: every interval, predict the next interval's request
/// count, input and output lengths (from the last interval), and size prefill by
/// prompt tokens/s over a replica's prefill throughput and decode by output tokens/s
/// over a replica's throughput at the ITL SLO, times a headroom (1 unless given); at
/// least one replica per pool.
#[derive(Debug)]
pub struct SlaPlanner {
    pool: Pool,
    cap: Capacity,
    profile: Profile,
    slo_ttft_s: f64,
    max: u32,
    interval: f64,
    last: Option<(f64, f64, f64, f64)>,
    desired: u32,
    headroom: f64,
}

impl SlaPlanner {
    #[must_use]
    pub fn new(
        pool: Pool,
        cap: Capacity,
        profile: Profile,
        cfg: &PoolPolicy,
        headroom: f64,
    ) -> Self {
        SlaPlanner {
            pool,
            cap,
            profile,
            slo_ttft_s: cfg.slo_ttft_s,
            max: cfg.max_replicas,
            interval: 60.0,
            last: None,
            desired: 1,
            headroom,
        }
    }
}

impl Autoscaler for SlaPlanner {
    fn period_s(&self) -> f64 {
        self.interval
    }
    fn wakes_on_arrival(&self) -> bool {
        false
    }
    fn decide(&mut self, v: &PoolView) -> u32 {
        let now = (
            v.t,
            v.arrived_requests,
            v.arrived_input_tokens,
            v.arrived_output_tokens,
        );
        let Some(prev) = self.last.replace(now) else {
            return self.desired.max(1);
        };
        let dt = (now.0 - prev.0).max(1e-9);
        let reqs = now.1 - prev.1;
        if reqs <= 0.0 {
            self.desired = 1;
            return 1;
        }
        let isl = (now.2 - prev.2) / reqs;
        let osl = (now.3 - prev.3) / reqs;
        let n = match self.pool {
            Pool::Prefill => {
                // The planner's prefill throughput is the profiled rate at that ISL,
                // derated so one prompt's compute leaves room under the TTFT target.
                let rate = self.profile.prefill_rate(isl);
                let derate = (1.0 - isl / rate / self.slo_ttft_s).clamp(0.3, 1.0);
                reqs * isl / dt / (rate * derate)
            }
            Pool::Decode => reqs * osl / dt / self.cap.decode_tokens_per_s,
        };
        self.desired = ((n * self.headroom).ceil() as u32).clamp(1, self.max);
        self.desired
    }
}
