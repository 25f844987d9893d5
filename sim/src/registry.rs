//! The policies by name: each one's pair of autoscalers, and runs of one or all of
//! them over a trace.

use std::cell::OnceCell;

use preheat_scaler::policy::Pool;

use crate::autoscalers::{
    Autoscaler, Capacity, HpaUtilization, KedaQueue, Kpa, POLICIES, Preheat, SlaPlanner, Static,
};
use crate::config::{SimConfig, StartClass};
use crate::replay::Sim;
use crate::report::{PolicyReport, SimReport, load_series};
use crate::sizing::static_peak;
use crate::{clairvoyant, trace::TraceRequest};

/// Unknown policy name.
#[derive(Debug, thiserror::Error)]
#[error("unknown policy {0:?} (expected one of: {list}, or all)", list = POLICIES.join(", "))]
pub struct UnknownPolicy(pub String);

/// A policy's (prefill, decode) autoscalers, and its fixed sizes if it has them.
type PolicyPair = (Box<dyn Autoscaler>, Box<dyn Autoscaler>, Option<(u32, u32)>);

/// Builds a policy's pair of autoscalers (prefill, decode). `peak` holds the
/// `static-peak` sizes once searched, shared by the policies that need them.
fn autoscalers(
    name: &str,
    cfg: &SimConfig,
    trace: &[TraceRequest],
    peak: &OnceCell<(u32, u32)>,
) -> Result<PolicyPair, UnknownPolicy> {
    let peak = || *peak.get_or_init(|| static_peak(cfg, trace));
    let prof = &cfg.profile;
    let (cp, cd) = (
        Capacity::new(prof, &cfg.prefill),
        Capacity::new(prof, &cfg.decode),
    );
    let (mp, md) = (cfg.prefill.max_replicas, cfg.decode.max_replicas);
    Ok(match name {
        "preheat" => (
            Box::new(Preheat::new(
                Pool::Prefill,
                cfg.prefill.clone(),
                prof.clone(),
                cfg.interval_s,
            )),
            Box::new(Preheat::new(
                Pool::Decode,
                cfg.decode.clone(),
                prof.clone(),
                cfg.interval_s,
            )),
            None,
        ),
        "static-peak" => {
            let (p, d) = peak();
            (Box::new(Static(p)), Box::new(Static(d)), Some((p, d)))
        }
        "clairvoyant" => {
            let (p, d) = peak();
            let plan = clairvoyant::prefill_plan(cfg, trace, p, d);
            (Box::new(plan), Box::new(Static(d)), None)
        }
        "hpa-utilization" => (
            Box::new(HpaUtilization::new(mp)),
            Box::new(HpaUtilization::new(md)),
            None,
        ),
        "keda-queue" => (
            Box::new(KedaQueue::new(Pool::Prefill, cp, mp)),
            Box::new(KedaQueue::new(Pool::Decode, cd, md)),
            None,
        ),
        "kpa" => (
            Box::new(Kpa::new(Pool::Prefill, cp, mp)),
            Box::new(Kpa::new(Pool::Decode, cd, md)),
            None,
        ),
        "sla-planner" => (
            Box::new(SlaPlanner::new(
                Pool::Prefill,
                cp,
                prof.clone(),
                &cfg.prefill,
            )),
            Box::new(SlaPlanner::new(Pool::Decode, cd, prof.clone(), &cfg.decode)),
            None,
        ),
        other => return Err(UnknownPolicy(other.to_owned())),
    })
}

/// Runs one named policy over the trace.
pub fn run_policy(
    name: &str,
    cfg: &SimConfig,
    trace: &[TraceRequest],
) -> Result<PolicyReport, UnknownPolicy> {
    run_policy_sharing(name, cfg, trace, &OnceCell::new())
}

fn run_policy_sharing(
    name: &str,
    cfg: &SimConfig,
    trace: &[TraceRequest],
    peak: &OnceCell<(u32, u32)>,
) -> Result<PolicyReport, UnknownPolicy> {
    let (p, d, fixed) = autoscalers(name, cfg, trace, peak)?;
    let mut r = Sim::new(cfg, trace, p, d).run();
    r.name = name.to_owned();
    r.fixed_replicas = fixed;
    Ok(r)
}

/// Runs the named policies (or all) and assembles the report; `progress` is told each
/// policy's name as it starts.
pub fn run(
    names: &[String],
    cfg: &SimConfig,
    trace: &[TraceRequest],
    trace_name: &str,
    mut progress: impl FnMut(&str),
) -> Result<SimReport, UnknownPolicy> {
    let list: Vec<String> = if names.iter().any(|n| n == "all") {
        POLICIES.iter().map(|s| (*s).to_owned()).collect()
    } else {
        names.to_vec()
    };
    // Fail on a bad name before minutes of simulation.
    if let Some(bad) = list.iter().find(|n| !POLICIES.contains(&n.as_str())) {
        return Err(UnknownPolicy(bad.clone()));
    }
    let mut policies = Vec::new();
    // `static-peak` and `clairvoyant` both need the static search: done once.
    let peak = OnceCell::new();
    for n in &list {
        progress(n);
        policies.push(run_policy_sharing(n, cfg, trace, &peak)?);
    }
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
        profile_source: cfg.profile.source.clone(),
        load: load_series(trace, cfg.sample_s),
        policies,
    })
}
