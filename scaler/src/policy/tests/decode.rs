//! The decode pool's size: concurrency, KV pressure, ITL.

use super::*;

#[test]
fn decode_sizes_from_concurrency_and_kv() {
    let mut p = policy(Pool::Decode);
    let d = p.decide(0.0, &obs(1, |s| s.running = 500.0));
    // ITL SLO 50 ms → 0.9 × 50 = 45 ms → batch ~230 per replica.
    assert!((2..=3).contains(&d.desired), "{d:?}");
    let mut p = policy(Pool::Decode);
    let d = p.decide(
        0.0,
        &obs(4, |s| {
            s.running = 40.0;
            s.kv_usage = 0.95;
        }),
    );
    assert!(d.desired >= 5, "KV pressure must add replicas: {d:?}");
}

/// Four replicas' caches 80% in use, of which 65 points are blocks reserved for
/// requests still queued at prefill: decode needs what its running sequences hold
/// (15 points), where it read the whole 80 and sized for it. Past the target (85%)
/// reservations count again: a full cache refuses the next one.
#[test]
fn regression_requests_waiting_for_prefill_read_as_decode_kv_pressure() {
    let needed = |usage: f64, reserved: f64| {
        let mut p = policy(Pool::Decode);
        let d = p.decide(
            0.0,
            &obs(4, |s| {
                s.running = 4.0;
                s.kv_usage = usage;
                s.kv_reserved = reserved;
            }),
        );
        (p.last_load().expect("a decode need").needed, d.desired)
    };
    let (all, _) = needed(0.80, 0.0);
    let (own, _) = needed(0.80, 0.65);
    assert!((all - 4.0 * 0.80 / 0.85).abs() < 1e-9, "{all}");
    assert!((own - 4.0 * 0.15 / 0.85).abs() < 1e-9, "{own}");
    // A cache past the target adds replicas, whatever holds it.
    let (full, desired) = needed(0.95, 0.80);
    assert!((full - 4.0 * 0.95 / 0.85).abs() < 1e-9, "{full}");
    assert!(desired >= 5, "{desired}");
}

#[test]
fn slo_violations_raise_replicas_while_a_queue_persists() {
    let queued = |p90: Option<f64>, backlog: f64| {
        let mut p = policy(Pool::Prefill);
        let mut o = obs(1, |s| {
            s.prompt_rate = 20_000.0;
            s.queued_prompt_tokens = backlog;
            s.ttft_p90 = p90;
        });
        o.measured_startup_s = Some(2.0);
        p.decide(0.0, &o).desired
    };
    let base = queued(None, 3_000_000.0);
    // 3× over the SLO with a real queue: the modelled need × 1.5 (the cap).
    let raised = queued(Some(6.0), 3_000_000.0);
    assert!(raised as f64 >= 1.4 * base as f64, "{base} → {raised}");
    // The same latency with the queue gone is history: no correction.
    assert_eq!(queued(Some(6.0), 0.0), queued(None, 0.0));
}
