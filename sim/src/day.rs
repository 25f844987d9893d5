//! Synthetic days: a request trace whose arrival rate follows a daily swing (trough at
//! night, peak in the afternoon) as a non-homogeneous Poisson process, with each
//! request's sizes (and prefix blocks) drawn from a real trace. The shared traces are
//! an hour each; a day with a 30× swing at fleet scale is what shows whether scaling
//! pays.

use std::f64::consts::PI;

use crate::trace::TraceRequest;

/// The shape of the day.
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub struct DayShape {
    /// Length of the trace in hours.
    pub hours: f64,
    /// Arrival rate at the peak (requests/s).
    pub peak_rps: f64,
    /// Peak rate over trough rate (≥ 1).
    pub swing: f64,
    /// Hour of the day the peak falls on (the trough is twelve hours away); a
    /// cosine day only.
    pub peak_hour: f64,
    pub seed: u64,
    /// Office hours instead of a cosine: (opening hour, closing hour, seconds the rate
    /// takes to climb from trough to peak at opening, and back at closing). The
    /// recurring ramp a forecast of the rate alone meets late.
    pub office: Option<(f64, f64, f64)>,
}

impl Default for DayShape {
    fn default() -> Self {
        DayShape {
            hours: 24.0,
            peak_rps: 20.0,
            swing: 30.0,
            peak_hour: 14.0,
            seed: 1,
            office: None,
        }
    }
}

impl DayShape {
    /// Every problem with the shape, at once.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut e = Vec::new();
        if !(self.hours.is_finite() && self.hours > 0.0 && self.hours <= 24.0 * 14.0) {
            e.push(format!("hours {}: between 0 and 336", self.hours));
        }
        if !(self.peak_rps.is_finite() && self.peak_rps > 0.0 && self.peak_rps <= 10_000.0) {
            e.push(format!(
                "peak rate {}: between 0 and 10000 req/s",
                self.peak_rps
            ));
        }
        if !(self.swing.is_finite() && self.swing >= 1.0) {
            e.push(format!(
                "swing {}: at least 1 (peak over trough)",
                self.swing
            ));
        }
        if !(self.peak_hour.is_finite() && (0.0..24.0).contains(&self.peak_hour)) {
            e.push(format!("peak hour {}: in [0, 24)", self.peak_hour));
        }
        if let Some((open, close, ramp)) = self.office {
            let hours_ok = open.is_finite() && close.is_finite() && 0.0 <= open && open < close;
            if !(hours_ok && close <= 24.0) {
                e.push(format!(
                    "office hours {open}-{close}: 0 <= open < close <= 24"
                ));
            } else if !(ramp.is_finite() && ramp > 0.0 && ramp <= (close - open) * 1800.0) {
                e.push(format!(
                    "office ramp {ramp} s: above 0 and at most half the office hours"
                ));
            }
        }
        e
    }

    /// Arrival rate (requests/s) `t` seconds into the trace, which starts at midnight:
    /// a raised cosine between trough and peak over 24 hours, or office hours.
    #[must_use]
    pub fn rate(&self, t: f64) -> f64 {
        let trough = self.peak_rps / self.swing;
        if let Some((open, close, ramp)) = self.office {
            let tod = t.rem_euclid(86_400.0);
            let up = ((tod - open * 3600.0) / ramp).clamp(0.0, 1.0);
            let down = ((close * 3600.0 - tod) / ramp).clamp(0.0, 1.0);
            return trough + (self.peak_rps - trough) * up.min(down);
        }
        let hour = t / 3600.0;
        let phase = 2.0 * PI * (hour - self.peak_hour) / 24.0;
        trough + (self.peak_rps - trough) * (1.0 + phase.cos()) / 2.0
    }
}

/// A day of arrivals shaped by `shape`, each request's sizes and prefix blocks drawn
/// (uniformly, with replacement) from `sizes`. Seeded: the same inputs give the same
/// trace. Arrivals by thinning: candidates at the peak rate, each kept with
/// probability rate(t) / peak.
pub fn day(sizes: &[TraceRequest], shape: &DayShape) -> Vec<TraceRequest> {
    let mut out = Vec::new();
    if sizes.is_empty() {
        return out;
    }
    let mut rng = SplitMix(shape.seed);
    let end = shape.hours * 3600.0;
    let mut t = 0.0;
    loop {
        // Exponential gap at the peak rate; 1 - u is in (0, 1], so ln is finite.
        t += -(1.0 - rng.unit()).ln() / shape.peak_rps;
        if t >= end {
            return out;
        }
        if rng.unit() * shape.peak_rps <= shape.rate(t) {
            let pick = &sizes[(rng.next() % sizes.len() as u64) as usize];
            out.push(TraceRequest { t, ..pick.clone() });
        }
    }
}

/// Writes a trace as Mooncake JSONL (`timestamp` in ms, `input_length`,
/// `output_length`, `hash_ids`), which [`crate::trace::load`] reads back.
pub fn write_jsonl(trace: &[TraceRequest], out: &mut impl std::io::Write) -> std::io::Result<()> {
    for r in trace {
        let line = serde_json::json!({
            "timestamp": (r.t * 1000.0).round() as u64,
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": r.blocks,
        });
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// splitmix64: small, seeded, and good enough for arrival times and picks.
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub(crate) fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    /// Exponentially distributed with mean `mean`.
    pub(crate) fn exp(&mut self, mean: f64) -> f64 {
        // 1 - u is in (0, 1], so ln is finite.
        -(1.0 - self.unit()).ln() * mean
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes() -> Vec<TraceRequest> {
        (0..10)
            .map(|i| TraceRequest {
                t: 0.0,
                input_tokens: 100 * (i + 1),
                output_tokens: 10 + i,
                blocks: vec![u64::from(i)],
            })
            .collect()
    }

    #[test]
    fn a_day_follows_its_swing_and_is_seeded() {
        let shape = DayShape {
            peak_rps: 5.0,
            ..DayShape::default()
        };
        let d = day(&sizes(), &shape);
        assert_eq!(d, day(&sizes(), &shape), "same seed, same day");
        assert_ne!(
            d,
            day(
                &sizes(),
                &DayShape {
                    seed: 2,
                    ..shape.clone()
                }
            )
        );
        assert!(d.windows(2).all(|w| w[0].t < w[1].t));
        // Expected count: the mean rate over a whole day, (peak + trough) / 2.
        let expect = (5.0 + 5.0 / 30.0) / 2.0 * 86_400.0;
        let n = d.len() as f64;
        assert!((n - expect).abs() < 0.02 * expect, "{n} vs {expect}");
        // The peak hour carries ~swing times the trough hour's arrivals.
        let in_hour = |h: f64| d.iter().filter(|r| (r.t / 3600.0 - h).abs() < 0.5).count() as f64;
        let (peak, trough) = (in_hour(14.0), in_hour(2.0));
        assert!(
            peak / trough > 20.0 && peak / trough < 45.0,
            "{peak} / {trough}"
        );
        // Sizes come from the source, prefixes with them.
        assert!(
            d.iter()
                .all(|r| r.input_tokens == 100 * (r.blocks[0] as u32 + 1))
        );
    }

    #[test]
    fn office_hours_climb_at_opening_and_fall_at_closing_every_day() {
        let shape = DayShape {
            peak_rps: 30.0,
            swing: 30.0,
            office: Some((8.0, 18.0, 120.0)),
            ..DayShape::default()
        };
        let at = |d: f64, h: f64, m: f64| shape.rate(d * 86_400.0 + h * 3600.0 + m * 60.0);
        for d in [0.0, 1.0, 6.0] {
            assert_eq!(at(d, 7.0, 59.0), 1.0, "night");
            assert!((at(d, 8.0, 1.0) - 15.5).abs() < 1e-9, "half way up");
            assert_eq!(at(d, 12.0, 0.0), 30.0, "day");
            assert!((at(d, 17.0, 59.0) - 15.5).abs() < 1e-9, "half way down");
            assert_eq!(at(d, 18.0, 0.0), 1.0);
        }
    }

    #[test]
    fn a_written_day_reads_back() {
        let d = day(
            &sizes(),
            &DayShape {
                hours: 0.5,
                ..DayShape::default()
            },
        );
        let mut buf = Vec::new();
        write_jsonl(&d, &mut buf).unwrap();
        let back = crate::trace::parse(std::str::from_utf8(&buf).unwrap(), "day.jsonl").unwrap();
        assert_eq!(back.len(), d.len());
        // Times are rebased on the first request and rounded to the millisecond.
        let t0 = d[0].t;
        for (a, b) in d.iter().zip(&back) {
            assert!((a.t - t0 - b.t).abs() < 1e-3 + 1e-9);
            assert_eq!(
                (a.input_tokens, a.output_tokens, &a.blocks),
                (b.input_tokens, b.output_tokens, &b.blocks)
            );
        }
    }

    #[test]
    fn bad_shapes_are_named_all_at_once() {
        let bad = DayShape {
            hours: 0.0,
            peak_rps: -1.0,
            swing: 0.5,
            peak_hour: 24.0,
            seed: 0,
            office: Some((9.0, 8.0, 60.0)),
        };
        assert_eq!(bad.problems().len(), 5, "{:?}", bad.problems());
        let steep = DayShape {
            office: Some((8.0, 9.0, 1801.0)),
            ..DayShape::default()
        };
        assert_eq!(steep.problems().len(), 1, "{:?}", steep.problems());
        assert!(DayShape::default().problems().is_empty());
    }
}
