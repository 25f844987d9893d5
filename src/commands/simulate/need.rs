//! `simulate --need-curve`: its table, JSON and plot.

use std::process::ExitCode;

use preheat_output::outln;
use preheat_output::{Panel, Series, svg};
use preheat_sim::need::{NeedPoint, NeedReport, PlanRun, PoolSeconds};

use super::sweeps::{short, write_outputs};
use crate::cli::SimulateArgs;

pub(super) fn write_need(
    a: &SimulateArgs,
    trace: &str,
    r: &NeedReport,
) -> anyhow::Result<ExitCode> {
    outln!(
        "{trace}: the fewest fixed replicas that hold a steady load at 99%, by rate (requests drawn from the trace)"
    );
    outln!(
        "{:>8} {:>8} {:>7} {:>8} {:>9} {:>9}",
        "req/s",
        "prefill",
        "decode",
        "SLO %",
        "requests",
        "seconds"
    );
    for p in &r.points {
        outln!(
            "{:>8.2} {:>8} {:>7} {:>8.2} {:>9} {:>9.0}",
            p.rate,
            p.prefill,
            p.decode,
            p.slo_attainment * 100.0,
            p.requests,
            p.seconds
        );
    }
    let (sp, sd) = r.static_peak;
    outln!(
        "static-peak on the trace: {sp}/{sd}; its {} minutes charged at each sizing:",
        r.minute_rates.len()
    );
    outln!(
        "{:<62} {:>11} {:>11} {:>11} {:>8}",
        "",
        "prefill",
        "decode",
        "GPU-s",
        "× fixed"
    );
    let c = &r.charges;
    let fixed = c.fixed.total();
    let charged = |name: &str, s: &PoolSeconds| -> anyhow::Result<()> {
        outln!(
            "{:<62} {:>11.0} {:>11.0} {:>11.0} {:>8.3}",
            name,
            s.prefill,
            s.decode,
            s.total(),
            ratio(s.total(), fixed)
        );
        Ok(())
    };
    charged("static-peak's size", &c.fixed)?;
    charged("the steady need at the minute's rate", &c.tracking)?;
    charged(
        &format!(
            "the same × {:.2} prefill, × {:.2} decode (busiest at static-peak)",
            c.relax.0, c.relax.1
        ),
        &c.relaxed,
    )?;
    charged(
        "static-peak's size in proportion to the rate",
        &c.proportional,
    )?;
    outln!("run on the trace in whole replicas, each minute's ready the moment it begins:");
    outln!(
        "{:<62} {:>8} {:>11} {:>14}",
        "",
        "SLO %",
        "GPU-s",
        "× static-peak"
    );
    let run = |name: &str, run: &PlanRun| -> anyhow::Result<()> {
        outln!(
            "{:<62} {:>8.2} {:>11.0} {:>14.3}",
            name,
            run.slo_attainment * 100.0,
            run.gpu_seconds,
            ratio(run.gpu_seconds, r.static_peak_gpu_seconds)
        );
        Ok(())
    };
    run(
        "static-peak",
        &PlanRun {
            slo_attainment: r.static_peak_attainment,
            gpu_seconds: r.static_peak_gpu_seconds,
        },
    )?;
    run("the steady need at the minute's rate", &r.tracking_run)?;
    run("the same, relaxed", &r.relaxed_run)?;
    match &r.scaled_run {
        Some(s) => run(
            &format!(
                "the same × {:.2} prefill, × {:.2} decode: the least holding 99%",
                s.prefill, s.decode
            ),
            &s.run,
        )?,
        None => outln!("no scale of the steady need holds 99% here: the need itself does not"),
    }
    write_outputs(a, r, || plot(trace, r))?;
    Ok(ExitCode::SUCCESS)
}

fn ratio(x: f64, of: f64) -> f64 {
    if of > 0.0 { x / of } else { 0.0 }
}

fn plot(trace: &str, r: &NeedReport) -> String {
    let hi = r.points.last().map_or(0.0, |p| p.rate);
    let (sp, sd) = (f64::from(r.static_peak.0), f64::from(r.static_peak.1));
    let curve = |name: &str, pick: fn(&NeedPoint) -> u32| Series {
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
