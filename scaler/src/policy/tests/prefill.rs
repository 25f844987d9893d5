//! The prefill pool's size: prompt rate, backlog, hindsight and a seeded window.

use super::*;

#[test]
fn prefill_sizes_from_prompt_rate_and_backlog() {
    // Table: (prompt tokens/s, queued tokens, expected replicas range).
    let cases = [
        (0.0, 0.0, 0..=0),
        (10_000.0, 0.0, 1..=1),
        (100_000.0, 0.0, 7..=9),
        // A pool at zero: new replicas drain the backlog over their start-up (at
        // least half the actuation: 15 s) and half the SLO:
        // 10k / (16k × 0.85) + 200k / 16 s / 16k ≈ 1.5.
        (10_000.0, 200_000.0, 2..=2),
        // ...and a backlog of a minute's work at once: + 1M / 16 s / 16k ≈ 4.6.
        (10_000.0, 1_000_000.0, 5..=5),
    ];
    for (rate, queued, want) in cases {
        let mut p = policy(Pool::Prefill);
        let mut o = obs(0, |s| {
            s.prompt_rate = rate;
            s.queued_prompt_tokens = queued;
        });
        o.measured_startup_s = Some(2.0);
        let d = p.decide(0.0, &o);
        assert!(
            want.contains(&d.desired),
            "rate {rate} queued {queued}: {d:?}"
        );
    }
}

#[test]
fn regression_a_short_start_up_turned_a_passing_queue_into_replicas() {
    // Four replicas serve 10k tokens/s with 44k/s to spare at 85%; a queue of 150k
    // tokens is gone within 4 s. With 1 s start-ups the old rule drained it over 2 s with new
    // replicas ((10k + 75k) / 13.6k: seven) and held them for a stabilisation window.
    for lead in [1.0, 2.0, 5.0, 20.0] {
        let mut p = policy(Pool::Prefill);
        let mut o = obs(4, |s| {
            s.prompt_rate = 10_000.0;
            s.queued_prompt_tokens = 150_000.0;
        });
        o.measured_startup_s = Some(lead);
        let d = p.decide(0.0, &o);
        assert_eq!(d.desired, 4, "lead {lead}: {d:?}");
    }
    // A queue the spare capacity cannot clear before new replicas serve (1 s start-up
    // plus 30 s of actuation, then half the SLO) still gets them, draining the rest
    // over their start-up (at least half the actuation) and half the SLO: spare
    // 4 × 16k × 0.85 − 10k = 44.4k/s, (4M − 44.4k × 32 s) / (16k × 16 s) ≈ 10.1,
    // plus the load's 0.7.
    let mut p = policy(Pool::Prefill);
    let mut o = obs(4, |s| {
        s.prompt_rate = 10_000.0;
        s.queued_prompt_tokens = 4_000_000.0;
    });
    o.measured_startup_s = Some(1.0);
    let d = p.decide(0.0, &o);
    assert_eq!(d.desired, 11, "{d:?}");
}

#[test]
fn regression_a_shorter_start_up_drained_a_backlog_with_more_replicas() {
    // Four busy replicas (no spare) and 2M queued tokens. The drain window was the
    // start-up plus half the SLO, so a 1 s start asked for 64 replicas (the maximum)
    // where a 15 s start asked for 13: replicas HPA's sync brings no sooner, held for
    // a stabilisation window, for no more requests served (Azure ×4 at 2 s starts:
    // +0.45% GPU-s at equal attainment, 1 s: +0.9%; BENCHMARKS.md #15).
    let desired = |lead: f64| {
        let mut p = policy(Pool::Prefill);
        let mut o = obs(4, |s| {
            s.prompt_rate = 64_000.0;
            s.queued_prompt_tokens = 2_000_000.0;
        });
        o.measured_startup_s = Some(lead);
        p.decide(0.0, &o).desired
    };
    let at_15 = desired(15.0);
    assert!(
        at_15 > 4,
        "a backlog no spare clears gets replicas: {at_15}"
    );
    for lead in [1.0, 2.0, 5.0, 10.0] {
        assert_eq!(desired(lead), at_15, "lead {lead}");
    }
    assert!(desired(20.0) <= at_15, "{} > {at_15}", desired(20.0));
}

#[test]
fn a_steady_window_is_sized_by_hindsight_at_its_planning_rate() {
    // 100k tokens/s of 2k-token prompts for two minutes. Before the window knows the
    // load, the forecast at the queueing cap sizes it (0.85 here); once it does, the
    // fewest fixed replicas that would have served the window at 65% of the profile's
    // rate (the replay pools capacity and smooths arrivals; BENCHMARKS.md, #15).
    let per = Profile::default().prefill_rate(2048.0);
    let before = (100_000.0 / (per * 0.85)).ceil() as u32;
    let after = (100_000.0 / (per * 0.65)).ceil();
    let mut p = policy(Pool::Prefill);
    for t in 0..=120 {
        let mut o = obs(before, |s| {
            s.prompt_rate = 100_000.0;
            s.prompt_rate_recent = 100_000.0;
            s.peak_span_s = 1.0;
            s.recent_span_s = 1.0;
        });
        o.mean_prompt_len = Some(2048.0);
        let d = p.decide(f64::from(t), &o);
        if t == 0 {
            assert_eq!(d.desired, before, "before the window is known");
        }
    }
    let load = p.last_load().unwrap();
    assert_eq!(load.needed.ceil(), after, "{load:?}");
}

#[test]
fn a_restarted_policy_seeded_with_its_window_sizes_from_it_at_once() {
    // Ten minutes of 100k tokens/s of 2k-token prompts, read back at a restart: the
    // first decision is the window's hindsight size (at 65% of the profile: 10), not a
    // cold start's forecast at the queueing cap (8).
    let per = Profile::default().prefill_rate(2048.0);
    let steady = |s: &mut PoolSignals| {
        s.prompt_rate = 100_000.0;
        s.prompt_rate_recent = 100_000.0;
        s.peak_span_s = 5.0;
        s.recent_span_s = 5.0;
    };
    let points: Vec<(f64, f64)> = (0..120)
        .rev()
        .map(|i| (f64::from(i) * 5.0, 100_000.0))
        .collect();
    let mut p = policy(Pool::Prefill);
    assert_eq!(p.seed_arrivals(1000.0, 5.0, &points, 1.0), 120);
    let d = p.decide(1000.0, &obs(8, steady));
    assert_eq!(
        f64::from(d.desired),
        (100_000.0 / (per * 0.65)).ceil(),
        "{d:?}"
    );
    let mut cold = policy(Pool::Prefill);
    assert_eq!(cold.decide(1000.0, &obs(8, steady)).desired, 8);
    // Once the window has arrivals of its own, or for decode, seeding takes nothing.
    assert_eq!(p.seed_arrivals(1005.0, 5.0, &points, 1.0), 0);
    assert_eq!(
        policy(Pool::Decode).seed_arrivals(0.0, 5.0, &points, 1.0),
        0
    );
    // Points older than the window, or not numbers, are dropped.
    let mut q = policy(Pool::Prefill);
    assert_eq!(
        q.seed_arrivals(
            0.0,
            5.0,
            &[(601.0, 1.0), (f64::NAN, 1.0), (5.0, f64::NAN), (0.0, 1.0)],
            1.0
        ),
        1
    );
}
