//! Runs over settings: each policy's knob along its frontier, start-up times, and many
//! policies run in parallel.

use super::*;

#[test]
fn preheats_headroom_moves_it_along_its_frontier() {
    let c = cfg();
    let trace = step_trace();
    let f = sweep::frontier(
        &["preheat".into(), "static-peak".into()],
        &c,
        &trace,
        &|_| {},
    )
    .unwrap();
    let knob = registry::knob("preheat").unwrap();
    let preheat: Vec<&sweep::Point> = f.points.iter().filter(|p| p.policy == "preheat").collect();
    assert_eq!(preheat.len(), knob.sweep.len());
    assert_eq!(
        f.points.len(),
        knob.sweep.len() + 1,
        "the reference runs once"
    );
    let (low, high) = (preheat[0], preheat[preheat.len() - 1]);
    assert_eq!((low.knob, high.knob), (Some(0.6), Some(1.5)));
    assert!(high.gpu_seconds > low.gpu_seconds, "{low:?} {high:?}");
    assert!(
        high.slo_attainment >= low.slo_attainment,
        "{low:?} {high:?}"
    );
    assert_eq!(f.preheat.as_ref().unwrap().knob, Some(1.0));
    // Only causal baselines can beat preheat; none were asked for.
    assert!(f.beaten_by.is_empty());
}

#[test]
fn a_frontier_names_every_baseline_setting_that_matches_preheat() {
    let c = cfg();
    let trace = step_trace();
    let f = sweep::frontier(&["preheat".into(), "kpa".into()], &c, &trace, &|_| {}).unwrap();
    let me = f.preheat.clone().unwrap();
    let expect: Vec<Option<f64>> = f
        .points
        .iter()
        .filter(|p| p.policy == "kpa" && p.matches_or_beats(&me))
        .map(|p| p.knob)
        .collect();
    let got: Vec<Option<f64>> = f.beaten_by.iter().map(|p| p.knob).collect();
    assert_eq!(got, expect);
    // KPA's lower concurrency targets hold more replicas.
    let kpa: Vec<&sweep::Point> = f.points.iter().filter(|p| p.policy == "kpa").collect();
    assert!(
        kpa[0].gpu_seconds > kpa[kpa.len() - 1].gpu_seconds,
        "{kpa:?}"
    );
}

#[test]
fn a_start_up_sweep_reruns_every_policy_per_start_time() {
    let c = cfg();
    let trace = step_trace();
    let names = ["preheat".to_owned(), "kpa".to_owned()];
    let s = sweep::startup_sweep(&names, &c, &trace, &[2.0, 120.0], &|_| {}).unwrap();
    assert_eq!(s.rows.len(), 2);
    for (_, points) in &s.rows {
        let got: Vec<&str> = points.iter().map(|p| p.policy.as_str()).collect();
        assert_eq!(got, ["preheat", "kpa"]);
    }
    // A step met by replicas that take two minutes to start misses more requests.
    for i in 0..2 {
        let (fast, slow) = (&s.rows[0].1[i], &s.rows[1].1[i]);
        assert!(
            slow.slo_attainment < fast.slo_attainment,
            "{fast:?} {slow:?}"
        );
    }
}

#[test]
fn runs_in_parallel_give_what_runs_one_at_a_time_give() {
    let c = cfg();
    let trace = step_trace();
    let names: Vec<String> = POLICIES.iter().map(|s| (*s).to_owned()).collect();
    let together = run(&names, &c, &trace, "t", &|_| {}).unwrap();
    for (p, name) in together.policies.iter().zip(POLICIES) {
        let alone = run_policy(name, &c, &trace).unwrap();
        assert_eq!(p.name, name);
        assert_eq!(
            p.gpu_seconds.to_bits(),
            alone.gpu_seconds.to_bits(),
            "{name}"
        );
        assert_eq!(
            p.slo_attainment.to_bits(),
            alone.slo_attainment.to_bits(),
            "{name}"
        );
    }
}
