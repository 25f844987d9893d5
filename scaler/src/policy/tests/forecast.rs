//! The forecast one lead ahead, headroom and the load view.

use super::*;

#[test]
fn forecast_adds_capacity_ahead_of_a_ramp() {
    let mut ramp = policy(Pool::Prefill);
    let mut flat = policy(Pool::Prefill);
    let mut d_ramp = 0;
    let mut d_flat = 0;
    for t in 0..120 {
        d_ramp = ramp
            .decide(
                t as f64,
                &obs(d_ramp, |s| s.prompt_rate = 1_000.0 + 500.0 * t as f64),
            )
            .desired;
        d_flat = flat
            .decide(t as f64, &obs(d_flat, |s| s.prompt_rate = 60_500.0))
            .desired;
    }
    assert!(
        d_ramp > d_flat,
        "a ramp ending at the same rate needs more ahead: {d_ramp} vs {d_flat}"
    );
}

#[test]
fn regression_a_first_scrape_read_as_zero_load_forecast_a_ramp() {
    // Seven replicas at a steady 42k prompt tokens/s, watched by a scaler that has just
    // started: its first scrape has no interval, so every rate reads 0. Taken as a
    // reading, the forecast saw 0 → 42k as a ramp and expected more one lead ahead
    // (44.5k here at 5 s; in the simulated steady hour, whose first 5 s brought 63k,
    // 58–70k for half a minute: 11 prefill replicas held for a stabilisation window
    // where 7 served).
    for pool in [Pool::Prefill, Pool::Decode] {
        let mut p = policy(pool);
        let mut o = obs(7, |s| s.recent_span_s = 0.0);
        o.measured_startup_s = Some(20.0);
        p.decide(0.0, &o);
        for i in 1..=6 {
            let t = f64::from(i) * 5.0;
            let mut o = obs(7, |s| {
                s.prompt_rate = 42_000.0;
                s.prompt_rate_recent = 42_000.0;
                s.generation_rate = 4_200.0;
                s.running = 40.0;
                s.recent_span_s = 5.0;
            });
            o.measured_startup_s = Some(20.0);
            let d = p.decide(t, &o);
            let load = p.last_load().expect("sized");
            assert!(
                load.forecast <= load.observed * 1.001,
                "{pool:?} at {t} s: {load:?} {d:?}"
            );
        }
    }
}

#[test]
fn headroom_scales_the_replicas_the_load_needs_and_must_be_positive() {
    let desired = |headroom: f64| {
        let mut p = PreheatPolicy::new(
            Pool::Prefill,
            PoolPolicy {
                headroom,
                ..PoolPolicy::default()
            },
            Profile::default(),
        );
        let mut o = obs(0, |s| s.prompt_rate = 100_000.0);
        o.measured_startup_s = Some(2.0);
        p.decide(0.0, &o).desired
    };
    let (one, two) = (desired(1.0), desired(2.0));
    assert!(one >= 2, "{one}");
    assert!((2 * one - 1..=2 * one).contains(&two), "{one} → {two}");
    for bad in [0.0, -1.0, f64::NAN] {
        let p = PoolPolicy {
            headroom: bad,
            ..PoolPolicy::default()
        };
        assert!(
            p.validate("prefill")
                .iter()
                .any(|e| e.contains("headroom must be > 0")),
            "{bad}"
        );
    }
}

#[test]
fn the_load_view_shows_the_need_with_headroom() {
    let need = |headroom: f64| {
        let mut p = PreheatPolicy::new(
            Pool::Prefill,
            PoolPolicy {
                headroom,
                ..PoolPolicy::default()
            },
            Profile::default(),
        );
        let mut o = obs(0, |s| s.prompt_rate = 100_000.0);
        o.measured_startup_s = Some(2.0);
        p.decide(0.0, &o);
        p.last_load().unwrap().needed
    };
    let (one, two) = (need(1.0), need(2.0));
    assert!(one > 1.0 && (two - 2.0 * one).abs() < 1e-9, "{one} {two}");
}
