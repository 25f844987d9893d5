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
    /// Hour of the day the peak falls on (the trough is twelve hours away).
    pub peak_hour: f64,
    pub seed: u64,
}

impl Default for DayShape {
    fn default() -> Self {
        DayShape {
            hours: 24.0,
            peak_rps: 20.0,
            swing: 30.0,
            peak_hour: 14.0,
            seed: 1,
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
        e
    }

    /// Arrival rate (requests/s) `t` seconds into the trace, which starts at midnight:
    /// a raised cosine between trough and peak over 24 hours.
    #[must_use]
    pub fn rate(&self, t: f64) -> f64 {
        let trough = self.peak_rps / self.swing;
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
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In [0, 1).
    fn unit(&mut self) -> f64 {
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
        };
        assert_eq!(bad.problems().len(), 4, "{:?}", bad.problems());
        assert!(DayShape::default().problems().is_empty());
    }
}
