//! Each model's demand as the fleet planner forecasts it: the chance that the model is
//! asked for within a horizon, from its own history. While it is busy the answer is
//! yes; once it idles, the answer is the share of its past idle stretches at least as
//! long as this one that ended within the horizon (their hazard), with its long-run
//! rate of wake-ups as a prior worth one stretch, so a model with no history, or one
//! idle longer than ever before, still gets an answer.

/// Arrivals further apart than this end an active stretch: the gap is an idle one.
/// A minute is long against the inter-arrival times of a model being used and short
/// against the idle grace (five minutes) after which its pools go to zero.
pub const IDLE_GAP_S: f64 = 60.0;

#[derive(Clone, Debug, Default)]
pub struct Demand {
    last: Option<f64>,
    /// Its idle stretches so far (gaps between arrivals longer than [`IDLE_GAP_S`]).
    gaps: Vec<f64>,
}

impl Demand {
    pub fn arrive(&mut self, t: f64) {
        if let Some(last) = self.last {
            let gap = t - last;
            if gap > IDLE_GAP_S {
                self.gaps.push(gap);
            }
        }
        self.last = Some(t);
    }

    /// Seconds since its last request (infinite before its first).
    pub fn idle_s(&self, t: f64) -> f64 {
        self.last.map_or(f64::INFINITY, |l| t - l)
    }

    /// Its wake-ups so far: each ended idle stretch, and its first request (the trace
    /// starts idle for every model).
    pub fn wakes(&self) -> f64 {
        self.gaps.len() as f64 + f64::from(u8::from(self.last.is_some()))
    }

    /// The chance it is asked for within `h` seconds of `t`; `fleet_rate` is the
    /// fleet's mean wake-ups per model per second, the prior of a model never asked
    /// for yet (it is in the fleet to be asked for).
    pub fn p_within(&self, t: f64, h: f64, fleet_rate: f64) -> f64 {
        let idle = self.idle_s(t);
        if idle <= IDLE_GAP_S {
            return 1.0;
        }
        let wakes = self.wakes();
        let rate = if wakes > 0.0 {
            wakes / t.max(IDLE_GAP_S)
        } else {
            fleet_rate
        };
        let prior = 1.0 - (-rate * h).exp();
        if !idle.is_finite() {
            return prior;
        }
        let (mut longer, mut ending) = (0.0, 0.0);
        for &g in &self.gaps {
            if g > idle {
                longer += 1.0;
                if g <= idle + h {
                    ending += 1.0;
                }
            }
        }
        (ending + prior) / (longer + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_model_is_asked_for_at_once() {
        let mut d = Demand::default();
        d.arrive(100.0);
        assert_eq!(d.p_within(130.0, 1.0, 0.0), 1.0);
    }

    #[test]
    fn idle_stretches_that_always_end_after_ten_minutes_say_so() {
        let mut d = Demand::default();
        let mut t = 0.0;
        for _ in 0..20 {
            d.arrive(t);
            t += 600.0;
        }
        // Idle 9.5 minutes: every past stretch ended within the next minute.
        let soon = d.p_within(t - 600.0 + 570.0, 60.0, 0.0);
        // Idle two minutes: none ends within the next minute.
        let early = d.p_within(t - 600.0 + 120.0, 60.0, 0.0);
        assert!(soon > 0.9, "{soon}");
        assert!(early < 0.1, "{early}");
    }

    #[test]
    fn a_model_never_asked_for_has_the_fleets_chance() {
        let d = Demand::default();
        assert_eq!(d.p_within(3600.0, 60.0, 0.0), 0.0);
        let p = d.p_within(3600.0, 60.0, 1.0 / 600.0);
        assert!((p - (1.0 - (-0.1f64).exp())).abs() < 1e-12, "{p}");
        let mut d = Demand::default();
        d.arrive(10.0);
        // Idle longer than any stretch seen: its own long-run rate answers.
        let p = d.p_within(3600.0, 60.0, 1.0);
        assert!(p > 0.0 && p < 0.05, "{p}");
    }
}
