//! The fleet's placement, a plan carried out, and whole runs (the plan's choices are
//! table-tested with it, in `preheat_scaler::cache_plan`).

use preheat_scaler::cache_plan::{self, Demand};

use super::nodes::{Cluster, Keeps};
use super::planner;
use crate::fleet_config::{Fleet, Tier};

const KEEP_ALL: Keeps = Keeps {
    staged: true,
    hot: true,
    engine_caches: true,
};

/// Two nodes of two GPUs; 8B models (16 GB each) with room for `nvme` and `ram` GB.
fn fleet(models: usize, nvme: f64, ram: f64) -> Fleet {
    let list: String = (0..models)
        .map(|i| format!("  - {{name: m{i}, params_b: 8, gpus_per_replica: 1}}\n"))
        .collect();
    Fleet::parse(
        &format!(
            "nodes: 2\ngpus_per_node: 2\nnvme_gb: {nvme}\nhost_ram_gb: {ram}\nmodels:\n{list}"
        ),
        "test",
    )
    .unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn a_start_goes_to_the_warmest_node_with_a_free_gpu() {
    let f = fleet(1, 100.0, 64.0);
    let mut c = Cluster::new(&f, KEEP_ALL);
    assert!(c.stage(1, 0, 0.0, &|_| false));
    let (node, s) = c.start(0, 10.0).unwrap();
    assert_eq!(node, 1);
    assert!(close(s, f.start_s(&f.models[0], Tier::Staged, true)));
    // The start read it: hot there once it serves.
    assert_eq!(c.tier(1, 0, 10.0 + s), Tier::Hot);
    let (node, _) = c.start(0, 30.0).unwrap();
    assert_eq!(node, 1, "hot beats remote");
    // Node 1 is full: the next goes to node 0 and fetches.
    let (node, s) = c.start(0, 31.0).unwrap();
    assert_eq!(node, 0);
    assert!(close(s, f.start_s(&f.models[0], Tier::Remote, true)));
}

#[test]
fn a_start_past_the_gpu_budget_waits() {
    let mut f = fleet(1, 100.0, 64.0);
    f.max_gpus = 1;
    let mut c = Cluster::new(&f, KEEP_ALL);
    assert!(c.start(0, 0.0).is_some());
    assert!(c.start(0, 1.0).is_none());
    assert_eq!(c.deferred, 1);
    c.stop(0, 0);
    assert!(c.start(0, 2.0).is_some(), "the GPU given back is free");
}

#[test]
fn a_host_standby_is_promoted_once() {
    let f = fleet(1, 100.0, 64.0);
    let mut c = Cluster::new(
        &f,
        Keeps {
            staged: false,
            hot: false,
            engine_caches: true,
        },
    );
    assert!(c.stage(0, 0, 0.0, &|_| false));
    assert!(c.park_host(0, 0, 5.0, &|_| false));
    assert_eq!(c.tier(0, 0, 4.0), Tier::Staged, "not parked yet");
    let (_, s) = c.start(0, 6.0).unwrap();
    assert!(close(s, f.start_s(&f.models[0], Tier::HostStandby, true)));
    assert!(close(c.nodes[0].ram_used, 0.0), "its memory went with it");
    assert_eq!(c.tier(0, 0, 7.0), Tier::Staged);
}

#[test]
fn zero_cold_keeps_nothing_and_restores_no_cache() {
    let f = fleet(1, 100.0, 64.0);
    let mut c = Cluster::new(
        &f,
        Keeps {
            staged: false,
            hot: false,
            engine_caches: false,
        },
    );
    let (_, s) = c.start(0, 0.0).unwrap();
    assert!(close(s, f.start_s(&f.models[0], Tier::Remote, false)));
    c.stop(0, 0);
    let (_, s2) = c.start(0, 500.0).unwrap();
    assert!(close(s, s2));
}

/// Demand of a model asked for every `period` seconds up to `until`.
fn periodic(period: f64, until: f64) -> Demand {
    let mut d = Demand::default();
    let mut t = 0.0;
    while t <= until {
        d.arrive(t);
        t += period;
    }
    d
}

/// The plan (the scaler's, table-tested there) carried out on simulated nodes: within
/// the budgets, each tier ready after the one below it plus its own build time.
#[test]
fn a_plan_carried_out_builds_each_tier_after_the_one_below_within_budgets() {
    let f = fleet(3, 40.0, 40.0);
    let mut c = Cluster::new(&f, KEEP_ALL);
    let demand = vec![
        periodic(600.0, 2700.0),
        periodic(900.0, 2700.0),
        Demand::default(),
    ];
    let t = 3000.0;
    let view = planner::view(&c, &demand, t);
    let plan = cache_plan::plan(&view, &cache_plan::candidates(&view));
    planner::apply(&mut c, &plan, t);
    let h = &f.hardware;
    let (fetch, read) = (
        16.0 / h.object_store_gbps + 16.0 / h.nvme_write_gbps,
        16.0 / h.nvme_read_gbps,
    );
    let mut parked = 0;
    for node in &c.nodes {
        assert!(node.nvme_used <= f.nvme_bytes + 1.0);
        assert!(node.ram_used <= f.host_ram_bytes + 1.0);
        for hold in &node.hold {
            if let Some(hot) = hold.hot {
                assert!(close(hot, t + fetch + read), "hot at {hot}");
            }
            for &at in &hold.host {
                assert!(at >= t + fetch + read + h.pod_start_s + h.engine_start_s - 1e-9);
                parked += 1;
            }
        }
    }
    assert!(parked >= 2, "the model due soonest has its pair");
    // Planned again a moment later, nothing is rebuilt: what is held stays.
    let before: Vec<Vec<Option<f64>>> = c
        .nodes
        .iter()
        .map(|n| n.hold.iter().map(|h| h.staged).collect())
        .collect();
    let view = planner::view(&c, &demand, t + 10.0);
    let plan = cache_plan::plan(&view, &cache_plan::candidates(&view));
    planner::apply(&mut c, &plan, t + 10.0);
    let after: Vec<Vec<Option<f64>>> = c
        .nodes
        .iter()
        .map(|n| n.hold.iter().map(|h| h.staged).collect())
        .collect();
    assert_eq!(before, after);
}

/// A fleet trace: model `a` busy for ten minutes, idle twenty, busy again; model `b`
/// asked a few times; model `c` never.
fn small_trace() -> crate::fleet_trace::FleetTrace {
    use crate::fleet_trace::{FleetRequest, FleetTrace};
    use crate::trace::TraceRequest;
    let req = |model: usize, t: f64| FleetRequest {
        model,
        req: TraceRequest {
            t,
            input_tokens: 1000,
            output_tokens: 50,
            blocks: Vec::new(),
        },
    };
    let mut requests = Vec::new();
    for k in 0..300 {
        requests.push(req(0, f64::from(k) * 2.0));
        requests.push(req(0, 1800.0 + f64::from(k) * 2.0));
    }
    for t in [100.0, 1300.0, 2500.0] {
        requests.push(req(1, t));
    }
    requests.sort_by(|a, b| a.req.t.total_cmp(&b.req.t));
    FleetTrace {
        models: vec!["m0".into(), "m1".into(), "m2".into()],
        requests,
    }
}

#[test]
fn whole_runs_account_for_every_request_and_warm_tiers_shorten_wakes() {
    use preheat_scaler::{PoolPolicy, Profile};
    let mut f = fleet(3, 100.0, 64.0);
    // Room for a replica per pool of every model, and more.
    f.gpus_per_node = 4;
    f.max_gpus = 8;
    let base = crate::SimConfig::new(
        PoolPolicy::default(),
        PoolPolicy::default(),
        Profile::default(),
    );
    let trace = small_trace();
    let policies = super::FLEET_POLICIES;
    let r = super::simulate(&policies, &base, &f, &trace, "t", "f", &|_| {});
    assert_eq!(r.policies.len(), 5);
    let by = |n: &str| r.policies.iter().find(|p| p.name == n).unwrap();
    for p in &r.policies {
        assert_eq!(p.per_model.len(), 3, "{}", p.name);
        let n: usize = p.per_model.iter().map(|m| m.requests).sum();
        assert_eq!(n, trace.requests.len(), "{}", p.name);
        assert_eq!(p.cold_unanswered, 0, "{}", p.name);
        assert!(p.gpu_seconds > 0.0, "{}", p.name);
    }
    // zero-cold fetches every start; preheat's wakes find standbys parked for them.
    let zc = by("zero-cold").starts;
    assert_eq!(zc.host_standby + zc.hot + zc.staged, 0);
    assert!(zc.remote > 0);
    let ph = by("preheat");
    assert!(ph.starts.host_standby > 0, "{:?}", ph.starts);
    let wait = |n: &str| by(n).cold_wait_p99_s.unwrap_or(0.0);
    assert!(
        wait("preheat") < wait("serverlessllm"),
        "{} {}",
        wait("preheat"),
        wait("serverlessllm")
    );
    assert!(wait("serverlessllm") < wait("zero-cold"));
    // Always-on holds a replica per pool of the model never asked for too.
    assert!(by("always-on").per_model[2].gpu_seconds > 0.0);
    assert_eq!(ph.per_model[2].gpu_seconds, 0.0);
    // The same inputs give the same report.
    let again = super::simulate(&policies, &base, &f, &trace, "t", "f", &|_| {});
    for (a, b) in r.policies.iter().zip(&again.policies) {
        assert_eq!(a.gpu_seconds, b.gpu_seconds, "{}", a.name);
        assert_eq!(a.ttft_attainment, b.ttft_attainment, "{}", a.name);
    }
}
