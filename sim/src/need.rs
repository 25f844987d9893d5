//! What it costs to hold each minute of a trace at the size its load needs as a steady
//! load: the yardstick for how far any scaling can take a day below one fixed size.
//!
//! The fewest fixed replicas that serve a steady load at 99% do not grow in proportion
//! to its rate: a small pool needs more margin (a clump of long prompts meets one or
//! two replicas), a large one pools it. [`need_curve`] measures that curve with
//! `static-peak`'s own search on steady Poisson hours at rates spanning the trace's
//! minutes, each drawing its requests from the trace itself; it then charges every
//! minute of the trace the curve's size at that minute's rate, as a policy would that
//! knew each minute's rate, started replicas instantly and never paid for learning.
//! Against `static-peak` on the whole trace, that says what share of the fixed size
//! scaling can save at best while holding each minute to the SLO, and the proportional
//! line beside it says what it would save if the need grew with the load.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Serialize;

use crate::clairvoyant::Plan;
use crate::config::{SimConfig, StartClass};
use crate::day::{DayShape, day};
use crate::replay::Sim;
use crate::sizing::static_peak;
use crate::trace::TraceRequest;

/// Seconds of each minute's bucket.
const MINUTE_S: f64 = 60.0;

/// The fewest fixed replicas serving a steady load at one rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NeedPoint {
    /// Requests/s of the steady load.
    pub rate: f64,
    pub prefill: u32,
    pub decode: u32,
    /// What that size attained on it (under 99% only where the pools' maxima did).
    pub slo_attainment: f64,
    pub requests: usize,
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

/// The need curve of a trace and what sizing its minutes by it costs.
#[derive(Clone, Debug, Serialize)]
pub struct NeedReport {
    /// Seconds of each steady load the curve was measured on.
    pub steady_s: f64,
    /// In increasing rate.
    pub points: Vec<NeedPoint>,
    /// Requests/s of each minute of the trace (the last one over what it covers).
    pub minute_rates: Vec<f64>,
    /// `static-peak` on the trace: its sizes, and those held over every minute (the
    /// yardstick every sizing below is charged the same way as).
    pub static_peak: (u32, u32),
    pub static_peak_attainment: f64,
    /// `static-peak`'s GPU-seconds as simulated (with the drain after the last
    /// request, which `fixed` leaves out).
    pub static_peak_gpu_seconds: f64,
    pub fixed: PoolSeconds,
    /// Every minute at the curve's size for its rate.
    pub tracking: PoolSeconds,
    /// The same, the curve scaled down per pool so that the busiest minute needs no
    /// more than `static-peak`'s size: the slack a fixed size takes at its busiest
    /// (missing there, making up for it elsewhere), granted to every minute alike.
    pub relaxed: PoolSeconds,
    /// `static-peak`'s sizes in proportion to each minute's rate against the busiest
    /// minute's: what tracking would cost if the need grew with the load.
    pub proportional: PoolSeconds,
    /// `(prefill, decode)`: the factor `relaxed` scales the curve by.
    pub relax: (f64, f64),
    /// `tracking` and `relaxed` as whole replicas (each minute's size rounded up, at
    /// least one) simulated on the trace with every replica ready the moment its
    /// minute begins: what each sizing attains, and costs, at best.
    pub tracking_run: Option<PlanRun>,
    pub relaxed_run: Option<PlanRun>,
    /// The least factor (to [`SCALED_STEP`]) the curve can be scaled by, both pools
    /// alike, and still hold the trace at 99% so simulated, with that run: the
    /// cheapest sizing by each minute's known rate along the curve's shape.
    pub scaled_run: Option<(f64, PlanRun)>,
}

/// Attainment the scaled curve must hold on the trace, as `static-peak` does.
const TARGET: f64 = 0.99;
/// Resolution of the scaled curve's factor.
pub const SCALED_STEP: f64 = 0.01;

/// Requests/s in each whole minute from 0 to the last request's, the last minute over
/// the seconds it covers (at least one).
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
    let minutes = (last.max(0.0) / MINUTE_S).floor() as usize + 1;
    let mut counts = vec![0usize; minutes];
    for r in trace.iter().filter(|r| r.t.is_finite()) {
        let m = ((r.t.max(0.0) / MINUTE_S).floor() as usize).min(minutes - 1);
        counts[m] += 1;
    }
    counts
        .iter()
        .enumerate()
        .map(|(m, &n)| n as f64 / minute_span(m, minutes, last))
        .collect()
}

/// Seconds minute `m` of `minutes` covers when the trace ends at `last`.
fn minute_span(m: usize, minutes: usize, last: f64) -> f64 {
    if m + 1 < minutes {
        MINUTE_S
    } else {
        (last - m as f64 * MINUTE_S).clamp(1.0, MINUTE_S)
    }
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

/// The curve's (prefill, decode) size at `rate`: linear between its points, from none
/// at no load to its first point, its last point's beyond it. Fractional: a yardstick,
/// not a deployment.
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
/// to its busiest's (`steady_s` seconds of steady Poisson arrivals each, requests drawn
/// from the trace, seeded) on every core, and charges the trace's minutes by it.
/// `progress` is told each steady load as it starts.
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
    let measured: Mutex<Vec<Option<NeedPoint>>> = Mutex::new(vec![None; grid.len()]);
    let next = AtomicUsize::new(0);
    // The whole trace's own search runs beside the steady ones.
    let fixed_cell = Mutex::new(None);
    let jobs = grid.len() + 1;
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    std::thread::scope(|s| {
        for _ in 0..threads.min(jobs) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= jobs {
                        break;
                    }
                    if i == 0 {
                        progress("static-peak on the trace");
                        let (p, d, r) = static_peak(cfg, trace);
                        *fixed_cell.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((p, d, r.slo_attainment, r.gpu_seconds));
                        continue;
                    }
                    let rate = grid[i - 1];
                    progress(&format!("steady load at {rate:.2} req/s"));
                    let steady = day(
                        trace,
                        &DayShape {
                            hours: steady_s / 3600.0,
                            peak_rps: rate,
                            swing: 1.0,
                            seed: i as u64,
                            ..DayShape::default()
                        },
                    );
                    let (prefill, decode, r) = static_peak(cfg, &steady);
                    measured.lock().unwrap_or_else(|e| e.into_inner())[i - 1] = Some(NeedPoint {
                        rate,
                        prefill,
                        decode,
                        slo_attainment: r.slo_attainment,
                        requests: steady.len(),
                    });
                }
            });
        }
    });
    let points: Vec<NeedPoint> = measured
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .flatten()
        .collect();
    let (sp, sd, static_peak_attainment, static_peak_gpu_seconds) = fixed_cell
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or((0, 0, 0.0, 0.0));
    let mut r = charge(points, rates, (sp, sd), static_peak_attainment, steady_s);
    r.static_peak_gpu_seconds = static_peak_gpu_seconds;
    progress("each minute at its steady need");
    r.tracking_run = Some(run_plan(cfg, trace, &r, (1.0, 1.0)));
    progress("each minute at its steady need, relaxed");
    r.relaxed_run = Some(run_plan(cfg, trace, &r, r.relax));
    r.scaled_run = least_scale(cfg, trace, &r, progress);
    r
}

/// Bisects the factor in `[the smaller relaxation, 1]` for the least that holds
/// [`TARGET`]; `None` where even the curve itself does not.
fn least_scale(
    cfg: &SimConfig,
    trace: &[TraceRequest],
    r: &NeedReport,
    progress: &(dyn Fn(&str) + Sync),
) -> Option<(f64, PlanRun)> {
    let full = r.tracking_run?;
    if full.slo_attainment < TARGET {
        return None;
    }
    let (mut lo, mut hi) = (r.relax.0.min(r.relax.1), 1.0f64);
    let mut best = (1.0, full);
    while hi - lo > SCALED_STEP {
        let mid = f64::midpoint(lo, hi);
        progress(&format!("each minute at {mid:.3}× its steady need"));
        let run = run_plan(cfg, trace, r, (mid, mid));
        if run.slo_attainment >= TARGET {
            best = (mid, run);
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(best)
}

/// Each minute of `r` at its rate's need scaled by `relax`, rounded up, simulated on
/// `trace` with replicas ready the moment they are planned.
fn run_plan(cfg: &SimConfig, trace: &[TraceRequest], r: &NeedReport, relax: (f64, f64)) -> PlanRun {
    let mut instant = cfg.clone();
    instant.start = StartClass::Hot;
    let instant = instant.with_startup_s(0.0);
    let (prefill, decode): (Vec<u32>, Vec<u32>) = r
        .minute_rates
        .iter()
        .map(|&rate| {
            let (p, d) = need_at(&r.points, rate);
            let whole = |x: f64| (x.ceil().max(1.0)) as u32;
            (whole(p * relax.0), whole(d * relax.1))
        })
        .unzip();
    let run = Sim::new(
        &instant,
        trace,
        Box::new(Plan::per_minute(prefill)),
        Box::new(Plan::per_minute(decode)),
    )
    .run();
    PlanRun {
        slo_attainment: run.slo_attainment,
        gpu_seconds: run.gpu_seconds,
    }
}

/// Charges every minute of `rates` by the curve `points`, and by the fixed and
/// proportional sizes of `static_peak`.
#[must_use]
pub fn charge(
    points: Vec<NeedPoint>,
    rates: Vec<f64>,
    static_peak: (u32, u32),
    static_peak_attainment: f64,
    steady_s: f64,
) -> NeedReport {
    let (sp, sd) = (f64::from(static_peak.0), f64::from(static_peak.1));
    let hi = rates.iter().copied().fold(0.0f64, f64::max);
    // The relaxation scales the curve down only: where the busiest minute needs less
    // than the fixed size, it stays as measured.
    let (np, nd) = need_at(&points, hi);
    let scale = |fixed: f64, need: f64| if need > fixed { fixed / need } else { 1.0 };
    let (rp, rd) = (scale(sp, np), scale(sd, nd));
    let mut fixed = PoolSeconds::default();
    let mut tracking = PoolSeconds::default();
    let mut relaxed = PoolSeconds::default();
    let mut proportional = PoolSeconds::default();
    // Every minute is charged a whole minute, the last too: its rate is over the
    // seconds it covers, and a replica held for part of a minute is held.
    let span = MINUTE_S;
    for &rate in &rates {
        let (p, d) = need_at(&points, rate);
        let share = if hi > 0.0 { rate / hi } else { 0.0 };
        fixed.prefill += sp * span;
        fixed.decode += sd * span;
        tracking.prefill += p * span;
        tracking.decode += d * span;
        relaxed.prefill += p * rp * span;
        relaxed.decode += d * rd * span;
        proportional.prefill += sp * share * span;
        proportional.decode += sd * share * span;
    }
    NeedReport {
        steady_s,
        points,
        minute_rates: rates,
        static_peak,
        static_peak_attainment,
        static_peak_gpu_seconds: 0.0,
        fixed,
        tracking,
        relaxed,
        proportional,
        relax: (rp, rd),
        tracking_run: None,
        relaxed_run: None,
        scaled_run: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(rate: f64, prefill: u32, decode: u32) -> NeedPoint {
        NeedPoint {
            rate,
            prefill,
            decode,
            slo_attainment: 0.99,
            requests: 1,
        }
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
    fn minute_rates_count_each_minute_and_the_last_over_what_it_covers() {
        let at = |t: f64| TraceRequest {
            t,
            input_tokens: 1,
            output_tokens: 1,
            blocks: Vec::new(),
        };
        // 120 in the first minute, none in the second, 10 in the first 20 s of the third.
        let mut trace: Vec<TraceRequest> = (0..120).map(|i| at(f64::from(i) * 0.5)).collect();
        trace.extend((0..10).map(|i| at(120.0 + f64::from(i) * 2.0)));
        let r = minute_rates(&trace);
        assert_eq!(r.len(), 3);
        assert!((r[0] - 2.0).abs() < 1e-12, "{r:?}");
        assert_eq!(r[1], 0.0);
        assert!((r[2] - 10.0 / 18.0).abs() < 1e-12, "{r:?}");
        assert!(minute_rates(&[]).is_empty());
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
        // A concave curve: 4 prefill at 1 req/s, 8 at 4 req/s; the day's static-peak
        // holds 6 (it misses at the busiest minute and makes up elsewhere).
        let curve = vec![point(1.0, 4, 1), point(4.0, 8, 2)];
        let r = charge(curve, vec![1.0, 4.0, 2.0], (6, 2), 0.99, 3600.0);
        assert_eq!(
            r.fixed,
            PoolSeconds {
                prefill: 1080.0,
                decode: 360.0
            }
        );
        // 4 + 8 + (4 + 4/3) prefill, 1 + 2 + 4/3 decode, a minute each.
        assert!((r.tracking.prefill - 60.0 * (12.0 + 16.0 / 3.0)).abs() < 1e-9);
        assert!((r.tracking.decode - 60.0 * (3.0 + 4.0 / 3.0)).abs() < 1e-9);
        // Relaxed so the busiest minute needs 6 prefill (× 0.75); decode's 2 already fits.
        assert!((r.relaxed.prefill - 0.75 * r.tracking.prefill).abs() < 1e-9);
        assert_eq!(r.relaxed.decode, r.tracking.decode);
        // In proportion: 6 × (1 + 4 + 2) / 4 prefill-minutes.
        assert!((r.proportional.prefill - 60.0 * 6.0 * 7.0 / 4.0).abs() < 1e-9);
        assert!((r.proportional.decode - 60.0 * 2.0 * 7.0 / 4.0).abs() < 1e-9);
    }

    #[test]
    fn a_swinging_trace_is_measured_at_steady_loads_from_its_quietest_minute_to_its_busiest() {
        use preheat_scaler::policy::PoolPolicy;
        use preheat_scaler::profile::Profile;
        let cfg = SimConfig::new(
            PoolPolicy::default(),
            PoolPolicy::default(),
            Profile::default(),
        );
        // Half an hour swinging 8×, of 8k-token prompts: half a replica's prefill at
        // the trough, a few at the peak.
        let sizes = [TraceRequest {
            t: 0.0,
            input_tokens: 8192,
            output_tokens: 20,
            blocks: Vec::new(),
        }];
        let trace = day(
            &sizes,
            &DayShape {
                hours: 0.5,
                peak_rps: 8.0,
                swing: 8.0,
                peak_hour: 0.25,
                ..DayShape::default()
            },
        );
        let seen = Mutex::new(Vec::new());
        let r = need_curve(&cfg, &trace, 3, 300.0, &|p| {
            seen.lock().unwrap().push(p.to_owned());
        });
        assert_eq!(
            seen.into_inner().unwrap().len(),
            6,
            "three steady loads, the trace, and two sizings run on it"
        );
        let rates = minute_rates(&trace);
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
        let minutes = rates.len() as f64 * 60.0;
        assert_eq!(r.fixed.total(), f64::from(sp + sd) * minutes);
        assert!(r.relaxed.prefill <= r.tracking.prefill && r.relaxed.decode <= r.tracking.decode);
        assert!(r.tracking.total() > 0.0 && r.proportional.total() > 0.0);
        // Both sizings ran on the trace; the steady need holds its minutes to 99%.
        let (tracked, relaxed) = (r.tracking_run.unwrap(), r.relaxed_run.unwrap());
        assert!(tracked.slo_attainment >= 0.99, "{tracked:?}");
        assert!(
            relaxed.gpu_seconds <= tracked.gpu_seconds,
            "{relaxed:?} {tracked:?}"
        );
        assert!(r.static_peak_gpu_seconds > 0.0);
        let (f, scaled) = r.scaled_run.unwrap();
        assert!(f <= 1.0 && scaled.slo_attainment >= 0.99, "{f} {scaled:?}");
        assert!(
            scaled.gpu_seconds <= tracked.gpu_seconds,
            "{scaled:?} {tracked:?}"
        );
    }
}
