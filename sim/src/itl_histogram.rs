//! The decode pool's inter-token latency as the scaler reads it: the engine observes
//! every token's gap from the one before it into a histogram, and the scaler takes
//! quantiles of the window's bucket deltas. Observed per decode step here too, so the
//! simulated scaler sees a slowing pool as the real one does, within a step, not when
//! the slowed requests finish.

use preheat_scaler::signals::exposition::{Buckets, quantile};

/// The upper bounds (`le`, seconds) of the bundled engine's ITL histogram, which are
/// vLLM's (`vllm:inter_token_latency_seconds`); a test of the binary holds them to
/// the engine's.
pub const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// Observations per bucket (not cumulative), the last one above every bound.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ItlCounts([f64; ITL_BUCKETS.len() + 1]);

impl ItlCounts {
    /// `count` tokens that each came `seconds` after the one before.
    pub(crate) fn observe(&mut self, seconds: f64, count: f64) {
        if count > 0.0 {
            // `le` buckets: a gap on a bound counts in that bound's bucket.
            let i = ITL_BUCKETS.partition_point(|&b| b < seconds);
            self.0[i] += count;
        }
    }

    /// The observations since `earlier`, as the scaler's cumulative buckets.
    fn since(&self, earlier: &ItlCounts) -> Buckets {
        let mut total = 0.0;
        let bounds = ITL_BUCKETS.iter().copied().chain([f64::INFINITY]);
        bounds
            .zip(self.0.iter().zip(&earlier.0))
            .map(|(le, (now, then))| {
                total += (now - then).max(0.0);
                (le, total)
            })
            .collect()
    }

    /// Quantile `q` of the observations since `earlier`, interpolated in its bucket as
    /// the scaler (and Prometheus' `histogram_quantile`) does; `None` without any.
    pub(crate) fn quantile_since(&self, earlier: &ItlCounts, q: f64) -> Option<f64> {
        quantile(&self.since(earlier), q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_the_scalers_over_the_window_only() {
        let mut then = ItlCounts::default();
        then.observe(0.5, 100.0);
        let mut now = then;
        assert_eq!(now.quantile_since(&then, 0.9), None);
        // 90 tokens at 40 ms, 10 at 180 ms: p50 inside (0.025, 0.05], p90 on its edge.
        now.observe(0.04, 90.0);
        now.observe(0.18, 10.0);
        let p50 = now.quantile_since(&then, 0.5).unwrap();
        assert!((p50 - (0.025 + 0.025 * 50.0 / 90.0)).abs() < 1e-12, "{p50}");
        assert_eq!(now.quantile_since(&then, 0.9), Some(0.05));
        let p99 = now.quantile_since(&then, 0.99).unwrap();
        assert!(p99 > 0.15 && p99 <= 0.2, "{p99}");
        // The earlier 0.5 s tokens are outside the window, but not from the start.
        assert!(now.quantile_since(&ItlCounts::default(), 0.99).unwrap() > 0.4);
    }

    #[test]
    fn a_gap_on_a_bound_counts_in_that_bounds_bucket_and_past_the_last_in_inf() {
        let mut c = ItlCounts::default();
        c.observe(0.1, 1.0);
        c.observe(1000.0, 1.0);
        c.observe(0.3, 0.0);
        let b = c.since(&ItlCounts::default());
        assert_eq!(b[4], (0.1, 1.0));
        assert_eq!(b[3], (0.075, 0.0));
        assert_eq!(b[18], (80.0, 1.0));
        assert_eq!(b[19], (f64::INFINITY, 2.0));
    }
}
