//! The fewest replicas that would have served the recent past: the pool's arrivals
//! over a trailing window, replayed through a fluid queue at each candidate size.
//!
//! A rate averaged over a minute hides bursts, and sizing for the single worst scrape
//! interval pays for every Poisson spike of a steady load. Asking "which fixed size
//! would have met the SLO for (nearly) all of the last ten minutes" is `static-peak`'s
//! hindsight search, run on a window the scaler has seen: on a steady load it settles
//! where a fixed size chosen with hindsight would, and after a burst it keeps what the
//! burst needed for as long as the window remembers it.

use std::collections::VecDeque;

/// Prompt tokens (uncached) that arrived per policy tick, over a trailing window.
#[derive(Clone, Debug, Default)]
pub struct ArrivalHistory {
    /// (end time, seconds covered, tokens), oldest first.
    buckets: VecDeque<(f64, f64, f64)>,
    /// When arrivals were last recorded (the next reading covers the time since).
    last_t: Option<f64>,
}

/// Longest gap between readings one rate is taken to cover.
const MAX_GAP_S: f64 = 60.0;

/// Seconds a reading at `t` (a source's latest rate over `span` seconds) stands for:
/// the time since the `last` reading, at most a minute or the span beyond it; the
/// first reading, one span. `None` for a reading not after the last one or not at a
/// number, which is skipped; otherwise `last` moves to `t`.
pub(crate) fn covered_since(last: &mut Option<f64>, t: f64, span: f64) -> Option<f64> {
    let span = if span.is_finite() { span.max(0.0) } else { 0.0 };
    if !t.is_finite() {
        return None;
    }
    let dt = match *last {
        Some(p) if t <= p => return None,
        Some(p) => (t - p).min(span.max(MAX_GAP_S)),
        None => span,
    };
    *last = Some(t);
    Some(dt)
}

/// How a candidate size is judged.
#[derive(Clone, Copy, Debug)]
pub struct ServiceModel {
    /// Tokens per second one replica prefills.
    pub rate_per_replica: f64,
    /// Longest queueing a request may see and still meet its TTFT target (the target
    /// less its own prefill time).
    pub max_wait_s: f64,
    /// Share of the window's tokens that must meet it.
    pub target: f64,
}

impl ArrivalHistory {
    /// Records a reading at `t`: `rate` tokens/s, the source's latest rate over `span`
    /// seconds, taken to hold since the last reading (the first: one span of it; a gap
    /// of skipped readings counts for at most a minute). A reading with no span (a
    /// pool at zero, or a source's first scrape) counts from the last reading on, so
    /// the window moves on while the pool is at zero instead of keeping its last busy
    /// minutes for the morning.
    pub fn record(&mut self, t: f64, rate: f64, span: f64, window: f64) {
        if let Some(dt) = covered_since(&mut self.last_t, t, span)
            && dt > 0.0
        {
            self.push(t, dt, rate * dt, window);
        }
    }

    /// Fills an empty window with readings taken before `t`: (seconds before `t`,
    /// tokens/s over the `step` before), oldest first; those outside the window or not
    /// numbers are dropped. Returns how many were taken; none once the window holds
    /// arrivals of its own.
    pub fn seed(&mut self, t: f64, step: f64, points: &[(f64, f64)], window: f64) -> usize {
        if self.covered_s() > 0.0 || !(step.is_finite() && step > 0.0) {
            return 0;
        }
        let mut taken = 0;
        for &(age, rate) in points {
            let usable = (0.0..=window).contains(&age) && rate.is_finite() && rate >= 0.0;
            if usable {
                self.push(t - age, step, rate * step, window);
                taken += 1;
            }
        }
        if taken > 0 {
            self.last_t = Some(t);
        }
        taken
    }

    /// Records `tokens` that arrived over the `dt` seconds ending at `t`, and forgets
    /// what ended more than `span` seconds ago.
    pub fn push(&mut self, t: f64, dt: f64, tokens: f64, span: f64) {
        if dt > 0.0 && tokens.is_finite() && tokens >= 0.0 {
            self.buckets.push_back((t, dt, tokens));
        }
        while self.buckets.front().is_some_and(|b| b.0 < t - span) {
            self.buckets.pop_front();
        }
    }

    /// Seconds of arrivals on record.
    #[must_use]
    pub fn covered_s(&self) -> f64 {
        self.buckets.iter().map(|b| b.1).sum()
    }

    /// Share of the window's tokens that `replicas` would have served within the
    /// model's wait. Arrivals are spread evenly over their interval; the queue is a
    /// fluid drained at `replicas × rate_per_replica`.
    #[must_use]
    pub fn met_share(&self, replicas: f64, m: &ServiceModel) -> f64 {
        let cap_rate = replicas * m.rate_per_replica;
        if cap_rate <= 0.0 {
            return 0.0;
        }
        let (mut backlog, mut met, mut total) = (0.0f64, 0.0, 0.0);
        let room = m.max_wait_s * cap_rate;
        for &(_, dt, a) in &self.buckets {
            // Over the interval the backlog moves linearly from `backlog` by `slope`; a
            // token waits for the backlog it finds.
            let slope = a - cap_rate * dt;
            let within = if slope > 0.0 {
                ((room - backlog) / slope).clamp(0.0, 1.0)
            } else if slope < 0.0 {
                1.0 - ((backlog - room) / -slope).clamp(0.0, 1.0)
            } else if backlog <= room {
                1.0
            } else {
                0.0
            };
            met += a * within;
            total += a;
            backlog = (backlog + slope).max(0.0);
        }
        if total > 0.0 { met / total } else { 1.0 }
    }

    /// The fewest replicas (up to `max`) meeting the model's target over the window;
    /// 0 when nothing arrived, `max` when even that misses.
    #[must_use]
    pub fn fewest_replicas(&self, m: &ServiceModel, max: u32) -> u32 {
        if !self.buckets.iter().any(|b| b.2 > 0.0) || m.rate_per_replica <= 0.0 {
            return 0;
        }
        let (mut lo, mut hi) = (1u32, max.max(1));
        if self.met_share(f64::from(hi), m) < m.target {
            return hi;
        }
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.met_share(f64::from(mid), m) >= m.target {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ServiceModel {
        ServiceModel {
            rate_per_replica: 10_000.0,
            max_wait_s: 1.0,
            target: 0.99,
        }
    }

    #[test]
    fn a_steady_load_needs_its_mean_rate() {
        let mut h = ArrivalHistory::default();
        for i in 1..=120 {
            h.push(f64::from(i) * 5.0, 5.0, 5.0 * 45_000.0, 600.0);
        }
        // 45k tokens/s over 10k per replica: 5 replicas, not 4.
        assert_eq!(h.fewest_replicas(&model(), 64), 5);
    }

    #[test]
    fn a_burst_is_remembered_for_the_window_then_forgotten() {
        let mut h = ArrivalHistory::default();
        h.push(5.0, 5.0, 400_000.0, 600.0);
        for i in 2..=100 {
            h.push(f64::from(i) * 5.0, 5.0, 5.0 * 1_000.0, 600.0);
        }
        // 400k tokens in 5 s, the last waiting at most 1 s: 400k / 10k / (5 + 1) ≈ 6.7.
        assert_eq!(h.fewest_replicas(&model(), 64), 7);
        for i in 101..=230 {
            h.push(f64::from(i) * 5.0, 5.0, 5.0 * 1_000.0, 600.0);
        }
        assert_eq!(h.fewest_replicas(&model(), 64), 1);
    }

    #[test]
    fn nothing_arrived_needs_nothing_and_more_than_max_says_max() {
        let mut h = ArrivalHistory::default();
        assert_eq!(h.fewest_replicas(&model(), 8), 0);
        h.push(5.0, 5.0, 0.0, 600.0);
        assert_eq!(h.fewest_replicas(&model(), 8), 0);
        h.push(10.0, 5.0, 5.0e7, 600.0);
        assert_eq!(h.fewest_replicas(&model(), 8), 8);
    }

    #[test]
    fn more_replicas_never_meet_less() {
        let mut h = ArrivalHistory::default();
        for i in 1..=60 {
            let burst = if i % 7 == 0 { 300_000.0 } else { 20_000.0 };
            h.push(f64::from(i) * 5.0, 5.0, burst, 600.0);
        }
        let mut last = 0.0;
        for c in 1..=40 {
            let s = h.met_share(f64::from(c), &model());
            assert!(s >= last - 1e-12, "{c}: {s} < {last}");
            last = s;
        }
    }
}
