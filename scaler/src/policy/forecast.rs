//! Load forecast over a lead time: Holt's linear (level + trend) smoothing.

/// Level-and-trend smoother of a rate observed at irregular times.
#[derive(Clone, Debug, Default)]
pub struct Holt {
    level: Option<f64>,
    trend: f64,
    last_t: f64,
}

impl Holt {
    /// Smoothing of the level and of the trend, per second of elapsed time.
    const ALPHA_PER_S: f64 = 0.15;
    const BETA_PER_S: f64 = 0.05;

    /// Feeds an observation `x` at time `t` (seconds).
    pub fn observe(&mut self, t: f64, x: f64) {
        let Some(level) = self.level else {
            self.level = Some(x);
            self.last_t = t;
            return;
        };
        let dt = (t - self.last_t).max(1e-3);
        // Convert per-second smoothing into this step's weights.
        let a = 1.0 - (1.0 - Self::ALPHA_PER_S).powf(dt);
        let b = 1.0 - (1.0 - Self::BETA_PER_S).powf(dt);
        let predicted = level + self.trend * dt;
        let new_level = a * x + (1.0 - a) * predicted;
        self.trend = b * (new_level - level) / dt + (1.0 - b) * self.trend;
        self.level = Some(new_level);
        self.last_t = t;
    }

    /// The value expected `lead` seconds after the last observation, never negative.
    #[must_use]
    pub fn forecast(&self, lead: f64) -> f64 {
        self.level.map_or(0.0, |l| (l + self.trend * lead).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ramp_is_extrapolated_and_a_flat_load_is_not() {
        let mut h = Holt::default();
        for t in 0..120 {
            h.observe(t as f64, 100.0 + 10.0 * t as f64);
        }
        let now = 100.0 + 10.0 * 119.0;
        let ahead = h.forecast(30.0);
        assert!(
            ahead > now + 200.0,
            "ramp of 10/s over 30 s lead: {ahead} vs {now}"
        );
        let mut f = Holt::default();
        for t in 0..120 {
            f.observe(t as f64, 500.0);
        }
        assert!((f.forecast(60.0) - 500.0).abs() < 1.0);
    }
}
