//! How a decision reaches the Deployment when KEDA carries it, as the chart renders the
//! ScaledObjects (`charts/preheat/templates/scaledobjects.yaml`, `values.yaml` `keda.*`):
//! the scaler answers `GetMetrics` with its desired replicas against a target of 1, and
//! the HPA KEDA manages reads it on its sync period, ignores changes within its
//! per-direction tolerance and rate-limits them by its policies; KEDA itself moves a
//! pool from 0 to 1 as soon as `StreamIsActive` says active, and back to 0 once the
//! scaler has been inactive for the cooldown period.

use crate::autoscalers::{Autoscaler, PoolView};
use crate::hpa::{Hpa, HpaBehavior};

/// The actuation path from a policy's decision to the replica count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Actuation {
    /// KEDA + HPA as the chart ships them (the default: it is how preheat is deployed).
    #[default]
    Keda,
    /// The decision is the replica count at the scaler's tick (`preheat up`, or a
    /// scaler patching Deployments itself).
    Direct,
}

/// HPA and KEDA settings, defaulting to what the chart renders.
#[derive(Clone, Copy, Debug, PartialEq)]
#[must_use]
pub struct KedaSettings {
    /// The HPA controller's sync period (`--horizontal-pod-autoscaler-sync-period`).
    /// HPA reads at the first scaler tick at or after each sync mark (the scaler's
    /// default 5 s tick divides 15 s).
    pub sync_s: f64,
    /// The HPA's `behavior` (tolerances, policies), as the chart sets it; clusters
    /// without the `HPAConfigurableTolerance` feature use 10% both ways instead.
    pub behavior: HpaBehavior,
    /// `cooldownPeriod`: seconds inactive before KEDA scales to zero.
    pub cooldown_s: f64,
}

impl Default for KedaSettings {
    fn default() -> Self {
        KedaSettings {
            sync_s: 15.0,
            behavior: HpaBehavior::CHART,
            cooldown_s: 300.0,
        }
    }
}

/// A policy whose decisions go through KEDA and HPA.
pub struct Keda {
    inner: Box<dyn Autoscaler>,
    s: KedaSettings,
    hpa: Hpa,
    next_sync: f64,
    last_active: f64,
}

impl std::fmt::Debug for Keda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keda")
            .field("settings", &self.s)
            .field("next_sync", &self.next_sync)
            .finish_non_exhaustive()
    }
}

impl Keda {
    pub fn new(inner: Box<dyn Autoscaler>, settings: KedaSettings, max_replicas: u32) -> Self {
        Keda {
            inner,
            s: settings,
            // HPA's minimum is 1 while KEDA holds the pool active.
            hpa: Hpa::new(settings.behavior, 1, max_replicas.max(1)),
            next_sync: 0.0,
            last_active: f64::NEG_INFINITY,
        }
    }
}

impl Autoscaler for Keda {
    fn period_s(&self) -> f64 {
        self.inner.period_s()
    }
    fn wakes_on_arrival(&self) -> bool {
        self.inner.wakes_on_arrival()
    }
    fn initial(&self) -> Option<u32> {
        self.inner.initial()
    }
    fn keeps_standbys(&self) -> bool {
        self.inner.keeps_standbys()
    }

    fn decide(&mut self, v: &PoolView) -> u32 {
        // The scaler decides on its own tick whatever HPA does with the answer.
        let desired = self.inner.decide(v);
        if desired > 0 {
            self.last_active = v.t;
        }
        // HPA syncs on its own clock, whether or not it has anything to do.
        let synced = v.t + 1e-9 >= self.next_sync;
        while self.next_sync <= v.t + 1e-9 {
            self.next_sync += self.s.sync_s;
        }
        if v.current == 0 {
            // Activation is pushed (StreamIsActive): KEDA sets one replica at once and
            // HPA takes it from there at its next sync.
            return u32::from(desired > 0);
        }
        if desired == 0 && v.t - self.last_active >= self.s.cooldown_s {
            self.hpa.reset();
            return 0;
        }
        if !synced {
            return v.current;
        }
        // The metric is the scaler's desired replicas against a target of 1 each.
        let ratio = f64::from(desired) / f64::from(v.current);
        self.hpa.sync(v.t, v.current, ratio, desired)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers a scripted desired count.
    struct Script(Vec<(f64, u32)>);

    impl Autoscaler for Script {
        fn period_s(&self) -> f64 {
            5.0
        }
        fn decide(&mut self, v: &PoolView) -> u32 {
            self.0
                .iter()
                .rev()
                .find(|(t, _)| *t <= v.t)
                .map_or(0, |s| s.1)
        }
    }

    fn view(t: f64, current: u32) -> PoolView {
        PoolView {
            t,
            current,
            ..PoolView::default()
        }
    }

    fn keda(script: Vec<(f64, u32)>) -> Keda {
        Keda::new(Box::new(Script(script)), KedaSettings::default(), 1000)
    }

    #[test]
    fn a_change_waits_for_the_hpa_sync() {
        let mut k = keda(vec![(0.0, 4), (20.0, 8)]);
        assert_eq!(k.decide(&view(0.0, 4)), 4);
        assert_eq!(k.decide(&view(15.0, 4)), 4);
        // The scaler wants 8 at 20 s; HPA reads it at 30 s.
        assert_eq!(k.decide(&view(20.0, 4)), 4);
        assert_eq!(k.decide(&view(25.0, 4)), 4);
        assert_eq!(k.decide(&view(30.0, 4)), 8);
    }

    #[test]
    fn scale_up_is_limited_to_double_or_four_pods_per_period() {
        let mut k = keda(vec![(0.0, 50)]);
        assert_eq!(k.decide(&view(0.0, 2)), 6, "max(2 × 2, 2 + 4)");
        assert_eq!(k.decide(&view(15.0, 6)), 12);
        assert_eq!(k.decide(&view(30.0, 12)), 24);
    }

    #[test]
    fn rate_limits_count_changes_both_ways_within_the_period() {
        // +4 at 0 s, then the scaler wants fewer: the down period began at 6 replicas
        // (10 − 4 added), so HPA may remove down to 5 at once, not only one pod.
        let mut k = keda(vec![(0.0, 10), (10.0, 2)]);
        assert_eq!(k.decide(&view(0.0, 6)), 10);
        assert_eq!(k.decide(&view(15.0, 10)), 5);
    }

    #[test]
    fn scale_down_removes_one_pod_per_thirty_seconds() {
        let mut k = keda(vec![(0.0, 2)]);
        assert_eq!(k.decide(&view(0.0, 10)), 9);
        assert_eq!(k.decide(&view(15.0, 9)), 9, "one pod per 30 s");
        assert_eq!(k.decide(&view(30.0, 9)), 8);
    }

    #[test]
    fn changes_within_the_tolerance_are_ignored() {
        // 100 → 96 is a 4% drop, inside the 5% scale-down tolerance.
        let mut k = keda(vec![(0.0, 96)]);
        assert_eq!(k.decide(&view(0.0, 100)), 100);
        // 100 → 102 is outside the 1% scale-up tolerance.
        let mut k = keda(vec![(0.0, 102)]);
        assert_eq!(k.decide(&view(0.0, 100)), 102);
    }

    #[test]
    fn activation_is_immediate_and_zero_waits_for_the_cooldown() {
        let mut k = keda(vec![(0.0, 3), (20.0, 0)]);
        assert_eq!(k.decide(&view(0.0, 0)), 1, "activated at once, one replica");
        assert_eq!(k.decide(&view(5.0, 1)), 1, "HPA reads 3 at its next sync");
        assert_eq!(k.decide(&view(15.0, 1)), 3);
        // Inactive after 15 s: HPA goes back to its minimum of one at once (its 30 s
        // scale-down period began at one replica: the +2 came within it), and the pool
        // stays there until KEDA's cooldown has passed.
        assert_eq!(k.decide(&view(30.0, 3)), 1);
        assert_eq!(k.decide(&view(60.0, 1)), 1);
        assert_eq!(k.decide(&view(300.0, 1)), 1);
        assert_eq!(k.decide(&view(315.0, 1)), 0);
    }
}
