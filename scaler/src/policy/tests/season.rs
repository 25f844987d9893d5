//! The season: a recurring ramp met one lead before it shows.

use super::*;

const DAY: f64 = 86_400.0;

/// A policy whose season learnt yesterday's morning (tokens/s per five-minute
/// bucket): nothing until 08:00, `at_8` from 08:00, `at_810` from 08:10.
fn after_a_morning(pool: Pool, at_8: f64, at_810: f64) -> PreheatPolicy {
    let mut p = policy(pool);
    let hm = |h: f64, m: f64| h * 3600.0 + m * 60.0;
    // Each reading is the mean over the bucket before it.
    let points = [
        (hm(8.0, 0.0), 0.0),
        (hm(8.0, 5.0), at_8),
        (hm(8.0, 10.0), at_8),
        (hm(8.0, 15.0), at_810),
    ];
    assert_eq!(p.seed_season(DAY + hm(7.0, 50.0), &points, 1.0), 4);
    p
}

#[test]
fn a_recurring_ramp_is_met_one_lead_before_it_shows() {
    // Yesterday: idle until 08:00, then 100k tokens/s, 500k from 08:10. The default
    // lead is 60 s and actuation 30 s: the season looks 90 s ahead, scaled by today's
    // level against yesterday's at this time (each side with half a replica's load
    // added, at most 1.5x). A pool at zero is woken only for a rise out of a quiet time.
    let unit = Profile::default().prefill_rate(2048.0) * 0.85;
    let level = |today: f64, then: f64| (today + unit / 2.0) / (then + unit / 2.0);
    let hm = |h: f64, m: f64| h * 3600.0 + m * 60.0;
    // Table: (time of day, replicas, today's tokens/s, the forecast sized for).
    let cases = [
        (hm(7.0, 57.0), 0, 0.0, 0.0),              // the ramp is beyond the lead
        (hm(7.0, 58.0) + 40.0, 0, 0.0, 100_000.0), // one lead before it: woken
        (hm(8.0, 6.0), 0, 0.0, 0.0),               // a holiday at zero: not woken,
        (hm(8.0, 8.0) + 40.0, 0, 0.0, 0.0),        // not even for the next rise
        (
            hm(8.0, 8.0) + 40.0,
            4,
            0.0,
            500_000.0 * level(0.0, 100_000.0),
        ), // serving
        (
            hm(8.0, 8.0) + 40.0,
            4,
            50_000.0,
            500_000.0 * level(50_000.0, 100_000.0),
        ),
        (hm(8.0, 8.0) + 40.0, 4, 400_000.0, 750_000.0), // a spike: at most 1.5x
    ];
    for (clock, current, rate, want) in cases {
        let (rate, want): (f64, f64) = (rate, want);
        let mut p = after_a_morning(Pool::Prefill, 100_000.0, 500_000.0);
        let mut o = obs(current, |s| {
            s.prompt_rate = rate;
            s.prompt_rate_recent = rate;
            s.recent_span_s = 5.0;
        });
        o.unix_time = Some(DAY + clock);
        let d = p.decide(DAY + clock, &o);
        let load = p.last_load().expect("sized");
        assert!(
            (load.forecast - want.max(rate)).abs() < 1.0,
            "{clock} {current}: {load:?}"
        );
        if current == 0 {
            // An idle pool at zero is woken only for the ramp, at its planning rate.
            let need = (want / unit).ceil() as u32;
            assert_eq!((d.desired, d.active), (need, need > 0), "{clock}: {d:?}");
        }
    }
}

#[test]
fn regression_a_pool_idle_all_night_was_not_woken_for_its_morning() {
    // Idle past its grace since 07:00 (the whole night, as far as the policy knows),
    // at zero, where the source has no span and no start-up to measure: the season
    // wakes it once the 08:00 ramp is within the longest start-up seen (at least the
    // default 60 s) and 30 s of actuation, and not before.
    for (startup, wake) in [(None, 90.0), (Some(120.0), 150.0)] {
        let mut p = after_a_morning(Pool::Prefill, 100_000.0, 100_000.0);
        let mut o = obs(2, |_| {});
        o.measured_startup_s = startup;
        p.decide(DAY + 6.0 * 3600.0, &o);
        let mut woke = None;
        let mut t = DAY + 7.0 * 3600.0;
        while t < DAY + 8.0 * 3600.0 {
            let mut o = obs(0, |_| {});
            o.unix_time = Some(t);
            let d = p.decide(t, &o);
            if d.active && woke.is_none() {
                woke = Some((t - DAY, d));
            }
            t += 5.0;
        }
        let (at, d) = woke.expect("woken before 08:00");
        assert_eq!(at, 8.0 * 3600.0 - wake, "{startup:?}: {d:?}");
        assert!(d.desired >= 7, "{d:?}");
    }
}

#[test]
fn a_season_is_learnt_from_what_the_pool_sees() {
    // One morning lived tick by tick (07:50-08:10), then the next day at 07:58:40; with
    // the season off, the same morning leaves the pool at zero.
    for (period, woken) in [(86_400.0, true), (0.0, false)] {
        let mut p = PreheatPolicy::new(
            Pool::Prefill,
            PoolPolicy {
                season_period_s: period,
                ..PoolPolicy::default()
            },
            Profile::default(),
        );
        let mut t = 7.0 * 3600.0 + 50.0 * 60.0;
        while t <= 8.0 * 3600.0 + 10.0 * 60.0 {
            let rate = if t >= 8.0 * 3600.0 { 100_000.0 } else { 0.0 };
            let mut o = obs(4, |s| {
                s.prompt_rate = rate;
                s.prompt_rate_recent = rate;
                s.recent_span_s = 5.0;
            });
            o.unix_time = Some(t);
            p.decide(t, &o);
            t += 5.0;
        }
        let mut o = obs(0, |_| {});
        let morning = DAY + 7.0 * 3600.0 + 58.0 * 60.0 + 40.0;
        o.unix_time = Some(morning);
        let d = p.decide(morning, &o);
        if woken {
            assert!(d.desired >= 7 && d.active, "{d:?}");
        } else {
            assert_eq!((d.desired, d.active), (0, false), "{d:?}");
        }
    }
}

#[test]
fn a_season_wakes_the_decode_pool_before_its_ramp() {
    // Yesterday generated 20k tokens/s from 08:00: at 50 ms ITL (45 ms planned) that is
    // 900 sequences, over one replica's batch at that ITL.
    let mut p = after_a_morning(Pool::Decode, 20_000.0, 20_000.0);
    let mut o = obs(0, |s| s.recent_span_s = 5.0);
    let morning = DAY + 7.0 * 3600.0 + 58.0 * 60.0 + 40.0;
    o.unix_time = Some(morning);
    let d = p.decide(morning, &o);
    let batch = Profile::default().max_batch_at(0.045);
    let need = (20_000.0 * 0.045 / batch).ceil() as u32;
    assert!(need >= 1);
    assert_eq!((d.desired, d.active), (need, true), "{d:?}");
}

#[test]
fn season_settings_are_checked_with_the_rest() {
    let cfg = PoolPolicy {
        season_period_s: 7.0 * DAY,
        season_bucket_s: 300.0,
        max_replicas: 0,
        ..PoolPolicy::default()
    };
    let e = cfg.validate("prefill").join("\n");
    assert!(e.contains("max_replicas must be > 0"), "{e}");
    assert!(
        e.contains("prefill: season_period_s / season_bucket_s must be at most 2000"),
        "{e}"
    );
    let weekly = PoolPolicy {
        season_period_s: 7.0 * DAY,
        season_bucket_s: 600.0,
        ..PoolPolicy::default()
    };
    assert!(weekly.validate("decode").is_empty());
}

#[test]
fn regression_a_pool_at_zero_woke_at_the_size_of_its_last_busy_window() {
    // Ten minutes of 100k tokens/s on eight replicas, then a night at zero, where the
    // source has no span: the hindsight window recorded nothing there and kept the
    // evening, so the morning's first held request woke ten replicas, not one.
    let mut p = policy(Pool::Prefill);
    for i in 0..120 {
        let o = obs(8, |s| {
            s.prompt_rate = 100_000.0;
            s.prompt_rate_recent = 100_000.0;
            s.recent_span_s = 5.0;
        });
        p.decide(f64::from(i) * 5.0, &o);
    }
    let mut t = 600.0;
    while t < 36_000.0 {
        p.decide(t, &obs(0, |_| {}));
        t += 5.0;
    }
    let mut o = obs(0, |_| {});
    o.held_requests = 1.0;
    let d = p.decide(36_000.0, &o);
    assert_eq!((d.desired, d.active), (1, true), "{d:?}");
}
