//! What `bench simreal` reports, as text, JSON and a plot.

use preheat_output::outln;
use serde::Serialize;

use super::predict::HOST_SLOTS_SENSITIVITY;
use super::stack::Start;

#[derive(Clone, Debug, Serialize)]
pub(super) struct PoolComparison {
    pub pool: &'static str,
    pub measured_replica_s: f64,
    pub predicted_replica_s: f64,
    /// (predicted − measured) / measured; `None` when it never ran for real.
    pub error: Option<f64>,
    /// Within the tolerance: a pool that never ran for real is only when the
    /// prediction did not run it either.
    pub within_tolerance: bool,
    pub measured_max: u32,
    pub predicted_max: u32,
}

/// A request that missed its SLO for real: where an attainment gap is.
#[derive(Debug, Serialize)]
pub(super) struct Missed {
    pub sent_at: f64,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub ttft: Option<f64>,
    pub itl: Option<f64>,
    pub ok: bool,
}

#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub requests: usize,
    pub failed: usize,
    /// The first few distinct errors of failed requests.
    pub errors: Vec<String>,
    /// Both sides are compared over [0, this]: from the first request to the last
    /// answer.
    pub window_s: f64,
    pub profile_source: String,
    pub starts: Vec<Start>,
    /// The start times the simulation ran with (the medians of `starts`, or the
    /// profile's where none of that kind was seen).
    pub sim_start_s: f64,
    pub sim_promote_s: f64,
    pub sim_start_measured: bool,
    /// Cores the stack's own processes (gateway, scaler, agent, load generator) used
    /// on average over the window, and the worker slots left (the simulation's
    /// shared host).
    pub stack_cores: f64,
    pub host_slots: f64,
    /// How much slower than their share of the cores workers computed together on
    /// the measured machine, `(workers, slowdown)`, as the simulation ran them.
    pub host_slowdown: Vec<(u32, f64)>,
    /// Requests with prompts shorter than the gateway's `--disagg-min-tokens`, whose
    /// decode workers computed them (and so does the simulation).
    pub prefilled_on_decode: usize,
    pub disagg_min_tokens: u32,
    pub measured_attainment: f64,
    pub predicted_attainment: f64,
    /// Predicted attainment with `HOST_SLOTS_SENSITIVITY` fewer and more worker slots.
    pub predicted_attainment_band: (f64, f64),
    pub attainment_error_points: f64,
    /// TTFT and ITL (p50, p99), measured and predicted: where an attainment gap comes
    /// from.
    pub measured_ttft: (Option<f64>, Option<f64>),
    pub predicted_ttft: (f64, f64),
    pub measured_itl: (Option<f64>, Option<f64>),
    pub predicted_itl: (f64, f64),
    pub pools: Vec<PoolComparison>,
    /// The requests that missed their SLO for real, in the order sent.
    pub missed: Vec<Missed>,
    pub replica_s_tolerance: f64,
    pub attainment_tolerance_points: f64,
    pub within_tolerance: bool,
    /// (seconds, prefill, decode) replicas, as `up` ran them and as predicted.
    pub measured: Vec<(f64, u32, u32)>,
    pub predicted: Vec<(f64, u32, u32)>,
}

pub(super) fn print_text(r: &Report) -> anyhow::Result<()> {
    outln!(
        "{} requests ({} failed) over {:.1} s; profile: {}",
        r.requests,
        r.failed,
        r.window_s,
        r.profile_source
    );
    for e in &r.errors {
        outln!("error: {e}");
    }
    outln!(
        "host: the stack besides its workers used {:.2} cores; {:.2} worker slots left",
        r.stack_cores,
        r.host_slots
    );
    if r.host_slowdown.is_empty() {
        outln!("host sharing: not measured (workers slow each other by cores only)");
    } else {
        let each: Vec<String> = r
            .host_slowdown
            .iter()
            .map(|(k, f)| format!("{k} workers ×{f:.3}"))
            .collect();
        outln!(
            "host sharing beyond the cores: {} (simulated as measured)",
            each.join(", ")
        );
    }
    outln!(
        "prompts computed on decode workers (shorter than {} tokens): {}",
        r.disagg_min_tokens,
        r.prefilled_on_decode
    );
    outln!(
        "starts measured: {} (simulated with {:.2} s to start{}, {:.3} s to promote)",
        r.starts.len(),
        r.sim_start_s,
        if r.sim_start_measured {
            ""
        } else {
            " (the profile's: none measured)"
        },
        r.sim_promote_s
    );
    outln!(
        "{:<8} {:>12} {:>12} {:>8} {:>6} {:>6}",
        "pool",
        "measured r-s",
        "predicted",
        "error",
        "max m",
        "max p"
    );
    for p in &r.pools {
        outln!(
            "{:<8} {:>12.1} {:>12.1} {:>8} {:>6} {:>6}",
            p.pool,
            p.measured_replica_s,
            p.predicted_replica_s,
            p.error
                .map_or("-".to_owned(), |e| format!("{:+.1}%", e * 100.0)),
            p.measured_max,
            p.predicted_max
        );
    }
    outln!(
        "SLO attainment: measured {:.2}%, predicted {:.2}% ({:+.2} points)",
        r.measured_attainment * 100.0,
        r.predicted_attainment * 100.0,
        r.attainment_error_points
    );
    outln!(
        "  predicted with {:.0}% fewer / more worker slots: {:.2}% / {:.2}%",
        HOST_SLOTS_SENSITIVITY * 100.0,
        r.predicted_attainment_band.0 * 100.0,
        r.predicted_attainment_band.1 * 100.0
    );
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |x| format!("{:.0} ms", x * 1e3));
    outln!(
        "TTFT p50/p99: measured {} / {}, predicted {} / {}; ITL p50/p99: measured {} / {}, predicted {} / {}",
        ms(r.measured_ttft.0),
        ms(r.measured_ttft.1),
        ms(Some(r.predicted_ttft.0)),
        ms(Some(r.predicted_ttft.1)),
        ms(r.measured_itl.0),
        ms(r.measured_itl.1),
        ms(Some(r.predicted_itl.0)),
        ms(Some(r.predicted_itl.1))
    );
    outln!(
        "within tolerance (replica-seconds ±{:.0}%, attainment ±{} points): {}",
        r.replica_s_tolerance * 100.0,
        r.attainment_tolerance_points,
        if r.within_tolerance { "yes" } else { "no" }
    );
    Ok(())
}

pub(super) fn plot(r: &Report) -> String {
    use preheat_output::plot::{Panel, Series, svg};
    let pool = |label: &str, pick: fn(&(f64, u32, u32)) -> u32| Panel {
        y_label: label.into(),
        series: [("measured", &r.measured), ("predicted", &r.predicted)]
            .into_iter()
            .map(|(name, v)| Series {
                name: name.into(),
                points: v.iter().map(|s| (s.0, f64::from(pick(s)))).collect(),
                step: true,
            })
            .collect(),
    };
    svg(
        &format!(
            "sim-to-real: {} requests; attainment measured {:.1}%, predicted {:.1}%",
            r.requests,
            r.measured_attainment * 100.0,
            r.predicted_attainment * 100.0
        ),
        "seconds",
        &[
            pool("prefill replicas", |s| s.1),
            pool("decode replicas", |s| s.2),
        ],
    )
}
