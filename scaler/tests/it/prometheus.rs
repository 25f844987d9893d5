//! The Prometheus source against a fake `/api/v1/query` endpoint: queries carry the
//! pool's selector and every engine's names, answers become signals, and an error or
//! a dead server makes the pool blind, never idle.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::routing::get;
use preheat_scaler::prom::PromSource;
use serde_json::{Value, json};

type Seen = Arc<Mutex<Vec<String>>>;

fn vector(v: Option<&str>) -> Value {
    let result = match v {
        Some(x) => json!([{"metric": {}, "value": [1_700_000_000.0, x]}]),
        None => json!([]),
    };
    json!({"status": "success", "data": {"resultType": "vector", "result": result}})
}

async fn query(
    State(seen): State<Seen>,
    Query(q): Query<BTreeMap<String, String>>,
) -> axum::Json<Value> {
    let q = q.get("query").cloned().unwrap_or_default();
    seen.lock().unwrap().push(q.clone());
    let answer = if q.contains("broken") {
        return axum::Json(
            json!({"status": "error", "errorType": "bad_data", "error": "parse error at char 7"}),
        );
    } else if q.starts_with("count(vllm:num_requests_running") {
        Some("3")
    } else if q.starts_with("sum(vllm:num_requests_waiting") {
        Some("12")
    } else if q.starts_with("sum(irate(vllm:prompt_tokens_total") {
        // The last two samples' rate, within the peak's range (tick 5 s + scrape 1 s).
        Some("7000")
    } else if q.starts_with("sum(rate(vllm:prompt_tokens_total") {
        Some("5000")
    } else if q.starts_with("max_over_time(sum(rate(vllm:prompt_tokens_total") {
        Some("9000")
    } else if q.starts_with("sum(rate(vllm:prefix_cache_queries_total") {
        Some("1000")
    } else if q.starts_with("sum(rate(vllm:prefix_cache_hits_total") {
        Some("250")
    } else if q.starts_with("sum by (le) (increase(vllm:time_to_first_token_seconds_bucket") {
        // 9 of 10 requests by 0.8 s: the 0.9 quantile is 0.8.
        let b = |le: &str, n: &str| json!({"metric": {"le": le}, "value": [1_700_000_000.0, n]});
        return axum::Json(json!({"status": "success", "data": {"resultType": "vector",
            "result": [b("+Inf", "10"), b("0.8", "9")]}}));
    } else if q.starts_with("avg(vllm:kv_cache_usage_perc") {
        Some("NaN")
    } else if q.starts_with("max(preheat:startup_phase_seconds") {
        Some("42")
    } else {
        None
    };
    axum::Json(vector(answer))
}

/// Two engines' names answering at once (`a or b`), one stale point outside the range
/// and one that is not a number.
async fn query_range(Query(q): Query<BTreeMap<String, String>>) -> axum::Json<Value> {
    let end: f64 = q["end"].parse().unwrap();
    let step: f64 = q["step"].parse().unwrap();
    assert!(q["query"].starts_with("sum(irate(vllm:prompt_tokens_total"));
    assert_eq!(end - q["start"].parse::<f64>().unwrap(), 20.0);
    let at = |back: f64, v: &str| json!([end - back * step, v]);
    axum::Json(
        json!({"status": "success", "data": {"resultType": "matrix", "result": [
            {"metric": {}, "values": [at(100.0, "1"), at(2.0, "1000"), at(1.0, "2000"), at(0.0, "NaN")]},
            {"metric": {}, "values": [at(1.0, "500"), at(0.0, "3000")]},
        ]}}),
    )
}

async fn fake() -> (String, Seen) {
    let seen = Seen::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = Router::new()
        .route("/api/v1/query", get(query))
        .route("/api/v1/query_range", get(query_range))
        .with_state(seen.clone());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (format!("http://{addr}/"), seen)
}

#[tokio::test]
async fn answers_become_pool_signals() {
    let (url, seen) = fake().await;
    let p = PromSource::new(reqwest::Client::new(), &url, 60.0, 5.0).with_scrape_interval(1.0);
    let (s, pods, startup) = p
        .pool_signals(r#"namespace="llm",pool="prefill""#, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(pods, 3);
    assert_eq!(s.endpoints_ok, 3);
    assert_eq!(s.waiting, 12.0);
    assert_eq!(s.prompt_rate, 5000.0);
    assert_eq!(s.prompt_rate_peak, 9000.0);
    assert_eq!(s.prompt_rate_recent, 7000.0);
    assert_eq!(
        s.recent_span_s, 1.0,
        "irate: the last two samples, a scrape apart"
    );
    assert_eq!(s.prefix_hit_rate, 0.25);
    assert_eq!(s.ttft_p90, Some(0.8));
    assert_eq!(s.kv_usage, 0.0, "NaN reads as absent");
    assert_eq!(s.itl_p90, None);
    assert_eq!(startup, Some(42.0));
    let seen = seen.lock().unwrap();
    assert!(
        seen.iter()
            .all(|q| q.contains(r#"namespace="llm",pool="prefill""#)),
        "{seen:?}"
    );
    // vLLM and SGLang names in one query, for either engine.
    assert!(
        seen.iter().any(|q| q.contains("vllm:num_requests_waiting")
            && q.contains(" or sum(sglang:num_queue_reqs"))
    );
    assert!(seen.iter().any(|q| q.contains("[60s]")));
}

#[tokio::test]
async fn recent_rates_come_back_per_tick_summed_over_names() {
    let (url, _) = fake().await;
    let p = PromSource::new(reqwest::Client::new(), &url, 60.0, 5.0);
    let points = p
        .recent_prompt_rates(r#"pool="prefill""#, 20.0, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(points, vec![(10.0, 1000.0), (5.0, 2500.0), (0.0, 3000.0)]);
}

#[tokio::test]
async fn errors_are_reported_not_read_as_idle() {
    let (url, _) = fake().await;
    let p = PromSource::new(reqwest::Client::new(), &url, 60.0, 5.0);
    let e = p
        .pool_signals("broken", Duration::from_secs(2))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("parse error at char 7"), "{e}");
    let dead = PromSource::new(reqwest::Client::new(), "http://127.0.0.1:9", 60.0, 5.0);
    assert!(
        dead.pool_signals("a=\"b\"", Duration::from_millis(500))
            .await
            .is_err()
    );
}
