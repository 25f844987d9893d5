//! Kubernetes' HPA controller, one model for every policy that goes through one: the
//! baselines with Kubernetes' default behaviour, and `preheat` behind KEDA with the
//! behaviour the chart renders (`keda.rs`). Per sync: a proposal is ignored within the
//! tolerance, clamped to the limits, scale-down held to the highest recommendation of
//! the stabilisation window, then rate-limited by the policies against the replicas
//! at the start of each policy's period (changes both ways count, as the controller
//! counts them).

use std::collections::VecDeque;

/// `behavior` of a HorizontalPodAutoscaler.
#[derive(Clone, Copy, Debug, PartialEq)]
#[must_use]
pub struct HpaBehavior {
    /// `scaleUp.tolerance` / `scaleDown.tolerance`: a metric ratio within
    /// [1 − down, 1 + up] changes nothing.
    pub up_tolerance: f64,
    pub down_tolerance: f64,
    /// `scaleDown.stabilizationWindowSeconds`: scale-down goes only as low as the
    /// highest recommendation over this window.
    pub down_stabilization_s: f64,
    /// Scale-up policies (the larger wins): +`up_percent`% or +`up_pods` per
    /// `up_period_s`.
    pub up_percent: f64,
    pub up_pods: u32,
    pub up_period_s: f64,
    /// Scale-down policy: at most `down_pods` removed per `down_period_s` (`None`:
    /// Kubernetes' default 100% per period, i.e. no limit).
    pub down_pods: Option<u32>,
    pub down_period_s: f64,
}

impl HpaBehavior {
    /// What an HPA does without a `behavior` (Kubernetes' defaults).
    pub const KUBERNETES_DEFAULT: HpaBehavior = HpaBehavior {
        up_tolerance: 0.1,
        down_tolerance: 0.1,
        down_stabilization_s: 300.0,
        up_percent: 100.0,
        up_pods: 4,
        up_period_s: 15.0,
        down_pods: None,
        down_period_s: 15.0,
    };

    /// What the chart renders for the pools' ScaledObjects
    /// (`charts/preheat/templates/scaledobjects.yaml`, `values.yaml` `keda.*`);
    /// `tests/chart.rs` holds the rendered objects to it.
    pub const CHART: HpaBehavior = HpaBehavior {
        up_tolerance: 0.01,
        down_tolerance: 0.05,
        down_stabilization_s: 0.0,
        up_percent: 100.0,
        up_pods: 4,
        up_period_s: 15.0,
        down_pods: Some(1),
        down_period_s: 30.0,
    };
}

/// One HPA's state between syncs.
#[derive(Clone, Debug)]
pub(crate) struct Hpa {
    b: HpaBehavior,
    min: u32,
    max: u32,
    /// (time, recommendation) over the stabilisation window.
    recommendations: VecDeque<(f64, u32)>,
    /// (time, replicas added or removed) of each change, over the longer period.
    changes: VecDeque<(f64, i64)>,
}

impl Hpa {
    pub(crate) fn new(behavior: HpaBehavior, min: u32, max: u32) -> Self {
        Hpa {
            b: behavior,
            min,
            max: max.max(min),
            recommendations: VecDeque::new(),
            changes: VecDeque::new(),
        }
    }

    /// Forgets its history (KEDA took the pool to zero).
    pub(crate) fn reset(&mut self) {
        self.recommendations.clear();
        self.changes.clear();
    }

    /// Replicas at the start of the period before `t`: now, less what was added in it,
    /// plus what was removed.
    fn period_start(&self, t: f64, period: f64, current: u32) -> u32 {
        let moved: i64 = self
            .changes
            .iter()
            .filter(|(at, _)| *at > t - period)
            .map(|c| c.1)
            .sum();
        u32::try_from((i64::from(current) - moved).max(0)).unwrap_or(u32::MAX)
    }

    /// One sync at `t` with `current` replicas: `ratio` is the metric over its target
    /// (for the tolerance), `proposal` the replicas the metric asks for
    /// (`ceil(current × ratio)`, or what the caller knows more exactly).
    pub(crate) fn sync(&mut self, t: f64, current: u32, ratio: f64, proposal: u32) -> u32 {
        let within = ratio <= 1.0 + self.b.up_tolerance && ratio >= 1.0 - self.b.down_tolerance;
        let raw = if current > 0 && within {
            current
        } else {
            proposal
        };
        let raw = raw.clamp(self.min, self.max);
        self.recommendations.push_back((t, raw));
        while self
            .recommendations
            .front()
            .is_some_and(|(at, _)| *at < t - self.b.down_stabilization_s)
        {
            self.recommendations.pop_front();
        }
        let stabilized = self
            .recommendations
            .iter()
            .map(|r| r.1)
            .max()
            .unwrap_or(raw);
        let mut want = if raw < current {
            stabilized.min(current)
        } else {
            raw
        };
        if want > current {
            let base = self.period_start(t, self.b.up_period_s, current);
            let by_percent = (f64::from(base) * (1.0 + self.b.up_percent / 100.0)).ceil() as u32;
            want = want.min(by_percent.max(base + self.b.up_pods));
        } else if want < current
            && let Some(pods) = self.b.down_pods
        {
            let base = self.period_start(t, self.b.down_period_s, current);
            want = want.max(base.saturating_sub(pods));
        }
        let want = want.clamp(self.min, self.max);
        if want != current {
            self.changes
                .push_back((t, i64::from(want) - i64::from(current)));
        }
        let keep = self.b.up_period_s.max(self.b.down_period_s);
        while self.changes.front().is_some_and(|c| c.0 <= t - keep) {
            self.changes.pop_front();
        }
        want
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_down_waits_for_the_stabilisation_window_by_default() {
        let mut h = Hpa::new(HpaBehavior::KUBERNETES_DEFAULT, 1, 100);
        assert_eq!(h.sync(0.0, 10, 1.0, 10), 10);
        assert_eq!(h.sync(15.0, 10, 0.5, 5), 10, "10 was recommended 15 s ago");
        assert_eq!(h.sync(301.0, 10, 0.5, 5), 5, "the 10s left the window");
        // Within 10%: nothing changes.
        assert_eq!(h.sync(316.0, 5, 1.08, 6), 5);
    }

    #[test]
    fn scale_up_is_limited_to_double_or_four_pods_per_period() {
        let mut h = Hpa::new(HpaBehavior::KUBERNETES_DEFAULT, 1, 100);
        assert_eq!(h.sync(0.0, 2, 25.0, 50), 6);
        assert_eq!(h.sync(15.0, 6, 50.0 / 6.0, 50), 12);
        assert_eq!(h.sync(30.0, 12, 50.0 / 12.0, 50), 24);
    }

    #[test]
    fn the_charts_behaviour_removes_one_pod_per_thirty_seconds_at_once() {
        let mut h = Hpa::new(HpaBehavior::CHART, 1, 100);
        assert_eq!(h.sync(0.0, 10, 0.2, 2), 9, "no stabilisation window");
        assert_eq!(h.sync(15.0, 9, 0.2, 2), 9);
        assert_eq!(h.sync(30.0, 9, 0.2, 2), 8);
    }
}
