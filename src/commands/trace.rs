//! `preheat trace`: request traces for the simulator, made from the shared ones.

use std::io::Write as _;
use std::process::ExitCode;

use anyhow::{Context, bail};
use preheat_output::outln;
use preheat_sim::day::{DayShape, day, write_jsonl};
use preheat_sim::fleet_trace::{self, FleetShape};
use preheat_sim::trace;

use crate::cli::{TraceCmd, TraceDayArgs, TraceFleetArgs};

pub fn run(cmd: TraceCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        TraceCmd::Day(a) => run_day(&a),
        TraceCmd::Fleet(a) => run_fleet(&a),
    }
}

/// Creates `path` and writes it through a buffer with `write`.
fn write_to(
    path: &std::path::Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    write(&mut w)
        .and_then(|()| w.flush())
        .with_context(|| format!("writing {}", path.display()))
}

fn run_fleet(a: &TraceFleetArgs) -> anyhow::Result<ExitCode> {
    let shape = FleetShape {
        models: a.models,
        hours: a.hours,
        zipf: a.zipf,
        seed: a.seed,
        active_mean_s: a.active_mean_s,
    };
    // Its problems are the shape's and the base trace's (too dense for the hours),
    // told together.
    let base = trace::load(&a.from)?;
    let fleet =
        fleet_trace::generate(&base, &shape).map_err(|p| anyhow::anyhow!("{}", p.join("\n")))?;
    write_to(&a.out, |w| fleet_trace::write_jsonl(&fleet, w))?;
    let mut per_model = vec![0usize; fleet.models.len()];
    for r in &fleet.requests {
        per_model[r.model] += 1;
    }
    let idle = per_model.iter().filter(|&&n| n == 0).count();
    outln!(
        "{}: {} requests of {} models over {} h (Zipf {}; most popular {} requests, least {}; {idle} never asked), from {} ({} requests)",
        a.out.display(),
        fleet.requests.len(),
        fleet.models.len(),
        a.hours,
        a.zipf,
        per_model.iter().max().unwrap_or(&0),
        per_model.iter().min().unwrap_or(&0),
        a.from.display(),
        base.len()
    );
    Ok(ExitCode::SUCCESS)
}

fn run_day(a: &TraceDayArgs) -> anyhow::Result<ExitCode> {
    let shape = DayShape {
        hours: a.hours,
        peak_rps: a.peak_rps,
        swing: a.swing,
        peak_hour: a.peak_hour,
        seed: a.seed,
        office: a.office.map(|(open, close)| (open, close, a.ramp_s)),
    };
    let problems = shape.problems();
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    let sizes = trace::load(&a.from)?;
    let d = day(&sizes, &shape);
    write_to(&a.out, |w| write_jsonl(&d, w))?;
    let peak = match a.office {
        Some((open, close)) => format!("{open}:00-{close}:00, ramps of {} s", a.ramp_s),
        None => format!("at {}:00", a.peak_hour),
    };
    outln!(
        "{}: {} requests over {} h (peak {} req/s {peak}, trough {:.2} req/s), sizes from {} ({} requests)",
        a.out.display(),
        d.len(),
        a.hours,
        a.peak_rps,
        a.peak_rps / a.swing,
        a.from.display(),
        sizes.len()
    );
    Ok(ExitCode::SUCCESS)
}
