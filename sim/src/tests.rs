use preheat_scaler::policy::PoolPolicy;
use preheat_scaler::profile::Profile;

use super::autoscalers::{Autoscaler, POLICIES, Static};
use super::replay::Sim;
use super::sizing::static_peak;
use super::trace::TraceRequest;
use super::*;

fn cfg() -> SimConfig {
    let pol = PoolPolicy {
        scale_down_stabilization_s: 60.0,
        idle_grace_s: 120.0,
        ..PoolPolicy::default()
    };
    SimConfig::new(pol.clone(), pol, Profile::default())
}

/// `n` requests every `gap` seconds from `start`.
fn steady(start: f64, n: usize, gap: f64, input: u32, output: u32) -> Vec<TraceRequest> {
    (0..n)
        .map(|i| TraceRequest {
            t: start + i as f64 * gap,
            input_tokens: input,
            output_tokens: output,
            blocks: Vec::new(),
        })
        .collect()
}

fn run_fixed(cfg: &SimConfig, trace: &[TraceRequest], p: u32, d: u32) -> PolicyReport {
    Sim::new(cfg, trace, Box::new(Static(p)), Box::new(Static(d))).run()
}

#[test]
fn light_load_on_enough_replicas_meets_every_slo() {
    let c = cfg();
    // 1 req/s of 2k tokens: an eighth of one prefill replica.
    let trace = steady(0.0, 100, 1.0, 2048, 50);
    let r = run_fixed(&c, &trace, 1, 1);
    assert_eq!(r.unfinished, 0);
    assert_eq!(r.slo_attainment, 1.0, "{r:?}");
    // TTFT is the bare prefill time: 2048 tokens at 16k tokens/s.
    assert!((r.ttft_p50 - 0.128).abs() < 1e-6, "{}", r.ttft_p50);
    // Fixed replicas cost replicas × (time until the last request finishes).
    let end = 99.0 + 0.128 + 49.0 * c.profile.itl(1.0);
    assert!(
        (r.gpu_seconds - 2.0 * end).abs() < 0.5,
        "{} vs {}",
        r.gpu_seconds,
        2.0 * end
    );
}

#[test]
fn overload_misses_the_ttft_slo_and_more_replicas_fix_it() {
    let c = cfg();
    // 40k prompt tokens/s: 2.5 replicas' worth.
    let trace = steady(0.0, 600, 0.05, 2048, 10);
    let one = run_fixed(&c, &trace, 1, 1);
    let four = run_fixed(&c, &trace, 4, 1);
    assert!(one.slo_attainment < 0.5, "{}", one.slo_attainment);
    assert!(four.slo_attainment > 0.99, "{}", four.slo_attainment);
    assert!(one.ttft_p99 > 10.0 * four.ttft_p99);
}

#[test]
fn same_input_same_report() {
    let c = cfg();
    let trace = steady(0.0, 300, 0.2, 3000, 40);
    let a = run_policy("preheat", &c, &trace).unwrap();
    let b = run_policy("preheat", &c, &trace).unwrap();
    assert_eq!(
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap()
    );
}

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
fn shared_prefixes_hit_the_cache() {
    let c = cfg();
    let trace: Vec<TraceRequest> = (0..40)
        .map(|i| TraceRequest {
            t: f64::from(i),
            input_tokens: 4096,
            output_tokens: 4,
            // Every request shares the first 6 of its 8 blocks.
            blocks: (0..6)
                .chain([100 + 2 * i as u64, 101 + 2 * i as u64])
                .collect(),
        })
        .collect();
    let r = run_fixed(&c, &trace, 2, 1);
    // First request misses everything; the rest hit 6 of 8 blocks.
    let want = 39.0 * 6.0 * 512.0 / (40.0 * 4096.0);
    assert!(
        (r.prefix_hit_rate - want).abs() < 1e-9,
        "{}",
        r.prefix_hit_rate
    );
}

#[test]
fn kv_capacity_bounds_decode_admission() {
    let mut c = cfg();
    c.profile.kv_tokens = 10_000.0;
    // Each sequence holds 4,100 tokens: two fit, the third waits.
    let trace = steady(0.0, 3, 0.0, 4000, 101);
    let r = run_fixed(&c, &trace, 3, 1);
    assert_eq!(r.unfinished, 0);
    assert!(r.itl_p99 > 1.5 * r.itl_p50, "the third waited: {r:?}");
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

/// Quiet, then a 10-minute step to ~5 prefill replicas' worth, then quiet.
fn step_trace() -> Vec<TraceRequest> {
    let mut trace = steady(0.0, 120, 1.0, 2048, 20);
    trace.extend(steady(120.0, 24_000, 0.025, 2048, 20));
    trace.extend(steady(720.0, 300, 1.0, 2048, 20));
    trace
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
fn on_a_shared_host_busy_replicas_split_its_speed() {
    // Two prompts at once on two prefill replicas: each alone in its own GPU, or both
    // on one host whose whole speed the profile measured (each at half speed).
    let mut c = cfg();
    let trace = steady(0.0, 2, 0.0, 2048, 2);
    let own = run_fixed(&c, &trace, 2, 1);
    assert!((own.ttft_p99 - 0.128).abs() < 1e-6, "{}", own.ttft_p99);
    c.shared_host = Some(1.0);
    let shared = run_fixed(&c, &trace, 2, 1);
    assert!(
        (shared.ttft_p99 - 0.256).abs() < 1e-6,
        "{}",
        shared.ttft_p99
    );
    // Two slots hold both at full speed.
    c.shared_host = Some(2.0);
    let roomy = run_fixed(&c, &trace, 2, 1);
    assert!((roomy.ttft_p99 - 0.128).abs() < 1e-6, "{}", roomy.ttft_p99);
    // A lone prompt runs at full speed even on one slot.
    c.shared_host = Some(1.0);
    let alone = run_fixed(&c, &steady(0.0, 1, 0.0, 2048, 1), 2, 1);
    assert!((alone.ttft_p99 - 0.128).abs() < 1e-6, "{}", alone.ttft_p99);
}

#[test]
fn a_shared_host_slows_busy_replicas_by_its_measured_slowdown_too() {
    // Two slots hold two prompts at full speed by the core count; a host measured 25%
    // slower than that with two computing stretches both, and leaves one alone as is.
    let mut c = cfg();
    c.shared_host = Some(2.0);
    c.shared_host_slowdown = vec![(2.0, 1.25), (4.0, 1.5)];
    let both = run_fixed(&c, &steady(0.0, 2, 0.0, 2048, 2), 2, 1);
    assert!((both.ttft_p99 - 0.16).abs() < 1e-6, "{}", both.ttft_p99);
    let alone = run_fixed(&c, &steady(0.0, 1, 0.0, 2048, 1), 2, 1);
    assert!((alone.ttft_p99 - 0.128).abs() < 1e-6, "{}", alone.ttft_p99);
    // Slots to spare do not hide it: the slowdown was measured beyond the cores.
    c.shared_host = Some(4.0);
    let roomy = run_fixed(&c, &steady(0.0, 2, 0.0, 2048, 2), 2, 1);
    assert!((roomy.ttft_p99 - 0.16).abs() < 1e-6, "{}", roomy.ttft_p99);
}

#[test]
fn the_host_slowdown_is_interpolated_between_its_measured_counts() {
    use crate::replay::slowdown_at;
    let p = [(2.0, 1.1), (4.0, 1.3)];
    assert_eq!(slowdown_at(&[], 3.0), 1.0);
    assert_eq!(slowdown_at(&p, 1.0), 1.0);
    assert!((slowdown_at(&p, 1.5) - 1.05).abs() < 1e-12);
    assert!((slowdown_at(&p, 2.0) - 1.1).abs() < 1e-12);
    assert!((slowdown_at(&p, 3.0) - 1.2).abs() < 1e-12);
    assert!((slowdown_at(&p, 9.0) - 1.3).abs() < 1e-12);
    // A measurement that went wrong slows nothing.
    assert_eq!(slowdown_at(&[(2.0, f64::NAN)], 2.0), 1.0);
    assert_eq!(slowdown_at(&[(2.0, -1.0)], 5.0), 1.0);
    assert_eq!(slowdown_at(&[(2.0, 0.97)], 2.0), 1.0);
}

#[test]
fn a_batching_prefill_computes_queued_prompts_together() {
    // Three 128-token prompts at once on one replica: one at a time they finish at
    // 1, 2 and 3 × 128 / rate(128); batched (a 512-token budget), the first runs alone
    // (the replica was idle) and the other two together at the rate of 256 tokens.
    let mut c = cfg();
    let p = &c.profile;
    let (one, two) = (128.0 / p.prefill_rate(128.0), 256.0 / p.prefill_rate(256.0));
    let trace = steady(0.0, 3, 0.0, 128, 1);
    let serial = run_fixed(&c, &trace, 1, 1);
    assert!(
        (serial.ttft_p99 - 3.0 * one).abs() < 1e-9,
        "{}",
        serial.ttft_p99
    );
    c.prefill_batch_tokens = Some(512.0);
    let batched = run_fixed(&c, &trace, 1, 1);
    assert_eq!(batched.unfinished, 0);
    assert!(
        (batched.ttft_p99 - (one + two)).abs() < 1e-9,
        "{}",
        batched.ttft_p99
    );
    // A budget below two prompts fills each pass with the head of the next prompt
    // (the second and 72 tokens of the third, then the third's last 56): the same
    // work, so the last first token comes when it did one prompt at a time.
    c.prefill_batch_tokens = Some(200.0);
    let tight = run_fixed(&c, &trace, 1, 1);
    assert!(
        (tight.ttft_p99 - 3.0 * one).abs() < 1e-9,
        "{}",
        tight.ttft_p99
    );
}

/// The engine's scheduler fills every forward pass to its token budget with chunks of
/// the prompts queued next; the simulator batched whole prompts only. Two 200-token
/// prompts with a 256-token budget went one after the other, each first token a
/// pass early, so a queue of `up`'s prompts gave first tokens sooner in the model
/// than in the engine.
#[test]
fn regression_the_simulated_prefill_batched_only_whole_prompts() {
    let mut c = cfg();
    c.prefill_batch_tokens = Some(256.0);
    let first_tokens = |input: u32, n: usize| {
        let trace = steady(0.0, n, 0.0, input, 1);
        Sim::new(&c, &trace, Box::new(Static(1)), Box::new(Static(1))).run_first_tokens()
    };
    let near = |got: &[f64], want: &[f64]| {
        got.len() == want.len() && got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-9)
    };
    // Four at once: the first alone (the replica was idle); then the second with 56
    // tokens of the third, the third's other 144 with 112 of the fourth, the fourth's
    // last 88. Each chunk carries its share of its prompt's time.
    let one = 200.0 / c.profile.prefill_rate(200.0);
    let got = first_tokens(200, 4);
    let want = [1.0, 2.28, 3.56, 4.0].map(|k| k * one);
    assert!(near(&got, &want), "{got:?} against {want:?}");
    // A prompt longer than the budget leaves its last pass's room to the next one:
    // 300 tokens, then 300 and 212 of the next (two passes of 256), then its 88.
    let one = 300.0 / c.profile.prefill_rate(300.0);
    let got = first_tokens(300, 3);
    let want = [1.0, 2.0 + 212.0 / 300.0, 3.0].map(|k| k * one);
    assert!(near(&got, &want), "{got:?} against {want:?}");
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

#[test]
fn short_prompts_prefilled_on_decode_need_no_prefill_replica_and_slow_its_steps() {
    let mut c = cfg();
    let short = steady(0.0, 5, 1.0, 16, 4);
    // Through the prefill pool, nothing moves without a prefill replica.
    assert_eq!(run_fixed(&c, &short, 0, 1).unfinished, 5);
    c.local_prefill_below = Some(32);
    let local = run_fixed(&c, &short, 0, 1);
    assert_eq!(local.unfinished, 0);
    let prefill_s = 16.0 / c.profile.prefill_rate(16.0);
    assert!(
        (local.ttft_p99 - prefill_s).abs() < 1e-9,
        "{}",
        local.ttft_p99
    );
    // A prompt at the threshold still goes to the prefill pool.
    assert_eq!(
        run_fixed(&c, &steady(0.0, 2, 1.0, 32, 4), 0, 1).unfinished,
        2
    );

    // A long request decoding when a short prompt joins its replica: one of its steps
    // is longer by the short prompt's compute. A one-token answer through the prefill
    // pool never reaches decode; computed on decode, it counts in the batch for the
    // step under way (from its admission) and its own.
    let mut trace = steady(0.0, 1, 0.0, 2048, 51);
    trace.extend(steady(0.5, 1, 0.0, 16, 1));
    c.local_prefill_below = None;
    let apart = run_fixed(&c, &trace, 1, 1);
    c.local_prefill_below = Some(32);
    let joined = run_fixed(&c, &trace, 1, 1);
    let batch_two = c.profile.itl(2.0) - c.profile.itl(1.0);
    let expected = (prefill_s + 2.0 * batch_two) / 50.0;
    assert!(
        (joined.itl_p99 - apart.itl_p99 - expected).abs() < 1e-9,
        "{} vs {} (+{expected})",
        joined.itl_p99,
        apart.itl_p99
    );
}

#[test]
fn prompts_computed_on_decode_do_not_size_the_prefill_pool() {
    // The real prefill scaler reads its prompt rate from the prefill workers' metrics;
    // a prompt a decode worker computed is counted there, not here.
    let mut c = cfg();
    c.prefill.min_replicas = 0;
    c.decode.min_replicas = 0;
    c.warm_start = false;
    let short = steady(0.0, 600, 0.1, 16, 20);
    let through_prefill = run_policy("preheat", &c, &short).unwrap();
    assert!(through_prefill.max_prefill_replicas > 0);
    c.local_prefill_below = Some(32);
    let on_decode = run_policy("preheat", &c, &short).unwrap();
    assert_eq!(on_decode.unfinished, 0);
    assert_eq!(on_decode.max_prefill_replicas, 0, "{on_decode:?}");
    assert!(on_decode.max_decode_replicas > 0);
}

/// A trace with bursts and lulls, shared prefixes, prompts short enough to be computed
/// on decode, and long answers: what the fast paths below must not change.
fn mixed_trace(n: usize) -> Vec<TraceRequest> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |m: u64| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % m
    };
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            // 20 s bursts at 25 req/s between 20 s lulls at 2 req/s.
            t += if (i / 500) % 2 == 0 { 0.04 } else { 0.5 };
            let input = if next(5) == 0 {
                8 + next(20) as u32
            } else {
                512 + next(12_000) as u32
            };
            let shared = next(4);
            let own = u64::from(input / 512);
            TraceRequest {
                t,
                input_tokens: input,
                output_tokens: 1 + next(400) as u32,
                blocks: (0..own)
                    .map(|b| {
                        if b < 3 {
                            shared * 10 + b
                        } else {
                            1_000 + i as u64 * 64 + b
                        }
                    })
                    .collect(),
            }
        })
        .collect()
}

#[test]
fn the_prefill_pool_alone_gives_the_prompt_completions_of_a_full_run() {
    // As `clairvoyant`'s bisection runs it: replicas ready at once, per-minute
    // schedules that scale both pools up and down (draining, retiring, prefix-index
    // slots released and taken again), batched prefill and not.
    let mut c = cfg().with_startup_s(0.0);
    c.local_prefill_below = Some(32);
    let trace = mixed_trace(3000);
    let minutes = (trace.last().unwrap().t / 60.0) as usize + 1;
    let mut compared = 0;
    for (batch, shift) in [(None, 0), (Some(4096.0), 1), (None, 2)] {
        c.prefill_batch_tokens = batch;
        let prefill: Vec<u32> = (0..minutes)
            .map(|m| 1 + ((m + shift) * 7 % 5) as u32)
            .collect();
        let decode: Vec<u32> = (0..minutes)
            .map(|m| 1 + ((m + shift) * 3 % 4) as u32)
            .collect();
        let sim = |d: &[u32]| {
            Sim::new(
                &c,
                &trace,
                Box::new(clairvoyant::Plan::per_minute(prefill.clone())),
                Box::new(clairvoyant::Plan::per_minute(d.to_vec())),
            )
        };
        let full = sim(&decode).run_prompts_done();
        let alone = sim(&vec![1; minutes]).prefill_only().run_first_tokens();
        // A decode step of the largest batch (this profile times no context), made
        // longer by the longest prompt a decode replica computes in one.
        let longest_step =
            c.profile.itl(c.max_batch() as f64) + 32.0 / c.profile.prefill_rate(32.0);
        for (i, r) in trace.iter().enumerate() {
            if c.prefills_on_decode(r) {
                continue;
            }
            let (done, first) = full[i];
            assert_eq!(
                done.to_bits(),
                alone[i].to_bits(),
                "request {i}: {done} against {} (batching {batch:?})",
                alone[i]
            );
            // Its first token waits, at most, for the decode step under way.
            assert!(
                first >= done && first <= done + longest_step + 1e-9,
                "request {i}: first token {first}, prompt done {done}"
            );
            compared += 1;
        }
    }
    assert!(compared > 5000, "{compared}");
}

#[test]
fn a_run_stopped_short_of_its_target_is_one_that_would_have_missed_it() {
    let mut c = cfg();
    c.local_prefill_below = Some(32);
    let trace = mixed_trace(3000);
    let (mut stopped, mut ran) = (0, 0);
    for p in 1..=8 {
        for d in [1, 3] {
            let full = run_fixed(&c, &trace, p, d);
            let sim = Sim::new(&c, &trace, Box::new(Static(p)), Box::new(Static(d)));
            match sim.run_unless_below(0.99) {
                None => {
                    stopped += 1;
                    assert!(full.slo_attainment < 0.99, "{p}/{d}: {full:?}");
                }
                Some(r) => {
                    ran += 1;
                    assert_eq!(r.slo_attainment.to_bits(), full.slo_attainment.to_bits());
                    // Never stopped at its own attainment: a miss is counted once, and
                    // only for a request the report counts as missed too.
                    let own = Sim::new(&c, &trace, Box::new(Static(p)), Box::new(Static(d)));
                    assert!(
                        own.run_unless_below(full.slo_attainment).is_some(),
                        "{p}/{d}"
                    );
                    assert_eq!(r.gpu_seconds.to_bits(), full.gpu_seconds.to_bits());
                    assert_eq!(r.ttft_p99.to_bits(), full.ttft_p99.to_bits());
                }
            }
        }
    }
    assert!(stopped > 0 && ran > 0, "stopped {stopped}, ran {ran}");
}

#[test]
fn decode_steps_slow_with_the_context_where_the_profile_measured_it() {
    use preheat_scaler::profile::ContextItl;
    let mut c = cfg();
    let short = steady(0.0, 4, 0.0, 64, 101);
    let long = steady(0.0, 4, 0.0, 4096, 101);
    // Without the long-context table, the context changes no step.
    let flat = (run_fixed(&c, &short, 4, 1), run_fixed(&c, &long, 4, 1));
    assert!((flat.0.itl_p50 - flat.1.itl_p50).abs() < 1e-12, "{flat:?}");
    c.profile.decode_itl_long = Some(ContextItl {
        short_context: 8.0,
        context: 2048.0,
        itl_s: vec![(1.0, 0.016), (16.0, 0.022)],
    });
    let (s, l) = (run_fixed(&c, &short, 4, 1), run_fixed(&c, &long, 4, 1));
    // Four sequences of 4096-token prompts generating 100 tokens after the first,
    // together: the line through (8, itl(4)) and (2048, long(4)), at their mean
    // context halfway, 4096 + 1 + 50.
    let at = |ctx: f64| {
        let (a, b) = (c.profile.itl(4.0), 0.016 + (0.022 - 0.016) * 3.0 / 15.0);
        a + (b - a) * (ctx - 8.0) / 2040.0
    };
    // The step time is re-read at every event (each second, here) at the context
    // then: within the first and last step's, and near the halfway one.
    for (r, first) in [(&l, 4097.0), (&s, 65.0)] {
        let (lo, mid, hi) = (at(first), at(first + 50.0), at(first + 100.0));
        assert!(
            r.itl_p50 > lo && r.itl_p50 < hi && (r.itl_p50 - mid).abs() < 1e-3 * mid,
            "{} not near {mid} in ({lo}, {hi})",
            r.itl_p50
        );
    }
    assert!(l.itl_p50 > 1.9 * flat.1.itl_p50);
}

/// A fixed size that keeps what it saw of its pool at each decision.
struct Watching(
    u32,
    std::sync::Arc<std::sync::Mutex<Vec<autoscalers::PoolView>>>,
);

impl Autoscaler for Watching {
    fn period_s(&self) -> f64 {
        1.0
    }
    fn decide(&mut self, v: &autoscalers::PoolView) -> u32 {
        self.1.lock().unwrap().push(v.clone());
        self.0
    }
    fn observes(&self) -> bool {
        true
    }
    fn initial(&self) -> Option<u32> {
        Some(self.0)
    }
}

/// Runs `prefill` fixed prefill replicas and one decode replica that keeps what it saw
/// at each decision; every request must finish.
fn run_watching_decode(
    c: &SimConfig,
    trace: &[TraceRequest],
    prefill: u32,
) -> Vec<autoscalers::PoolView> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let run = Sim::new(
        c,
        trace,
        Box::new(Static(prefill)),
        Box::new(Watching(1, seen.clone())),
    )
    .run();
    assert_eq!(run.unfinished, 0);
    seen.lock().unwrap().clone()
}

#[test]
fn regression_the_decode_itl_and_token_rate_waited_for_requests_to_finish() {
    // Sixteen long answers on one decode replica: every step at the profile's batch-16
    // ITL, and none of them done in the first minute.
    let c = cfg();
    let trace = steady(0.0, 16, 0.0, 64, 8000);
    let seen = run_watching_decode(&c, &trace, 2);
    let itl = c.profile.itl(16.0);
    let first_done = 7999.0 * itl;
    assert!(first_done > 60.0, "{first_done}");
    let v = seen
        .iter()
        .find(|v| v.t >= 30.0)
        .expect("a decision at 30 s");
    // The engine counts each token and each gap as it comes: the scaler sees the
    // slow steps and the token rate long before any request finishes.
    let p90 = v.signals.itl_p90.expect("gaps seen by 30 s");
    let bounds = ITL_BUCKETS;
    let i = bounds.partition_point(|&b| b < itl);
    let below = i.checked_sub(1).map_or(0.0, |j| bounds[j]);
    assert!(p90 > below && p90 <= bounds[i], "{p90} vs {itl}");
    let rate = v.signals.generation_rate;
    assert!((rate - 16.0 / itl).abs() < 0.05 * 16.0 / itl, "{rate}");
}

#[test]
fn a_prompt_lands_on_the_decode_replica_that_reserved_its_kv_when_it_went_to_prefill() {
    // The gateway picks a request's decode worker, which reserves the prompt's blocks,
    // before the prompt goes to prefill. A long prompt arriving first reserves on one
    // decode replica; four short ones right after see it held and all reserve on the
    // other, and land there once prefilled, though the first is still prefilling then
    // and the first replica holds nothing running. Picked only when each prompt is done
    // (as the simulator did), they split two and two.
    let mut c = cfg();
    c.profile.prefill_tokens_per_s = vec![(1.0, 1_000.0)];
    c.profile.decode_itl_s = vec![(1.0, 0.01), (2.0, 0.02), (4.0, 0.04)];
    c.profile.kv_tokens = 100_000.0;
    // 8,002 KV tokens reserved, more than the four others' 4 × 1,501.
    let mut trace = steady(0.0, 1, 0.0, 8_000, 2);
    trace.extend(steady(0.001, 4, 0.0, 1_000, 501));
    let r = run_fixed(&c, &trace, 2, 2);
    assert_eq!(r.unfinished, 0);
    // The four decode together, at 0.04 s a step with all four, for most of their
    // tokens (mean ITL p50 0.034 s); split two and two it was 0.016 s.
    assert!(r.itl_p50 > 0.03, "ITL p50 {}", r.itl_p50);
}

#[test]
fn the_decode_scaler_sees_kv_reserved_for_prompts_still_in_prefill() {
    // Ten 2,000-token prompts at once on one prefill replica computing 1,000 tokens/s:
    // the last is done at 20 s. Each reserved its prompt's KV on the decode replica when
    // it was routed, and the engines report that within their usage and on its own.
    let mut c = cfg();
    c.profile.prefill_tokens_per_s = vec![(1.0, 1_000.0)];
    c.profile.kv_tokens = 100_000.0;
    let trace = steady(0.0, 10, 0.0, 2_000, 5_000);
    let seen = run_watching_decode(&c, &trace, 1);
    let at = |t: f64| seen.iter().find(|v| v.t >= t).unwrap().signals.clone();
    // At 1 s: the first prompt still computing, all ten reserved (20,000 tokens).
    let s = at(1.0);
    assert!((s.kv_reserved - 0.2).abs() < 1e-9, "{s:?}");
    assert!((s.kv_usage - 0.2).abs() < 1e-9, "{s:?}");
    // At 11 s: five landed and running (7,000 tokens each), five still reserved.
    let s = at(11.0);
    assert_eq!(s.running, 5.0, "{s:?}");
    assert!((s.kv_reserved - 0.1).abs() < 1e-9, "{s:?}");
    assert!((s.kv_usage - 0.45).abs() < 1e-9, "{s:?}");
    // Once every prompt is done, nothing is reserved.
    assert_eq!(seen.last().unwrap().signals.kv_reserved, 0.0);
}
