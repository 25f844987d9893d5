//! `preheat simulate`: replays a trace against the scaling policies and reports SLO
//! attainment against GPU-seconds.

use std::process::ExitCode;

use anyhow::{Context, bail};
use preheat_output::outln;
use preheat_output::{Panel, Series, svg};
use preheat_scaler::{Config, PoolPolicy, Profile};
use preheat_sim::{self as sim, SimConfig, SimReport, StartClass};

use crate::cli::SimulateArgs;

mod fleet;
mod need;
mod sweeps;

/// Seconds of steady load each point of `--need-curve` is measured on.
const NEED_STEADY_S: f64 = 3600.0;

/// A start time longer than this is a typo (an hour to start a replica).
const MAX_STARTUP_S: f64 = 3600.0;

/// Validated options.
struct Options {
    sim: SimConfig,
    policies: Vec<String>,
}

/// The scaler config `simulate` overrides when no `--config` is given: one model whose
/// pools keep the shipped defaults.
const DEFAULT_MODEL: &str = "models=[{name: default, prefill: {}, decode: {}}]";

/// Why `simulate` refuses a `--set`, if it does: of a scaler config it reads the first
/// model's pools, the tick, the window and the profile; the rest configures a
/// deployment (addresses, sources, `mode`: see `--actuation`), which a simulation has
/// none of.
fn sim_override_problem(spec: &str) -> Option<String> {
    let path = spec.split_once('=').map_or(spec, |(p, _)| p);
    let read = matches!(
        path,
        "models" | "models.0" | "interval_s" | "window_s" | "profile"
    ) || Config::first_model_policy_key(path).is_some();
    (!read).then(|| {
        format!(
            "--set {path}: a simulation reads only the first model's pools \
             (models.0.prefill.KEY, models.0.decode.KEY), interval_s, window_s and \
             profile of a scaler config"
        )
    })
}

fn options(a: &SimulateArgs) -> anyhow::Result<Options> {
    let mut errs = Vec::new();
    let mut profile_file = a.profile.clone();
    let (mut prefill, mut decode, mut interval, mut window) =
        (PoolPolicy::default(), PoolPolicy::default(), None, None);
    errs.extend(a.overrides.iter().filter_map(|o| sim_override_problem(o)));
    if a.config.is_some() || !a.overrides.is_empty() {
        // Without a file, overrides apply to one model at the shipped defaults, the
        // model the simulator runs when nothing is given.
        let overrides: Vec<String> = match a.config {
            Some(_) => a.overrides.clone(),
            None => std::iter::once(DEFAULT_MODEL.to_owned())
                .chain(a.overrides.iter().cloned())
                .collect(),
        };
        match Config::load_policies(a.config.as_deref(), &overrides) {
            Ok(c) => {
                let m = &c.models[0];
                prefill = m.prefill.policy.clone();
                decode = m.decode.policy.clone();
                interval = Some(c.interval_s);
                window = Some(c.window_s);
                // The scaler's profile, unless `--profile` names another.
                profile_file = profile_file.or(c.profile);
            }
            Err(e) => errs.push(e.to_string()),
        }
    }
    let profile = match &profile_file {
        Some(p) => Profile::from_file(p)
            .map_err(|e| errs.push(e.to_string()))
            .ok(),
        None => Some(Profile::default()),
    };
    if let Some(s) = a.slo_ttft {
        prefill.slo_ttft_s = s;
        decode.slo_ttft_s = s;
    }
    if let Some(s) = a.slo_itl {
        prefill.slo_itl_s = s;
        decode.slo_itl_s = s;
    }
    errs.extend(prefill.validate("prefill"));
    errs.extend(decode.validate("decode"));
    let start = StartClass::from(a.start);
    if a.policy.is_empty() {
        errs.push("--policy: name at least one policy".into());
    }
    for p in a.policy.iter().map(|p| p.as_str()).filter(|&p| p != "all") {
        let fleet_only = !sim::autoscalers::POLICIES.contains(&p);
        let single_only = !sim::fleet::FLEET_POLICIES.contains(&p);
        if a.fleet.is_some() && single_only {
            errs.push(format!(
                "--policy {p}: a single-model policy; with --fleet give {}, or all",
                sim::fleet::FLEET_POLICIES.join(", ")
            ));
        } else if a.fleet.is_none() && fleet_only {
            errs.push(format!(
                "--policy {p}: a fleet policy; give --fleet FLEET.yaml with a fleet trace"
            ));
        }
    }
    for &s in &a.startup_s {
        if !(s.is_finite() && (0.0..=MAX_STARTUP_S).contains(&s)) {
            errs.push(format!(
                "--startup-s {s}: give start times from 0 to {MAX_STARTUP_S} seconds"
            ));
        }
    }
    if !(1..=sim::trace::MAX_RATE_SCALE).contains(&a.rate_scale) {
        errs.push(format!(
            "--rate-scale {}: give a whole number from 1 to {}",
            a.rate_scale,
            sim::trace::MAX_RATE_SCALE
        ));
    }
    let (Some(profile), true) = (profile, errs.is_empty()) else {
        bail!("{}", errs.join("\n"));
    };
    let mut sim = SimConfig::new(prefill, decode, profile);
    sim.start = start;
    sim.standbys = a.standbys;
    sim.actuation = a.actuation.into();
    sim.start_unix = a.start_unix as f64;
    sim.local_prefill_below =
        (a.disagg_min_tokens > 0).then(|| u32::try_from(a.disagg_min_tokens).unwrap_or(u32::MAX));
    if let Some(i) = interval {
        sim.interval_s = i;
    }
    if let Some(w) = window {
        sim.window_s = w;
    }
    Ok(Options {
        sim,
        policies: a.policy.iter().map(|p| p.as_str().to_owned()).collect(),
    })
}

pub fn run(a: &SimulateArgs) -> anyhow::Result<ExitCode> {
    let o = options(a)?;
    if let Some(path) = &a.fleet {
        return fleet::run(a, path, &o.sim, &o.policies);
    }
    let mut trace = sim::trace::scale_rate(&sim::trace::load(&a.trace)?, a.rate_scale);
    let blocks = sim::trace::intern_blocks(&mut trace);
    tracing::debug!(blocks, "distinct prefix blocks");
    let name = if a.rate_scale > 1 {
        format!("{} ×{}", a.trace.display(), a.rate_scale)
    } else {
        a.trace.display().to_string()
    };
    let started = std::time::Instant::now();
    let progress = |p: &str| tracing::info!(run = p, "simulating");
    let done = |runs: usize| {
        let seconds = started.elapsed().as_secs_f64();
        tracing::info!(
            seconds,
            requests = trace.len(),
            runs,
            requests_per_s = (trace.len() * runs) as f64 / seconds.max(1e-9),
            "simulation done"
        );
    };
    if let Some(points) = a.need_curve {
        let r = sim::need::need_curve(&o.sim, &trace, points as usize, NEED_STEADY_S, &progress);
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            steady_loads = r.points.len(),
            runs_on_the_trace = r.trace_runs,
            "need curve done"
        );
        return need::write_need(a, &name, &r);
    }
    if a.frontier {
        let f = sim::sweep::frontier(&o.policies, &o.sim, &trace, &progress)?;
        done(f.points.len());
        return sweeps::write_frontier(a, &name, &f);
    }
    if !a.startup_s.is_empty() {
        // In order, once each: the table and plot read along start time.
        let mut startups = a.startup_s.clone();
        startups.sort_by(f64::total_cmp);
        startups.dedup();
        let s = sim::sweep::startup_sweep(&o.policies, &o.sim, &trace, &startups, &progress)?;
        done(s.rows.iter().map(|r| r.1.len()).sum());
        return sweeps::write_startup(a, &name, &s);
    }
    let report = sim::run(&o.policies, &o.sim, &trace, &name, &progress)?;
    done(report.policies.len());
    write_outputs(a, &report, || plot(&report))?;
    print_table(&report)?;
    Ok(ExitCode::SUCCESS)
}

/// Writes the report to `--json` and, drawn only when asked, the plot to `--plot`.
fn write_outputs(
    a: &SimulateArgs,
    report: &impl serde::Serialize,
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

fn print_table(r: &SimReport) -> anyhow::Result<()> {
    outln!(
        "{}: {} requests over {:.0} s; SLO TTFT {} s (per {} prompt tokens), ITL {} s; replicas start in {} s ({:?}); preheat actuated by {:?}",
        r.trace,
        r.requests,
        r.trace_span_s,
        r.slo_ttft_s,
        r.slo_ttft_ref_tokens,
        r.slo_itl_s,
        r.startup_s,
        r.start_class,
        r.actuation
    );
    if let Some(n) = r.standbys {
        outln!(
            "{n} parked standby per pool, promoted in {} s, replaced by hot starts; their GPU time counts",
            r.startup_s
        );
    }
    outln!("profile: {}", r.profile_source);
    outln!(
        "{:<16} {:>8} {:>11} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "policy",
        "SLO %",
        "GPU-s",
        "starts",
        "events",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "max P/D"
    );
    for p in &r.policies {
        outln!(
            "{:<16} {:>8.2} {:>11.0} {:>7} {:>7} {:>8.3} {:>8.3} {:>8.4} {:>8.4} {:>7}",
            p.name,
            p.slo_attainment * 100.0,
            p.gpu_seconds,
            p.cold_starts,
            p.scale_events,
            p.ttft_p50,
            p.ttft_p99,
            p.itl_p50,
            p.itl_p99,
            format!("{}/{}", p.max_prefill_replicas, p.max_decode_replicas)
        );
    }
    Ok(())
}

fn plot(r: &SimReport) -> String {
    let load = Panel {
        y_label: "prompt tokens/s".into(),
        series: vec![Series {
            name: "load".into(),
            points: r.load.iter().map(|&(t, tok, _)| (t, tok)).collect(),
            step: false,
        }],
    };
    let pool = |label: &str, pick: fn(&(f64, u32, u32)) -> u32| Panel {
        y_label: label.into(),
        series: r
            .policies
            .iter()
            .map(|p| Series {
                name: p.name.clone(),
                points: p
                    .timeline
                    .iter()
                    .map(|x| (x.0, f64::from(pick(x))))
                    .collect(),
                step: true,
            })
            .collect(),
    };
    svg(
        &format!(
            "{}: load and replicas per policy",
            std::path::Path::new(&r.trace)
                .file_name()
                .map_or(r.trace.clone(), |f| f.to_string_lossy().into_owned())
        ),
        "seconds",
        &[
            load,
            pool("prefill replicas", |x| x.1),
            pool("decode replicas", |x| x.2),
        ],
    )
}
