//! A restarted scaler reads what its policy learnt back from Prometheus.

use super::*;

async fn fake_prometheus(history: History) -> String {
    use axum::extract::Query;
    use serde_json::json;
    use std::collections::BTreeMap;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = Router::new()
        .route(
            "/api/v1/query",
            get(|Query(q): Query<BTreeMap<String, String>>| async move {
                let q = &q["query"];
                let v = if q.starts_with("count(") {
                    Some("1")
                } else if q.contains("prompt_tokens_total") {
                    // The window's rate, its peak and the latest: all the same.
                    Some("100000")
                } else {
                    None
                };
                let result = match v {
                    Some(v) => json!([{"metric": {}, "value": [1.7e9, v]}]),
                    None => json!([]),
                };
                axum::Json(json!({"status": "success",
                    "data": {"resultType": "vector", "result": result}}))
            }),
        )
        .route(
            "/api/v1/query_range",
            get(
                move |Query(q): Query<BTreeMap<String, String>>| async move {
                    let (start, end): (f64, f64) =
                        (q["start"].parse().unwrap(), q["end"].parse().unwrap());
                    let step: f64 = q["step"].parse().unwrap();
                    let prompts = q["query"].contains("prompt_tokens_total");
                    let mut values = Vec::new();
                    let mut t = start;
                    while history != History::None && prompts && t <= end {
                        let v = match history {
                            History::Burst if (end - t - 300.0).abs() < step / 2.0 => "400000",
                            // Each point is the bucket before it: the one holding this
                            // time of day yesterday ends at start + 300.
                            History::Ramp if step == 300.0 && t > start + 300.0 => "1000000",
                            _ => "100000",
                        };
                        values.push(json!([t, v]));
                        t += step;
                    }
                    axum::Json(json!({"status": "success", "data": {"resultType": "matrix",
                    "result": [{"metric": {}, "values": values}]}}))
                },
            ),
        );
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

/// The prefill pool's first decision from a scaler reading `prometheus`.
async fn first_prefill_decision(prometheus: &str, prefill: &str) -> i64 {
    let mut scaler = Running::start(&[
        "interval_s=5".into(),
        format!("prometheus_url={prometheus}"),
        format!(
            "models=[{{name: llama, prefill: {{prometheus_selector: 'pool=\"prefill\"'{prefill}}}, decode: {{prometheus_selector: 'pool=\"decode\"'}}}}]"
        ),
    ])
    .await;
    let d = wait_for_async("a decision", Duration::from_secs(10), async || {
        Some(desired(&mut scaler.client, "prefill").await).filter(|d| *d >= 0)
    })
    .await;
    scaler.stop().await;
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_scaler_reads_its_hindsight_window_back_from_prometheus() {
    // 100k tokens/s of 2k-token prompts on replicas of 16k tokens/s, and five minutes
    // ago a 5 s burst of 2M tokens. Read back, the window holds the burst, and the pool
    // is sized at once to have drained it within the SLO (about 27 replicas). Without
    // the history the first tick knows one scrape interval of steady load (about 9).
    let seeded = first_prefill_decision(&fake_prometheus(History::Burst).await, "").await;
    assert!(seeded >= 20, "the burst in the read-back window: {seeded}");
    let fresh = first_prefill_decision(&fake_prometheus(History::None).await, "").await;
    assert!((7..=10).contains(&fresh), "no history: {fresh}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_scaler_reads_its_season_back_from_prometheus() {
    // Yesterday at this time the pool took 100k tokens/s as now, and 1M from the next
    // five-minute bucket on. Read back, the season sizes the pool for the ramp one
    // lead ahead (a 5-minute lead reaches the next bucket whatever the clock):
    // 1M / (16k x 0.85) is past the 64-replica limit. Without it, 7-10 as above.
    let lead = ", default_lead_s: 300";
    let seasoned = first_prefill_decision(&fake_prometheus(History::Ramp).await, lead).await;
    assert_eq!(seasoned, 64, "the ramp yesterday");
    let off = ", default_lead_s: 300, season_period_s: 0";
    let fresh = first_prefill_decision(&fake_prometheus(History::Ramp).await, off).await;
    assert!(fresh < 20, "no season: {fresh}");
}
