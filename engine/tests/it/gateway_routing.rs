//! A gateway in-process in front of real in-process workers: how it spreads requests.

use std::time::{Duration, Instant};

use preheat_engine::colocated::ServeOptions;
use preheat_engine::disagg::gateway::{self, GatewayOptions};
use preheat_engine::disagg::wire::messages::WorkerRole;
use preheat_engine::disagg::worker::{self, WorkerOptions};
use preheat_engine::metrics::Role;
use preheat_testkit::{Wait, wait_for_async};
use serde_json::Value;

use super::server::{listen, metric_sum, scrape};

/// A worker of `role` with `kv_cache_bytes` of KV cache, registering with `gateway` and
/// reporting its load every second, as in the field.
fn start_worker(
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

type Task = tokio::task::JoinHandle<preheat_engine::Result<()>>;

/// Registers a decode worker `id` at `url` with the gateway whose internal listener is
/// `internal`, as a worker's start (and each heartbeat after a drop) does.
async fn register_decode(client: &reqwest::Client, internal: &str, id: &str, url: &str) {
    let info = gateway::model_info(
        &preheat_testkit::model_fixture("llama-tiny"),
        16,
        Some("tiny"),
    )
    .unwrap();
    let r = client
        .post(format!("{internal}/internal/register"))
        .json(
            &serde_json::json!({"id": id, "role": "decode", "url": url, "model": "tiny",
              "compat": info.compat, "kv_format": preheat_engine::kv::payload::FORMAT_VERSION}),
        )
        .send()
        .await
        .unwrap();
    let status = r.status();
    assert!(
        status.is_success(),
        "{status}: {}",
        r.text().await.unwrap_or_default()
    );
}

/// A gateway and its workers in this process, stopped together.
pub(crate) struct Stack {
    pub(crate) url: String,
    /// Where workers register.
    pub(crate) internal: String,
    /// Each worker's role and URL, in the order asked for.
    workers: Vec<(WorkerRole, String)>,
    pub(crate) client: reqwest::Client,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<Task>,
}

impl Stack {
    /// Starts a gateway and a worker per `(role, KV bytes)`, and waits until all have
    /// registered and reported their load, and every decode worker was told of every
    /// prefill worker.
    async fn start(spec: &[(WorkerRole, usize)]) -> Stack {
        Self::start_with(spec, |_| {}).await
    }

    /// [`Stack::start`] with the gateway's options as `tune` leaves them.
    pub(crate) async fn start_with(
        spec: &[(WorkerRole, usize)],
        tune: impl FnOnce(&mut GatewayOptions),
    ) -> Stack {
        let model = preheat_testkit::model_fixture("llama-tiny");
        let info = gateway::model_info(&model, 16, Some("tiny")).unwrap();
        let (gl, url) = listen().await;
        let (gil, internal) = listen().await;
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let mut gw_stop = stop_rx.clone();
        let mut opts = GatewayOptions {
            models: vec![gateway::GatewayModel::new(info)],
            ..GatewayOptions::default()
        };
        tune(&mut opts);
        let mut tasks = vec![tokio::spawn(gateway::run(
            gl,
            Some(gil),
            opts,
            async move {
                let _ = gw_stop.wait_for(|s| *s).await;
            },
        ))];
        let mut workers = Vec::new();
        for &(role, kv) in spec {
            let (l, w) = listen().await;
            tasks.push(start_worker(role, l, &w, &internal, stop_rx.clone(), kv));
            workers.push((role, w));
        }
        let prefills = spec.iter().filter(|w| w.0 == WorkerRole::Prefill).count();
        let client = reqwest::Client::new();
        wait_for_async(
            "the workers all registered",
            Duration::from_secs(60),
            async || {
                let v: Value = match client
                    .get(format!("{internal}/internal/workers"))
                    .send()
                    .await
                {
                    Ok(r) => r.json().await.unwrap_or_default(),
                    Err(_) => Value::Null,
                };
                let list = v["workers"].as_array().cloned().unwrap_or_default();
                if list.len() == spec.len()
                    && list.iter().filter(|w| w["role"] == "decode").all(|w| {
                        w["prefill_peers"] == prefills && w["load"]["kv_blocks"].as_u64() > Some(0)
                    })
                {
                    Ok(())
                } else {
                    Err(format!("{list:?}"))
                }
            },
        )
        .await;
        Stack {
            url,
            internal,
            workers,
            client,
            stop,
            tasks,
        }
    }

    /// `n` completions of distinct 64-token prompts (no shared prefix to follow, long
    /// enough to be disaggregated), sent at once; each must succeed.
    async fn send_at_once(&self, n: u32, max_tokens: u32) {
        let sends = (0..n).map(|i| {
            let c = self.client.clone();
            let url = format!("{}/v1/completions", self.url);
            async move {
                let prompt: Vec<u32> = (0..64).map(|t| 1 + (i * 97 + t * 13) % 200).collect();
                let r = c
                    .post(url)
                    .json(&serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(
                    r.status(),
                    200,
                    "request {i}: {}",
                    r.text().await.unwrap_or_default()
                );
            }
        });
        futures_util::future::join_all(sends).await;
    }

    /// Registers a decode worker served at `url` as `id`, by hand (a fake: it sends
    /// no heartbeats, so the stack needs a long `worker_timeout`).
    /// A short completion ("hello", 4 tokens) within `timeout`: its status and body.
    async fn hello(&self, timeout: Duration) -> (reqwest::StatusCode, String) {
        let r = self
            .client
            .post(format!("{}/v1/completions", self.url))
            .json(&serde_json::json!({"model": "tiny", "prompt": "hello", "max_tokens": 4}))
            .timeout(timeout)
            .send()
            .await
            .unwrap();
        let status = r.status();
        (status, r.text().await.unwrap())
    }

    pub(crate) async fn register_decode(&self, id: &str, url: &str) {
        register_decode(&self.client, &self.internal, id, url).await;
    }

    pub(crate) async fn stop(self) {
        self.stop.send(true).unwrap();
        for t in self.tasks {
            t.await.unwrap().unwrap();
        }
    }
}

/// Two prefill and two decode workers reporting their load every second: eight requests
/// sent at once must not all go to the pair that looked emptiest at the last report.
/// The gateway routed on the reports alone, so every request between two heartbeats
/// went to one decode worker and one prefill worker while the others idled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_requests_between_two_load_reports_all_went_to_one_worker() {
    let kv = 8 << 20;
    let s = Stack::start(&[
        (WorkerRole::Prefill, kv),
        (WorkerRole::Prefill, kv),
        (WorkerRole::Decode, kv),
        (WorkerRole::Decode, kv),
    ])
    .await;
    s.send_at_once(8, 16).await;
    let mut served = Vec::new();
    for (role, url) in &s.workers {
        let m = scrape(&s.client, url).await;
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
    s.stop().await;
}

/// A decode worker with no room to reserve for a prompt's K/V answered 429, and the
/// gateway passed that to the client although another decode worker had room: a
/// request failed that the pool could serve. Here one decode worker's whole cache is a
/// block, so every prompt is too long for it; each goes to the other one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_a_decode_worker_without_room_failed_a_request_another_could_take() {
    let s = Stack::start(&[
        (WorkerRole::Prefill, 8 << 20),
        (WorkerRole::Decode, 8 << 20),
        (WorkerRole::Decode, 1),
    ])
    .await;
    s.send_at_once(6, 4).await;
    s.stop().await;
}

/// The only decode worker holds one prompt at a time (six blocks of 16 tokens, 8 KiB
/// each for this model): of six requests sent at once, those it has no room for now
/// wait at the gateway and are asked again, and all six complete. Before, each one
/// refused failed with 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_without_room_now_makes_requests_wait_not_fail() {
    let s = Stack::start(&[
        (WorkerRole::Prefill, 8 << 20),
        (WorkerRole::Decode, 6 * 8192),
    ])
    .await;
    s.send_at_once(6, 4).await;
    let refused = metric_sum(
        &scrape(&s.client, &s.workers[1].1).await,
        "preheat:requests_rejected_total",
    );
    assert!(refused >= 1.0, "the decode worker never ran out of room");
    s.stop().await;
}

/// A prompt longer than every decode worker's whole cache can never run: asked again,
/// a worker would refuse it for want of room until the hold time ran out. The client
/// learns the limit at once (400). (With a larger worker beside, it goes there: the
/// regression test above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_longer_than_every_decode_workers_cache_fails_at_once() {
    let small = Stack::start(&[(WorkerRole::Prefill, 8 << 20), (WorkerRole::Decode, 1)]).await;
    let t0 = Instant::now();
    let prompt: Vec<u32> = (1..65).collect();
    let r = small
        .client
        .post(format!("{}/v1/completions", small.url))
        .json(&serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body = r.text().await.unwrap();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("maximum context length"), "{body}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    small.stop().await;
}

/// A decode worker that takes a request and dies (here: takes the connection, reads
/// the request and drops it), three times over: the request is replayed twice, then
/// fails with the reason. A request that crashes its workers takes down no more than
/// three, and its client is not left waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_decode_workers_all_die_fails_after_two_replays() {
    // The fakes send no heartbeats: kept in the rotation however slow this run is.
    let s = Stack::start_with(&[], |o| o.worker_timeout = Duration::from_secs(600)).await;
    for i in 0..3 {
        let (l, url) = listen().await;
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = l.accept().await {
                use tokio::io::AsyncReadExt;
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf).await;
            }
        });
        s.register_decode(&format!("dying-{i}"), &url).await;
    }
    let t0 = Instant::now();
    let (status, body) = s.hello(Duration::from_secs(30)).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("decode worker"), "{body}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    let replays = metric_sum(
        &scrape(&s.client, &s.url).await,
        "preheat:gateway_replays_total",
    );
    assert_eq!(replays, 2.0);
    s.stop().await;
}

/// A request replayed after its only decode worker was lost waited for a worker other
/// than that one, although the worker registered again within a second (its next
/// heartbeat): the client was held for the whole hold time (300 s by default, as long
/// as a client's own timeout), then failed with "no decode worker became available".
/// Here the only worker drops every request it takes and registers again 300 ms
/// later: each replay must go back to it, and the request fail after two replays with
/// the worker's loss, long before the hold time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_a_replay_waited_the_whole_hold_time_for_another_worker_than_the_only_one() {
    let s = Stack::start_with(&[], |o| {
        o.worker_timeout = Duration::from_secs(600);
        o.hold_timeout = Duration::from_secs(20);
    })
    .await;
    let (l, url) = listen().await;
    let (client, internal, at) = (s.client.clone(), s.internal.clone(), url.clone());
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = l.accept().await {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf).await;
            drop(conn);
            // Deliberate: after the gateway has seen the loss, as a heartbeat would.
            tokio::time::sleep(Duration::from_millis(300)).await;
            register_decode(&client, &internal, "flaky", &at).await;
        }
    });
    s.register_decode("flaky", &url).await;
    let t0 = Instant::now();
    let (status, body) = s.hello(Duration::from_secs(60)).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("decode worker") && !body.contains("hold time"),
        "{body}"
    );
    let replays = metric_sum(
        &scrape(&s.client, &s.url).await,
        "preheat:gateway_replays_total",
    );
    assert_eq!(replays, 2.0, "{body}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    s.stop().await;
}

/// A client that gave up while its request was held left the held count up for good:
/// the request's task is dropped at its wait, and the count was taken back only after
/// it. The scaler reads that count as waiting requests, so a pool could never go back
/// to zero. Held twice here: for a decode worker (none yet), and for room (the only
/// decode worker answers 429 to every ask).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_a_client_that_gave_up_while_held_stayed_counted_as_pending() {
    let s = Stack::start_with(&[], |o| o.worker_timeout = Duration::from_secs(600)).await;
    let pending = async || {
        metric_sum(
            &scrape(&s.client, &s.url).await,
            "preheat:gateway_pending_requests",
        )
    };
    // Reaches `want`; 0 must also stay (a request waiting for room is counted while it
    // pauses between asks, so a held one may read 0 for an instant).
    let settles_at = async |want: f64| {
        Wait::new(format!("pending to read {want}"), Duration::from_secs(10))
            .every(Duration::from_millis(10))
            .until_async(async || {
                let n = pending().await;
                if n == want { Ok(()) } else { Err(n) }
            })
            .await;
        if want == 0.0 {
            for _ in 0..5 {
                // Deliberate: it must stay 0, which only time passing shows.
                tokio::time::sleep(Duration::from_millis(100)).await;
                assert_eq!(
                    pending().await,
                    0.0,
                    "a request nobody waits for is counted"
                );
            }
        }
    };
    for phase in ["no decode worker", "no room"] {
        if phase == "no room" {
            let (l, url) = listen().await;
            let full = axum::Router::new().route(
                "/internal/generate",
                axum::routing::post(|| async {
                    (
                        axum::http::StatusCode::TOO_MANY_REQUESTS,
                        axum::Json(serde_json::json!({"class": "overloaded", "message": "full"})),
                    )
                }),
            );
            tokio::spawn(async move { axum::serve(l, full).await });
            s.register_decode("full", &url).await;
        }
        let client = s.client.clone();
        let url = format!("{}/v1/completions", s.url);
        let held = tokio::spawn(async move {
            client
                .post(url)
                .json(&serde_json::json!({"model": "tiny", "prompt": "hello", "max_tokens": 4}))
                .send()
                .await
        });
        settles_at(1.0).await;
        held.abort();
        let _ = held.await;
        settles_at(0.0).await;
        eprintln!("{phase}: counted while held, and not after");
    }
    s.stop().await;
}

/// A fake decode worker's answer to one call: NDJSON lines, then either the end of the
/// stream or (`None`) the connection broken, as a killed worker breaks it.
type Script = Vec<Option<&'static str>>;

/// Decode workers that play `script(n)` for the deployment's n-th call, registered as
/// `fake-0`, `fake-1`, … (again, if they were dropped); returns the call counter.
pub(crate) async fn fake_decode_workers(
    s: &Stack,
    count: usize,
    script: fn(usize) -> Script,
) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    for i in 0..count {
        let (l, url) = listen().await;
        let calls = std::sync::Arc::clone(&calls);
        let app = axum::Router::new()
            .route(
                "/internal/generate",
                axum::routing::post(move || {
                    let n = calls.fetch_add(1, Ordering::SeqCst);
                    async move {
                        use futures_util::StreamExt;
                        // A pause before each line (deliberate): each reaches the gateway
                        // on its own, before the break that follows it.
                        let lines = futures_util::stream::iter(script(n)).then(|l| async move {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            match l {
                                Some(l) => Ok(format!("{l}\n")),
                                None => Err(std::io::Error::other("killed")),
                            }
                        });
                        axum::body::Body::from_stream(lines)
                    }
                }),
            )
            .route(
                "/internal/peers",
                axum::routing::post(|| async { axum::http::StatusCode::NO_CONTENT }),
            );
        tokio::spawn(async move { axum::serve(l, app).await });
        s.register_decode(&format!("fake-{i}"), &url).await;
    }
    calls
}

pub(crate) const SEEN: &str = r#"{"type":"delta","tokens":[[5,null,[]]],"text":"lost"}"#;
pub(crate) const GOOD: &str = r#"{"type":"delta","tokens":[[6,null,[]]],"text":"kept"}"#;
pub(crate) const DONE: &str = r#"{"type":"finished","reason":"length","prompt_tokens":2,"completion_tokens":1,"cached_tokens":0}"#;

/// What a client sees when the decode worker running its request dies and the gateway
/// replays it on another: a whole answer has only the replay's text; a stream that had
/// sent nothing streams the replay; a stream that had sent a chunk ends with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_request_shows_its_client_only_what_it_can_take() {
    let s = Stack::start_with(&[], |o| o.worker_timeout = Duration::from_secs(600)).await;
    let post = async |stream: bool| {
        s.client
            .post(format!("{}/v1/completions", s.url))
            .json(&serde_json::json!({"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": stream}))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap()
    };
    // The first call sends a token and dies; the replay answers.
    let dies_after_a_token = |n: usize| -> Script {
        if n == 0 {
            vec![Some(SEEN), None]
        } else {
            vec![Some(GOOD), Some(DONE)]
        }
    };
    fake_decode_workers(&s, 2, dies_after_a_token).await;
    let whole: Value = post(false).await.json().await.unwrap();
    assert_eq!(whole["choices"][0]["text"], "kept", "{whole}");
    fake_decode_workers(&s, 2, dies_after_a_token).await;
    let streamed = post(true).await.text().await.unwrap();
    assert!(
        streamed.contains("lost") && streamed.contains("\"error\""),
        "{streamed}"
    );
    assert!(!streamed.contains("kept"), "{streamed}");
    // The first call dies before any line: a stream has sent nothing yet.
    fake_decode_workers(&s, 2, |n| {
        if n == 0 {
            vec![None]
        } else {
            vec![Some(GOOD), Some(DONE)]
        }
    })
    .await;
    let streamed = post(true).await.text().await.unwrap();
    assert!(
        streamed.contains("kept") && streamed.trim_end().ends_with("data: [DONE]"),
        "{streamed}"
    );
    assert!(!streamed.contains("\"error\""), "{streamed}");
    let replays = metric_sum(
        &scrape(&s.client, &s.url).await,
        "preheat:gateway_replays_total",
    );
    assert_eq!(replays, 3.0);
    s.stop().await;
}
