//! The fleet cache (`preheat`'s fleet policy) on the simulated nodes: the plan is the
//! scaler's own ([`preheat_scaler::cache_plan`], the code a deployment runs), made
//! from a view of the simulated fleet and carried out here, each holding ready after
//! the time its tier takes to build.

use preheat_scaler::cache_plan::{
    Demand, FleetView, Holding, ModelView, NodeView, Plan, START_RATE_WINDOW_S,
};

use crate::fleet::nodes::Cluster;
use crate::fleet_config::Tier;

/// The simulated fleet at `t` as the planner sees it.
pub(crate) fn view(c: &Cluster, demand: &[Demand], t: f64) -> FleetView {
    let fleet = c.fleet;
    let h = &fleet.hardware;
    let models = fleet
        .models
        .iter()
        .enumerate()
        .map(|(m, model)| {
            let steps = fleet.steps(model);
            let s = |tier| fleet.start_s(model, tier, true);
            ModelView {
                bytes: model.weight_bytes(),
                gpus_per_replica: model.gpus_per_replica,
                start_s: [
                    s(Tier::HostStandby),
                    s(Tier::Hot),
                    s(Tier::Staged),
                    s(Tier::Remote),
                ],
                build_s: [
                    steps.fetch_s,
                    steps.read_s,
                    h.pod_start_s + h.engine_start_s,
                ],
                replicas: c.replicas[m],
                demand: demand[m].clone(),
                recent_starts: c.start_times[m]
                    .iter()
                    .rev()
                    .take_while(|&&s| s >= t - START_RATE_WINDOW_S)
                    .count() as u32,
            }
        })
        .collect();
    let nodes = c
        .nodes
        .iter()
        .map(|n| NodeView {
            free_gpus: n.free_gpus,
            holds: n
                .hold
                .iter()
                .map(|h| Holding {
                    staged: h.staged.is_some(),
                    hot: h.hot.is_some(),
                    host: h.host.len() as u32,
                })
                .collect(),
        })
        .collect();
    FleetView {
        t,
        models,
        nodes,
        nvme_bytes: fleet.nvme_bytes,
        ram_bytes: fleet.host_ram_bytes,
        gpus_held: c.gpus_held,
        max_gpus: fleet.max_gpus,
    }
}

/// Carries out a plan: standbys beyond it dropped at once, missing holdings built
/// (each ready when the tier below it is, plus its own time), others left in place
/// until their room is needed by what the plan holds.
pub(crate) fn apply(c: &mut Cluster, plan: &Plan, t: f64) {
    let fleet = c.fleet;
    let h = fleet.hardware.clone();
    for (n, node_plan) in plan.iter().enumerate() {
        for (m, h) in node_plan.iter().enumerate() {
            c.drop_host(n, m, h.host as usize);
        }
        let staged_pin = |v: usize| node_plan[v].staged;
        let ram_pin = |v: usize| node_plan[v].hot;
        for (m, &Holding { staged, hot, host }) in node_plan.iter().enumerate() {
            let steps = fleet.steps(&fleet.models[m]);
            let (fetch, read) = (steps.fetch_s, steps.read_s);
            if staged && !c.stage(n, m, t + fetch, &staged_pin) {
                continue;
            }
            let staged_at = c.nodes[n].hold[m].staged.unwrap_or(t).max(t);
            if hot {
                c.make_hot(n, m, staged_at + read, &ram_pin);
            }
            let from = c.nodes[n].hold[m]
                .hot
                .map_or(staged_at + read, |a| a.max(t));
            let park_at = from + h.pod_start_s + h.engine_start_s;
            while (c.nodes[n].hold[m].host.len() as u32) < host {
                if !c.park_host(n, m, park_at, &ram_pin) {
                    break;
                }
            }
        }
    }
}
