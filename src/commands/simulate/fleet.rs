//! `preheat simulate --fleet`: a fleet's trace against the fleet policies, on the same
//! budgets; the table, the JSON report and the plot.

use std::path::Path;
use std::process::ExitCode;

use preheat_output::{Panel, Series, outln, stack, svg};
use preheat_sim::fleet::{self, FleetReport};
use preheat_sim::fleet_config::Fleet;
use preheat_sim::{SimConfig, fleet_trace};

use crate::cli::SimulateArgs;

pub(super) fn run(
    a: &SimulateArgs,
    fleet_path: &Path,
    base: &SimConfig,
    policies: &[String],
) -> anyhow::Result<ExitCode> {
    let fleet = Fleet::load(fleet_path)?;
    if let Some(m) = fleet.models.iter().find(|m| m.priority != 0) {
        tracing::warn!(
            model = %m.name,
            priority = m.priority,
            "the fleet simulator gives GPUs to starts in the order asked: `priority` is not simulated yet"
        );
    }
    let names: Vec<String> = fleet.models.iter().map(|m| m.name.clone()).collect();
    let trace = fleet_trace::load(&a.trace, Some(&names))?;
    let policies = fleet::fleet_policy_list(policies)?;
    let started = std::time::Instant::now();
    let progress = |p: &str| tracing::info!(policy = p, "simulating the fleet");
    let report = fleet::simulate(
        &policies,
        base,
        &fleet,
        &trace,
        &a.trace.display().to_string(),
        &fleet_path.display().to_string(),
        &progress,
    );
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        requests = report.requests,
        models = report.models,
        policies = report.policies.len(),
        "fleet simulation done"
    );
    super::write_outputs(a, &report, || plot(&report))?;
    print_table(&report)?;
    Ok(ExitCode::SUCCESS)
}

fn print_table(r: &FleetReport) -> anyhow::Result<()> {
    outln!(
        "{}: {} requests over {:.0} s, {} models on {} nodes × {} GPUs (budget {})",
        r.trace,
        r.requests,
        r.trace_span_s,
        r.models,
        r.nodes,
        r.gpus_per_node,
        r.max_gpus
    );
    outln!(
        "profile: {} (scaled per model by 8 / params_b × GPUs)",
        r.profile_source
    );
    outln!(
        "{:<14} {:>11} {:>7} {:>7} {:>6} {:>9} {:>9}   {:<38} {:>8}",
        "policy",
        "GPU-s",
        "TTFT %",
        "SLO %",
        "cold",
        "cold p99",
        "wait p99",
        "starts gpu/host/hot/staged/remote",
        "deferred"
    );
    for p in &r.policies {
        let s = &p.starts;
        outln!(
            "{:<14} {:>11.0} {:>7.2} {:>7.2} {:>6} {:>9} {:>9}   {:<38} {:>8}",
            p.name,
            p.gpu_seconds,
            p.ttft_attainment * 100.0,
            p.slo_attainment * 100.0,
            p.cold_requests,
            p.cold_ttft_p99_s
                .map_or("-".to_owned(), |v| format!("{v:.2}")),
            p.cold_wait_p99_s
                .map_or("-".to_owned(), |v| format!("{v:.2}")),
            format!(
                "{}/{}/{}/{}/{}",
                s.gpu_standby, s.host_standby, s.hot, s.staged, s.remote
            ),
            p.deferred_starts
        );
    }
    Ok(())
}

fn plot(r: &FleetReport) -> String {
    let short = Path::new(&r.trace)
        .file_name()
        .map_or(r.trace.clone(), |f| f.to_string_lossy().into_owned());
    let cost = svg(
        &format!("{short}: TTFT attainment against GPU-seconds, per fleet policy"),
        "GPU-seconds",
        &[Panel {
            y_label: "TTFT attainment %".into(),
            series: r
                .policies
                .iter()
                .map(|p| Series {
                    name: p.name.clone(),
                    points: vec![(p.gpu_seconds, p.ttft_attainment * 100.0)],
                    step: false,
                })
                .collect(),
        }],
    );
    let mut charts = vec![cost];
    // Each model's tier under preheat's fleet cache: a band per model, the line
    // climbing within it from remote (its floor) to serving (its top).
    if let Some(p) = r.policies.iter().find(|p| p.name == "preheat") {
        let end = r.trace_span_s;
        let series = p
            .per_model
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let base = i as f64;
                let mut points: Vec<(f64, f64)> = m
                    .tiers
                    .iter()
                    .map(|&(t, level)| (t, base + f64::from(level) * 0.2))
                    .collect();
                if let Some(&(t, y)) = points.last() {
                    points.push((end.max(t), y));
                }
                Series {
                    name: m.name.clone(),
                    points,
                    step: true,
                }
            })
            .collect();
        charts.push(svg(
            &format!(
                "{short}: each model's warmest tier under preheat (a band per model, bottom to top: remote, staged, hot, parked in host memory, serving)"
            ),
            "seconds",
            &[Panel {
                y_label: "model (band), tier".into(),
                series,
            }],
        ));
    }
    stack(&charts)
}
