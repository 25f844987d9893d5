//! Scheduled floors.

use super::*;

/// Thursday 2026-12-03 08:00 UTC.
const THU_8AM: f64 = 1_796_284_800.0;

fn scheduled(min_replicas: u32) -> PreheatPolicy {
    PreheatPolicy::new(
        Pool::Prefill,
        PoolPolicy {
            scale_down_stabilization_s: 60.0,
            idle_grace_s: 100.0,
            schedule: vec![ScheduledFloor {
                cron: "0 8 * * 1-5".into(),
                duration_s: 3600.0,
                min_replicas,
            }],
            ..PoolPolicy::default()
        },
        Profile::default(),
    )
}

#[test]
fn a_scheduled_floor_is_ready_by_its_start_and_holds_for_its_duration() {
    // Table: (seconds from Thursday 08:00, desired, active); replicas start in 120 s,
    // plus 30 s of actuation, so the floor is raised at 07:57:30. No traffic at all.
    let cases = [
        (-180.0, 0, false),
        (-151.0, 0, false),
        (-150.0, 4, true),
        (0.0, 4, true),
        (3599.0, 4, true),
        (3600.0, 0, false),
        // Saturday 08:00: weekdays only.
        (2.0 * 86_400.0, 0, false),
    ];
    for (at, want, active) in cases {
        let mut p = scheduled(4);
        let mut o = obs(0, |_| {});
        o.measured_startup_s = Some(120.0);
        o.unix_time = Some(THU_8AM + at);
        let d = p.decide(0.0, &o);
        assert_eq!((d.desired, d.active), (want, active), "at {at}: {d:?}");
        if want > 0 {
            assert_eq!(d.reason, "scheduled floor");
        }
    }
}

#[test]
fn a_scheduled_floor_keeps_the_pool_from_zero_and_then_lets_it_go() {
    let mut p = scheduled(3);
    let mut o = obs(3, |_| {});
    o.measured_startup_s = Some(60.0);
    // Idle through the floor, past the idle grace: held at 3.
    for k in 0..60 {
        o.unix_time = Some(THU_8AM + f64::from(k) * 50.0);
        let d = p.decide(f64::from(k) * 50.0, &o);
        assert_eq!((d.desired, d.active), (3, true), "{k}: {d:?}");
    }
    // Past 09:00 the floor is gone: idle past grace, to zero.
    o.unix_time = Some(THU_8AM + 3700.0);
    let d = p.decide(3700.0, &o);
    assert_eq!((d.desired, d.active), (0, false), "{d:?}");
    // Traffic above the floor is sized as always.
    let mut p = scheduled(2);
    let mut o = obs(1, |s| s.prompt_rate = 100_000.0);
    o.unix_time = Some(THU_8AM);
    assert!(p.decide(0.0, &o).desired > 2);
    // Without a wall clock no schedule applies.
    let mut p = scheduled(4);
    assert_eq!(p.decide(0.0, &obs(0, |_| {})).desired, 0);
}

#[test]
fn schedule_errors_are_reported_together() {
    let cfg = PoolPolicy {
        max_replicas: 8,
        schedule: vec![
            ScheduledFloor {
                cron: "0 8 * *".into(),
                duration_s: 60.0,
                min_replicas: 1,
            },
            ScheduledFloor {
                cron: "0 25 * * *".into(),
                duration_s: 0.0,
                min_replicas: 9,
            },
        ],
        ..PoolPolicy::default()
    };
    let e = cfg.validate("prefill");
    assert_eq!(e.len(), 4, "{e:?}");
    assert!(
        e[0].contains("schedule[0].cron") && e[0].contains("five fields"),
        "{e:?}"
    );
    assert!(
        e[1].contains("schedule[1].cron") && e[1].contains("hour"),
        "{e:?}"
    );
    assert!(e[2].contains("schedule[1].duration_s"), "{e:?}");
    assert!(
        e[3].contains("schedule[1].min_replicas 9 > max_replicas 8"),
        "{e:?}"
    );
}

/// Regression: a pool woken from zero by a floor (no start-up measured: the default
/// lead) whose replicas then reported a shorter start-up saw the window close before
/// its start, went to zero, and was raised again: flapping. The lead never shrinks now.
#[test]
fn regression_a_floor_raised_from_zero_flapped_when_replicas_reported_a_short_start() {
    let mut p = scheduled(4);
    // At zero: the default lead (60 s) + actuation (30 s): raised at 07:58:30.
    let mut o = obs(0, |_| {});
    o.unix_time = Some(THU_8AM - 90.0);
    assert_eq!(p.decide(0.0, &o).desired, 4);
    // Up, having started in 20 s; still before 08:00, idle past the grace period.
    for (k, at) in [-60.0, -30.0, -1.0].into_iter().enumerate() {
        let mut o = obs(4, |_| {});
        o.measured_startup_s = Some(20.0);
        o.unix_time = Some(THU_8AM + at);
        let d = p.decide(200.0 + k as f64, &o);
        assert_eq!((d.desired, d.active), (4, true), "at {at}: {d:?}");
    }
}
