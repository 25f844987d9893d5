//! The plan's choices, as a table.

use super::*;

const GB: f64 = 1e9;

/// An 8B model at bf16 on default hardware: start-ups from host standby, hot, staged,
/// remote, and the tiers' build times.
fn model(demand: Demand, replicas: u32) -> ModelView {
    ModelView {
        bytes: 16.0 * GB,
        gpus_per_replica: 1,
        start_s: [1.14, 7.64, 10.1, 28.2],
        build_s: [18.1, 2.5, 7.0],
        replicas,
        demand,
        recent_starts: 0,
    }
}

/// Demand of a model asked for every `period` seconds up to `until` (none when 0).
fn periodic(period: f64, until: f64) -> Demand {
    let mut d = Demand::default();
    if period <= 0.0 {
        return d;
    }
    let mut t = 0.0;
    while t <= until {
        d.arrive(t);
        t += period;
    }
    d
}

/// Two nodes of two GPUs, `busy` of each taken.
fn view(models: Vec<ModelView>, nvme_gb: f64, ram_gb: f64, busy: [u32; 2]) -> FleetView {
    let n = models.len();
    FleetView {
        t: 3000.0,
        nodes: busy
            .iter()
            .map(|&b| NodeView {
                free_gpus: 2 - b,
                holds: vec![Holding::default(); n],
            })
            .collect(),
        models,
        nvme_bytes: nvme_gb * GB,
        ram_bytes: ram_gb * GB,
        gpus_held: busy.iter().sum(),
        max_gpus: 4,
    }
}

fn parked(p: &Plan, m: usize) -> Vec<u32> {
    p.iter().map(|node| node[m].host).collect()
}

#[test]
fn the_plan_fills_budgets_by_value() {
    type Check = fn(&Plan) -> Result<(), String>;
    /// (case, request period per model (0: never asked), NVMe GB, RAM GB, GPUs busy
    /// per node, what must hold).
    type Case = (&'static str, Vec<f64>, f64, f64, [u32; 2], Check);
    let cases: [Case; 5] = [
        (
            "a model about to be asked for gets the room for a pair of standbys",
            vec![600.0, 0.0],
            100.0,
            16.0,
            [0, 0],
            |p| {
                let (a, b) = (parked(p, 0), parked(p, 1));
                (a.iter().sum::<u32>() == 2 && b.iter().sum::<u32>() == 0)
                    .then_some(())
                    .ok_or(format!("{a:?} {b:?}"))
            },
        ),
        (
            "standbys go where GPUs are free, never beyond them",
            vec![600.0],
            100.0,
            64.0,
            [2, 0],
            |p| {
                (parked(p, 0) == [0, 2])
                    .then_some(())
                    .ok_or(format!("{:?}", parked(p, 0)))
            },
        ),
        (
            "one staged copy per model while room is short, beside its hot copy and standbys",
            vec![600.0, 900.0, 0.0],
            48.0,
            64.0,
            [0, 0],
            |p| {
                let bad = p
                    .iter()
                    .flatten()
                    .any(|h| (h.hot || h.host > 0) && !h.staged);
                (!bad).then_some(()).ok_or(format!("{p:?}"))
            },
        ),
        (
            "no node holds more than its budgets",
            vec![600.0, 700.0, 800.0, 900.0, 1000.0, 0.0],
            40.0,
            40.0,
            [1, 0],
            |p| {
                for node in p {
                    let nvme = node.iter().filter(|h| h.staged).count() as f64 * 16.0;
                    let ram: f64 = node
                        .iter()
                        .map(|h| (f64::from(u8::from(h.hot)) + f64::from(h.host)) * 16.0)
                        .sum();
                    if nvme > 40.0 || ram > 40.0 {
                        return Err(format!("NVMe {nvme} GB, RAM {ram} GB"));
                    }
                }
                Ok(())
            },
        ),
        (
            "every model's first pair before a busier model's further copies",
            // m0 asked for every minute (due soon, worth most), m1 every 33 minutes.
            vec![60.0, 2000.0],
            200.0,
            200.0,
            [0, 0],
            |p| {
                // Four free GPUs: m0's pair and m1's pair; m0's further copies, worth
                // more than m1's first by value alone, come after it.
                let per: Vec<u32> = (0..2).map(|m| parked(p, m).iter().sum()).collect();
                (per == [2, 2]).then_some(()).ok_or(format!("{per:?}"))
            },
        ),
    ];
    for (name, periods, nvme, ram, busy, check) in cases {
        let models = periods
            .iter()
            .map(|&p| model(periodic(p, 3000.0 - p / 2.0), 0))
            .collect();
        let mut v = view(models, nvme, ram, busy);
        // Further copies are worth something only while the fleet's GPUs are in use.
        v.max_gpus = 8;
        v.gpus_held = 4;
        let p = plan(&v, &candidates(&v));
        if let Err(e) = check(&p) {
            panic!("{name}: {e}");
        }
    }
}

#[test]
fn a_held_standby_stays_on_its_node_while_it_has_a_gpu() {
    let mut v = view(vec![model(periodic(600.0, 2700.0), 0)], 100.0, 32.0, [1, 0]);
    v.nodes[0].holds[0] = Holding {
        staged: true,
        hot: false,
        host: 1,
    };
    let p = plan(&v, &candidates(&v));
    assert_eq!(p[0][0].host, 1, "kept where it is: {p:?}");
    assert_eq!(p[1][0].host, 1, "its pair where a GPU is free: {p:?}");
}

#[test]
fn a_model_due_sooner_is_worth_more_and_a_serving_one_less() {
    let v = view(
        vec![
            model(periodic(600.0, 2700.0), 0),
            model(periodic(3000.0, 0.0), 0),
            model(periodic(600.0, 2700.0), 3),
        ],
        100.0,
        64.0,
        [0, 0],
    );
    let cands = candidates(&v);
    let value = |m: usize, kind: Kind| {
        cands
            .iter()
            .find(|c| c.m == m && c.kind == kind && c.rank == 0)
            .map_or(0.0, |c| c.value)
    };
    for kind in [Kind::Staged, Kind::Hot, Kind::Host] {
        assert!(value(0, kind) > value(1, kind), "{kind:?}");
        assert!(value(0, kind) > value(2, kind), "{kind:?}");
    }
}

#[test]
fn standbys_stay_within_the_fleets_gpu_budget() {
    let mut v = view(vec![model(periodic(600.0, 2700.0), 0)], 100.0, 64.0, [0, 0]);
    v.max_gpus = 1;
    v.gpus_held = 0;
    let p = plan(&v, &candidates(&v));
    assert_eq!(parked(&p, 0).iter().sum::<u32>(), 1, "{p:?}");
}
