//! Damping: scale-down steps and stabilisation, bursts, idleness, blind pools.

use super::*;

/// A light load on 20 prefill replicas every 5 s until the policy takes its first
/// scale-down step: the policy, the step's time and the step.
fn stepped_down_from_20() -> (PreheatPolicy, f64, Decision) {
    let mut p = policy(Pool::Prefill);
    let mut t = 0.0;
    while t < 60.0 {
        p.decide(t, &obs(20, light));
        t += 5.0;
    }
    let step = p.decide(t, &obs(20, light));
    (p, t, step)
}

/// 10k prompt tokens/s, read every 5 s.
fn light(s: &mut PoolSignals) {
    s.prompt_rate = 10_000.0;
    s.prompt_rate_recent = 10_000.0;
    s.peak_span_s = 5.0;
    s.recent_span_s = 5.0;
}

#[test]
fn regression_a_scale_down_step_lasted_one_tick_and_hpa_missed_it() {
    // HPA reads the answer every 15 s; the policy ticks every 5 s and steps down every
    // stabilisation / 4. A step answered for one tick and then "current" again was seen
    // by one sync in three: a pool of 40 on a load for 16 never shrank.
    let (mut p, mut t, step) = stepped_down_from_20();
    assert_eq!(step.reason, "scale down", "{step:?}");
    assert!(step.desired < 20, "{step:?}");
    // Until the next step (stabilisation / 4 = 15 s here), every answer keeps it: HPA
    // has not acted yet...
    t += 5.0;
    let d = p.decide(t, &obs(20, light));
    assert_eq!(d.desired, step.desired, "t={t}: {d:?}");
    // ...or removed one pod.
    t += 5.0;
    assert_eq!(p.decide(t, &obs(19, light)).desired, step.desired);
    // Load that needs the replicas back cancels the step.
    t += 5.0;
    let heavy = p.decide(t, &obs(19, |s| s.prompt_rate = 400_000.0));
    assert!(heavy.desired >= 19, "{heavy:?}");
    t += 5.0;
    assert!(
        p.decide(t, &obs(19, light)).desired >= 19,
        "the window holds the heavy tick"
    );
}

#[test]
fn a_scale_down_step_is_dropped_when_the_pool_is_raised_above_where_it_stepped_from() {
    let (mut p, mut t, step) = stepped_down_from_20();
    assert_eq!((step.reason, step.desired), ("scale down", 15), "{step:?}");
    // Someone (a floor that came and went while the pool was blind, a person) set 30:
    // the old step is not answered, nor does the next step fall below 30 − 25%.
    t += 5.0;
    let d = p.decide(t, &obs(30, light));
    assert_eq!(d.desired, 30, "{d:?}");
    t += 15.0;
    let d = p.decide(t, &obs(30, light));
    assert_eq!((d.reason, d.desired), ("scale down", 22), "{d:?}");
}

#[test]
fn scale_down_waits_and_steps() {
    let mut p = policy(Pool::Prefill);
    let busy = |s: &mut PoolSignals| s.prompt_rate = 100_000.0;
    let d = p.decide(0.0, &obs(8, busy));
    assert!(d.desired >= 7);
    // Load drops: nothing is removed inside the stabilisation window.
    let quiet = |s: &mut PoolSignals| s.prompt_rate = 1_000.0;
    for t in 1..60 {
        let d = p.decide(t as f64, &obs(8, quiet));
        assert_eq!(d.desired, 8, "t={t}: {d:?}");
    }
    // After it, one step of 25%.
    let d = p.decide(61.0, &obs(8, quiet));
    assert_eq!(d.desired, 6, "{d:?}");
}

#[test]
fn a_restarted_policy_removes_nothing_before_a_stabilisation_window() {
    // Regression: a fresh policy (scaler restart, simulator start) had no window
    // history and scaled a loaded pool down on its first tick, before any rate was
    // measured.
    let mut p = policy(Pool::Prefill);
    for t in 0..60 {
        let d = p.decide(t as f64, &obs(8, |_| {}));
        assert_eq!(d.desired, 8, "t={t}: {d:?}");
    }
    assert!(p.decide(61.0, &obs(8, |_| {})).desired < 8);
}

#[test]
fn a_burst_keeps_its_capacity_for_the_burst_memory() {
    let mut p = PreheatPolicy::new(
        Pool::Prefill,
        PoolPolicy {
            scale_down_stabilization_s: 10.0,
            burst_memory_s: 100.0,
            ..PoolPolicy::default()
        },
        Profile::default(),
    );
    let burst = |s: &mut PoolSignals| {
        s.prompt_rate = 5_000.0;
        s.prompt_rate_peak = 100_000.0;
        s.prompt_rate_recent = 100_000.0;
        s.peak_span_s = 5.0;
        s.recent_span_s = 5.0;
    };
    let quiet = |s: &mut PoolSignals| {
        s.prompt_rate = 1_000.0;
        s.prompt_rate_recent = 1_000.0;
        s.peak_span_s = 1.0;
        s.recent_span_s = 1.0;
    };
    let held = p.decide(0.0, &obs(1, burst)).desired;
    assert!(held >= 4, "{held}");
    let mut cur = held;
    for t in 1..100 {
        cur = p.decide(t as f64, &obs(cur, quiet)).desired;
        assert_eq!(cur, held, "t={t}: still inside the burst memory");
    }
    for t in 101..200 {
        cur = p.decide(t as f64, &obs(cur, quiet)).desired;
    }
    assert_eq!(cur, 1, "released after the memory and the stabilisation");
}

#[test]
fn never_zero_with_work_and_zero_after_idle_grace() {
    let mut p = policy(Pool::Decode);
    let d = p.decide(0.0, &obs(1, |s| s.waiting = 1.0));
    assert!(d.desired >= 1 && d.active);
    for t in 1..100 {
        let d = p.decide(t as f64, &obs(1, |_| {}));
        assert!(d.active, "t={t}: still inside the idle grace");
    }
    let d = p.decide(101.0, &obs(1, |_| {}));
    assert_eq!((d.desired, d.active), (0, false));
    // Held requests at zero: active at once.
    let mut o = obs(0, |_| {});
    o.held_requests = 1.0;
    let d = p.decide(102.0, &o);
    assert_eq!((d.desired, d.active), (1, true));
}

#[test]
fn blind_holds_and_limits_apply() {
    let mut p = policy(Pool::Prefill);
    let mut o = obs(5, |_| {});
    o.signals.endpoints_ok = 0;
    o.signals.endpoints_failed = 5;
    let d = p.decide(1000.0, &o);
    assert_eq!((d.desired, d.active), (5, true));
    let limits = PoolPolicy {
        min_replicas: 2,
        max_replicas: 3,
        ..PoolPolicy::default()
    };
    let mut p = PreheatPolicy::new(Pool::Prefill, limits.clone(), Profile::default());
    assert_eq!(p.decide(0.0, &obs(2, |s| s.prompt_rate = 1e9)).desired, 3);
    let mut q = PreheatPolicy::new(Pool::Prefill, limits, Profile::default());
    assert_eq!(q.decide(0.0, &obs(2, |_| {})).desired, 2);
}

#[test]
fn regression_a_blind_pool_at_zero_was_activated() {
    // Found by the cluster run: right after a scaler start, before its pod watch
    // listed, a pool at zero was blind, held at 0 — and reported active, so KEDA
    // started a replica of each pool on every fresh install.
    let mut p = policy(Pool::Decode);
    let mut o = obs(0, |_| {});
    o.signals.endpoints_failed = 1;
    let d = p.decide(0.0, &o);
    assert_eq!((d.desired, d.active), (0, false));
    o.held_requests = 1.0;
    let d = p.decide(1.0, &o);
    assert_eq!(
        (d.desired, d.active),
        (1, true),
        "a held request still wakes it"
    );
}

#[test]
fn regression_an_idle_pool_at_zero_was_activated_after_a_scaler_start() {
    // Found by the cluster run: a fresh policy counted idleness from its own start,
    // so for the first idle grace a pool at zero with no traffic was reported
    // active and KEDA started a replica of it (every install, every restart).
    let mut p = policy(Pool::Prefill);
    let d = p.decide(0.0, &obs(0, |_| {}));
    assert_eq!((d.desired, d.active), (0, false), "{}", d.reason);
    let mut o = obs(0, |_| {});
    o.held_requests = 2.0;
    assert!(p.decide(1.0, &o).active, "held requests still wake it");
}
