//! One policy's run over a fleet: every model's simulation stepped in time order, the
//! fleet cache planned between steps, and the runs' requests scored together.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use preheat_scaler::percentile::percentile;

use preheat_scaler::cache_plan::{self, Demand, PLAN_S};

use super::nodes::{Cluster, Keeps};
use super::planner;
use super::report::{FleetPolicyReport, FleetReport, ModelReport, TierStarts};
use crate::config::{SimConfig, StartClass};
use crate::fleet_config::{Fleet, Tier};
use crate::fleet_trace::FleetTrace;
use crate::registry::{PolicyPair, autoscaler_pair};
use crate::replay::{Placement, RequestScore, Sim, Start};
use crate::trace::TraceRequest;

/// How often each model's tier is sampled for the report's timeline.
const TIER_SAMPLE_S: f64 = 60.0;

/// One model's starts, placed on the shared fleet.
struct ModelPlacement<'f> {
    cluster: Rc<RefCell<Cluster<'f>>>,
    m: usize,
}

impl Placement for ModelPlacement<'_> {
    fn start(&mut self, t: f64) -> Option<Start> {
        let (node, ready_in) = self.cluster.borrow_mut().start(self.m, t)?;
        Some(Start { node, ready_in })
    }
    fn initial(&mut self) -> Option<u16> {
        self.cluster.borrow_mut().initial(self.m)
    }
    fn stop(&mut self, node: u16) {
        self.cluster.borrow_mut().stop(self.m, node);
    }
}

/// The simulation settings of model `m` under `policy`: the base profile scaled to
/// its size and GPUs, its own SLOs, start-up times from the fleet's hardware.
fn model_config(
    base: &SimConfig,
    fleet: &Fleet,
    m: usize,
    policy: &str,
    first_minute: bool,
) -> SimConfig {
    let fm = &fleet.models[m];
    let scale = 8.0 / fm.params_b * f64::from(fm.gpus_per_replica);
    let mut cfg = base.clone();
    let p = &mut cfg.profile;
    for x in &mut p.prefill_tokens_per_s {
        x.1 *= scale;
    }
    for x in &mut p.decode_itl_s {
        x.1 /= scale;
    }
    if let Some(l) = &mut p.decode_itl_long {
        for x in &mut l.itl_s {
            x.1 /= scale;
        }
    }
    p.kv_tokens *= scale;
    let caches = keeps_of(policy).engine_caches;
    p.startup_s.cold = fleet.start_s(fm, Tier::Remote, caches);
    p.startup_s.staged = fleet.start_s(fm, Tier::Staged, caches);
    p.startup_s.hot = fleet.start_s(fm, Tier::Hot, caches);
    p.startup_s.standby = fleet.start_s(fm, Tier::HostStandby, caches);
    cfg.start = if policy == "clairvoyant" {
        StartClass::Staged
    } else {
        StartClass::Hot
    };
    for pool in [&mut cfg.prefill, &mut cfg.decode] {
        // A model slower than the profile's computes a prompt in proportionally more
        // time on any number of replicas: its target, unless it names one, is the
        // run's stretched as much (a target it cannot meet would measure its size,
        // not the policy).
        pool.slo_ttft_s = fm.slo_ttft_s.unwrap_or(pool.slo_ttft_s / scale.min(1.0));
        if let Some(s) = fm.slo_itl_s {
            pool.slo_itl_s = s;
        }
        if policy == "always-on" {
            pool.min_replicas = pool.min_replicas.max(1);
        }
    }
    // A model asked for in the trace's first minute was already being served; the
    // others open at their policy's minimum.
    cfg.warm_start = first_minute;
    cfg
}

/// The single-model autoscaler that sizes each model's pools under every serving fleet
/// policy: one for all, so that what they differ in is what their starts find (the
/// single-model comparison measures the sizing policies).
const SIZING: &str = "preheat";

fn keeps_of(policy: &str) -> Keeps {
    Keeps {
        staged: policy != "zero-cold",
        hot: policy != "zero-cold",
        engine_caches: policy != "zero-cold",
    }
}

/// What one model's run gave.
struct ModelRun {
    m: usize,
    gpu_s: f64,
    scores: Vec<RequestScore>,
    starts: TierStarts,
    tiers: Vec<(f64, u8)>,
}

/// Runs every named fleet policy (on all cores) and reports them in order.
#[allow(clippy::too_many_arguments)]
pub fn simulate(
    policies: &[&str],
    base: &SimConfig,
    fleet: &Fleet,
    trace: &FleetTrace,
    trace_name: &str,
    fleet_name: &str,
    progress: &(dyn Fn(&str) + Sync),
) -> FleetReport {
    let per_model = split(trace, fleet);
    // clairvoyant's hindsight search is the longest: first.
    let mut order: Vec<usize> = (0..policies.len()).collect();
    order.sort_by_key(|&i| policies[i] != "clairvoyant");
    let runs = crate::on_cores::run_ordered(policies.len(), &order, |i| {
        progress(policies[i]);
        let started = std::time::Instant::now();
        let (runs, deferred) = run_together(policies[i], base, fleet, &per_model);
        let mut r = assemble(policies[i], fleet, &per_model, &runs, deferred);
        r.wall_s = started.elapsed().as_secs_f64();
        r
    });
    FleetReport {
        trace: trace_name.to_owned(),
        fleet: fleet_name.to_owned(),
        requests: trace.requests.len(),
        models: fleet.models.len(),
        trace_span_s: trace.requests.last().map_or(0.0, |r| r.req.t),
        nodes: fleet.nodes,
        gpus_per_node: fleet.gpus_per_node,
        max_gpus: fleet.max_gpus,
        profile_source: base.profile.source.clone(),
        policies: runs,
    }
}

/// Each fleet model's requests (by the fleet's model order), prefixes interned.
fn split(trace: &FleetTrace, fleet: &Fleet) -> Vec<Vec<TraceRequest>> {
    let mut out = vec![Vec::new(); fleet.models.len()];
    let index: Vec<Option<usize>> = trace.models.iter().map(|n| fleet.model_index(n)).collect();
    for r in &trace.requests {
        if let Some(Some(m)) = index.get(r.model) {
            out[*m].push(r.req.clone());
        }
    }
    for t in &mut out {
        crate::trace::intern_blocks(t);
    }
    out
}

/// Every model's run stepped together on the shared fleet, each charged up to the
/// time the last request of any is done. `clairvoyant`'s are placed on no node: each
/// model alone, every start one staged start-up ahead (a reference, not a placement).
fn run_together(
    policy: &str,
    base: &SimConfig,
    fleet: &Fleet,
    per_model: &[Vec<TraceRequest>],
) -> (Vec<ModelRun>, u32) {
    let cluster = Rc::new(RefCell::new(Cluster::new(fleet, keeps_of(policy))));
    let cfgs: Vec<SimConfig> = per_model
        .iter()
        .enumerate()
        .map(|(m, t)| {
            model_config(
                base,
                fleet,
                m,
                policy,
                t.first().is_some_and(|r| r.t < 60.0),
            )
        })
        .collect();
    let mut sims: Vec<(usize, Sim)> = Vec::new();
    for (m, trace) in per_model.iter().enumerate() {
        if trace.is_empty() {
            continue;
        }
        let (p, d): PolicyPair = if policy == "clairvoyant" {
            let (p, d) = crate::clairvoyant::plan(&cfgs[m], trace);
            (
                Box::new(p.at_zero_when_idle(trace)),
                Box::new(d.at_zero_when_idle(trace)),
            )
        } else {
            autoscaler_pair(SIZING, &cfgs[m], trace).expect("a known policy")
        };

        let sim = Sim::new(&cfgs[m], trace, p, d).marking_cold();
        sims.push((
            m,
            if policy == "clairvoyant" {
                sim
            } else {
                sim.placed(Box::new(ModelPlacement {
                    cluster: Rc::clone(&cluster),
                    m,
                }))
            },
        ));
    }
    // always-on holds a replica per pool of a model the trace never asks for too:
    // the replicas (of g GPUs each) so held, per model.
    let idle_held: Vec<u32> = (0..per_model.len())
        .map(|m| {
            let held = policy == "always-on" && per_model[m].is_empty();
            let mut c = cluster.borrow_mut();
            (0..2)
                .map(|_| u32::from(held && c.initial(m).is_some()))
                .sum()
        })
        .collect();
    // Arrivals in time order, for the planner's demand.
    let mut arrivals: Vec<(f64, usize)> = per_model
        .iter()
        .enumerate()
        .flat_map(|(m, t)| t.iter().map(move |r| (r.t, m)))
        .collect();
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let last_arrival = arrivals.last().map_or(0.0, |a| a.0);
    let give_up = last_arrival + base.max_drain_s;
    let plans = policy == "preheat";
    let mut demand = vec![Demand::default(); fleet.models.len()];
    let mut fed = 0;
    let mut next_plan = if plans { 0.0 } else { f64::INFINITY };
    // clairvoyant holds nothing on any node: no tier to sample.
    let mut next_sample = if policy == "clairvoyant" {
        f64::INFINITY
    } else {
        0.0
    };
    let mut tiers: Vec<Vec<(f64, u8)>> = vec![Vec::new(); fleet.models.len()];
    let mut next: Vec<f64> = sims.iter().map(|(_, s)| s.next_event_time()).collect();
    let mut end = 0.0f64;
    loop {
        if sims.iter().all(|(_, s)| s.all_done()) {
            break;
        }
        let (i, ti) = next
            .iter()
            .enumerate()
            .fold((usize::MAX, f64::INFINITY), |b, (i, &t)| {
                if t < b.1 { (i, t) } else { b }
            });
        let tf = next_plan.min(next_sample);
        let t = ti.min(tf);
        if !t.is_finite() || t > give_up {
            break;
        }
        end = end.max(t);
        if tf <= ti {
            while let Some(&(at, m)) = arrivals.get(fed)
                && at <= tf
            {
                demand[m].arrive(at);
                fed += 1;
            }
            let mut c = cluster.borrow_mut();
            if tf >= next_plan {
                let view = planner::view(&c, &demand, tf);
                let plan = cache_plan::plan(&view, &cache_plan::candidates(&view));
                planner::apply(&mut c, &plan, tf);
                next_plan += PLAN_S;
            }
            if tf >= next_sample {
                for (m, series) in tiers.iter_mut().enumerate() {
                    let level = if c.replicas[m] > 0 {
                        4
                    } else {
                        c.best_level(m, tf)
                    };
                    if series.last().is_none_or(|&(_, l)| l != level) {
                        series.push((tf, level));
                    }
                }
                next_sample += TIER_SAMPLE_S;
            }
            continue;
        }
        sims[i].1.step_to(ti);
        next[i] = sims[i].1.next_event_time();
    }
    let c = cluster.borrow();
    debug_assert!(c.gpus_held <= fleet.max_gpus, "over the GPU budget");
    debug_assert_eq!(
        c.gpus_held,
        c.nodes
            .iter()
            .map(|n| fleet.gpus_per_node - n.free_gpus)
            .sum::<u32>(),
        "GPUs held and GPUs taken from nodes disagree"
    );
    let deferred = c.deferred;
    let starts: Vec<TierStarts> = c.starts.iter().map(TierStarts::from_counts).collect();
    drop(c);
    let mut runs: Vec<ModelRun> = sims
        .into_iter()
        .map(|(m, mut sim)| {
            sim.stop_at(end);
            let (report, scores) = sim.scored_report();
            ModelRun {
                m,
                gpu_s: report.gpu_seconds * f64::from(fleet.models[m].gpus_per_replica),
                scores,
                starts: if policy == "clairvoyant" {
                    TierStarts {
                        staged: report.cold_starts,
                        ..TierStarts::default()
                    }
                } else {
                    starts[m]
                },
                tiers: std::mem::take(&mut tiers[m]),
            }
        })
        .collect();
    // Models the trace never asks for: always-on holds a replica per pool of each.
    for m in (0..per_model.len()).filter(|&m| per_model[m].is_empty()) {
        runs.push(ModelRun {
            m,
            gpu_s: f64::from(idle_held[m] * fleet.models[m].gpus_per_replica) * end,
            scores: Vec::new(),
            starts: TierStarts::default(),
            tiers: std::mem::take(&mut tiers[m]),
        });
    }
    (runs, deferred)
}

fn p99(mut v: Vec<f64>) -> Option<f64> {
    for x in &mut v {
        if x.is_nan() {
            *x = f64::INFINITY;
        }
    }
    percentile(&mut v, 0.99)
}

fn assemble(
    policy: &str,
    fleet: &Fleet,
    per_model: &[Vec<TraceRequest>],
    runs: &[ModelRun],
    deferred: u32,
) -> FleetPolicyReport {
    let total: usize = per_model.iter().map(Vec::len).sum();
    let share = |n: usize, of: usize| if of == 0 { 1.0 } else { n as f64 / of as f64 };
    let mut starts = TierStarts::default();
    let mut by_size: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut wait_by_size: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut cold_all: Vec<f64> = Vec::new();
    let mut wait_all = Vec::new();
    let (mut ttft_ok, mut slo_ok, mut gpu_s) = (0, 0, 0.0);
    let mut per = Vec::new();
    for r in runs {
        let fm = &fleet.models[r.m];
        let n_ttft = r.scores.iter().filter(|s| s.ttft_met).count();
        let n_slo = r.scores.iter().filter(|s| s.slo_met).count();
        let cold: Vec<f64> = r.scores.iter().filter(|s| s.cold).map(|s| s.ttft).collect();
        let wait: Vec<f64> = r
            .scores
            .iter()
            .filter(|s| s.cold)
            .map(|s| s.ttft - s.compute_s)
            .collect();
        let size = format!("{}", fm.params_b);
        wait_by_size.entry(size.clone()).or_default().extend(&wait);
        wait_all.extend(&wait);
        ttft_ok += n_ttft;
        slo_ok += n_slo;
        gpu_s += r.gpu_s;
        starts.add(&r.starts);
        by_size.entry(size).or_default().extend(&cold);
        cold_all.extend(&cold);
        per.push(ModelReport {
            name: fm.name.clone(),
            params_b: fm.params_b,
            requests: r.scores.len(),
            gpu_seconds: r.gpu_s,
            ttft_attainment: share(n_ttft, r.scores.len()),
            slo_attainment: share(n_slo, r.scores.len()),
            cold_requests: cold.len(),
            cold_ttft_p99_s: p99(cold),
            cold_wait_p99_s: p99(wait),
            starts: r.starts,
            tiers: r.tiers.clone(),
        });
    }
    per.sort_by_key(|p| fleet.model_index(&p.name));
    FleetPolicyReport {
        name: policy.to_owned(),
        gpu_seconds: gpu_s,
        ttft_attainment: share(ttft_ok, total),
        slo_attainment: share(slo_ok, total),
        cold_requests: cold_all.len(),
        cold_unanswered: cold_all.iter().filter(|t| t.is_nan()).count(),
        cold_ttft_p99_s: p99(cold_all),
        cold_ttft_p99_s_by_params_b: by_size
            .into_iter()
            .filter_map(|(k, v)| p99(v).map(|p| (k, p)))
            .collect(),
        cold_wait_p99_s: p99(wait_all),
        cold_wait_p99_s_by_params_b: wait_by_size
            .into_iter()
            .filter_map(|(k, v)| p99(v).map(|p| (k, p)))
            .collect(),
        starts,
        deferred_starts: deferred,
        wall_s: 0.0,
        per_model: per,
    }
}
