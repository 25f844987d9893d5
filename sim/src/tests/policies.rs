//! How each policy sizes the pools over a run: scaling to zero, the baselines, the
//! hindsight references, standbys, actuation through KEDA, and scheduled floors.

use super::*;

#[test]
fn preheat_scales_to_zero_in_a_long_gap_and_back_without_losing_a_request() {
    let c = cfg();
    let mut trace = steady(0.0, 50, 1.0, 1000, 20);
    trace.extend(steady(1000.0, 50, 1.0, 1000, 20));
    let r = run_policy("preheat", &c, &trace).unwrap();
    assert_eq!(r.unfinished, 0);
    let zero = r
        .timeline
        .iter()
        .any(|&(t, p, d)| t > 400.0 && t < 1000.0 && p == 0 && d == 0);
    assert!(zero, "both pools reach zero in the gap: {:?}", r.timeline);
    let back = r
        .timeline
        .iter()
        .any(|&(t, p, d)| t > 1000.0 && p > 0 && d > 0);
    assert!(back, "and come back");
    // The request that woke the pools waited one start-up, no more.
    assert!(r.ttft_p99 <= c.startup_s() + 2.0, "{}", r.ttft_p99);
}

#[test]
fn static_peak_is_the_smallest_fixed_size_reaching_99_percent() {
    let c = cfg();
    let trace = steady(0.0, 600, 0.05, 2048, 10);
    let (p, d, _) = static_peak(&c, &trace);
    assert!(run_fixed(&c, &trace, p, d).slo_attainment >= 0.99);
    assert!(p > 1 && run_fixed(&c, &trace, p - 1, d).slo_attainment < 0.99);
    assert_eq!(d, 1);
}

#[test]
fn unknown_policy_is_refused_before_running() {
    let c = cfg();
    let e = run(
        &["preheat".into(), "magic".into()],
        &c,
        &steady(0.0, 1, 1.0, 1, 1),
        "x",
        &|_| panic!("must not start"),
    )
    .unwrap_err();
    assert!(e.to_string().contains("magic") && e.to_string().contains("kpa"));
}

#[test]
fn every_baseline_runs_and_finishes_every_request() {
    let c = cfg();
    let mut trace = steady(0.0, 200, 0.1, 2048, 30);
    trace.extend(steady(400.0, 100, 0.5, 512, 100));
    for name in POLICIES {
        let r = run_policy(name, &c, &trace).unwrap();
        assert_eq!(r.unfinished, 0, "{name}");
        assert!(
            r.gpu_seconds > 0.0 && r.slo_attainment > 0.0,
            "{name}: {r:?}"
        );
    }
}

#[test]
fn clairvoyant_plans_each_minute_for_its_own_load() {
    let c = cfg();
    // A quiet minute, a minute of 60k prompt tokens/s (4 replicas' worth), quiet again.
    let mut trace = steady(0.0, 60, 1.0, 2048, 10);
    trace.extend(steady(60.0, 1740, 1.0 / 29.0, 2048, 10));
    trace.extend(steady(120.0, 180, 1.0, 2048, 10));
    let (plan, _) = clairvoyant::plan(&c, &trace);
    let sizes: Vec<u32> = (0..5)
        .map(|m| plan_at(&plan, m as f64 * 60.0 + 30.0))
        .collect();
    // The minute after the burst may still need its size (the backlog spills over in
    // the smaller fixed-size runs); the one after that is quiet again.
    assert!(sizes[1] >= 4 && sizes[0] <= 2 && sizes[3] <= 2, "{sizes:?}");
    let fixed = run_policy("static-peak", &c, &trace).unwrap();
    let seer = run_policy("clairvoyant", &c, &trace).unwrap();
    assert!(seer.slo_attainment >= 0.99, "{seer:?}");
    assert!(
        seer.gpu_seconds < 0.8 * fixed.gpu_seconds,
        "{} vs {}",
        seer.gpu_seconds,
        fixed.gpu_seconds
    );
}

fn plan_at(plan: &clairvoyant::Plan, t: f64) -> u32 {
    use autoscalers::Autoscaler;
    plan.clone().decide(&autoscalers::PoolView {
        t,
        ..autoscalers::PoolView::default()
    })
}

#[test]
fn clairvoyant_with_a_lead_over_a_minute_keeps_the_minutes_in_between() {
    // Bug: with a two-minute start-up the plan looked at now and two minutes ahead
    // only, dropping the replicas a busy minute in between needed.
    let mut c = cfg().with_startup_s(120.0);
    c.sample_s = 1.0;
    let mut trace = steady(0.0, 60, 1.0, 2048, 10);
    trace.extend(steady(60.0, 1740, 1.0 / 29.0, 2048, 10));
    trace.extend(steady(120.0, 240, 1.0, 2048, 10));
    let (plan, _) = clairvoyant::plan(&c, &trace);
    let busy = plan_at(&plan, 90.0);
    assert!(busy >= 4, "{busy}");
    // At 30 s, the busy minute (60–120 s) is within the two-minute lead.
    assert_eq!(plan_at(&plan, 30.0), busy);
    let seer = run_policy("clairvoyant", &c, &trace).unwrap();
    assert!(seer.slo_attainment >= 0.99, "{seer:?}");
}

/// `before` replicas until `at`, then `after`.
struct StepAt(f64, u32, u32);

impl Autoscaler for StepAt {
    fn period_s(&self) -> f64 {
        1.0
    }
    fn wakes_on_arrival(&self) -> bool {
        false
    }
    fn decide(&mut self, v: &autoscalers::PoolView) -> u32 {
        if v.t >= self.0 { self.2 } else { self.1 }
    }
    fn initial(&self) -> Option<u32> {
        Some(self.1)
    }
}

#[test]
fn parked_standbys_are_promoted_first_and_their_gpu_time_counts() {
    let trace = steady(0.0, 100, 1.0, 512, 2);
    let run = |start: StartClass| {
        let mut c = cfg();
        c.start = start;
        c.standbys = 1;
        Sim::new(
            &c,
            &trace,
            Box::new(StepAt(10.0, 1, 3)),
            Box::new(Static(1)),
        )
        .run()
    };
    let (hot, standby) = (run(StartClass::Hot), run(StartClass::Standby));
    assert_eq!(hot.standby_gpu_seconds, 0.0);
    // One parked standby for the scaling prefill pool over the whole run (promoted at
    // 10 s, its replacement held from then on while it starts and parks); the fixed
    // decode pool keeps none.
    let end = 99.0;
    assert!(
        (standby.standby_gpu_seconds - end).abs() < 2.0,
        "{}",
        standby.standby_gpu_seconds
    );
    // Replicas cost the same from their start either way: the difference is the
    // standbys' time.
    assert!(
        (standby.gpu_seconds - hot.gpu_seconds - standby.standby_gpu_seconds).abs() < 1.0,
        "{} - {} vs {}",
        standby.gpu_seconds,
        hot.gpu_seconds,
        standby.standby_gpu_seconds
    );
}

fn first_time_prefill_reaches(r: &PolicyReport, n: u32) -> f64 {
    r.timeline
        .iter()
        .find(|x| x.1 >= n)
        .map_or(f64::INFINITY, |x| x.0)
}

#[test]
fn keda_actuation_waits_for_hpa_where_direct_scales_at_the_tick() {
    let mut c = cfg();
    c.sample_s = 1.0;
    let trace = step_trace();
    c.actuation = Actuation::Direct;
    let direct = run_policy("preheat", &c, &trace).unwrap();
    c.actuation = Actuation::Keda;
    let keda = run_policy("preheat", &c, &trace).unwrap();
    let (td, tk) = (
        first_time_prefill_reaches(&direct, 4),
        first_time_prefill_reaches(&keda, 4),
    );
    assert!(td.is_finite() && tk.is_finite(), "{td} {tk}");
    // HPA reads the scaler every 15 s and doubles at most per period.
    assert!(tk > td, "keda {tk} s, direct {td} s");
    // Scale-down is one pod per 30 s under the chart's HPA policy: slower to shed.
    assert!(
        keda.gpu_seconds > direct.gpu_seconds,
        "{keda:?}\n{direct:?}"
    );
}

#[test]
fn a_configured_headroom_is_what_preheat_runs_with() {
    // Bug (review): without a swept knob the run overwrote the configured headroom
    // with the knob's default, so `--set prefill.headroom=…` did nothing.
    let mut c = cfg();
    let trace = step_trace();
    let plain = run_policy("preheat", &c, &trace).unwrap();
    c.prefill.headroom = 1.5;
    c.decode.headroom = 1.5;
    let generous = run_policy("preheat", &c, &trace).unwrap();
    assert_eq!((plain.knob, generous.knob), (Some(1.0), Some(1.5)));
    assert!(generous.gpu_seconds > plain.gpu_seconds, "{generous:?}");
}

/// The scaler's scheduled floors run in the simulator too: a floor at 00:10 on the
/// trace's clock (t = 0 is `start_unix`) raises prefill a start-up ahead and holds it,
/// through KEDA actuation, over a trace that is idle then.
#[test]
fn a_scheduled_floor_raises_the_pool_ahead_of_its_start_in_the_simulator() {
    let mut c = cfg();
    c.sample_s = 5.0;
    c.prefill.schedule = vec![preheat_scaler::policy::ScheduledFloor {
        cron: "10 0 * * *".into(),
        duration_s: 600.0,
        min_replicas: 3,
    }];
    // 1970-01-01 is a Thursday; the floor fires daily.
    c.start_unix = 0.0;
    let mut trace = steady(0.0, 5, 1.0, 512, 8);
    trace.extend(steady(1800.0, 5, 1.0, 512, 8));
    let r = run_policy("preheat", &c, &trace).unwrap();
    assert_eq!(r.unfinished, 0);
    let at = |t0: f64, t1: f64| -> Vec<u32> {
        r.timeline
            .iter()
            .filter(|x| x.0 >= t0 && x.0 < t1)
            .map(|x| x.1)
            .collect()
    };
    // Three replicas by 00:10 (the floor is raised one start-up ahead), held to 00:20.
    assert!(
        at(600.0, 1190.0).iter().all(|&p| p >= 3),
        "{:?}",
        r.timeline
    );
    // Before it, the idle pool was at zero.
    assert!(at(300.0, 500.0).contains(&0), "{:?}", r.timeline);
    // Without the schedule the same trace never has 3.
    c.prefill.schedule.clear();
    let plain = run_policy("preheat", &c, &trace).unwrap();
    assert!(
        plain.timeline.iter().all(|x| x.1 < 3),
        "{:?}",
        plain.timeline
    );
}

#[test]
fn an_idle_start_opens_at_the_policies_minimum() {
    let mut c = cfg();
    c.prefill.min_replicas = 0;
    c.decode.min_replicas = 0;
    let trace = steady(30.0, 20, 1.0, 2048, 10);
    let warm = run_policy("preheat", &c, &trace).unwrap();
    assert_eq!((warm.timeline[0].1, warm.timeline[0].2), (1, 1));
    c.warm_start = false;
    let idle = run_policy("preheat", &c, &trace).unwrap();
    assert_eq!((idle.timeline[0].1, idle.timeline[0].2), (0, 0));
    // Woken by the first request, and nothing lost.
    assert_eq!(idle.unfinished, 0);
    assert!(idle.timeline.iter().any(|s| s.1 > 0 && s.2 > 0));
}
