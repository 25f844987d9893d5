//! The fleet cache (`preheat`'s fleet policy): which model is staged, hot or parked on
//! which node. For each model and tier, the value of holding it is the chance that
//! the model needs a start within the time that tier takes to build (so that it could
//! not be built once asked for), times the start-up time it saves over the tier below,
//! times the share of the model's requests that start holds up (all of them for a
//! model at zero, `1 / (n + 1)` for one added to `n` serving replicas); a further copy on another node is worth that times the fleet's GPU use (the chance
//! that the nodes already holding it have no GPU free). Each node's NVMe and host RAM
//! are filled by value per byte; a standby goes where GPUs are free to promote it.

use crate::fleet::demand::Demand;
use crate::fleet::nodes::Cluster;
use crate::fleet_config::Tier;

/// How often the plan is made, seconds: the scaler's metric tick is of this order,
/// and tiers take seconds to minutes to build.
pub(crate) const PLAN_S: f64 = 10.0;

/// Over the last this many seconds a serving model's rate of starts is counted.
const START_RATE_WINDOW_S: f64 = 1800.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Staged,
    Hot,
    Host,
}

/// One holding the plan may choose: `copy` (from 0) of model `m` in a tier.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Candidate {
    pub(crate) m: usize,
    pub(crate) kind: Kind,
    pub(crate) copy: u32,
    pub(crate) value: f64,
    pub(crate) bytes: f64,
}

/// What each node should hold: per node, per model, (staged, hot, host standbys).
pub(crate) type Plan = Vec<Vec<(bool, bool, u32)>>;

/// The chance that model `m` needs a start within `h` seconds of `t`: for a model at
/// zero, that it is asked for (its demand); for one serving, that it scales up (its
/// recent rate of starts).
fn p_start(c: &Cluster, demand: &[Demand], m: usize, t: f64, h: f64, fleet_rate: f64) -> f64 {
    if c.replicas[m] == 0 {
        return demand[m].p_within(t, h, fleet_rate);
    }
    let recent = c.start_times[m]
        .iter()
        .rev()
        .take_while(|&&s| s >= t - START_RATE_WINDOW_S)
        .count() as f64;
    let rate = recent / START_RATE_WINDOW_S.min(t.max(1.0));
    1.0 - (-rate * h).exp()
}

/// The candidates at `t`, most valuable per byte first.
pub(crate) fn candidates(c: &Cluster, demand: &[Demand], t: f64) -> Vec<Candidate> {
    let fleet = c.fleet;
    let h = &fleet.hardware;
    let nodes = fleet.nodes;
    let use_share = (f64::from(c.gpus_held) / f64::from(fleet.max_gpus)).clamp(0.0, 1.0);
    let fleet_rate = demand.iter().map(Demand::wakes).sum::<f64>()
        / demand.len().max(1) as f64
        / t.max(super::demand::IDLE_GAP_S);
    let mut out = Vec::new();
    for (m, model) in fleet.models.iter().enumerate() {
        let gb = model.weight_bytes() / 1e9;
        let s = |tier| fleet.start_s(model, tier, true);
        let fetch = gb / h.object_store_gbps + gb / h.nvme_write_gbps;
        let read = gb / h.nvme_read_gbps;
        let park = h.pod_start_s + h.engine_start_s;
        // (kind, build time from the tier below, seconds saved over it, copies).
        let tiers = [
            (
                Kind::Staged,
                fetch,
                s(Tier::Remote) - s(Tier::Staged),
                nodes,
            ),
            (Kind::Hot, read, s(Tier::Staged) - s(Tier::Hot), nodes),
            // Two per node: a model at zero wakes both its pools at once.
            (
                Kind::Host,
                park,
                s(Tier::Hot) - s(Tier::HostStandby),
                2 * nodes,
            ),
        ];
        // A start of a model at zero holds up every request it gets; one added to n
        // serving replicas, the share of the load it takes.
        let affected = 1.0 / f64::from(c.replicas[m] + 1);
        for (kind, build, saved, copies) in tiers {
            let p = p_start(c, demand, m, t, build + PLAN_S, fleet_rate);
            let first = p * saved.max(0.0) * affected;
            for copy in 0..copies {
                let further = if kind == Kind::Host { copy / 2 } else { copy };
                out.push(Candidate {
                    m,
                    kind,
                    copy,
                    value: first * use_share.powi(further as i32),
                    bytes: model.weight_bytes(),
                });
            }
        }
    }
    // Every model's first copy of a tier (first pair of standbys) before anyone's
    // further ones: a further copy serves only when the nodes holding the first are
    // full, a first one every time the model wakes. Then the most valuable per byte;
    // among equals the smaller, the colder tier (a hot copy needs its staged file).
    let rank = |c: &Candidate| {
        if c.kind == Kind::Host {
            c.copy / 2
        } else {
            c.copy
        }
    };
    out.sort_by(|a, b| {
        rank(a)
            .cmp(&rank(b))
            .then((b.value / b.bytes).total_cmp(&(a.value / a.bytes)))
            .then(a.bytes.total_cmp(&b.bytes))
            .then(a.kind.cmp(&b.kind))
            .then(a.copy.cmp(&b.copy))
    });
    out
}

/// Fills each node's budgets with the candidates in order: each goes to the node that
/// already holds it if one does, else to the one with the most GPUs free (a standby
/// is promoted only where a GPU is free); a hot copy or a standby needs the staged
/// file on its node, planned with it when missing.
pub(crate) fn plan(c: &Cluster, cands: &[Candidate]) -> Plan {
    let fleet = c.fleet;
    let n_nodes = c.nodes.len();
    let n_models = fleet.models.len();
    let mut plan: Plan = vec![vec![(false, false, 0); n_models]; n_nodes];
    let mut nvme = vec![0.0f64; n_nodes];
    let mut ram = vec![0.0f64; n_nodes];
    // GPUs on each node left for standbys to promote into.
    let mut spare: Vec<i64> = c.nodes.iter().map(|n| i64::from(n.free_gpus)).collect();
    for cand in cands {
        let m = cand.m;
        let g = i64::from(fleet.models[m].gpus_per_replica);
        let b = cand.bytes;
        let fits_nvme = |n: usize, nvme: &[f64]| nvme[n] + b <= fleet.nvme_bytes + 1.0;
        let fits_ram = |n: usize, ram: &[f64]| ram[n] + b <= fleet.host_ram_bytes + 1.0;
        let held = |n: usize| {
            let h = &c.nodes[n].hold[m];
            match cand.kind {
                Kind::Staged => h.staged.is_some(),
                Kind::Hot => h.hot.is_some(),
                Kind::Host => h.host.len() as u32 > plan[n][m].2,
            }
        };
        let open = (0..n_nodes).filter(|&n| {
            let (staged, hot, _) = plan[n][m];
            match cand.kind {
                Kind::Staged => !staged && fits_nvme(n, &nvme),
                Kind::Hot => !hot && fits_ram(n, &ram) && (staged || fits_nvme(n, &nvme)),
                // A standby is promoted into a free GPU of its node.
                Kind::Host => spare[n] >= g && fits_ram(n, &ram) && (staged || fits_nvme(n, &nvme)),
            }
        });
        let best = match cand.kind {
            Kind::Host => open.max_by_key(|&n| (held(n), spare[n], usize::MAX - n)),
            _ => open.max_by_key(|&n| (held(n), spare[n], usize::MAX - n)),
        };
        let Some(n) = best else {
            continue;
        };
        let entry = &mut plan[n][m];
        if !entry.0 {
            entry.0 = true;
            nvme[n] += b;
        }
        match cand.kind {
            Kind::Staged => {}
            Kind::Hot => {
                entry.1 = true;
                ram[n] += b;
            }
            Kind::Host => {
                entry.2 += 1;
                ram[n] += b;
                spare[n] -= g;
            }
        }
    }
    plan
}

/// Carries out a plan: standbys beyond it dropped at once, missing holdings built
/// (each ready when the tier below it is, plus its own time), others left in place
/// until their room is needed by what the plan holds.
pub(crate) fn apply(c: &mut Cluster, plan: &Plan, t: f64) {
    let fleet = c.fleet;
    let h = fleet.hardware.clone();
    for (n, node_plan) in plan.iter().enumerate() {
        for (m, &(_, _, host)) in node_plan.iter().enumerate() {
            c.drop_host(n, m, host as usize);
        }
        let staged_pin = |v: usize| node_plan[v].0;
        let ram_pin = |v: usize| node_plan[v].1;
        for (m, &(staged, hot, host)) in node_plan.iter().enumerate() {
            let gb = fleet.models[m].weight_bytes() / 1e9;
            let fetch = gb / h.object_store_gbps + gb / h.nvme_write_gbps;
            let read = gb / h.nvme_read_gbps;
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
