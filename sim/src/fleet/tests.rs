//! The fleet's placement, the planner's choices (a table), and whole runs.

use super::demand::Demand;
use super::nodes::{Cluster, Keeps};
use super::planner::{self, Kind};
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

/// The planner's choices: (case, fleet, demand per model, GPUs busy per node, what
/// must hold).
#[test]
fn the_planner_fills_budgets_by_value() {
    type Check = fn(&planner::Plan) -> Result<(), String>;
    struct Case {
        name: &'static str,
        models: usize,
        nvme: f64,
        ram: f64,
        /// Per model: the period of its requests (0: never asked for).
        periods: Vec<f64>,
        busy: [u32; 2],
        check: Check,
    }
    let t = 3000.0;
    let cases = [
        Case {
            name: "a model about to be asked for gets the one standby's room",
            models: 2,
            nvme: 100.0,
            ram: 16.0,
            // m0 every 10 min (idle 5 min at t: due in 5), m1 never asked for: the
            // room for two standbys goes to m0's pair (one per pool).
            periods: vec![600.0, 0.0],
            busy: [0, 0],
            check: |p| {
                let parked: Vec<u32> = (0..2).map(|m| p[0][m].2 + p[1][m].2).collect();
                (parked == [2, 0])
                    .then_some(())
                    .ok_or(format!("parked {parked:?}"))
            },
        },
        Case {
            name: "standbys go where GPUs are free",
            models: 1,
            nvme: 100.0,
            ram: 64.0,
            periods: vec![600.0],
            busy: [2, 0],
            check: |p| {
                (p[0][0].2 == 0 && p[1][0].2 == 2)
                    .then_some(())
                    .ok_or(format!("node 0 {:?}, node 1 {:?}", p[0][0], p[1][0]))
            },
        },
        Case {
            name: "a hot copy or a standby has its staged file on its node",
            models: 3,
            nvme: 48.0,
            ram: 64.0,
            periods: vec![600.0, 900.0, 0.0],
            busy: [0, 0],
            check: |p| {
                for node in p {
                    for &(staged, hot, host) in node {
                        if (hot || host > 0) && !staged {
                            return Err(format!("{node:?}"));
                        }
                    }
                }
                Ok(())
            },
        },
        Case {
            name: "no node holds more than its budgets",
            models: 6,
            nvme: 40.0,
            ram: 40.0,
            periods: vec![600.0, 700.0, 800.0, 900.0, 1000.0, 0.0],
            busy: [1, 0],
            check: |p| {
                for node in p {
                    let staged = node.iter().filter(|h| h.0).count() as f64 * 16.0;
                    let ram: f64 = node
                        .iter()
                        .map(|h| (f64::from(u8::from(h.1)) + f64::from(h.2)) * 16.0)
                        .sum();
                    if staged > 40.0 || ram > 40.0 {
                        return Err(format!("staged {staged} GB, RAM {ram} GB"));
                    }
                }
                Ok(())
            },
        },
    ];
    for case in cases {
        let f = fleet(case.models, case.nvme, case.ram);
        let mut c = Cluster::new(&f, KEEP_ALL);
        for (n, &busy) in case.busy.iter().enumerate() {
            c.nodes[n].free_gpus -= busy;
        }
        let demand: Vec<Demand> = case
            .periods
            .iter()
            .map(|&p| {
                if p > 0.0 {
                    periodic(p, t - p / 2.0)
                } else {
                    Demand::default()
                }
            })
            .collect();
        let cands = planner::candidates(&c, &demand, t);
        let plan = planner::plan(&c, &cands);
        if let Err(e) = (case.check)(&plan) {
            panic!("{}: {e}\nplan {plan:?}", case.name);
        }
        // Carried out, it builds what it planned within the budgets.
        planner::apply(&mut c, &plan, t);
        for node in &c.nodes {
            assert!(node.nvme_used <= f.nvme_bytes + 1.0, "{}", case.name);
            assert!(node.ram_used <= f.host_ram_bytes + 1.0, "{}", case.name);
        }
    }
}

#[test]
fn a_planned_standby_stays_where_it_is_while_its_node_has_a_gpu() {
    let f = fleet(1, 100.0, 32.0);
    let mut c = Cluster::new(&f, KEEP_ALL);
    let d = vec![periodic(600.0, 2700.0)];
    let plan = planner::plan(&c, &planner::candidates(&c, &d, 3000.0));
    planner::apply(&mut c, &plan, 3000.0);
    let parked_on = |c: &Cluster| (0..2).find(|&n| !c.nodes[n].hold[0].host.is_empty());
    let first = parked_on(&c).expect("a standby was parked");
    // The other node now has more GPUs free; the standby still has one where it is.
    c.nodes[first].free_gpus = 1;
    let plan = planner::plan(&c, &planner::candidates(&c, &d, 3010.0));
    planner::apply(&mut c, &plan, 3010.0);
    assert_eq!(parked_on(&c), Some(first));
}

#[test]
fn candidates_are_worth_more_for_a_model_due_sooner() {
    let f = fleet(2, 100.0, 64.0);
    let c = Cluster::new(&f, KEEP_ALL);
    let d = vec![periodic(600.0, 2700.0), periodic(3000.0, 0.0)];
    let cands = planner::candidates(&c, &d, 3000.0);
    let value = |m: usize, kind: Kind| {
        cands
            .iter()
            .find(|x| x.m == m && x.kind == kind && x.copy == 0)
            .unwrap()
            .value
    };
    for kind in [Kind::Staged, Kind::Hot, Kind::Host] {
        assert!(value(0, kind) > value(1, kind), "{kind:?}");
    }
}
