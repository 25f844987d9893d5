//! `simulate --need-curve`: its table, JSON and plot.

use std::process::ExitCode;

use preheat_sim::need::{NeedReport, PoolSeconds};

use super::sweeps::{short, write_outputs};
use crate::cli::SimulateArgs;
use crate::output::outln;
use crate::plot::{Panel, Series, svg};

pub(super) fn write_need(
    a: &SimulateArgs,
    trace: &str,
    r: &NeedReport,
) -> anyhow::Result<ExitCode> {
    outln!(
        "{trace}: the fewest fixed replicas that hold a steady {:.0} s at 99%, by rate (requests drawn from the trace)",
        r.steady_s
    );
    outln!(
        "{:>8} {:>8} {:>7} {:>8} {:>9}",
        "req/s",
        "prefill",
        "decode",
        "SLO %",
        "requests"
    );
    for p in &r.points {
        outln!(
            "{:>8.2} {:>8} {:>7} {:>8.2} {:>9}",
            p.rate,
            p.prefill,
            p.decode,
            p.slo_attainment * 100.0,
            p.requests
        );
    }
    let (sp, sd) = r.static_peak;
    outln!(
        "static-peak on the trace: {sp}/{sd} ({:.2}%); its {} minutes charged at each sizing:",
        r.static_peak_attainment * 100.0,
        r.minute_rates.len()
    );
    outln!(
        "{:<58} {:>11} {:>11} {:>11} {:>8}",
        "",
        "prefill",
        "decode",
        "GPU-s",
        "× fixed"
    );
    let fixed = r.fixed.total();
    let row = |name: &str, s: &PoolSeconds| -> anyhow::Result<()> {
        outln!(
            "{:<58} {:>11.0} {:>11.0} {:>11.0} {:>8.3}",
            name,
            s.prefill,
            s.decode,
            s.total(),
            if fixed > 0.0 { s.total() / fixed } else { 0.0 }
        );
        Ok(())
    };
    row("static-peak's size, every minute", &r.fixed)?;
    row("each minute at its rate's steady need", &r.tracking)?;
    row(
        "the same, relaxed to static-peak's size at the busiest",
        &r.relaxed,
    )?;
    row(
        "static-peak's size in proportion to the rate",
        &r.proportional,
    )?;
    let runs = [
        ("each minute at its rate's steady need", r.tracking_run),
        ("the same, relaxed", r.relaxed_run),
    ];
    outln!(
        "the same in whole replicas, simulated on the trace, ready the moment each minute begins:"
    );
    outln!(
        "{:<58} {:>8} {:>11} {:>14}",
        "",
        "SLO %",
        "GPU-s",
        "× static-peak"
    );
    outln!(
        "{:<58} {:>8.2} {:>11.0} {:>14.3}",
        "static-peak",
        r.static_peak_attainment * 100.0,
        r.static_peak_gpu_seconds,
        1.0
    );
    for (name, run) in runs {
        if let Some(run) = run {
            outln!(
                "{:<58} {:>8.2} {:>11.0} {:>14.3}",
                name,
                run.slo_attainment * 100.0,
                run.gpu_seconds,
                if r.static_peak_gpu_seconds > 0.0 {
                    run.gpu_seconds / r.static_peak_gpu_seconds
                } else {
                    0.0
                }
            );
        }
    }
    if let Some((f, run)) = r.scaled_run {
        outln!(
            "{:<58} {:>8.2} {:>11.0} {:>14.3}",
            format!("the same at {f:.2}×, the least that holds 99%"),
            run.slo_attainment * 100.0,
            run.gpu_seconds,
            if r.static_peak_gpu_seconds > 0.0 {
                run.gpu_seconds / r.static_peak_gpu_seconds
            } else {
                0.0
            }
        );
    }
    write_outputs(a, r, || plot(trace, r))?;
    Ok(ExitCode::SUCCESS)
}

fn plot(trace: &str, r: &NeedReport) -> String {
    let hi = r.points.last().map_or(0.0, |p| p.rate);
    let (sp, sd) = (f64::from(r.static_peak.0), f64::from(r.static_peak.1));
    let curve = |name: &str, pick: fn(&preheat_sim::need::NeedPoint) -> u32| Series {
        name: name.into(),
        points: std::iter::once((0.0, 0.0))
            .chain(r.points.iter().map(|p| (p.rate, f64::from(pick(p)))))
            .collect(),
        step: false,
    };
    let line = |name: &str, to: f64| Series {
        name: name.into(),
        points: vec![(0.0, 0.0), (hi, to)],
        step: false,
    };
    svg(
        &format!(
            "{}: replicas a steady load needs at 99%, against its rate",
            short(trace)
        ),
        "requests/s",
        &[
            Panel {
                y_label: "prefill replicas".into(),
                series: vec![
                    curve("steady need", |p| p.prefill),
                    line("static-peak in proportion", sp),
                ],
            },
            Panel {
                y_label: "decode replicas".into(),
                series: vec![
                    curve("steady need", |p| p.decode),
                    line("static-peak in proportion", sd),
                ],
            },
        ],
    )
}
