//! What an observing decode scaler sees during a run: the engine's ITL and token rate
//! as they come, and KV reserved for prompts still in prefill.

use super::*;

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
