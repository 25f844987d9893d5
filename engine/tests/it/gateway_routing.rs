//! A gateway in-process in front of real in-process workers: how it spreads requests.

use std::time::{Duration, Instant};

use preheat_engine::colocated::ServeOptions;
use preheat_engine::disagg::gateway::{self, GatewayOptions};
use preheat_engine::disagg::protocol::WorkerRole;
use preheat_engine::disagg::worker::{self, WorkerOptions};
use preheat_engine::metrics::Role;
use serde_json::Value;

use super::server::{listen, metric_sum, scrape};

/// A worker of `role` registering with `gateway` and reporting its load every second,
/// as in the field, with 8 MiB of KV cache.
fn start_worker(
    role: WorkerRole,
    listener: tokio::net::TcpListener,
    url: &str,
    gateway: &str,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<preheat_engine::Result<()>> {
    start_worker_with_kv(role, listener, url, gateway, stop, 8 << 20)
}

fn start_worker_with_kv(
    role: WorkerRole,
    listener: tokio::net::TcpListener,
    url: &str,
    gateway: &str,
    stop: tokio::sync::watch::Receiver<bool>,
    kv_cache_bytes: usize,
) -> tokio::task::JoinHandle<preheat_engine::Result<()>> {
    let model = preheat_testkit::model_fixture("llama-tiny");
    let mut serve = ServeOptions::new(model, listener.local_addr().unwrap());
    serve.kv_cache_bytes = kv_cache_bytes;
    serve.role = match role {
        WorkerRole::Prefill => Role::Prefill,
        WorkerRole::Decode => Role::Decode,
    };
    let opts = WorkerOptions {
        serve,
        role,
        gateway: Some(gateway.to_owned()),
        advertise: url.to_owned(),
        heartbeat: Duration::from_secs(1),
        transfer_timeout: Duration::from_secs(10),
        kv_listener: None,
    };
    let mut stop = stop;
    tokio::spawn(worker::run(listener, opts, async move {
        let _ = stop.wait_for(|s| *s).await;
    }))
}

/// Two prefill and two decode workers reporting their load every second: eight requests
/// sent at once must not all go to the pair that looked emptiest at the last report.
/// The gateway routed on the reports alone, so every request between two heartbeats
/// went to one decode worker and one prefill worker while the others idled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_requests_between_two_load_reports_all_went_to_one_worker() {
    let model = preheat_testkit::model_fixture("llama-tiny");
    let info = gateway::model_info(&model, 16, Some("tiny")).unwrap();
    let (gl, gw_url) = listen().await;
    let (gil, gw_internal) = listen().await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut gw_stop = stop_rx.clone();
    let gw_task = tokio::spawn(gateway::run(
        gl,
        Some(gil),
        GatewayOptions {
            model: Some(info),
            ..GatewayOptions::default()
        },
        async move {
            let _ = gw_stop.wait_for(|s| *s).await;
        },
    ));
    let mut workers = Vec::new();
    let mut urls = Vec::new();
    for role in [
        WorkerRole::Prefill,
        WorkerRole::Prefill,
        WorkerRole::Decode,
        WorkerRole::Decode,
    ] {
        let (l, url) = listen().await;
        workers.push(start_worker(role, l, &url, &gw_internal, stop_rx.clone()));
        urls.push((role, url));
    }
    let c = reqwest::Client::new();
    // All four registered and reporting (decode workers with their KV size), and both
    // decode workers told of both prefill workers.
    let t0 = Instant::now();
    loop {
        let ok = match c
            .get(format!("{gw_internal}/internal/workers"))
            .send()
            .await
        {
            Ok(r) => {
                let v: Value = r.json().await.unwrap_or_default();
                let list = v["workers"].as_array().cloned().unwrap_or_default();
                list.len() == 4
                    && list.iter().filter(|w| w["role"] == "decode").all(|w| {
                        w["prefill_peers"] == 2 && w["load"]["kv_blocks"].as_u64() > Some(0)
                    })
            }
            Err(_) => false,
        };
        if ok {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the workers never all registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Distinct prompts (no shared prefix to follow), long enough to be disaggregated.
    let sends = (0..8u32).map(|i| {
        let c = c.clone();
        let url = format!("{gw_url}/v1/completions");
        async move {
            let prompt: Vec<u32> = (0..64).map(|t| 1 + (i * 97 + t * 13) % 200).collect();
            let r = c
                .post(url)
                .json(&serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        }
    });
    futures_util::future::join_all(sends).await;
    let mut served = Vec::new();
    for (role, url) in &urls {
        let m = scrape(&c, url).await;
        let n = match role {
            // Prompts prefilled there, 64 tokens each.
            WorkerRole::Prefill => metric_sum(&m, "vllm:prompt_tokens_total") / 64.0,
            WorkerRole::Decode => metric_sum(&m, "vllm:request_success_total"),
        };
        served.push((*role, n));
    }
    eprintln!("requests per worker: {served:?}");
    for (role, n) in &served {
        assert!(
            *n >= 2.0,
            "a {role:?} worker served {n} of 8 requests sent at once: {served:?}"
        );
    }
    stop_tx.send(true).unwrap();
    for w in workers {
        w.await.unwrap().unwrap();
    }
    gw_task.await.unwrap().unwrap();
}

/// A decode worker with no room to reserve for a prompt's K/V answers 429, and the
/// gateway passed that to the client although another decode worker had room: a
/// request failed that the pool could serve. Now it goes to another decode worker,
/// and only a pool with no other decode worker answers 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_a_decode_worker_without_room_failed_a_request_another_could_take() {
    let model = preheat_testkit::model_fixture("llama-tiny");
    let info = gateway::model_info(&model, 16, Some("tiny")).unwrap();
    let (gl, gw_url) = listen().await;
    let (gil, gw_internal) = listen().await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut gw_stop = stop_rx.clone();
    let gw_task = tokio::spawn(gateway::run(
        gl,
        Some(gil),
        GatewayOptions {
            model: Some(info),
            ..GatewayOptions::default()
        },
        async move {
            let _ = gw_stop.wait_for(|s| *s).await;
        },
    ));
    // One prefill worker; a decode worker with room and one whose cache is one block.
    let mut workers = Vec::new();
    let mut tiny = String::new();
    for (role, kv) in [
        (WorkerRole::Prefill, 8 << 20),
        (WorkerRole::Decode, 8 << 20),
        (WorkerRole::Decode, 1),
    ] {
        let (l, url) = listen().await;
        if kv == 1 {
            tiny.clone_from(&url);
        }
        workers.push(start_worker_with_kv(
            role,
            l,
            &url,
            &gw_internal,
            stop_rx.clone(),
            kv,
        ));
    }
    let c = reqwest::Client::new();
    let t0 = Instant::now();
    loop {
        let v: Value = match c
            .get(format!("{gw_internal}/internal/workers"))
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => Value::Null,
        };
        let list = v["workers"].as_array().cloned().unwrap_or_default();
        if list.len() == 3
            && list
                .iter()
                .filter(|w| w["role"] == "decode")
                .all(|w| w["prefill_peers"] == 1 && w["load"]["kv_blocks"].as_u64() > Some(0))
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the workers never all registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Prompts of 4 blocks, sent at once: the gateway counts each in its decode
    // worker's KV until it ends, so while one is at the larger worker the next goes
    // to the emptier, smaller one, whatever the order of ties.
    let sends = (0..6u32).map(|i| {
        let c = c.clone();
        let url = format!("{gw_url}/v1/completions");
        async move {
            let prompt: Vec<u32> = (0..64).map(|t| 1 + (i * 97 + t * 13) % 200).collect();
            let r = c
                .post(url)
                .json(&serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "request {i}: {}", r.text().await.unwrap_or_default());
        }
    });
    futures_util::future::join_all(sends).await;
    let refused = metric_sum(&scrape(&c, &tiny).await, "preheat:requests_rejected_total");
    assert!(refused >= 1.0, "the small decode worker was never tried");
    stop_tx.send(true).unwrap();
    for w in workers {
        w.await.unwrap().unwrap();
    }
    gw_task.await.unwrap().unwrap();
}
