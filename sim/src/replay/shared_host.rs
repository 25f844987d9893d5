//! Replicas sharing one host: each computing replica's share of its speed, slowed
//! further by what the host measured with that many computing.

use super::Sim;

impl Sim<'_> {
    /// On a shared host, every replica's speed from now: its share of the compute
    /// among the replicas computing at this moment.
    pub(super) fn share_host(&mut self, slots: f64) {
        let t = self.t;
        let busy = self
            .prefill
            .iter()
            .filter(|r| r.is_ready(t) && r.is_busy())
            .count()
            + self
                .decode
                .iter()
                .filter(|r| r.is_ready(t) && !r.is_empty())
                .count();
        // A NaN share would stop every replica for ever: the floor instead.
        let share = slots / busy.max(1) as f64;
        let speed = if share.is_nan() {
            1e-3
        } else {
            // The measured slowdown is beyond the share of the cores, which is at most
            // all of one replica's.
            (share.min(1.0) / slowdown_at(&self.cfg.shared_host_slowdown, busy as f64))
                .clamp(1e-3, 1.0)
        };
        for r in &mut self.prefill {
            r.set_speed(t, speed);
        }
        for r in &mut self.decode {
            r.set_speed(t, speed);
        }
    }
}

/// `points`' slowdown at `busy` replicas computing: 1.0 for one replica or none,
/// linear from there to the first point and between the points, and the last one's
/// beyond it. A factor under 1.0 (faster than the share of the cores, which
/// compute-bound replicas cannot be) or not a number counts as 1.0.
fn slowdown_at(points: &[(f64, f64)], busy: f64) -> f64 {
    let f = |v: f64| if v.is_finite() && v >= 1.0 { v } else { 1.0 };
    // One replica alone runs at its share: the curve starts at (1, 1.0).
    let mut prev = (1.0, 1.0);
    for &(k, v) in points {
        let v = f(v);
        if busy <= k {
            if busy <= prev.0 {
                return prev.1;
            }
            return prev.1 + (v - prev.1) * (busy - prev.0) / (k - prev.0);
        }
        prev = (k, v);
    }
    prev.1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_slowdown_is_interpolated_between_its_measured_counts() {
        let p = [(2.0, 1.1), (4.0, 1.3)];
        assert_eq!(slowdown_at(&[], 3.0), 1.0);
        assert_eq!(slowdown_at(&p, 1.0), 1.0);
        assert!((slowdown_at(&p, 1.5) - 1.05).abs() < 1e-12);
        assert!((slowdown_at(&p, 2.0) - 1.1).abs() < 1e-12);
        assert!((slowdown_at(&p, 3.0) - 1.2).abs() < 1e-12);
        assert!((slowdown_at(&p, 9.0) - 1.3).abs() < 1e-12);
        // A measurement that went wrong slows nothing.
        assert_eq!(slowdown_at(&[(2.0, f64::NAN)], 2.0), 1.0);
        assert_eq!(slowdown_at(&[(2.0, -1.0)], 5.0), 1.0);
        assert_eq!(slowdown_at(&[(2.0, 0.97)], 2.0), 1.0);
    }
}
