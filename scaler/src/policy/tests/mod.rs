use super::*;

/// `current` replicas, each answering with a second reading (a rate over a 1 s span;
/// none at zero, as a scrape source reports a pool with nothing to read).
fn obs(current: u32, f: impl FnOnce(&mut PoolSignals)) -> Observation {
    let mut s = PoolSignals {
        endpoints_ok: current as usize,
        recent_span_s: if current > 0 { 1.0 } else { 0.0 },
        ..PoolSignals::default()
    };
    f(&mut s);
    Observation {
        signals: s,
        current,
        ..Observation::default()
    }
}

fn policy(pool: Pool) -> PreheatPolicy {
    PreheatPolicy::new(
        pool,
        PoolPolicy {
            scale_down_stabilization_s: 60.0,
            idle_grace_s: 100.0,
            ..PoolPolicy::default()
        },
        Profile::default(),
    )
}

mod decode;
mod forecast;
mod prefill;
mod scale_down;
mod schedule;
mod season;

#[test]
fn a_policy_key_is_one_a_config_file_spells() {
    for key in ["headroom", "schedule", "max_replicas", "season_period_s"] {
        assert!(PoolPolicy::has_key(key), "{key}");
    }
    for key in [
        "endpoints",
        "selector",
        "deployment",
        "metrics_port",
        "Headroom",
        "",
    ] {
        assert!(!PoolPolicy::has_key(key), "{key}");
    }
}
