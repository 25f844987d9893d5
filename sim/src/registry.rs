//! The policies by name: each one's pair of autoscalers and its knob, and runs of many
//! (policy, knob, settings) on a trace, in parallel: a comparison, a frontier (each
//! policy's knob swept), a start-up sweep.

use std::sync::OnceLock;

use preheat_scaler::policy::Pool;
use serde::Serialize;

use crate::autoscalers::{
    Autoscaler, Capacity, HpaUtilization, KedaQueue, Kpa, POLICIES, Preheat, SlaPlanner, Static,
};
use crate::config::{SimConfig, StartClass};
use crate::keda::{Actuation, Keda, KedaSettings};
use crate::replay::Sim;
use crate::report::{PolicyReport, SimReport, load_series};
use crate::sizing::static_peak;
use crate::{clairvoyant, trace::TraceRequest};

/// Unknown policy name.
#[derive(Debug, thiserror::Error)]
#[error("unknown policy {0:?} (expected one of: {list}, or all)", list = POLICIES.join(", "))]
pub struct UnknownPolicy(pub String);

/// The setting of a policy an operator would tune: what `--frontier` sweeps.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Knob {
    pub name: &'static str,
    /// The shipped (or an operator's first) setting.
    pub default: f64,
    /// Settings a frontier tries, from cheapest to most generous.
    pub sweep: &'static [f64],
}

/// A policy's knob; `None` for the references (`static-peak`, `clairvoyant`), which
/// have none: they are points, not policies anyone tunes.
#[must_use]
pub fn knob(policy: &str) -> Option<Knob> {
    let k = |name, default, sweep| {
        Some(Knob {
            name,
            default,
            sweep,
        })
    };
    match policy {
        "preheat" => k("headroom", 1.0, &[0.6, 0.7, 0.8, 0.9, 1.0, 1.15, 1.3, 1.5]),
        "hpa-utilization" => k(
            "target utilisation",
            HpaUtilization::DEFAULT_TARGET,
            &[0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
        ),
        "keda-queue" => k(
            "waiting per replica (× its in-SLO capacity)",
            KedaQueue::DEFAULT_FRACTION,
            &[0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5],
        ),
        "kpa" => k(
            "concurrency per replica (× its in-SLO capacity)",
            Kpa::DEFAULT_FRACTION,
            &[0.3, 0.4, 0.5, 0.6, 0.7, 0.85, 1.0],
        ),
        "sla-planner" => k("headroom", 1.0, &[0.8, 0.9, 1.0, 1.15, 1.3, 1.5, 2.0]),
        _ => None,
    }
}

/// The knob setting a run uses: the one asked for, else `preheat`'s configured
/// headroom (`None` when its pools' differ), else the policy's default.
#[must_use]
pub fn setting(spec: &RunSpec) -> Option<f64> {
    spec.knob.or_else(|| match spec.policy.as_str() {
        "preheat" => {
            let (p, d) = (spec.cfg.prefill.headroom, spec.cfg.decode.headroom);
            (p == d).then_some(p)
        }
        name => knob(name).map(|k| k.default),
    })
}

/// One simulation to run: a policy at a knob setting under some settings.
#[derive(Clone, Debug)]
pub struct RunSpec {
    pub policy: String,
    /// `None`: the policy's default.
    pub knob: Option<f64>,
    pub cfg: SimConfig,
}

/// A policy's (prefill, decode) autoscalers.
pub(crate) type PolicyPair = (Box<dyn Autoscaler>, Box<dyn Autoscaler>);

/// `static-peak`'s sizes and the report of its run at them.
type Peak = (u32, u32, PolicyReport);

/// Builds a policy's pair of autoscalers (prefill, decode). `peak` gives the
/// `static-peak` sizes, searched once for all the runs that need them.
fn autoscalers<'a>(
    spec: &RunSpec,
    trace: &[TraceRequest],
    peak: &dyn Fn() -> &'a Peak,
) -> Result<PolicyPair, UnknownPolicy> {
    let cfg = &spec.cfg;
    let name = spec.policy.as_str();
    let knob = setting(spec).unwrap_or(1.0);
    let prof = &cfg.profile;
    let (cp, cd) = (
        Capacity::new(prof, &cfg.prefill),
        Capacity::new(prof, &cfg.decode),
    );
    let (mp, md) = (cfg.prefill.max_replicas, cfg.decode.max_replicas);
    Ok(match name {
        "preheat" => {
            let scaler = |pool, policy: &preheat_scaler::policy::PoolPolicy| {
                let mut policy = policy.clone();
                // Without a knob the configured headroom stands (`--config`, `--set`).
                if let Some(k) = spec.knob {
                    policy.headroom = k;
                }
                let inner: Box<dyn Autoscaler> = Box::new(Preheat::new(
                    pool,
                    policy.clone(),
                    prof.clone(),
                    cfg.interval_s,
                    cfg.start_unix,
                ));
                match cfg.actuation {
                    Actuation::Direct => inner,
                    Actuation::Keda => Box::new(Keda::new(
                        inner,
                        KedaSettings::default(),
                        policy.max_replicas,
                    )) as Box<dyn Autoscaler>,
                }
            };
            (
                scaler(Pool::Prefill, &cfg.prefill),
                scaler(Pool::Decode, &cfg.decode),
            )
        }
        "static-peak" => {
            let &(p, d, _) = peak();
            (Box::new(Static(p)), Box::new(Static(d)))
        }
        "clairvoyant" => {
            let (p, d) = clairvoyant::plan(cfg, trace);
            (Box::new(p), Box::new(d))
        }
        "hpa-utilization" => (
            Box::new(HpaUtilization::new(mp, knob)),
            Box::new(HpaUtilization::new(md, knob)),
        ),
        "keda-queue" => (
            Box::new(KedaQueue::new(Pool::Prefill, cp, mp, knob)),
            Box::new(KedaQueue::new(Pool::Decode, cd, md, knob)),
        ),
        "kpa" => (
            Box::new(Kpa::new(Pool::Prefill, cp, mp, knob)),
            Box::new(Kpa::new(Pool::Decode, cd, md, knob)),
        ),
        "sla-planner" => (
            Box::new(SlaPlanner::new(
                Pool::Prefill,
                cp,
                prof.clone(),
                &cfg.prefill,
                knob,
            )),
            Box::new(SlaPlanner::new(
                Pool::Decode,
                cd,
                prof.clone(),
                &cfg.decode,
                knob,
            )),
        ),
        other => return Err(UnknownPolicy(other.to_owned())),
    })
}

/// A named policy's (prefill, decode) autoscalers at its default knob, for a run
/// driven from outside (a fleet's).
pub(crate) fn autoscaler_pair(
    name: &str,
    cfg: &SimConfig,
    trace: &[TraceRequest],
) -> Result<PolicyPair, UnknownPolicy> {
    let spec = RunSpec {
        policy: name.to_owned(),
        knob: None,
        cfg: cfg.clone(),
    };
    let cell = OnceLock::new();
    autoscalers(&spec, trace, &|| {
        cell.get_or_init(|| static_peak(cfg, trace))
    })
}

/// Runs one named policy over the trace, at its default knob.
pub fn run_policy(
    name: &str,
    cfg: &SimConfig,
    trace: &[TraceRequest],
) -> Result<PolicyReport, UnknownPolicy> {
    let spec = RunSpec {
        policy: name.to_owned(),
        knob: None,
        cfg: cfg.clone(),
    };
    let cell = OnceLock::new();
    run_one(&spec, trace, &|| {
        cell.get_or_init(|| static_peak(cfg, trace))
    })
}

fn run_one<'a>(
    spec: &RunSpec,
    trace: &[TraceRequest],
    peak: &dyn Fn() -> &'a Peak,
) -> Result<PolicyReport, UnknownPolicy> {
    let mut r = if spec.policy == "static-peak" {
        // Its search ran it at the sizes it found; replicas up from the start do not
        // depend on start times or actuation.
        peak().2.clone()
    } else {
        let (p, d) = autoscalers(spec, trace, peak)?;
        Sim::new(&spec.cfg, trace, p, d).run()
    };
    r.name.clone_from(&spec.policy);
    r.knob = setting(spec);
    r.fixed_replicas = (spec.policy == "static-peak").then(|| (peak().0, peak().1));
    Ok(r)
}

/// Runs every spec (on all cores), reports in the specs' order; `progress` is told
/// each run's label as it starts. `static-peak`'s search runs once, with `base`, for
/// all the runs that need it (it does not depend on start times or actuation: its
/// replicas are up from the start).
pub fn run_many(
    specs: &[RunSpec],
    base: &SimConfig,
    trace: &[TraceRequest],
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Vec<PolicyReport>, UnknownPolicy> {
    if let Some(bad) = specs
        .iter()
        .find(|s| !POLICIES.contains(&s.policy.as_str()))
    {
        return Err(UnknownPolicy(bad.policy.clone()));
    }
    let peak_cell = OnceLock::new();
    let peak = || peak_cell.get_or_init(|| static_peak(base, trace));
    // Longest first, so no core is left with one long run at the end: the hindsight
    // references replay the trace many times over (clairvoyant's bisection most).
    // `static-peak`'s search runs once: its other specs, which wait for it and then
    // copy its report, go last, not each holding a core while it runs.
    let first_peak = specs.iter().position(|s| s.policy == "static-peak");
    let cost_rank = |i: usize| match specs[i].policy.as_str() {
        "clairvoyant" => 0,
        "static-peak" if Some(i) == first_peak => 1,
        "static-peak" => 3,
        _ => 2,
    };
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by_key(|&i| cost_rank(i));
    crate::on_cores::run_ordered(specs.len(), &order, |i| {
        let spec = &specs[i];
        progress(&label(spec));
        run_one(spec, trace, &peak)
    })
    .into_iter()
    .collect()
}

fn label(spec: &RunSpec) -> String {
    let mut l = spec.policy.clone();
    if let Some(k) = spec.knob {
        l.push_str(&format!(" at {k}"));
    }
    l
}

/// The named policies, `all` expanded; an unknown name is an error before anything
/// runs.
pub fn policy_list(names: &[String]) -> Result<Vec<String>, UnknownPolicy> {
    let list: Vec<String> = if names.iter().any(|n| n == "all") {
        POLICIES.iter().map(|s| (*s).to_owned()).collect()
    } else {
        names.to_vec()
    };
    if let Some(bad) = list.iter().find(|n| !POLICIES.contains(&n.as_str())) {
        return Err(UnknownPolicy(bad.clone()));
    }
    Ok(list)
}

/// Runs the named policies (or all) and assembles the report; `progress` is told each
/// run's label as it starts.
pub fn run(
    names: &[String],
    cfg: &SimConfig,
    trace: &[TraceRequest],
    trace_name: &str,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<SimReport, UnknownPolicy> {
    let specs: Vec<RunSpec> = policy_list(names)?
        .into_iter()
        .map(|policy| RunSpec {
            policy,
            knob: None,
            cfg: cfg.clone(),
        })
        .collect();
    let policies = run_many(&specs, cfg, trace, progress)?;
    Ok(SimReport {
        trace: trace_name.to_owned(),
        requests: trace.len(),
        trace_span_s: trace.last().map_or(0.0, |r| r.t),
        slo_ttft_s: cfg.prefill.slo_ttft_s,
        slo_ttft_ref_tokens: cfg.prefill.slo_ttft_ref_tokens,
        slo_itl_s: cfg.decode.slo_itl_s,
        start_class: cfg.start,
        startup_s: cfg.startup_s(),
        standbys: (cfg.start == StartClass::Standby).then_some(cfg.standbys),
        actuation: cfg.actuation,
        profile_source: cfg.profile.source.clone(),
        load: load_series(trace, cfg.sample_s),
        policies,
    })
}
