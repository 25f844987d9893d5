//! Per-endpoint history over a sliding window: counter rates and latency quantiles
//! from histogram bucket deltas, robust to counter resets (a restarted engine).

use std::collections::VecDeque;

use super::exposition::{Buckets, Reading, quantile};

/// Readings of one endpoint within the last `span` seconds.
#[derive(Clone, Debug)]
pub struct Window {
    span: f64,
    points: VecDeque<(f64, Reading)>,
}

impl Window {
    #[must_use]
    pub fn new(span_secs: f64) -> Self {
        Window {
            span: span_secs,
            points: VecDeque::new(),
        }
    }

    /// Adds a reading taken at time `t` (seconds, monotonic).
    pub fn push(&mut self, t: f64, r: Reading) {
        self.points.push_back((t, r));
        // Keep one point at or before the window start, so rates cover the full span.
        while self.points.len() > 2 && self.points[1].0 <= t - self.span {
            self.points.pop_front();
        }
    }

    #[must_use]
    pub fn latest(&self) -> Option<&(f64, Reading)> {
        self.points.back()
    }

    /// Per-second increase of a counter over the window; a decrease is a reset, and
    /// the increase since the reset is counted from zero.
    pub fn rate(&self, f: impl Fn(&Reading) -> Option<f64>) -> Option<f64> {
        let covered = self.covered_s();
        (covered > 0.0).then(|| self.increase(f) / covered)
    }

    /// Increase of a counter over the window (reset-aware like [`Window::rate`]).
    pub fn increase(&self, f: impl Fn(&Reading) -> Option<f64>) -> f64 {
        self.increase_since(f, f64::NEG_INFINITY)
    }

    /// Increase of a counter after time `since`, an interval that straddles it
    /// counted in proportion.
    pub fn increase_since(&self, f: impl Fn(&Reading) -> Option<f64>, since: f64) -> f64 {
        let mut total = 0.0;
        let mut prev: Option<(f64, f64)> = None;
        for (t, r) in &self.points {
            let Some(v) = f(r) else { continue };
            if let Some((pt, p)) = prev
                && *t > since
            {
                let inc = if v >= p { v - p } else { v };
                // (`t > pt` always here; the guard keeps a zero out of the divisor.)
                let share = if pt >= since || *t <= pt {
                    1.0
                } else {
                    (t - since) / (t - pt)
                };
                total += inc * share;
            }
            prev = Some((*t, v));
        }
        total
    }

    /// Seconds from the first reading kept to the last: the window's span once the
    /// endpoint has been read for that long, less before.
    #[must_use]
    pub fn covered_s(&self) -> f64 {
        match (self.points.front(), self.points.back()) {
            (Some((t0, _)), Some((t1, _))) => (t1 - t0).max(0.0),
            _ => 0.0,
        }
    }

    /// Mean seconds between readings.
    #[must_use]
    pub fn mean_spacing(&self) -> Option<f64> {
        let (a, b) = (self.points.front()?.0, self.points.back()?.0);
        (self.points.len() > 1).then(|| (b - a) / (self.points.len() - 1) as f64)
    }

    /// Highest per-second increase between consecutive readings in the window: the
    /// short-term peak that a window-average rate smooths away.
    pub fn peak_rate(&self, f: impl Fn(&Reading) -> Option<f64>) -> Option<f64> {
        let mut peak: Option<f64> = None;
        let mut prev: Option<(f64, f64)> = None;
        for (t, r) in &self.points {
            let Some(v) = f(r) else { continue };
            if let Some((pt, pv)) = prev
                && *t > pt
            {
                let inc = if v >= pv { v - pv } else { v };
                let rate = inc / (t - pt);
                peak = Some(peak.map_or(rate, |p: f64| p.max(rate)));
            }
            prev = Some((*t, v));
        }
        peak
    }

    /// Per-second increase of a counter between the last two readings.
    pub fn last_rate(&self, f: impl Fn(&Reading) -> Option<f64>) -> Option<f64> {
        let n = self.points.len();
        let ((t0, r0), (t1, r1)) = (self.points.get(n.checked_sub(2)?)?, self.points.back()?);
        let (v0, v1) = (f(r0)?, f(r1)?);
        let inc = if v1 >= v0 { v1 - v0 } else { v1 };
        (t1 > t0).then(|| inc / (t1 - t0))
    }

    /// Bucket deltas of a histogram over the window (reset-aware like [`Window::rate`]).
    pub fn delta_buckets(&self, f: impl Fn(&Reading) -> Option<&Buckets>) -> Option<Buckets> {
        let mut acc: Option<Buckets> = None;
        let mut prev: Option<&Buckets> = None;
        for (_, r) in &self.points {
            let Some(b) = f(r) else { continue };
            if let Some(p) = prev {
                let reset = b.last().map(|x| x.1) < p.last().map(|x| x.1) || b.len() != p.len();
                let d: Buckets = if reset {
                    b.clone()
                } else {
                    b.iter()
                        .zip(p)
                        .map(|(x, y)| (x.0, (x.1 - y.1).max(0.0)))
                        .collect()
                };
                acc = Some(match acc {
                    Some(a) if a.len() == d.len() => {
                        a.iter().zip(&d).map(|(x, y)| (x.0, x.1 + y.1)).collect()
                    }
                    _ => d,
                });
            }
            prev = Some(b);
        }
        acc
    }
}

/// Adds bucket lists with the same bounds (several endpoints of one pool).
#[must_use]
pub fn merge(a: Option<Buckets>, b: Option<Buckets>) -> Option<Buckets> {
    match (a, b) {
        (Some(a), Some(b)) if a.len() == b.len() => {
            Some(a.iter().zip(&b).map(|(x, y)| (x.0, x.1 + y.1)).collect())
        }
        (Some(a), _) => Some(a),
        (None, b) => b,
    }
}

/// `quantile` of merged deltas, for convenience.
#[must_use]
pub fn window_quantile(b: &Option<Buckets>, q: f64) -> Option<f64> {
    b.as_ref().and_then(|b| quantile(b, q))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(prompt: f64, ttft: &[f64]) -> Reading {
        Reading {
            prompt_tokens: Some(prompt),
            ttft: Some(vec![(0.5, ttft[0]), (f64::INFINITY, ttft[1])]),
            ..Reading::default()
        }
    }

    #[test]
    fn rates_and_resets() {
        let mut w = Window::new(30.0);
        w.push(0.0, r(100.0, &[0.0, 0.0]));
        w.push(10.0, r(300.0, &[4.0, 5.0]));
        assert_eq!(w.rate(|r| r.prompt_tokens), Some(20.0));
        assert_eq!(w.last_rate(|r| r.prompt_tokens), Some(20.0));
        // The engine restarted: counter back to 50.
        w.push(20.0, r(50.0, &[1.0, 1.0]));
        assert_eq!(w.rate(|r| r.prompt_tokens), Some(250.0 / 20.0));
        assert_eq!(w.last_rate(|r| r.prompt_tokens), Some(5.0));
        let d = w.delta_buckets(|r| r.ttft.as_ref()).unwrap();
        assert_eq!(d, vec![(0.5, 5.0), (f64::INFINITY, 6.0)]);
    }

    #[test]
    fn an_increase_since_a_time_counts_the_straddling_interval_in_part() {
        let mut w = Window::new(60.0);
        for (t, v) in [(0.0, 0.0), (10.0, 100.0), (20.0, 300.0), (30.0, 20.0)] {
            w.push(t, r(v, &[0.0, 0.0]));
        }
        // 10 → 20 s: +200, half of it after 15 s; 20 → 30 s: a reset, +20.
        assert_eq!(w.increase_since(|r| r.prompt_tokens, 15.0), 120.0);
        assert_eq!(w.increase_since(|r| r.prompt_tokens, 10.0), 220.0);
        assert_eq!(w.increase_since(|r| r.prompt_tokens, 30.0), 0.0);
        assert_eq!(w.increase(|r| r.prompt_tokens), 320.0);
    }

    #[test]
    fn old_points_leave_the_window() {
        let mut w = Window::new(10.0);
        for t in 0..100 {
            w.push(t as f64, r(t as f64 * 10.0, &[0.0, 0.0]));
        }
        assert!(w.points.len() <= 12);
        assert_eq!(w.rate(|r| r.prompt_tokens), Some(10.0));
    }
}
