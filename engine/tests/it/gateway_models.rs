//! One gateway, several models: the request's `model` picks one, each has its own
//! workers and held requests, and a model that cannot be read answers 503 while the
//! others serve.

use std::time::Duration;

use preheat_engine::colocated::ServeOptions;
use preheat_engine::disagg::gateway::{self, GatewayModel, GatewayOptions};
use preheat_engine::disagg::wire::messages::WorkerRole;
use preheat_engine::disagg::worker::{self, WorkerOptions};
use preheat_engine::metrics::Role;
use preheat_testkit::{Wait, model_fixture};
use serde_json::{Value, json};

use super::server::{get_json, listen, scrape};

/// A decode worker of the fixture `fixture` served as `name`, registering at `gateway`.
async fn decode_worker(
    fixture: &str,
    name: &str,
    gateway: &str,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<preheat_engine::Result<()>> {
    let (l, url) = listen().await;
    let mut serve = ServeOptions::new(model_fixture(fixture), l.local_addr().unwrap());
    serve.served_model_name = Some(name.to_owned());
    serve.kv_cache_bytes = 8 << 20;
    serve.role = Role::Decode;
    let opts = WorkerOptions {
        serve,
        role: WorkerRole::Decode,
        gateway: Some(gateway.to_owned()),
        advertise: url,
        heartbeat: Duration::from_secs(1),
        transfer_timeout: Duration::from_secs(10),
        kv_listener: None,
    };
    let mut stop = stop;
    tokio::spawn(worker::run(l, opts, async move {
        let _ = stop.wait_for(|s| *s).await;
    }))
}

/// Models `a` (llama-tiny) and `b` (qwen2-tiny), and `c`, whose manifest could not be
/// read; only `b` has a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gateway_serves_each_model_on_its_own_workers_and_holds_the_others() {
    let info = |fixture: &str, name: &str| {
        gateway::model_info(&model_fixture(fixture), 16, Some(name)).unwrap()
    };
    let (gl, url) = listen().await;
    let (gil, internal) = listen().await;
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let opts = GatewayOptions {
        models: vec![
            GatewayModel::new(info("llama-tiny", "a")),
            GatewayModel::new(info("qwen2-tiny", "b")),
            GatewayModel::unreadable("c", "reading its manifest: 404 Not Found"),
        ],
        ..GatewayOptions::default()
    };
    let mut gw_stop = stop_rx.clone();
    let gw = tokio::spawn(gateway::run(gl, Some(gil), opts, async move {
        let _ = gw_stop.wait_for(|s| *s).await;
    }));
    let worker = decode_worker("qwen2-tiny", "b", &internal, stop_rx.clone()).await;
    let c = reqwest::Client::new();
    Wait::new("b's decode worker registered", Duration::from_secs(60))
        .until_async(async || {
            let v = get_json(&c, &format!("{internal}/internal/workers")).await;
            v["workers"]
                .as_array()
                .is_some_and(|w| w.len() == 1 && w[0]["model"] == "b")
        })
        .await;
    let complete = async |model: Option<&str>| {
        let mut body = json!({"prompt": "hello", "max_tokens": 2, "temperature": 0});
        if let Some(m) = model {
            body["model"] = m.into();
        }
        let r = c
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<Value>().await.unwrap_or_default(),
        )
    };

    // Every configured model is listed, at zero or unreadable included.
    let models = get_json(&c, &format!("{url}/v1/models")).await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["a", "b", "c"], "{models}");
    assert_eq!(models["data"][2]["available"], false, "{models}");

    // `b` is served by its own worker (qwen2's vocabulary, not llama's).
    let (status, body) = complete(Some("b")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "b");

    // An unknown model: 404 naming the models served.
    let (status, body) = complete(Some("zzz")).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("a, b, c"), "{msg}");
    // The unreadable model: 503 with the cause; no model named: 400 naming `model`.
    let (status, body) = complete(Some("c")).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("404 Not Found"),
        "{body}"
    );
    let (status, body) = complete(None).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "model", "{body}");

    // `a` has no worker: its request is held, counted for `a`'s decode pool alone.
    let held = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move {
            c.post(format!("{url}/v1/completions"))
                .json(&json!({"model": "a", "prompt": "hello", "max_tokens": 2}))
                .send()
                .await
        }
    });
    let pending = async |model: &str| {
        let page = scrape(&c, &url).await;
        let want = format!("model_name=\"{model}\"");
        page.lines()
            .filter(|l| l.starts_with("preheat:gateway_pending_requests") && l.contains(&want))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    Wait::new("a's request held", Duration::from_secs(10))
        .until_async(async || pending("a").await == 1.0)
        .await;
    assert_eq!(pending("b").await, 0.0);
    // `b` still serves meanwhile.
    assert_eq!(complete(Some("b")).await.0, 200);
    // One exposition: each family once, both models' series in it.
    let page = scrape(&c, &url).await;
    assert_eq!(
        page.matches("# TYPE preheat:gateway_pending_requests ")
            .count(),
        1,
        "{page}"
    );
    for m in ["a", "b"] {
        assert!(
            page.contains(&format!(
                "preheat:gateway_workers{{model_name=\"{m}\",role=\"decode\"}}"
            )),
            "{page}"
        );
    }
    // A worker of neither model is refused, naming the models served.
    let r = c
        .post(format!("{internal}/internal/register"))
        .json(
            &json!({"id": "x", "role": "decode", "url": "http://127.0.0.1:9", "model": "x",
                      "compat": "none", "kv_format": preheat_engine::kv::payload::FORMAT_VERSION}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let text = r.text().await.unwrap();
    assert!(text.contains("a, b"), "{text}");

    // An address registered again for another model (a reused port) leaves the first
    // model's rotation.
    for (model, fixture) in [("a", "llama-tiny"), ("b", "qwen2-tiny")] {
        let r = c
            .post(format!("{internal}/internal/register"))
            .json(
                &json!({"id": "reused", "role": "decode", "url": "http://127.0.0.1:9",
                          "model": model, "compat": info(fixture, model).compat,
                          "kv_format": preheat_engine::kv::payload::FORMAT_VERSION}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
    let v = get_json(&c, &format!("{internal}/internal/workers")).await;
    let reused: Vec<&Value> = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["id"] == "reused")
        .collect();
    assert_eq!(reused.len(), 1, "{v}");
    assert_eq!(reused[0]["model"], "b", "{v}");

    held.abort();
    let _ = held.await;
    stop.send(true).unwrap();
    gw.await.unwrap().unwrap();
    worker.await.unwrap().unwrap();
}
