use super::*;

const DAY: f64 = 86_400.0;

/// A day at `rate(t)` read every 5 s.
fn live(s: &mut Season, from: f64, to: f64, rate: impl Fn(f64) -> f64) {
    let mut t = from;
    while t <= to {
        s.record(t, rate(t), 5.0);
        t += 5.0;
    }
}

fn morning(t: f64) -> f64 {
    // Idle at night, 1,000 tokens/s from 08:00.
    if (t % DAY) >= 8.0 * 3600.0 {
        1000.0
    } else {
        0.0
    }
}

#[test]
fn yesterdays_ramp_is_expected_one_horizon_ahead() {
    let mut s = Season::new(DAY, 300.0).expect("season");
    live(&mut s, 0.0, DAY, morning);
    // 07:58 on day two: the 08:00 ramp is within a 5-minute horizon, not within 1 s.
    let at = DAY + 8.0 * 3600.0 - 120.0;
    let o = s.outlook(at, 300.0).expect("learnt");
    assert_eq!(o.now, Some(0.0));
    assert!((o.ahead - 1000.0).abs() < 1e-6, "{o:?}");
    let o = s.outlook(at, 1.0).expect("learnt");
    assert_eq!(o.ahead, 0.0, "{o:?}");
}

#[test]
fn nothing_is_expected_before_a_bucket_is_learnt() {
    let mut s = Season::new(DAY, 300.0).expect("season");
    assert_eq!(s.outlook(1000.0, 600.0), None);
    // A bucket is learnt when the clock leaves it, and only when mostly seen.
    live(&mut s, 200.0, 290.0, |_| 10.0);
    live(&mut s, 300.0, 305.0, |_| 10.0);
    assert_eq!(s.outlook(DAY + 100.0, 600.0), None, "a third of a bucket");
    live(&mut s, 310.0, 600.0, |_| 10.0);
    assert!(s.outlook(DAY + 400.0, 0.0).is_some());
}

#[test]
fn a_changed_day_takes_over_within_a_few_periods() {
    let mut s = Season::new(DAY, 300.0).expect("season");
    live(&mut s, 0.0, DAY, |_| 100.0);
    for d in 1..=4 {
        let d = f64::from(d);
        live(&mut s, d * DAY, (d + 1.0) * DAY, |_| 1000.0);
    }
    let o = s.outlook(5.0 * DAY + 3600.0, 0.0).expect("learnt");
    // 100 → 1000 blended by halves over four days: 943.75.
    assert!((o.ahead - 943.75).abs() < 1.0, "{o:?}");
}

#[test]
fn a_pool_at_zero_learns_its_quiet_hours_and_a_ramp_with_no_bucket_before_it_counts() {
    // At zero the source has no span: the readings still count from the last one.
    let mut s = Season::new(DAY, 300.0).expect("season");
    let mut t = 7.0 * 3600.0;
    while t <= 8.0 * 3600.0 + 600.0 {
        let (rate, span) = if t >= 8.0 * 3600.0 {
            (900.0, 5.0)
        } else {
            (0.0, 0.0)
        };
        s.record(t, rate, span);
        t += 5.0;
    }
    let o = s
        .outlook(DAY + 7.0 * 3600.0 + 58.0 * 60.0, 300.0)
        .expect("learnt");
    assert_eq!((o.now, o.ahead), (Some(0.0), 900.0));
    // Seeded without the quiet bucket (Prometheus has no points for no pods): the
    // ramp ahead still counts, with nothing to compare now with.
    let mut seeded = Season::new(DAY, 300.0).expect("season");
    seeded.seed(DAY, &[(8.0 * 3600.0 + 300.0, 900.0)]);
    let o = seeded
        .outlook(DAY + 7.0 * 3600.0 + 58.0 * 60.0, 300.0)
        .expect("ahead");
    assert_eq!((o.now, o.ahead), (None, 900.0));
    // Readings out of order or not numbers are skipped, not counted backwards.
    let before = s.clone();
    s.record(10.0, 5.0, 5.0);
    s.record(f64::NAN, 5.0, 5.0);
    assert_eq!(format!("{before:?}"), format!("{s:?}"));
}

#[test]
fn a_week_is_told_apart_by_day() {
    let week = 7.0 * DAY;
    let mut s = Season::new(week, 600.0).expect("season");
    // The Unix epoch was a Thursday: busy for five days from Thursday 00:00 UTC,
    // idle on the two after (a weekend, shifted to the epoch's week).
    live(
        &mut s,
        0.0,
        week,
        |t| if t < 5.0 * DAY { 500.0 } else { 0.0 },
    );
    let busy_noon = week + 0.5 * DAY;
    let idle_noon = week + 6.5 * DAY;
    assert_eq!(s.outlook(busy_noon, 0.0).map(|o| o.ahead), Some(500.0));
    assert_eq!(s.outlook(idle_noon, 0.0).map(|o| o.ahead), Some(0.0));
}

#[test]
fn seeded_buckets_come_from_the_bucket_before_each_reading_and_are_bounded() {
    let mut s = Season::new(DAY, 300.0).expect("season");
    let now = 10.0 * DAY;
    let points = [
        // The bucket 09:00-09:05 of yesterday, read at 09:05.
        (now - DAY + 9.0 * 3600.0 + 300.0, 700.0),
        (now - 2.0 * DAY, 9.0),  // older than a period
        (now + 60.0, 9.0),       // in the future
        (now - 600.0, f64::NAN), // not a number
        (now - 900.0, -1.0),     // negative
    ];
    assert_eq!(s.seed(now, &points), 1);
    let o = s.outlook(now + 9.0 * 3600.0 + 10.0, 0.0).expect("seeded");
    assert_eq!(o.now, Some(700.0));
    // Seeds never overwrite what was learnt.
    assert_eq!(s.seed(now, &points[..1]), 0);
}

#[test]
fn a_restored_season_expects_what_the_saved_one_did_and_goes_on_filling_its_bucket() {
    let mut s = Season::new(DAY, 300.0).expect("season");
    live(&mut s, 0.0, DAY + 150.0, morning);
    let st = s.state();
    // Through the state file's encoding, as a restarted scaler reads it.
    let st: SeasonState = serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
    let mut r = Season::new(DAY, 300.0).expect("season");
    assert_eq!(r.restore(&st, DAY + 160.0).map(|r| r.buckets), Ok(288));
    let at = DAY + 8.0 * 3600.0 - 120.0;
    assert_eq!(r.outlook(at, 300.0), s.outlook(at, 300.0));
    // The bucket saved half-read goes on filling across the restart (a gap counts
    // as skipped readings) and is learnt when the clock leaves it.
    live(&mut s, DAY + 160.0, DAY + 400.0, |_| 50.0);
    live(&mut r, DAY + 160.0, DAY + 400.0, |_| 50.0);
    assert_eq!(r.state(), s.state());
}

#[test]
fn a_saved_season_that_does_not_fit_is_refused_whole_by_reason() {
    let mut s = Season::new(DAY, 300.0).expect("season");
    live(&mut s, 0.0, 3600.0, |_| 10.0);
    let good = s.state();
    let mut other = Season::new(DAY, 600.0).expect("season");
    let e = other.restore(&good, 4000.0).unwrap_err();
    assert!(e.contains("600 s buckets") || e.contains("of 600 s"), "{e}");
    let mut short = good.clone();
    short.learnt.pop();
    let mut bad_rate = good.clone();
    bad_rate.learnt[3] = Some(-1.0);
    for (st, want) in [(short, "287 buckets"), (bad_rate, "bucket 3")] {
        let mut r = Season::new(DAY, 300.0).expect("season");
        let e = r.restore(&st, 4000.0).unwrap_err();
        assert!(e.contains(want), "{e}");
        assert_eq!(r.outlook(1000.0, 0.0), None, "nothing taken from {want}");
    }
    // A bucket being filled that is not readings is dropped, the learnt ones kept.
    let mut bad_fill = good.clone();
    bad_fill.filling = Some(Filling {
        bucket: 12,
        sum: 1.0,
        secs: f64::NAN,
    });
    let mut r = Season::new(DAY, 300.0).expect("season");
    let learnt = good.learnt.iter().flatten().count();
    assert_eq!(
        r.restore(&bad_fill, 4000.0),
        Ok(Restored {
            buckets: learnt,
            filling_s: 0.0
        })
    );
    // Saved by a clock ahead of this one: the learnt buckets stand, the reading
    // time and the bucket being filled are dropped, so this run's readings count.
    let mut r = Season::new(DAY, 300.0).expect("season");
    assert_eq!(r.restore(&good, 1000.0).map(|r| r.buckets), Ok(learnt));
    assert_eq!((r.state().filling, r.state().last_unix), (None, None));
    r.record(1005.0, 10.0, 5.0);
    assert_eq!(r.state().last_unix, Some(1005.0));
}

#[test]
fn regression_a_bucket_read_past_its_length_made_the_scaler_refuse_its_own_state() {
    // Each reading covers the time since the last one, across a bucket's start: a
    // tick at 299.0 then jittered ones from 300.5 to 599.9 fill bucket 1 with 300.9 s.
    // Saved then, the state was refused whole on restart (and overwritten).
    let mut s = Season::new(DAY, 300.0).expect("season");
    live(&mut s, 0.0, 295.0, |_| 10.0);
    s.record(299.0, 10.0, 5.0);
    let mut t = 300.5;
    while t < 599.0 {
        s.record(t, 10.0, 5.0);
        t += 5.0;
    }
    s.record(599.9, 10.0, 5.0);
    let st = s.state();
    let secs = st.filling.expect("filling").secs;
    assert!(secs > 300.0, "{secs}");
    let mut r = Season::new(DAY, 300.0).expect("season");
    let got = r.restore(&st, 600.0).expect("its own state");
    assert_eq!(got.buckets, 1);
    assert!((got.filling_s - secs).abs() < 1e-9, "{got:?}");
}

#[test]
fn readings_from_while_the_scaler_was_down_update_what_it_resumed() {
    // Resumed at 09:00 from a save at 08:00 that had learnt 100 for every bucket;
    // Prometheus has 500 for 08:30-08:35 (after the save) and 900 for 07:30-07:35
    // (before it, which the saved blend already holds).
    let mut s = Season::new(DAY, 300.0).expect("season");
    let mut st = s.state();
    st.learnt = vec![Some(100.0); 288];
    st.last_unix = Some(8.0 * 3600.0);
    let now = 9.0 * 3600.0;
    s.restore(&st, now).expect("restored");
    let after = 8.5 * 3600.0 + 300.0;
    let before = 7.5 * 3600.0 + 300.0;
    assert_eq!(s.seed(now, &[(after, 500.0), (before, 900.0)]), 1);
    let at = |u: f64| s.outlook(u, 0.0).and_then(|o| o.now);
    assert_eq!(
        at(DAY + 8.5 * 3600.0 + 10.0),
        Some(300.0),
        "blended by halves"
    );
    assert_eq!(at(DAY + 7.5 * 3600.0 + 10.0), Some(100.0), "kept");
}

#[test]
fn a_resumed_bucket_under_way_is_not_also_seeded_and_a_stale_one_is_dropped() {
    let mut s = Season::new(DAY, 300.0).expect("season");
    let mut st = s.state();
    // Saved at 08:02 with 08:00-08:05 part read; resumed at 08:10.
    st.last_unix = Some(8.0 * 3600.0 + 120.0);
    st.filling = Some(Filling {
        bucket: 96,
        sum: 1200.0,
        secs: 120.0,
    });
    let now = 8.0 * 3600.0 + 600.0;
    assert_eq!(s.restore(&st, now).map(|r| r.filling_s), Ok(120.0));
    // Prometheus's point for 08:00-08:05: left to the bucket's own readings.
    assert_eq!(s.seed(now, &[(8.0 * 3600.0 + 300.0, 50.0)]), 0);
    // A bucket under way more than a period old, or read for far longer than a
    // bucket, is not resumed.
    for (bucket, secs) in [(96 - 288, 120.0), (96, 601.0)] {
        st.filling = Some(Filling {
            bucket,
            sum: 1.0,
            secs,
        });
        let mut r = Season::new(DAY, 300.0).expect("season");
        assert_eq!(
            r.restore(&st, now).map(|r| r.filling_s),
            Ok(0.0),
            "{bucket} {secs}"
        );
    }
}

#[test]
fn bad_periods_are_refused_by_name() {
    assert!(problems(0.0, 0.0).is_empty(), "off");
    assert!(problems(DAY, 300.0).is_empty());
    assert!(Season::new(0.0, 300.0).is_none());
    for (p, b, want) in [
        (-1.0, 300.0, "season_period_s"),
        (f64::NAN, 300.0, "season_period_s"),
        (DAY, 10.0, "season_bucket_s"),
        (DAY, DAY, "season_bucket_s"),
        (28.0 * DAY, 600.0, "at most 2000"),
        (7.0 * DAY, 303.0, "dividing"),
        (DAY, 300.5, "whole seconds"),
    ] {
        let e = problems(p, b).join("; ");
        assert!(e.contains(want), "{p}/{b}: {e}");
        assert!(Season::new(p, b).is_none());
    }
}
