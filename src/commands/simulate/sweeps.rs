//! `simulate --frontier` and `simulate --startup-s`: their tables, JSON and plots (and
//! the outputs `--need-curve` shares).

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::Context;
use preheat_output::outln;
use preheat_output::{Panel, Series, svg};
use preheat_sim::sweep::{Frontier, Point, StartupSweep};

use crate::cli::SimulateArgs;

fn knob_text(p: &Point) -> String {
    p.knob.map_or_else(|| "-".to_owned(), |k| format!("{k}"))
}

pub(super) fn write_outputs<T: serde::Serialize>(
    a: &SimulateArgs,
    report: &T,
    plot: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, plot()).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Points grouped by policy, in first-seen order.
fn by_policy(points: &[Point]) -> Vec<(&str, Vec<&Point>)> {
    let mut order: Vec<&str> = Vec::new();
    let mut groups: BTreeMap<&str, Vec<&Point>> = BTreeMap::new();
    for p in points {
        if !groups.contains_key(p.policy.as_str()) {
            order.push(&p.policy);
        }
        groups.entry(&p.policy).or_default().push(p);
    }
    order
        .into_iter()
        .map(|n| (n, groups.remove(n).unwrap_or_default()))
        .collect()
}

pub(super) fn write_frontier(
    a: &SimulateArgs,
    trace: &str,
    f: &Frontier,
) -> anyhow::Result<ExitCode> {
    outln!("{trace}: each policy's knob swept (SLO attainment against GPU-seconds)");
    outln!(
        "{:<16} {:>7} {:>8} {:>11} {:>7}",
        "policy",
        "knob",
        "SLO %",
        "GPU-s",
        "max P/D"
    );
    for p in &f.points {
        outln!(
            "{:<16} {:>7} {:>8.2} {:>11.0} {:>7}",
            p.policy,
            knob_text(p),
            p.slo_attainment * 100.0,
            p.gpu_seconds,
            format!("{}/{}", p.max_prefill_replicas, p.max_decode_replicas)
        );
    }
    if let Some(me) = &f.preheat {
        if f.beaten_by.is_empty() {
            outln!(
                "preheat (shipped setting): {:.2}% at {:.0} GPU-s; no setting of any baseline reaches that attainment at that cost or less",
                me.slo_attainment * 100.0,
                me.gpu_seconds
            );
        } else {
            outln!(
                "preheat (shipped setting): {:.2}% at {:.0} GPU-s; matched or beaten by: {}",
                me.slo_attainment * 100.0,
                me.gpu_seconds,
                f.beaten_by
                    .iter()
                    .map(|p| format!("{} at {}", p.policy, knob_text(p)))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    write_outputs(a, f, || frontier_plot(trace, f))?;
    Ok(ExitCode::SUCCESS)
}

fn frontier_plot(trace: &str, f: &Frontier) -> String {
    let series = by_policy(&f.points)
        .into_iter()
        .map(|(name, mut pts)| {
            pts.sort_by(|a, b| a.gpu_seconds.total_cmp(&b.gpu_seconds));
            Series {
                name: name.to_owned(),
                points: pts
                    .iter()
                    .map(|p| (p.gpu_seconds, p.slo_attainment * 100.0))
                    .collect(),
                step: false,
            }
        })
        .collect();
    svg(
        &format!(
            "{}: SLO attainment against GPU-seconds, each policy's knob swept",
            short(trace)
        ),
        "GPU-seconds",
        &[Panel {
            y_label: "SLO attainment %".into(),
            series,
        }],
    )
}

pub(super) fn write_startup(
    a: &SimulateArgs,
    trace: &str,
    s: &StartupSweep,
) -> anyhow::Result<ExitCode> {
    outln!("{trace}: every policy per replica start-up time");
    outln!(
        "{:>9} {:<16} {:>8} {:>11} {:>7}",
        "start s",
        "policy",
        "SLO %",
        "GPU-s",
        "max P/D"
    );
    for (start, points) in &s.rows {
        for p in points {
            outln!(
                "{:>9} {:<16} {:>8.2} {:>11.0} {:>7}",
                start,
                p.policy,
                p.slo_attainment * 100.0,
                p.gpu_seconds,
                format!("{}/{}", p.max_prefill_replicas, p.max_decode_replicas)
            );
        }
    }
    write_outputs(a, s, || startup_plot(trace, s))?;
    Ok(ExitCode::SUCCESS)
}

fn startup_plot(trace: &str, s: &StartupSweep) -> String {
    let flat: Vec<(f64, &Point)> = s
        .rows
        .iter()
        .flat_map(|(start, pts)| pts.iter().map(move |p| (*start, p)))
        .collect();
    let panel = |label: &str, y: fn(&Point) -> f64| {
        let mut names: Vec<&str> = Vec::new();
        for (_, p) in &flat {
            if !names.contains(&p.policy.as_str()) {
                names.push(&p.policy);
            }
        }
        Panel {
            y_label: label.into(),
            series: names
                .into_iter()
                .map(|n| Series {
                    name: n.to_owned(),
                    points: flat
                        .iter()
                        .filter(|(_, p)| p.policy == n)
                        .map(|(start, p)| (*start, y(p)))
                        .collect(),
                    step: false,
                })
                .collect(),
        }
    };
    svg(
        &format!(
            "{}: attainment and cost against replica start-up time",
            short(trace)
        ),
        "start-up seconds",
        &[
            panel("SLO attainment %", |p| p.slo_attainment * 100.0),
            panel("GPU-seconds", |p| p.gpu_seconds),
        ],
    )
}

pub(super) fn short(trace: &str) -> String {
    std::path::Path::new(trace)
        .file_name()
        .map_or_else(|| trace.to_owned(), |f| f.to_string_lossy().into_owned())
}
