//! One pool's targets and limits as configured (`policy:` in the scaler's config),
//! with their defaults and the checks that refuse a bad one.

use serde::{Deserialize, Serialize};

use super::MAX_FLOOR_S;
use super::cron::Cron;
use super::season;

/// Targets and limits of one pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolPolicy {
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// Time to first token target (seconds) for prompts up to `slo_ttft_ref_tokens`.
    pub slo_ttft_s: f64,
    /// Longer prompts get a proportionally longer TTFT target: prefill time grows with
    /// the prompt, so a fixed target would be unreachable for long-context requests
    /// however many replicas run.
    pub slo_ttft_ref_tokens: f64,
    /// Inter-token latency target (seconds).
    pub slo_itl_s: f64,
    /// Seconds desired must stay below current before replicas are removed.
    pub scale_down_stabilization_s: f64,
    /// Fraction of current replicas removed per scale-down step (at least one).
    pub scale_down_step: f64,
    /// Seconds with nothing running, queued or held before the pool goes to zero
    /// (only when `min_replicas` is 0).
    pub idle_grace_s: f64,
    /// Seconds of prompt arrivals the prefill pool is sized in hindsight over (the
    /// fewest fixed replicas that would have served them): bursts recur, and one
    /// shorter than a start-up can only be met by replicas already running. 0 keeps
    /// only the latest interval.
    pub burst_memory_s: f64,
    /// Start-up lead time used for the forecast when no start has been measured.
    pub default_lead_s: f64,
    /// Mean prompt length assumed before any traffic is seen.
    pub default_prompt_len: f64,
    /// Factor on the replicas the load model says are needed: above 1 buys SLO margin
    /// with GPUs, below 1 saves GPUs at the SLO's expense. The one knob that moves
    /// this policy along its cost/attainment frontier (`simulate --frontier`).
    pub headroom: f64,
    /// Floors for peaks the operator knows (`[{cron: "0 8 * * 1-5", duration_s:
    /// 36000, min_replicas: 4}]`).
    pub schedule: Vec<ScheduledFloor>,
    /// The period the load repeats over, seconds (86400: daily; 604800: weekly; 0:
    /// off). The pool is sized ahead, by one lead, for the load seen at that time of
    /// the period before (blended over periods, scaled by today's level).
    pub season_period_s: f64,
    /// The period's buckets, seconds: the load is learnt as a mean per bucket.
    pub season_bucket_s: f64,
}

/// At least `min_replicas` from each time `cron` fires (UTC) for `duration_s`; ready
/// by then: the floor is raised one start-up lead earlier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduledFloor {
    /// Five-field cron expression (minute hour day-of-month month day-of-week), UTC.
    pub cron: String,
    /// How long the floor holds after each start, seconds (at most a week).
    pub duration_s: f64,
    pub min_replicas: u32,
}

impl Default for PoolPolicy {
    fn default() -> Self {
        PoolPolicy {
            min_replicas: 0,
            max_replicas: 64,
            slo_ttft_s: 2.0,
            slo_ttft_ref_tokens: 8192.0,
            slo_itl_s: 0.05,
            scale_down_stabilization_s: 300.0,
            scale_down_step: 0.25,
            idle_grace_s: 300.0,
            burst_memory_s: 600.0,
            default_lead_s: 60.0,
            default_prompt_len: 2048.0,
            headroom: 1.0,
            schedule: Vec::new(),
            season_period_s: 86_400.0,
            season_bucket_s: 300.0,
        }
    }
}

impl PoolPolicy {
    /// Whether `key` names one of these settings as a config file spells it (a pool's
    /// other keys say where its metrics come from: a deployment's, not a policy's).
    #[must_use]
    pub fn has_key(key: &str) -> bool {
        serde_json::to_value(PoolPolicy::default()).is_ok_and(|v| v.get(key).is_some())
    }

    /// The TTFT target of a prompt of `len` tokens.
    #[must_use]
    pub fn ttft_slo_for(&self, len: f64) -> f64 {
        self.slo_ttft_s * (len / self.slo_ttft_ref_tokens).max(1.0)
    }

    /// Every problem with the values at once.
    pub fn validate(&self, what: &str) -> Vec<String> {
        let mut e = Vec::new();
        if self.min_replicas > self.max_replicas {
            e.push(format!(
                "{what}: min_replicas {} > max_replicas {}",
                self.min_replicas, self.max_replicas
            ));
        }
        if self.max_replicas == 0 {
            e.push(format!("{what}: max_replicas must be > 0"));
        }
        for (n, v) in [
            ("slo_ttft_s", self.slo_ttft_s),
            ("slo_itl_s", self.slo_itl_s),
            ("slo_ttft_ref_tokens", self.slo_ttft_ref_tokens),
            ("default_prompt_len", self.default_prompt_len),
            ("headroom", self.headroom),
        ] {
            if !(v.is_finite() && v > 0.0) {
                e.push(format!("{what}: {n} must be > 0"));
            }
        }
        for (n, v) in [
            (
                "scale_down_stabilization_s",
                self.scale_down_stabilization_s,
            ),
            ("idle_grace_s", self.idle_grace_s),
            ("burst_memory_s", self.burst_memory_s),
            ("default_lead_s", self.default_lead_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                e.push(format!("{what}: {n} must be >= 0"));
            }
        }
        if !(self.scale_down_step > 0.0 && self.scale_down_step <= 1.0) {
            e.push(format!("{what}: scale_down_step must be in (0, 1]"));
        }
        e.extend(
            season::problems(self.season_period_s, self.season_bucket_s)
                .into_iter()
                .map(|p| format!("{what}: {p}")),
        );
        for (i, f) in self.schedule.iter().enumerate() {
            let at = format!("{what}: schedule[{i}]");
            if let Err(err) = Cron::parse(&f.cron) {
                e.push(format!("{at}.cron: {err}"));
            }
            if !(f.duration_s > 0.0 && f.duration_s <= MAX_FLOOR_S) {
                e.push(format!(
                    "{at}.duration_s must be in (0, {MAX_FLOOR_S}], got {}",
                    f.duration_s
                ));
            }
            if f.min_replicas > self.max_replicas {
                e.push(format!(
                    "{at}.min_replicas {} > max_replicas {}",
                    f.min_replicas, self.max_replicas
                ));
            }
        }
        e
    }
}
