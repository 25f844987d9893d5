//! A decode worker in-process against a fake gateway and a fake prefill worker that
//! dies mid-transfer: the reserved blocks are released, the failure is reported as a
//! prefill failure (so the gateway retries), and the worker keeps serving.

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::post;
use preheat_engine::colocated::ServeOptions;
use preheat_engine::disagg::peers::Announcement;
use preheat_engine::disagg::wire::messages::{GenerateBody, WireError, WorkerRole};
use preheat_engine::disagg::worker::{self, WorkerOptions};
use preheat_engine::metrics::Role;
use preheat_engine::sampling::SamplingParams;
use preheat_testkit::wait_for_async;

use super::server::{healthy, listen, scrape};

fn kv_usage(metrics: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with("vllm:kv_cache_usage_perc"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}

/// Whether a `/metrics` page shows no KV block in use, for `wait_for`.
fn kv_empty(metrics: &str) -> Result<(), String> {
    let u = kv_usage(metrics);
    if u == 0.0 {
        Ok(())
    } else {
        Err(format!("blocks leaked: {u}"))
    }
}

/// Waits up to 30 s for `base`'s `/health` to answer 200 (503 while the model loads).
async fn wait_healthy(base: &str) {
    let c = reqwest::Client::new();
    wait_for_async(
        format!("{base} healthy"),
        Duration::from_secs(30),
        async || healthy(&c, base).await,
    )
    .await;
}

/// A 99-token prompt and 3 greedy tokens, pulled from `prefill` (or prefilled here).
fn generate_body(prefill: Option<String>) -> GenerateBody {
    GenerateBody {
        request_id: "r".into(),
        prompt: (1..100).collect(),
        params: SamplingParams {
            temperature: 0.0,
            max_tokens: 3,
            ignore_eos: true,
            ..SamplingParams::default()
        },
        prefill,
    }
}

/// A gateway that accepts every registration, heartbeat and deregistration.
async fn accepting_gateway() -> String {
    let (gl, gw) = listen().await;
    let g = Router::new()
        .route("/internal/register", post(|| async { "ok" }))
        .route("/internal/heartbeat", post(|| async { "ok" }))
        .route("/internal/deregister", post(|| async { "ok" }));
    tokio::spawn(async move { axum::serve(gl, g).await.unwrap() });
    gw
}

/// A decode worker running in this process (8 MiB of KV cache on llama-tiny), healthy.
struct Decode {
    url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<preheat_engine::Result<()>>,
}

impl Decode {
    async fn start(
        gateway: Option<String>,
        token: Option<std::sync::Arc<preheat_edge::ClusterToken>>,
        transfer_timeout: Duration,
    ) -> Decode {
        Decode::start_with_grace(gateway, token, transfer_timeout, None).await
    }

    async fn start_with_grace(
        gateway: Option<String>,
        token: Option<std::sync::Arc<preheat_edge::ClusterToken>>,
        transfer_timeout: Duration,
        drain_grace: Option<Duration>,
    ) -> Decode {
        let model = preheat_testkit::model_fixture("llama-tiny");
        let (dl, url) = listen().await;
        let mut serve = ServeOptions::new(model, dl.local_addr().unwrap());
        if let Some(g) = drain_grace {
            serve.drain_grace = g;
        }
        serve.kv_cache_bytes = 8 << 20;
        serve.role = Role::Decode;
        serve.cluster_token = token;
        let opts = WorkerOptions {
            serve,
            role: WorkerRole::Decode,
            gateway,
            advertise: url.clone(),
            heartbeat: Duration::from_millis(200),
            transfer_timeout,
            kv_listener: None,
        };
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(worker::run(dl, opts, async {
            let _ = stop_rx.await;
        }));
        wait_healthy(&url).await;
        Decode { url, stop, task }
    }

    /// Announces `prefill` as a gateway would: the only addresses it may pull from.
    async fn announce(&self, prefill: &[String], token: Option<&preheat_edge::ClusterToken>) {
        let mut r = reqwest::Client::new()
            .post(format!("{}/internal/peers", self.url))
            .json(&Announcement {
                from: "test-gateway".into(),
                seq: 0,
                prefill: prefill.to_vec(),
                ttl_ms: 60_000,
            });
        if let Some(t) = token {
            r = r.header("authorization", t.bearer());
        }
        assert_eq!(r.send().await.unwrap().status(), 204);
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn prefill_dying_mid_transfer_releases_the_reservation() {
    let gw = accepting_gateway().await;
    // A prefill worker that sends the start of a message and then breaks off.
    let (pl, prefill) = listen().await;
    let p = Router::new().route(
        "/internal/prefill",
        post(|| async {
            let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
                Ok(Bytes::from_static(b"PHKV\x10\x00\x00\x00{\"version\":1")),
                Err(std::io::Error::other("killed")),
            ];
            Body::from_stream(futures_util::stream::iter(chunks))
        }),
    );
    tokio::spawn(async move { axum::serve(pl, p).await.unwrap() });
    let d = Decode::start(Some(gw), None, Duration::from_secs(5)).await;
    d.announce(std::slice::from_ref(&prefill), None).await;
    let decode = d.url.clone();
    let c = reqwest::Client::new();
    let body = generate_body;
    // A peer is held to the public API's bounds (regression: /internal/generate skipped
    // the OpenAI validation, e.g. unbounded logprobs and stop strings).
    for (field, params) in [
        (
            "logprobs",
            SamplingParams {
                logprobs: Some(100_000),
                ..SamplingParams::default()
            },
        ),
        (
            "stop",
            SamplingParams {
                stop: vec!["x".into(); 1000],
                ..SamplingParams::default()
            },
        ),
    ] {
        let mut b = body(None);
        b.params = params;
        let r = c
            .post(format!("{decode}/internal/generate"))
            .json(&b)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{field}");
        let err: WireError = r.json().await.unwrap();
        assert!(err.message.contains(field), "{field}: {err:?}");
    }
    let r = c
        .post(format!("{decode}/internal/generate"))
        .json(&body(Some(prefill)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let w_err: WireError = r.json().await.unwrap();
    assert!(w_err.prefill_failed, "{w_err:?}");
    // The 7 reserved blocks are back: usage returns to zero.
    wait_for_async(
        "the reserved blocks back",
        Duration::from_secs(5),
        async || {
            // Gauges update on engine steps: a small local request makes one happen.
            let r = c
                .post(format!("{decode}/internal/generate"))
                .json(&body(None))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let lines = r.text().await.unwrap();
            assert!(lines.contains("\"finished\""), "{lines}");
            kv_empty(&scrape(&c, &decode).await)
        },
    )
    .await;
    d.stop().await;
}

/// A decode worker told to stop while a request waited for its K/V (a prefill backlog,
/// a stalled prefill worker) exited mid-pull once its drain grace ran out: the gateway
/// saw a broken connection and failed the request. The request now comes back
/// refused as a draining worker refuses, which the gateway retries elsewhere.
#[tokio::test]
async fn a_pull_outlasting_the_drain_grace_is_handed_back_not_cut_off() {
    let gw = accepting_gateway().await;
    // A prefill worker that takes the request and never answers.
    let (pl, prefill) = listen().await;
    let p = Router::new().route(
        "/internal/prefill",
        post(std::future::pending::<&'static str>),
    );
    tokio::spawn(async move { axum::serve(pl, p).await.unwrap() });
    let d = Decode::start_with_grace(
        Some(gw),
        None,
        Duration::from_secs(60),
        Some(Duration::from_millis(500)),
    )
    .await;
    d.announce(std::slice::from_ref(&prefill), None).await;
    let c = reqwest::Client::new();
    let body = generate_body(Some(prefill));
    let sent = tokio::spawn(
        c.post(format!("{}/internal/generate", d.url))
            .json(&body)
            .send(),
    );
    // Its blocks are reserved: the pull has begun.
    wait_for_async("the blocks reserved", Duration::from_secs(5), async || {
        kv_usage(&scrape(&c, &d.url).await) > 0.0
    })
    .await;
    let t0 = Instant::now();
    d.stop().await;
    let r = sent.await.unwrap().unwrap();
    assert_eq!(r.status(), 503);
    let w: WireError = r.json().await.unwrap();
    assert!(
        !w.prefill_failed && w.message.contains("drain grace"),
        "{w:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn a_prefill_worker_reports_the_blocks_it_holds() {
    use std::sync::{Arc, Mutex};
    let seen: Arc<Mutex<Vec<Vec<u64>>>> = Arc::default();
    let (gl, gw) = listen().await;
    let s2 = Arc::clone(&seen);
    let g = Router::new()
        .route("/internal/register", post(|| async { "ok" }))
        .route(
            "/internal/heartbeat",
            post(
                move |axum::Json(h): axum::Json<
                    preheat_engine::disagg::wire::messages::Heartbeat,
                >| {
                    let s2 = Arc::clone(&s2);
                    async move {
                        s2.lock().unwrap().push(h.blocks);
                        "ok"
                    }
                },
            ),
        )
        .route("/internal/deregister", post(|| async { "ok" }));
    tokio::spawn(async move { axum::serve(gl, g).await.unwrap() });
    let model = preheat_testkit::model_fixture("llama-tiny");
    let (pl, prefill) = listen().await;
    let mut serve = ServeOptions::new(model, pl.local_addr().unwrap());
    serve.role = Role::Prefill;
    let opts = WorkerOptions {
        serve,
        role: WorkerRole::Prefill,
        gateway: Some(gw),
        advertise: prefill.clone(),
        heartbeat: Duration::from_millis(100),
        transfer_timeout: Duration::from_secs(5),
        kv_listener: None,
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let w = tokio::spawn(worker::run(pl, opts, async {
        let _ = stop_rx.await;
    }));
    wait_healthy(&prefill).await;
    let c = reqwest::Client::new();
    let prompt: Vec<u32> = (1..66).collect();
    let r = c
        .post(format!("{prefill}/internal/prefill"))
        .json(&preheat_engine::disagg::wire::messages::PrefillBody {
            request_id: "r".into(),
            prompt: prompt.clone(),
            params: SamplingParams::default(),
        })
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let want = preheat_engine::kv::PrefixKey::UNKEYED.block_hashes(&prompt, 16);
    assert_eq!(want.len(), 4);
    wait_for_async(
        "the prompt's blocks reported",
        Duration::from_secs(5),
        async || {
            seen.lock()
                .unwrap()
                .iter()
                .any(|b| want.iter().all(|h| b.contains(h)))
        },
    )
    .await;
    let _ = stop_tx.send(());
    w.await.unwrap().unwrap();
}

/// A KV peer that takes the connection and then never answers (a stalled or hostile
/// prefill endpoint). With the deployment's token, a decode worker gives up after its
/// transfer timeout, reports a prefill failure (the gateway then prefills elsewhere or
/// locally) and has released the reservation; an `http://` prefill address, which would
/// be sent the token itself, is refused by name.
#[tokio::test]
async fn regression_a_stalled_kv_peer_held_a_reservation_for_300_s() {
    use std::sync::Arc;
    let token = Arc::new(preheat_edge::ClusterToken::new(
        b"stalled-peer-test-token-0123456789abcdef",
    ));
    let stall = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stall_addr = stall.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = stall.accept().await {
            held.push(s); // read nothing, answer nothing
        }
    });
    let d = Decode::start(None, Some(Arc::clone(&token)), Duration::from_secs(2)).await;
    let http_prefill = "http://127.0.0.1:9/internal/prefill".to_owned();
    d.announce(
        &[http_prefill.clone(), format!("tcp://{stall_addr}")],
        Some(&token),
    )
    .await;
    let decode = d.url.clone();
    let c = reqwest::Client::new();
    let generate = |prefill: Option<String>| {
        c.post(format!("{decode}/internal/generate"))
            .header("authorization", token.bearer())
            .json(&generate_body(prefill))
            .send()
    };
    let r = generate(Some(http_prefill)).await.unwrap();
    assert_eq!(r.status(), 400);
    let e: WireError = r.json().await.unwrap();
    assert!(e.message.contains("tcp://"), "{e:?}");
    let t0 = Instant::now();
    let r = generate(Some(format!("tcp://{stall_addr}"))).await.unwrap();
    let waited = t0.elapsed();
    assert_eq!(r.status(), 502);
    let e: WireError = r.json().await.unwrap();
    assert!(e.prefill_failed, "{e:?}");
    assert!(waited < Duration::from_secs(6), "{waited:?}");
    // The reservation is back: a local request runs and usage returns to zero.
    wait_for_async("the reservation back", Duration::from_secs(5), async || {
        let r = generate(None).await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.text().await.unwrap().contains("\"finished\""));
        kv_empty(&scrape(&c, &decode).await)
    })
    .await;
    d.stop().await;
}

/// A decode worker pulled K/V from whatever address the request body named, so a holder
/// of the token could make it connect anywhere (SSRF). Now only addresses a gateway
/// announced are used; any other is refused as a prefill failure (the gateway then
/// prefills elsewhere or locally) before a connection is made or a block reserved.
#[tokio::test]
async fn regression_a_decode_worker_pulled_kv_from_any_address_a_body_named() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let token = Arc::new(preheat_edge::ClusterToken::new(
        b"announced-peers-test-token-0123456789abcdef",
    ));
    // A listener that counts connections and closes each at once.
    let trap = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let trap_addr = format!("tcp://{}", trap.local_addr().unwrap());
    let seen = Arc::new(AtomicUsize::new(0));
    let seen2 = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((s, _)) = trap.accept().await {
            seen2.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    let d = Decode::start(None, Some(Arc::clone(&token)), Duration::from_secs(2)).await;
    let c = reqwest::Client::new();
    let generate = |prefill: &str| {
        c.post(format!("{}/internal/generate", d.url))
            .header("authorization", token.bearer())
            .json(&GenerateBody {
                request_id: "r".into(),
                prompt: (1..100).collect(),
                params: SamplingParams {
                    max_tokens: 2,
                    ..SamplingParams::default()
                },
                prefill: Some(prefill.to_owned()),
            })
            .send()
    };
    // Nothing announced yet; then a list without the trap.
    for announced in [None, Some(vec!["tcp://127.0.0.1:9".to_owned()])] {
        if let Some(list) = &announced {
            d.announce(list, Some(&token)).await;
        }
        let r = generate(&trap_addr).await.unwrap();
        assert_eq!(r.status(), 502, "{announced:?}");
        let e: WireError = r.json().await.unwrap();
        assert!(
            e.prefill_failed && e.unannounced && e.message.contains("announced"),
            "{e:?}"
        );
    }
    // Deliberate: a connection that must never come is given time to show.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        seen.load(Ordering::SeqCst),
        0,
        "the decode worker connected to an address only a request body named"
    );
    // Announced, the same address is used (and fails as the peer hangs up).
    d.announce(std::slice::from_ref(&trap_addr), Some(&token))
        .await;
    let r = generate(&trap_addr).await.unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    // An announcement is held to its bounds, and asks for the token like the rest.
    let many: Vec<String> = (0..5000).map(|i| format!("tcp://10.0.0.1:{i}")).collect();
    let r = c
        .post(format!("{}/internal/peers", d.url))
        .header("authorization", token.bearer())
        .json(&Announcement {
            from: "gw".into(),
            seq: 0,
            prefill: many,
            ttl_ms: 1000,
        })
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = c
        .post(format!("{}/internal/peers", d.url))
        .json(&Announcement {
            from: "gw".into(),
            seq: 0,
            prefill: vec![trap_addr.clone()],
            ttl_ms: 1000,
        })
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    d.stop().await;
}
