//! The gateway as the chart runs it: started with `--model` (read for its manifest
//! only, here from a packed snapshot served with Range requests), Ready while both
//! pools are at zero, holding requests and answering a clear 503 with Retry-After when
//! the hold time runs out; a worker that starts later serves what was held.

mod harness;

use std::time::{Duration, Instant};

use harness::{Gateway, Worker, gateway, metric, metric_sum};
use preheat_testkit::{serve_files, wait_for_async};
use serde_json::{Value, json};

fn tiny_snapshot(dir: &std::path::Path) -> std::path::PathBuf {
    harness::synth_tiny(dir, "tiny", 0)
}

/// A gateway of `model` served as `tiny`, holding requests `hold_secs`, healthy.
fn tiny_gateway(model: &str, hold_secs: u64) -> Gateway {
    let g = gateway()
        .model(model)
        .args(&["--served-model-name", "tiny"])
        .args(&["--hold-timeout-secs", &hold_secs.to_string()])
        .start();
    g.wait_healthy(60);
    g
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A short completion request to the gateway at `base`.
fn completion(c: &reqwest::Client, base: &str) -> reqwest::RequestBuilder {
    c.post(format!("{base}/v1/completions"))
        .json(&json!({"model": "tiny", "prompt": "hello", "max_tokens": 4}))
}

/// `base`'s `GET /v1/models`: the page, and the ids it lists.
async fn models(c: &reqwest::Client, base: &str) -> (Value, Vec<String>) {
    let page: Value = c
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids = page["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| Some(m["id"].as_str()?.to_owned()))
        .collect();
    (page, ids)
}

/// Requests held at `base`'s gateway.
async fn pending(c: &reqwest::Client, base: &str) -> f64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // Summed over the pools held requests wait for; absent, -1.
    metric_sum(&text, "preheat:gateway_pending_requests").unwrap_or(-1.0)
}

#[test]
fn regression_gateway_at_zero_was_never_ready_and_refused_requests_at_once() {
    // The bug: a gateway with no workers answered /health 503 (its readiness probe
    // never passed, liveness restarted it) and a completion 503 at once, so nothing
    // was ever held and the pools stayed at zero.
    let dir = tempfile::tempdir().unwrap();
    let snap = tiny_snapshot(dir.path());
    let gw = tiny_gateway(snap.to_str().unwrap(), 2);
    let base = gw.url.clone();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let (page, ids) = models(&c, &base).await;
        assert_eq!(ids, ["tiny"], "{page}");
        // The gateway refuses what it would not honour at once, by name, before
        // holding anything (the same checks as `engine serve`).
        for (field, value) in [
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            ("response_format", json!({"type": "xml"})),
            // A grammar is compiled with the gateway's own tokenizer, before holding.
            ("guided_regex", json!("(unclosed")),
        ] {
            let mut body =
                json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]});
            body[field] = value;
            let r = c
                .post(format!("{base}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400);
            let e: Value = r.json().await.unwrap();
            assert_eq!(e["error"]["param"], field, "{e}");
        }
        for stream in [false, true] {
            let t0 = Instant::now();
            let req = c
                .post(format!("{base}/v1/completions"))
                .json(&json!({"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": stream}))
                .send();
            let req = tokio::spawn(req);
            // Held, and counted where the scaler reads it.
            let held = async || {
                let n = pending(&c, &base).await;
                if n == 1.0 {
                    Ok(())
                } else {
                    Err(format!("{n} pending"))
                }
            };
            wait_for_async(
                "the request held while the pools are at zero",
                Duration::from_millis(1500),
                held,
            )
            .await;
            let r = req.await.unwrap().unwrap();
            let waited = t0.elapsed();
            assert_eq!(r.status(), 503, "stream={stream}");
            assert!(
                waited >= Duration::from_secs(2),
                "answered after {waited:?}, before the hold time"
            );
            let retry: u64 = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .expect("Retry-After");
            assert!(retry >= 1);
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["error"]["code"], "no_workers", "{body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("hold time"),
                "{body}"
            );
        }
        assert_eq!(pending(&c, &base).await, 0.0);
    });
    // Still Ready after all that: readiness means "can accept and hold".
    gw.wait_healthy(1);
}

#[test]
fn gateway_reads_its_model_from_a_packed_url_and_a_late_worker_serves_what_was_held() {
    let dir = tempfile::tempdir().unwrap();
    let snap = tiny_snapshot(dir.path());
    harness::pack(&snap, 1);
    let url = format!("{}/tiny.phpack", serve_files(dir.path()));
    let gw = tiny_gateway(&url, 120);
    let base = gw.url.clone();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let req = tokio::spawn(
            c.post(format!("{base}/v1/completions"))
                .json(
                    &json!({"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}),
                )
                .send(),
        );
        wait_for_async("the request held", Duration::from_secs(10), async || {
            pending(&c, &base).await >= 1.0
        })
        .await;
        // A decode worker of the same snapshot registers: the gateway's model, read
        // from the card alone, must be the worker's (same KV compatibility hash).
        let _worker = decode_worker(&snap, Some(&gw));
        let r = req.await.unwrap().unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    });
}

#[test]
fn gateway_refuses_a_model_source_that_is_not_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let bogus = dir.path().join("bogus.preheat");
    std::fs::write(&bogus, vec![7u8; 4096]).unwrap();
    let out = harness::preheat(["engine", "gateway", "--model", bogus.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bogus.preheat") && err.contains("magic"),
        "{err}"
    );
}

/// `--model NAME=SOURCE`, repeated (and `--model-env NAME=VAR`, the source in the
/// environment, as the chart passes a Secret's): one gateway lists every model, serves
/// a worker of each (a worker joins the model it names), and a model whose source
/// cannot be read answers 503 with the cause while the others serve; the one-model
/// options that cannot apply to several are refused by name.
#[test]
fn one_gateway_fronts_several_models_and_one_unreadable_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    let a = harness::synth_tiny(dir.path(), "a-snap", 1);
    let b = harness::synth_tiny(dir.path(), "b-snap", 2);
    let bogus = dir.path().join("bogus.preheat");
    std::fs::write(&bogus, vec![7u8; 4096]).unwrap();
    let named = |n: &str, p: &std::path::Path| format!("{n}={}", p.display());
    let gw = gateway()
        .model(&named("alpha", &a))
        .env("PREHEAT_TEST_BETA_SOURCE", b.to_str().unwrap())
        .args(&["--model-env", "beta=PREHEAT_TEST_BETA_SOURCE"])
        .model(&named("gamma", &bogus))
        .args(&["--hold-timeout-secs", "60"])
        .start();
    gw.wait_healthy(60);
    let base = gw.url.clone();
    let _worker = gw
        .worker("decode", &b)
        .args(&["--served-model-name", "beta"])
        .start();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let (page, ids) = models(&c, &base).await;
        assert_eq!(ids, ["alpha", "beta", "gamma"], "{page}");
        let ask = async |model: &str| {
            let r = c
                .post(format!("{base}/v1/completions"))
                .json(&json!({"model": model, "prompt": "hello", "max_tokens": 2}))
                .timeout(Duration::from_secs(60))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        };
        let (status, body) = ask("beta").await;
        assert_eq!(status, 200, "{body}");
        let (status, body) = ask("gamma").await;
        assert_eq!(status, 503, "{body}");
        assert!(
            body.contains("bogus.preheat") && body.contains("magic"),
            "{body}"
        );
    });
    // Options of one model, given with several: refused, each by name, at once.
    let out = harness::preheat([
        "engine",
        "gateway",
        "--model",
        &named("alpha", &a),
        "--model",
        b.to_str().unwrap(),
        "--served-model-name",
        "x",
        "--chat-template",
        "t.jinja",
        "--model-env",
        "delta=PREHEAT_TEST_UNSET_SOURCE",
        "--model-env",
        "PREHEAT_TEST_UNSET_SOURCE",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--served-model-name names one model")
            && err.contains("--chat-template")
            && err.contains("$PREHEAT_TEST_UNSET_SOURCE is not set")
            && err.contains("give it as NAME=VAR"),
        "{err}"
    );
}

/// Discovery with several models: each model's workers come from its own Services
/// (`--decode-service NAME=SERVICE`), so `b`'s decode worker serves `b` and `a`'s
/// requests stay held; a Service not named for a model is refused by name.
#[test]
fn each_models_workers_are_discovered_from_its_own_services() {
    let dir = tempfile::tempdir().unwrap();
    let a = harness::synth_tiny(dir.path(), "a-snap", 1);
    let b = harness::synth_tiny(dir.path(), "b-snap", 2);
    let worker = harness::worker("decode", &b)
        .args(&["--served-model-name", "b"])
        .kv_mib(16)
        .start();
    worker.wait_healthy(60);
    let api = fake_kube::Shared::default();
    api.lock().unwrap().slices = vec![fake_kube::slice(
        "b-decode",
        worker.port,
        &[("127.0.0.1", true)],
        1,
    )];
    let url = fake_kube::serve(api);
    let named = |n: &str, p: &std::path::Path| format!("{n}={}", p.display());
    let gw = gateway()
        .discovering()
        .model(&named("a", &a))
        .model(&named("b", &b))
        .args(&["--hold-timeout-secs", "3"])
        .args(&["--discover-namespace", "llm", "--kube-api-url", &url])
        .args(&[
            "--prefill-service",
            "a=a-prefill",
            "--decode-service",
            "a=a-decode",
        ])
        .args(&[
            "--prefill-service",
            "b=b-prefill",
            "--decode-service",
            "b=b-decode",
        ])
        .start();
    gw.wait_healthy(60);
    let base = gw.url.clone();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let ask = async |model: &str| {
            c.post(format!("{base}/v1/completions"))
                .json(&json!({"model": model, "prompt": "hello", "max_tokens": 2}))
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        };
        assert_eq!(ask("b").await, 200);
        // `a` has no worker in its Services: held, then 503 at the hold time.
        assert_eq!(ask("a").await, 503);
    });
    let out = harness::preheat([
        "engine",
        "gateway",
        "--model",
        &named("a", &a),
        "--model",
        &named("b", &b),
        "--discover-namespace",
        "llm",
        "--prefill-service",
        "a=a-prefill",
        "--decode-service",
        "a-decode",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--decode-service a-decode: with several --model, give it as NAME=SERVICE")
            && err.contains("--prefill-service: model b needs one NAME=SERVICE, 0 given"),
        "{err}"
    );
}

/// A Kubernetes API serving EndpointSlices (list, then a watch fed by `events`), as the
/// gateway's kube-rs reflector reads them.
mod fake_kube {
    use std::sync::{Arc, Mutex};

    use axum::body::{Body, Bytes};
    use axum::extract::{Query, State};
    use axum::response::{IntoResponse, Response};
    use serde_json::{Value, json};
    use tokio::sync::mpsc;

    #[derive(Default)]
    pub struct Api {
        pub slices: Vec<Value>,
        pub watches: Vec<mpsc::UnboundedSender<Value>>,
    }

    pub type Shared = Arc<Mutex<Api>>;

    pub fn slice(service: &str, port: u16, endpoints: &[(&str, bool)], rv: u32) -> Value {
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{service}-x"), "namespace": "llm",
                         "resourceVersion": rv.to_string(),
                         "labels": {"kubernetes.io/service-name": service,
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": endpoints.iter().map(|(ip, ready)| json!({
                "addresses": [ip], "conditions": {"ready": ready}
            })).collect::<Vec<_>>(),
        })
    }

    async fn slices(
        State(s): State<Shared>,
        Query(q): Query<std::collections::BTreeMap<String, String>>,
    ) -> Response {
        let want = q
            .get("labelSelector")
            .into_iter()
            .flat_map(|l| l.split(','))
            .find_map(|kv| kv.strip_prefix("kubernetes.io/service-name="))
            .unwrap_or("")
            .to_owned();
        if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
            let (tx, rx) = mpsc::unbounded_channel::<Value>();
            s.lock().unwrap().watches.push(tx);
            let stream = futures_util::stream::unfold(rx, move |mut rx| {
                let want = want.clone();
                async move {
                    loop {
                        let v = rx.recv().await?;
                        if v["object"]["metadata"]["labels"]["kubernetes.io/service-name"] == want {
                            let mut line = serde_json::to_vec(&v).unwrap();
                            line.push(b'\n');
                            return Some((Ok::<_, std::io::Error>(Bytes::from(line)), rx));
                        }
                    }
                }
            });
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(stream))
                .unwrap();
        }
        let items: Vec<Value> = s
            .lock()
            .unwrap()
            .slices
            .iter()
            .filter(|v| v["metadata"]["labels"]["kubernetes.io/service-name"] == want.as_str())
            .cloned()
            .collect();
        axum::Json(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
            "metadata": {"resourceVersion": "1"}, "items": items,
        }))
        .into_response()
    }

    /// Serves on a thread of its own; returns the base URL.
    pub fn serve(state: Shared) -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let app = axum::Router::new()
                    .route(
                        "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices",
                        axum::routing::get(slices),
                    )
                    .with_state(state);
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(l.local_addr().unwrap()).unwrap();
                axum::serve(l, app).await.unwrap();
            });
        });
        format!("http://{}", rx.recv().unwrap())
    }

    pub fn push(state: &Shared, kind: &str, obj: Value) {
        for w in &state.lock().unwrap().watches {
            let _ = w.send(json!({"type": kind, "object": obj}));
        }
    }
}

/// A decode worker of `snap` served as `tiny`, registering with `gateway` when given
/// (else it only serves, to be discovered).
fn decode_worker(snap: &std::path::Path, gateway: Option<&Gateway>) -> Worker {
    let w = match gateway {
        Some(g) => g.worker("decode", snap),
        None => harness::worker("decode", snap),
    };
    w.args(&["--served-model-name", "tiny"]).kv_mib(16).start()
}

#[test]
fn gateways_find_workers_in_endpoint_slices_ready_and_of_their_model_only() {
    let dir = tempfile::tempdir().unwrap();
    let snap = tiny_snapshot(dir.path());
    let other = harness::synth_tiny(dir.path(), "other", 7);
    // Pods have addresses of their own; here every worker is on 127.0.0.1 and each
    // slice names the port of the one it lists.
    let good = decode_worker(&snap, None);
    let bad = decode_worker(&other, None);
    good.wait_healthy(60);
    bad.wait_healthy(60);
    let (port, bad_port) = (good.port, bad.port);
    let api = fake_kube::Shared::default();
    {
        let mut a = api.lock().unwrap();
        a.slices = vec![fake_kube::slice(
            "d",
            port,
            &[("127.0.0.1", true), ("127.0.0.9", false)],
            1,
        )];
    }
    let url = fake_kube::serve(api.clone());
    let discovering = || {
        let g = gateway()
            .discovering()
            .model(snap.to_str().unwrap())
            .args(&["--served-model-name", "tiny", "--hold-timeout-secs", "3"])
            .args(&["--discover-namespace", "llm", "--kube-api-url", &url])
            .args(&["--prefill-service", "p", "--decode-service", "d"])
            .start();
        g.wait_healthy(60);
        g
    };
    // Two replicas behind one Service: both see the same workers.
    let (g1, g2) = (discovering(), discovering());
    let (base1, base2) = (g1.url.clone(), g2.url.clone());
    rt().block_on(async {
        let c = reqwest::Client::new();
        for base in [&base1, &base2] {
            let r = completion(&c, base).send().await.unwrap();
            assert_eq!(r.status(), 200, "{base}: {:?}", r.text().await);
            // No registration endpoint where workers are discovered.
            let r = c
                .post(format!("{base}/internal/register"))
                .json(&json!({}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 404);
        }
        // The only Ready endpoint now serves another model: it must not be used.
        fake_kube::push(
            &api,
            "MODIFIED",
            fake_kube::slice("d", bad_port, &[("127.0.0.1", true)], 2),
        );
        // Both dropped the worker no longer listed (the other model's is never
        // admitted: a request held 3 s would find it).
        for g in [&g1, &g2] {
            wait_for_async(
                "the unlisted worker dropped",
                Duration::from_secs(10),
                async || {
                    metric(
                        &g.metrics(),
                        "preheat:gateway_workers{model_name=\"tiny\",role=\"decode\"}",
                    ) == Some(0.0)
                },
            )
            .await;
        }
        let r = completion(&c, &base1).send().await.unwrap();
        assert_eq!(r.status(), 503, "a worker of another model was used");
        // Back to the right worker, not ready: still nothing; ready: served.
        fake_kube::push(
            &api,
            "MODIFIED",
            fake_kube::slice("d", port, &[("127.0.0.1", false)], 3),
        );
        // Deliberate: nothing to observe while the gateway (rightly) admits nobody, so
        // it is given the time a wrong admission would take before the request is sent.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let held = tokio::spawn(completion(&c, &base2).send());
        wait_for_async("the request held", Duration::from_secs(10), async || {
            pending(&c, &base2).await >= 1.0
        })
        .await;
        fake_kube::push(
            &api,
            "MODIFIED",
            fake_kube::slice("d", port, &[("127.0.0.1", true)], 4),
        );
        let r = held.await.unwrap().unwrap();
        assert_eq!(
            r.status(),
            200,
            "the held request is served once the endpoint is Ready"
        );
    });
}
