//! The fleet cache's plan: which model is staged, hot or parked on which node, from
//! each model's demand and the nodes' budgets. Pure: it reads a [`FleetView`] and
//! returns a [`Plan`]; the simulator carries plans out on its nodes, a deployment on
//! its warm-pool agents.
//!
//! For each model and tier, the value of holding it is the chance that the model
//! needs a start within the time that tier takes to build (so that it could not be
//! built once asked for), times the start-up time it saves over the tier below, times
//! the share of the model's requests that start holds up (all of them for a model at
//! zero, `1 / (n + 1)` for one added to `n` serving replicas). A further copy on
//! another node is worth that times the fleet's GPU use (the chance that the nodes
//! already holding it have no GPU free). Each node's NVMe and host RAM are filled by
//! value per byte, every model's first copy (first pair of standbys, one per pool)
//! before anyone's further ones; a standby goes only where a GPU is free to promote
//! it.

pub mod demand;

pub use demand::Demand;

/// How often a plan is made, seconds: the scaler's metric tick is of this order, and
/// tiers take seconds to minutes to build.
pub const PLAN_S: f64 = 10.0;

/// Over the last this many seconds a serving model's rate of starts is counted.
pub const START_RATE_WINDOW_S: f64 = 1800.0;

/// A tier the plan fills, coldest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// The snapshot on the node's NVMe.
    Staged,
    /// The snapshot in the node's page cache.
    Hot,
    /// A standby parked in the node's host memory.
    Host,
}

/// One model as the plan sees it.
#[derive(Clone, Debug)]
pub struct ModelView {
    /// Its weights, bytes (what each copy takes of NVMe or host RAM).
    pub bytes: f64,
    pub gpus_per_replica: u32,
    /// Start-up, seconds, from a standby parked in host memory, hot, staged, remote.
    pub start_s: [f64; 4],
    /// Seconds to build each tier from the one below: stage (fetch and write), hot
    /// (read), park (a standby's process started on hot weights).
    pub build_s: [f64; 3],
    /// Replicas up now (starting or serving), fleet-wide.
    pub replicas: u32,
    /// The chance, per horizon, that it needs a start: see [`p_start`].
    pub demand: Demand,
    /// Its starts within the last [`START_RATE_WINDOW_S`].
    pub recent_starts: u32,
}

/// What a node holds of one model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holding {
    pub staged: bool,
    pub hot: bool,
    /// Standbys parked in host memory.
    pub host: u32,
}

/// One node as the plan sees it.
#[derive(Clone, Debug)]
pub struct NodeView {
    pub free_gpus: u32,
    /// Per model (in [`FleetView::models`]' order).
    pub holds: Vec<Holding>,
}

/// The fleet at one instant.
#[derive(Clone, Debug)]
pub struct FleetView {
    pub t: f64,
    pub models: Vec<ModelView>,
    pub nodes: Vec<NodeView>,
    /// Per node: what preheat may use of NVMe and of host RAM, bytes.
    pub nvme_bytes: f64,
    pub ram_bytes: f64,
    /// GPUs held fleet-wide, and the fleet's budget.
    pub gpus_held: u32,
    pub max_gpus: u32,
}

/// One holding the plan may choose: a copy of model `m` in a tier, of `rank` 0 for
/// the copies its next start needs (the first staged and hot copy, the first pair of
/// standbys), higher for further ones.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub m: usize,
    pub kind: Kind,
    pub rank: u32,
    pub value: f64,
}

/// What each node should hold: per node, per model.
pub type Plan = Vec<Vec<Holding>>;

/// The chance that a model needs a start within `h` seconds: for a model at zero, that
/// it is asked for (its demand; `fleet_rate` the prior of one never asked yet); for
/// one serving, that it scales up, from its recent rate of starts.
#[must_use]
pub fn p_start(m: &ModelView, t: f64, h: f64, fleet_rate: f64) -> f64 {
    if m.replicas == 0 {
        return m.demand.p_within(t, h, fleet_rate);
    }
    let rate = f64::from(m.recent_starts) / START_RATE_WINDOW_S.min(t.max(1.0));
    1.0 - (-rate * h).exp()
}

/// The candidates, in the order the plan takes them.
#[must_use]
pub fn candidates(v: &FleetView) -> Vec<Candidate> {
    let nodes = v.nodes.len() as u32;
    let use_share = (f64::from(v.gpus_held) / f64::from(v.max_gpus.max(1))).clamp(0.0, 1.0);
    let fleet_rate = v.models.iter().map(|m| m.demand.wakes()).sum::<f64>()
        / v.models.len().max(1) as f64
        / v.t.max(demand::IDLE_GAP_S);
    let mut out = Vec::new();
    for (i, m) in v.models.iter().enumerate() {
        let [host, hot, staged, remote] = m.start_s;
        let [stage, read, park] = m.build_s;
        // (kind, build time, seconds saved over the tier below, copies, copies of
        // rank 0): a model at zero wakes both its pools at once.
        let tiers = [
            (Kind::Staged, stage, remote - staged, nodes, 1),
            (Kind::Hot, read, staged - hot, nodes, 1),
            (Kind::Host, park, hot - host, 2 * nodes, 2),
        ];
        let affected = 1.0 / f64::from(m.replicas + 1);
        for (kind, build, saved, copies, first) in tiers {
            let p = p_start(m, v.t, build + PLAN_S, fleet_rate);
            let value = p * saved.max(0.0) * affected;
            for copy in 0..copies {
                let rank = copy / first;
                out.push(Candidate {
                    m: i,
                    kind,
                    rank,
                    value: value * use_share.powi(rank as i32),
                });
            }
        }
    }
    // Every model's copies of rank 0 before anyone's further ones: a further copy
    // serves only when the nodes holding the first are full, a first one every time
    // the model wakes. Then the most valuable per byte; among equals the smaller, the
    // colder tier (a hot copy needs its staged file).
    let bytes = |c: &Candidate| v.models[c.m].bytes;
    out.sort_by(|a, b| {
        a.rank
            .cmp(&b.rank)
            .then((b.value / bytes(b)).total_cmp(&(a.value / bytes(a))))
            .then(bytes(a).total_cmp(&bytes(b)))
            .then(a.kind.cmp(&b.kind))
    });
    out
}

/// Fills each node's budgets with the candidates in order: each goes to the node that
/// already holds it if one does, else beside its planned staged file, else to the one
/// with the most GPUs free (a standby is promoted only where a GPU is free); a hot
/// copy or a standby needs the staged file on its node, planned with it when missing
/// (and then counting as the model's staged copy). Standbys are planned only within
/// the fleet's GPU budget left.
/// Candidates of no value still fill room left over: the warm pool stages what fits
/// before anything is asked for.
#[must_use]
pub fn plan(v: &FleetView, cands: &[Candidate]) -> Plan {
    let n_nodes = v.nodes.len();
    let mut plan: Plan = vec![vec![Holding::default(); v.models.len()]; n_nodes];
    let mut nvme = vec![0.0f64; n_nodes];
    let mut ram = vec![0.0f64; n_nodes];
    // GPUs on each node left for standbys to promote into, and in the fleet's budget.
    let mut spare: Vec<i64> = v.nodes.iter().map(|n| i64::from(n.free_gpus)).collect();
    let mut budget = i64::from(v.max_gpus) - i64::from(v.gpus_held);
    for cand in cands {
        let m = cand.m;
        let g = i64::from(v.models[m].gpus_per_replica);
        // A staged file planned beside a hot copy or a standby already counts as this
        // copy: another would spend NVMe other models' first copies need.
        if cand.kind == Kind::Staged
            && plan.iter().filter(|node| node[m].staged).count() > cand.rank as usize
        {
            continue;
        }
        if cand.kind == Kind::Host && budget < g {
            continue;
        }
        let b = v.models[m].bytes;
        let fits_nvme = |n: usize, nvme: &[f64]| nvme[n] + b <= v.nvme_bytes + 1.0;
        let fits_ram = |n: usize, ram: &[f64]| ram[n] + b <= v.ram_bytes + 1.0;
        let held = |n: usize| {
            let h = v.nodes[n].holds[m];
            match cand.kind {
                Kind::Staged => h.staged,
                Kind::Hot => h.hot,
                Kind::Host => h.host > plan[n][m].host,
            }
        };
        let open = (0..n_nodes).filter(|&n| {
            let p = plan[n][m];
            match cand.kind {
                Kind::Staged => !p.staged && fits_nvme(n, &nvme),
                Kind::Hot => !p.hot && fits_ram(n, &ram) && (p.staged || fits_nvme(n, &nvme)),
                Kind::Host => {
                    spare[n] >= g && fits_ram(n, &ram) && (p.staged || fits_nvme(n, &nvme))
                }
            }
        });
        // Where it is held already; else beside its planned staged file; else where
        // the most GPUs are free.
        let beside = |n: usize| cand.kind != Kind::Staged && plan[n][m].staged;
        let Some(n) = open.max_by_key(|&n| (held(n), beside(n), spare[n], usize::MAX - n)) else {
            continue;
        };
        let entry = &mut plan[n][m];
        if !entry.staged {
            entry.staged = true;
            nvme[n] += b;
        }
        match cand.kind {
            Kind::Staged => {}
            Kind::Hot => {
                entry.hot = true;
                ram[n] += b;
            }
            Kind::Host => {
                entry.host += 1;
                ram[n] += b;
                spare[n] -= g;
                budget -= g;
            }
        }
    }
    plan
}

#[cfg(test)]
mod tests;
