//! What it costs to hold each minute of a trace at the size its load needs as a steady
//! load: the yardstick for how far any scaling can take a day below one fixed size.
//!
//! The fewest fixed replicas that serve a steady load at 99% do not grow in proportion
//! to its rate: a small pool needs more margin (a clump of long prompts meets one or
//! two replicas), a large one pools it. [`need_curve`] measures that curve with
//! `static-peak`'s own search on steady Poisson hours at rates spanning the trace's
//! minutes, each drawing its requests from the trace itself; it then charges every
//! minute of the trace the curve's size at that minute's rate, as a policy would that
//! knew each minute's rate, started replicas instantly and never paid for learning,
//! and runs those sizes on the trace. Against `static-peak` on the whole trace, that
//! says what share of the fixed size sizing by load can save at best along the
//! curve's shape, and the proportional line beside it says what it would save if the
//! need grew with the load. The curve takes arrivals within a minute as Poisson: on a
//! trace whose bursts are shorter than that, its sizes miss, and the runs show it.

use serde::Serialize;

use crate::clairvoyant::{MINUTE, Plan};
use crate::config::{SimConfig, StartClass};
use crate::day::{DayShape, day};
use crate::replay::Sim;
use crate::sizing::static_peak;
use crate::trace::TraceRequest;

/// Attainment a sizing must hold on the trace, as `static-peak`'s does.
const TARGET: f64 = 0.99;
/// Resolution of a scaled curve's factor.
pub const SCALED_STEP: f64 = 0.01;
/// Most requests one steady load holds: a trace whose busiest minute is far busier
/// than a fleet's (every request at one instant) is measured over a shorter load,
/// not one that exhausts memory.
pub const MAX_STEADY_REQUESTS: f64 = 2_000_000.0;

/// The fewest fixed replicas serving a steady load at one rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NeedPoint {
    /// Requests/s of the steady load.
    pub rate: f64,
    /// `static-peak`'s sizes on it.
    pub prefill: u32,
    pub decode: u32,
    /// What that size attained on it (under 99% only where the pools' maxima did).
    pub slo_attainment: f64,
    /// Requests in the steady load, and the seconds they came over.
    pub requests: usize,
    pub seconds: f64,
}

/// GPU-seconds per pool of one way of sizing the trace's minutes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PoolSeconds {
    pub prefill: f64,
    pub decode: f64,
}

impl PoolSeconds {
    #[must_use]
    pub fn total(&self) -> f64 {
        self.prefill + self.decode
    }
}

/// A minute-by-minute size simulated on the trace.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PlanRun {
    pub slo_attainment: f64,
    pub gpu_seconds: f64,
}

/// The curve scaled per pool by the least factors that still hold the trace at 99%
/// (prefill's first, with decode at the curve; then decode's under it), and its run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ScaledRun {
    pub prefill: f64,
    pub decode: f64,
    pub run: PlanRun,
}

/// Each minute of the trace charged by the curve, and by `static-peak`'s size.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Charges {
    /// `static-peak`'s size, every minute.
    pub fixed: PoolSeconds,
    /// Every minute at the curve's size for its rate.
    pub tracking: PoolSeconds,
    /// The same, the curve scaled down per pool so that the busiest minute needs no
    /// more than `static-peak`'s size: the ratio of the fixed size to a steady load's
    /// need at the busiest minute's rate, granted to every minute alike.
    pub relaxed: PoolSeconds,
    /// `static-peak`'s sizes in proportion to each minute's rate against the busiest
    /// minute's: what tracking would cost if the need grew with the load.
    pub proportional: PoolSeconds,
    /// `(prefill, decode)`: the factor `relaxed` scales the curve by.
    pub relax: (f64, f64),
}

/// The need curve of a trace and what sizing its minutes by it costs.
#[derive(Clone, Debug, Serialize)]
pub struct NeedReport {
    /// Seconds of each steady load the curve was asked to be measured on (a point's
    /// own says where [`MAX_STEADY_REQUESTS`] made it shorter).
    pub steady_s: f64,
    /// In increasing rate.
    pub points: Vec<NeedPoint>,
    /// Requests/s of each minute of the trace.
    pub minute_rates: Vec<f64>,
    /// `static-peak` on the trace: its sizes, attainment and GPU-seconds as simulated
    /// (with the drain after the last request, which `charges.fixed` leaves out).
    pub static_peak: (u32, u32),
    pub static_peak_attainment: f64,
    pub static_peak_gpu_seconds: f64,
    pub charges: Charges,
    /// `tracking` and `relaxed` in whole replicas (each minute's size rounded up, at
    /// least one) simulated on the trace with every replica ready the moment its
    /// minute begins: what each sizing attains, and costs, at best.
    pub tracking_run: PlanRun,
    pub relaxed_run: PlanRun,
    /// `None` where the curve itself does not hold 99% on the trace.
    pub scaled_run: Option<ScaledRun>,
    /// Simulations run on the trace (the steady loads' searches aside).
    pub trace_runs: usize,
}

/// Requests/s in each whole minute from 0 to the last request's. The last minute is
/// taken over a whole minute too, as every sizing here charges it: a few requests in
/// its first second are not a burst.
#[must_use]
pub fn minute_rates(trace: &[TraceRequest]) -> Vec<f64> {
    let Some(last) = trace
        .iter()
        .map(|r| r.t)
        .filter(|t| t.is_finite())
        .reduce(f64::max)
    else {
        return Vec::new();
    };
    let minutes = (last.max(0.0) / MINUTE).floor() as usize + 1;
    let mut counts = vec![0usize; minutes];
    for r in trace.iter().filter(|r| r.t.is_finite()) {
        let m = ((r.t.max(0.0) / MINUTE).floor() as usize).min(minutes - 1);
        counts[m] += 1;
    }
    counts.iter().map(|&n| n as f64 / MINUTE).collect()
}

/// `n` rates from `lo` to `hi`, evenly spaced in their logarithm (the curve bends most
/// at low rates); one where they are equal.
#[must_use]
pub fn rate_grid(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if !(lo > 0.0 && hi.is_finite() && hi >= lo) || n == 0 {
        return Vec::new();
    }
    if n == 1 || hi <= lo * (1.0 + 1e-9) {
        return vec![hi];
    }
    let step = (hi / lo).ln() / (n - 1) as f64;
    (0..n)
        .map(|i| {
            if i + 1 == n {
                hi
            } else {
                lo * (step * i as f64).exp()
            }
        })
        .collect()
}

/// The curve's (prefill, decode) size at `rate`: linear between its points (in
/// increasing rate), from none at no load to its first point, its last point's beyond
/// it. Fractional: a yardstick, not a deployment.
#[must_use]
pub fn need_at(points: &[NeedPoint], rate: f64) -> (f64, f64) {
    // No load, or a rate that is not a number, needs nothing.
    if rate.is_nan() || rate <= 0.0 {
        return (0.0, 0.0);
    }
    let mut prev = (0.0, 0.0, 0.0);
    for p in points {
        let here = (p.rate, f64::from(p.prefill), f64::from(p.decode));
        if rate <= p.rate {
            let f = if here.0 > prev.0 {
                (rate - prev.0) / (here.0 - prev.0)
            } else {
                1.0
            };
            return (
                prev.1 + (here.1 - prev.1) * f,
                prev.2 + (here.2 - prev.2) * f,
            );
        }
        prev = here;
    }
    (prev.1, prev.2)
}

/// Measures the need curve of `trace` at `points` rates from its quietest busy minute's
/// to its busiest's (`steady_s` seconds of steady Poisson arrivals each, at most
/// [`MAX_STEADY_REQUESTS`], requests drawn from the trace, seeded) on every core,
/// charges the trace's minutes by it and runs those sizes on the trace. `progress` is
/// told each run as it starts.
#[must_use]
pub fn need_curve(
    cfg: &SimConfig,
    trace: &[TraceRequest],
    points: usize,
    steady_s: f64,
    progress: &(dyn Fn(&str) + Sync),
) -> NeedReport {
    let rates = minute_rates(trace);
    let busy = rates.iter().copied().filter(|&r| r > 0.0);
    let lo = busy.clone().reduce(f64::min).unwrap_or(0.0);
    let hi = busy.reduce(f64::max).unwrap_or(0.0);
    let grid = rate_grid(lo, hi, points);
    // The whole trace's own search (job 0) runs beside the steady ones, first: it is
    // the longest.
    let order: Vec<usize> = (0..=grid.len()).collect();
    let mut measured = crate::on_cores::run_ordered(grid.len() + 1, &order, |i| {
        if i == 0 {
            progress("static-peak on the trace");
            let (p, d, r) = static_peak(cfg, trace);
            return Measured::Fixed(p, d, r.slo_attainment, r.gpu_seconds);
        }
        let rate = grid[i - 1];
        progress(&format!("steady load at {rate:.2} req/s"));
        let seconds = steady_s.min(MAX_STEADY_REQUESTS / rate);
        let steady = day(
            trace,
            &DayShape {
                hours: seconds / 3600.0,
                peak_rps: rate,
                swing: 1.0,
                seed: i as u64,
                ..DayShape::default()
            },
        );
        let (prefill, decode, r) = static_peak(cfg, &steady);
        Measured::Point(NeedPoint {
            rate,
            prefill,
            decode,
            slo_attainment: r.slo_attainment,
            requests: steady.len(),
            seconds,
        })
    })
    .into_iter();
    let Some(Measured::Fixed(sp, sd, static_peak_attainment, static_peak_gpu_seconds)) =
        measured.next()
    else {
        unreachable!("job 0 is the trace's own search")
    };
    let points: Vec<NeedPoint> = measured
        .filter_map(|m| match m {
            Measured::Point(p) => Some(p),
            Measured::Fixed(..) => None,
        })
        .collect();
    let charges = charge(&points, &rates, (sp, sd));
    let plans = Plans {
        cfg,
        trace,
        points: &points,
        rates: &rates,
        runs: std::cell::Cell::new(0),
    };
    progress("each minute at its steady need");
    let tracking_run = plans.run((1.0, 1.0));
    progress("each minute at its steady need, relaxed");
    let relaxed_run = plans.run(charges.relax);
    let scaled_run =
        (tracking_run.slo_attainment >= TARGET).then(|| plans.least_scale(tracking_run, progress));
    NeedReport {
        steady_s,
        trace_runs: plans.runs.get(),
        points,
        minute_rates: rates,
        static_peak: (sp, sd),
        static_peak_attainment,
        static_peak_gpu_seconds,
        charges,
        tracking_run,
        relaxed_run,
        scaled_run,
    }
}

/// One job of [`need_curve`]'s: `static-peak` on the trace (its sizes, attainment and
/// GPU-seconds), or a point of the curve.
enum Measured {
    Fixed(u32, u32, f64, f64),
    Point(NeedPoint),
}

/// The curve's sizes run on the trace, each minute's replicas ready the moment it
/// begins.
struct Plans<'a> {
    cfg: &'a SimConfig,
    trace: &'a [TraceRequest],
    points: &'a [NeedPoint],
    rates: &'a [f64],
    runs: std::cell::Cell<usize>,
}

impl Plans<'_> {
    /// Each minute at its rate's need scaled by `(prefill, decode)`, rounded up (at
    /// least one, as `clairvoyant`'s plans).
    fn run(&self, scale: (f64, f64)) -> PlanRun {
        self.runs.set(self.runs.get() + 1);
        let mut instant = self.cfg.clone();
        instant.start = StartClass::Hot;
        let instant = instant.with_startup_s(0.0);
        let whole = |x: f64| x.ceil().max(1.0) as u32;
        let (prefill, decode): (Vec<u32>, Vec<u32>) = self
            .rates
            .iter()
            .map(|&rate| {
                let (p, d) = need_at(self.points, rate);
                (whole(p * scale.0), whole(d * scale.1))
            })
            .unzip();
        let run = Sim::new(
            &instant,
            self.trace,
            Box::new(Plan::per_minute(prefill)),
            Box::new(Plan::per_minute(decode)),
        )
        .run();
        PlanRun {
            slo_attainment: run.slo_attainment,
            gpu_seconds: run.gpu_seconds,
        }
    }

    /// The least prefill factor in [0, 1] (to [`SCALED_STEP`]) that holds
    /// [`TARGET`] with decode at the curve, then the least decode factor under it, as
    /// `static-peak` sizes its pools; `full` is the curve's own run, which holds it.
    fn least_scale(&self, full: PlanRun, progress: &(dyn Fn(&str) + Sync)) -> ScaledRun {
        let least = |scaled: &dyn Fn(f64) -> (f64, f64), best: PlanRun| {
            // `hi` always holds the target; `lo` is not known to.
            let (mut lo, mut hi, mut best) = (0.0f64, 1.0f64, best);
            while hi - lo > SCALED_STEP {
                let mid = f64::midpoint(lo, hi);
                let scale = scaled(mid);
                progress(&format!(
                    "each minute at {:.3}× prefill, {:.3}× decode of its steady need",
                    scale.0, scale.1
                ));
                let run = self.run(scale);
                if run.slo_attainment >= TARGET {
                    (hi, best) = (mid, run);
                } else {
                    lo = mid;
                }
            }
            (hi, best)
        };
        let (prefill, run) = least(&|f| (f, 1.0), full);
        let (decode, run) = least(&|f| (prefill, f), run);
        ScaledRun {
            prefill,
            decode,
            run,
        }
    }
}

/// Charges every minute of `rates` by the curve `points`, and by the fixed and
/// proportional sizes of `static_peak`, a whole minute each (a replica held for part
/// of a minute is held).
#[must_use]
pub fn charge(points: &[NeedPoint], rates: &[f64], static_peak: (u32, u32)) -> Charges {
    let (sp, sd) = (f64::from(static_peak.0), f64::from(static_peak.1));
    let hi = rates.iter().copied().fold(0.0f64, f64::max);
    // The relaxation scales the curve down only: where the busiest minute needs less
    // than the fixed size, it stays as measured.
    let (np, nd) = need_at(points, hi);
    let scale = |fixed: f64, need: f64| if need > fixed { fixed / need } else { 1.0 };
    let (rp, rd) = (scale(sp, np), scale(sd, nd));
    let mut c = Charges {
        relax: (rp, rd),
        ..Charges::default()
    };
    for &rate in rates {
        let (p, d) = need_at(points, rate);
        let share = if hi > 0.0 { rate / hi } else { 0.0 };
        let add = |s: &mut PoolSeconds, prefill: f64, decode: f64| {
            s.prefill += prefill * MINUTE;
            s.decode += decode * MINUTE;
        };
        add(&mut c.fixed, sp, sd);
        add(&mut c.tracking, p, d);
        add(&mut c.relaxed, p * rp, d * rd);
        add(&mut c.proportional, sp * share, sd * share);
    }
    c
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    fn point(rate: f64, prefill: u32, decode: u32) -> NeedPoint {
        NeedPoint {
            rate,
            prefill,
            decode,
            slo_attainment: 0.99,
            requests: 1,
            seconds: 3600.0,
        }
    }

    fn at(t: f64) -> TraceRequest {
        TraceRequest {
            t,
            input_tokens: 8192,
            output_tokens: 20,
            blocks: Vec::new(),
        }
    }

    fn cfg() -> SimConfig {
        use preheat_scaler::policy::PoolPolicy;
        use preheat_scaler::profile::Profile;
        SimConfig::new(
            PoolPolicy::default(),
            PoolPolicy::default(),
            Profile::default(),
        )
    }

    #[test]
    fn the_need_is_interpolated_between_measured_rates_from_none_at_no_load() {
        let c = [point(2.0, 4, 1), point(10.0, 12, 3)];
        assert_eq!(need_at(&c, 0.0), (0.0, 0.0));
        assert_eq!(need_at(&c, f64::NAN), (0.0, 0.0));
        assert_eq!(need_at(&c, 1.0), (2.0, 0.5));
        assert_eq!(need_at(&c, 2.0), (4.0, 1.0));
        assert_eq!(need_at(&c, 6.0), (8.0, 2.0));
        assert_eq!(need_at(&c, 50.0), (12.0, 3.0));
        assert_eq!(need_at(&[], 5.0), (0.0, 0.0));
    }

    #[test]
    fn minute_rates_count_each_whole_minute_the_last_too() {
        // 120 in the first minute, none in the second, 10 in the first 20 s of the
        // third: a tenth of a request a second over its minute, not a burst.
        let mut trace: Vec<TraceRequest> = (0..120).map(|i| at(f64::from(i) * 0.5)).collect();
        trace.extend((0..10).map(|i| at(120.0 + f64::from(i) * 2.0)));
        let r = minute_rates(&trace);
        assert_eq!(r.len(), 3);
        assert!((r[0] - 2.0).abs() < 1e-12, "{r:?}");
        assert_eq!(r[1], 0.0);
        assert!((r[2] - 10.0 / 60.0).abs() < 1e-12, "{r:?}");
        assert!(minute_rates(&[]).is_empty());
        // A lone late request is one a minute.
        assert_eq!(minute_rates(&[at(600.2)])[10], 1.0 / 60.0);
    }

    #[test]
    fn the_rate_grid_spans_the_minutes_evenly_in_log() {
        let g = rate_grid(1.0, 100.0, 3);
        assert_eq!(g.len(), 3);
        assert!(
            (g[1] - 10.0).abs() < 1e-9 && g[0] == 1.0 && g[2] == 100.0,
            "{g:?}"
        );
        assert_eq!(rate_grid(5.0, 5.0, 4), vec![5.0]);
        assert!(rate_grid(0.0, 5.0, 4).is_empty());
        assert!(rate_grid(1.0, 5.0, 0).is_empty());
    }

    #[test]
    fn every_minute_is_charged_its_rates_need_and_the_fixed_size_alike() {
        // A concave curve: 4 prefill at 1 req/s, 8 at 4 req/s; the trace's
        // static-peak holds 6/2.
        let curve = [point(1.0, 4, 1), point(4.0, 8, 2)];
        let c = charge(&curve, &[1.0, 4.0, 2.0], (6, 2));
        assert_eq!(
            c.fixed,
            PoolSeconds {
                prefill: 1080.0,
                decode: 360.0
            }
        );
        // 4 + 8 + (4 + 4/3) prefill, 1 + 2 + 4/3 decode, a minute each.
        assert!((c.tracking.prefill - 60.0 * (12.0 + 16.0 / 3.0)).abs() < 1e-9);
        assert!((c.tracking.decode - 60.0 * (3.0 + 4.0 / 3.0)).abs() < 1e-9);
        // Relaxed so the busiest minute needs 6 prefill (× 0.75); decode's 2 already fits.
        assert_eq!(c.relax, (0.75, 1.0));
        assert!((c.relaxed.prefill - 0.75 * c.tracking.prefill).abs() < 1e-9);
        assert_eq!(c.relaxed.decode, c.tracking.decode);
        // In proportion: 6 × (1 + 4 + 2) / 4 prefill-minutes.
        assert!((c.proportional.prefill - 60.0 * 6.0 * 7.0 / 4.0).abs() < 1e-9);
        assert!((c.proportional.decode - 60.0 * 2.0 * 7.0 / 4.0).abs() < 1e-9);
    }

    #[test]
    fn a_swinging_trace_is_measured_at_steady_loads_and_sized_minute_by_minute() {
        // Half an hour of 8k-token prompts: a quarter hour at 8 req/s (several
        // replicas' prefill), then 1 req/s (half of one).
        let trace = day(
            &[at(0.0)],
            &DayShape {
                hours: 0.5,
                peak_rps: 8.0,
                swing: 8.0,
                office: Some((0.0, 0.25, 60.0)),
                ..DayShape::default()
            },
        );
        let rates = minute_rates(&trace);
        assert!(rates[5] > 6.0 && rates[25] < 2.0, "{rates:?}");
        let seen = Mutex::new(Vec::new());
        let r = need_curve(&cfg(), &trace, 3, 300.0, &|p| {
            seen.lock().unwrap().push(p.to_owned());
        });
        // Three steady loads and the trace's own search, then every run on the trace.
        assert_eq!(seen.into_inner().unwrap().len(), 4 + r.trace_runs);
        assert_eq!(r.minute_rates, rates);
        assert_eq!(r.points.len(), 3);
        let busiest = rates.iter().copied().fold(0.0, f64::max);
        assert_eq!(r.points[2].rate, busiest);
        assert!(r.points.windows(2).all(|w| w[0].rate < w[1].rate));
        for p in &r.points {
            assert!(
                p.slo_attainment >= 0.99 && p.prefill >= 1 && p.decode >= 1,
                "{p:?}"
            );
        }
        assert!(r.points[2].prefill > r.points[0].prefill, "{:?}", r.points);
        let (sp, sd) = r.static_peak;
        assert!(sp >= 1 && sd >= 1 && r.static_peak_attainment >= 0.99);
        assert_eq!(
            r.charges.fixed.total(),
            f64::from(sp + sd) * rates.len() as f64 * 60.0
        );
        // Sized by the minute, the swing costs less than the fixed size holds.
        assert!(
            r.charges.tracking.total() < r.charges.fixed.total(),
            "{r:?}"
        );
        assert!(r.tracking_run.slo_attainment >= 0.99, "{r:?}");
        assert!(
            r.tracking_run.gpu_seconds < r.static_peak_gpu_seconds,
            "{r:?}"
        );
        // The least scale: bisected per pool (7 halvings each to a 1% step), holding 99%
        // for no more than the curve itself.
        let scaled = r.scaled_run.unwrap();
        assert_eq!(r.trace_runs, 2 + 14);
        assert!(scaled.prefill <= 1.0 && scaled.decode <= 1.0, "{scaled:?}");
        assert!(scaled.run.slo_attainment >= 0.99, "{scaled:?}");
        assert!(
            scaled.run.gpu_seconds <= r.tracking_run.gpu_seconds,
            "{scaled:?}"
        );
    }

    #[test]
    fn a_trace_at_one_instant_or_of_one_request_is_measured_without_panicking() {
        // 200 requests at t = 0: 3.3 req/s over the minute.
        let burst: Vec<TraceRequest> = (0..200).map(|_| at(0.0)).collect();
        let r = need_curve(&cfg(), &burst, 4, 60.0, &|_| {});
        assert_eq!(r.minute_rates.len(), 1);
        assert_eq!(r.points.len(), 1, "one busy minute, one rate");
        let r = need_curve(&cfg(), &[at(30.0)], 4, 60.0, &|_| {});
        assert_eq!(r.points.len(), 1);
        let r = need_curve(&cfg(), &[], 4, 60.0, &|_| {});
        assert!(r.points.is_empty() && r.minute_rates.is_empty());
    }
}
