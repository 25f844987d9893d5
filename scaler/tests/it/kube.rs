//! Kubernetes interactions against an in-process fake API server (no cluster runs
//! here): pod discovery by label selector through list + watch, direct-mode scaling
//! through the scale subresource, and the control loop driving both.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, patch};
use preheat_scaler::config::Config;
use preheat_scaler::kube::{PodSet, client, scale_deployment};
use preheat_scaler::profile::Profile;
use preheat_testkit::{Wait, wait_for_async};
use serde_json::{Value, json};
use tokio::sync::mpsc;

#[derive(Default)]
struct Fake {
    pods: Vec<Value>,
    /// Senders of open watches: events pushed here reach every watcher.
    watches: Vec<mpsc::UnboundedSender<Value>>,
    /// deployment → replicas set through the scale subresource.
    scaled: BTreeMap<String, i64>,
    list_selectors: Vec<String>,
    patches: usize,
    /// Every replica count patched, in order (a restart must never patch one lower
    /// than the Deployment had).
    history: Vec<(String, i64)>,
    /// Pod lists never answer (a watch that has not listed yet).
    list_hangs: bool,
    /// Every write, in order: `scale NAME=N` and `cost POD=N`.
    writes: Vec<String>,
}

type Shared = Arc<Mutex<Fake>>;

fn pod(name: &str, ip: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "resourceVersion": "1",
                     "labels": {"app": "p"}},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
    })
}

async fn pods(State(s): State<Shared>, Query(q): Query<BTreeMap<String, String>>) -> Response {
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let (tx, rx) = mpsc::unbounded_channel::<Value>();
        s.lock().unwrap().watches.push(tx);
        // Newline-delimited watch events, as the API server streams them.
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            let v = rx.recv().await?;
            let mut line = serde_json::to_vec(&v).unwrap();
            line.push(b'\n');
            Some((Ok::<_, std::io::Error>(Bytes::from(line)), rx))
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    if s.lock().unwrap().list_hangs {
        std::future::pending::<()>().await;
    }
    let mut f = s.lock().unwrap();
    f.list_selectors
        .push(q.get("labelSelector").cloned().unwrap_or_default());
    axum::Json(json!({
        "apiVersion": "v1", "kind": "PodList",
        "metadata": {"resourceVersion": "1"},
        "items": f.pods,
    }))
    .into_response()
}

async fn scale(
    State(s): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut f = s.lock().unwrap();
    f.patches += 1;
    if name == "missing" {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": "deployments.apps \"missing\" not found", "reason": "NotFound", "code": 404});
        return (StatusCode::NOT_FOUND, axum::Json(status)).into_response();
    }
    let replicas = v["spec"]["replicas"].as_i64().unwrap_or(-1);
    f.scaled.insert(name.clone(), replicas);
    f.history.push((name.clone(), replicas));
    f.writes.push(format!("scale {name}={replicas}"));
    axum::Json(json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"replicas": replicas}, "status": {"replicas": replicas}
    }))
    .into_response()
}

/// `PATCH .../pods/NAME`: the scaler's deletion cost, recorded in order.
async fn pod_patch(State(s): State<Shared>, Path(name): Path<String>, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let cost = &v["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"];
    let mut f = s.lock().unwrap();
    f.writes
        .push(format!("cost {name}={}", cost.as_str().unwrap_or("?")));
    let Some(p) = f
        .pods
        .iter()
        .find(|p| p["metadata"]["name"] == name.as_str())
    else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let mut p = p.clone();
    p["metadata"]["annotations"] = v["metadata"]["annotations"].clone();
    axum::Json(p).into_response()
}

/// `GET .../scale`: what the Deployment has now (404 for a Deployment never set).
async fn scale_get(State(s): State<Shared>, Path((ns, name)): Path<(String, String)>) -> Response {
    let f = s.lock().unwrap();
    let Some(&replicas) = f.scaled.get(&name) else {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": format!("deployments.apps \"{name}\" not found"), "reason": "NotFound", "code": 404});
        return (StatusCode::NOT_FOUND, axum::Json(status)).into_response();
    };
    axum::Json(json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"replicas": replicas}, "status": {"replicas": replicas}
    }))
    .into_response()
}

async fn fake_api(state: Shared) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = Router::new()
        .route("/api/v1/namespaces/llm/pods", get(pods))
        .route("/api/v1/namespaces/llm/pods/{name}", patch(pod_patch))
        .route(
            "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
            patch(scale).get(scale_get),
        )
        .with_state(state);
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

fn push(state: &Shared, kind: &str, obj: Value) {
    let f = state.lock().unwrap();
    for w in &f.watches {
        let _ = w.send(json!({"type": kind, "object": obj}));
    }
}

/// How long the scaler's watch and ticks (every 0.1-0.2 s here) may take to show.
const PATIENCE: Duration = Duration::from_secs(10);

#[tokio::test]
async fn discovery_lists_then_follows_the_watch() {
    let state = Shared::default();
    {
        let mut f = state.lock().unwrap();
        f.pods = vec![pod("a", "10.0.0.1", true), pod("b", "10.0.0.2", false)];
    }
    let url = fake_api(state.clone()).await;
    let c = client(Some(&url)).await.unwrap();
    let set = PodSet::watch(c, "llm", "app=p", 8000, "/metrics");
    wait_for_async("first list", PATIENCE, async || set.synced()).await;
    let v = set.view();
    assert_eq!(v.current, 2, "a starting pod counts as a replica");
    assert_eq!(
        v.ready.values().collect::<Vec<_>>(),
        ["http://10.0.0.1:8000/metrics"]
    );
    assert_eq!(state.lock().unwrap().list_selectors, ["app=p"]);
    // The watch, not another list, brings changes.
    wait_for_async("watch open", PATIENCE, async || {
        !state.lock().unwrap().watches.is_empty()
    })
    .await;
    let mut b = pod("b", "10.0.0.2", true);
    b["metadata"]["resourceVersion"] = json!("2");
    push(&state, "MODIFIED", b);
    let mut a = pod("a", "10.0.0.1", true);
    a["metadata"]["resourceVersion"] = json!("3");
    a["metadata"]["deletionTimestamp"] = json!("2026-11-30T00:00:00Z");
    push(&state, "MODIFIED", a);
    let mut c6 = pod("c", "fd00::6", true);
    c6["metadata"]["resourceVersion"] = json!("4");
    push(&state, "ADDED", c6);
    wait_for_async("watch events applied", PATIENCE, async || {
        let v = set.view();
        v.current == 2 && v.ready.len() == 2
    })
    .await;
    let v = set.view();
    assert_eq!(
        v.ready.values().cloned().collect::<Vec<_>>(),
        [
            "http://10.0.0.2:8000/metrics",
            "http://[fd00::6]:8000/metrics"
        ],
        "terminating pods are dropped; IPv6 is bracketed"
    );
    assert_eq!(state.lock().unwrap().list_selectors.len(), 1);
}

#[tokio::test]
async fn direct_mode_patches_the_scale_subresource() {
    let state = Shared::default();
    let url = fake_api(state.clone()).await;
    let c = client(Some(&url)).await.unwrap();
    assert_eq!(
        scale_deployment(c.clone(), "llm", "m-decode", 3)
            .await
            .unwrap(),
        3
    );
    assert_eq!(state.lock().unwrap().scaled["m-decode"], 3);
    let e = scale_deployment(c, "llm", "missing", 1)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("llm/missing") && e.contains("not found"), "{e}");
}

#[tokio::test]
async fn controller_discovers_pods_and_scales_the_deployment() {
    // One engine pod with a long queue: the prefill pool must grow.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_port = l.local_addr().unwrap().port();
    let text = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 400\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4\n";
    let app = Router::new().route("/metrics", get(move || async move { text }));
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    let state = Shared::default();
    state.lock().unwrap().pods = vec![pod("p0", "127.0.0.1", true)];
    let url = fake_api(state.clone()).await;
    let yaml = format!(
        "grpc_listen: 127.0.0.1:0\nhttp_listen: 127.0.0.1:0\ninterval_s: 0.2\nwindow_s: 2\nmode: direct\nkubernetes: {{namespace: llm, api_url: \"{url}\"}}\nmodels:\n  - name: m\n    prefill: {{selector: 'app=p', metrics_port: {metrics_port}, deployment: m-prefill, default_lead_s: 1}}\n    decode: {{selector: 'app=p', metrics_port: {metrics_port}, deployment: m-decode, default_lead_s: 1}}\n"
    );
    let dir = tempfile_path();
    std::fs::write(&dir, yaml).unwrap();
    let cfg = Config::load(Some(&dir), &[]).unwrap();
    let _ = std::fs::remove_file(&dir);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(preheat_scaler::server::run(
        cfg,
        Profile::default(),
        async {
            let _ = stop_rx.await;
        },
    ));
    wait_for_async("prefill scaled up", PATIENCE, async || {
        state
            .lock()
            .unwrap()
            .scaled
            .get("m-prefill")
            .is_some_and(|r| *r > 1)
    })
    .await;
    let patches = state.lock().unwrap().patches;
    // Deliberate: a few ticks go by (interval 0.2 s), which only time passing shows.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let later = state.lock().unwrap().patches;
    assert!(
        later <= patches + 2,
        "an unchanged decision is not re-sent every tick ({patches} → {later})"
    );
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
}

fn tempfile_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("preheat-kube-{}.yaml", std::process::id()))
}

/// Starts the scaler on `yaml` (a config naming the fake API at `url`); returns the
/// gRPC address and the stop switch.
async fn start_scaler(yaml: String) -> (String, tokio::sync::oneshot::Sender<()>) {
    let grpc = preheat_testkit::free_port();
    let yaml = format!("grpc_listen: 127.0.0.1:{grpc}\nhttp_listen: 127.0.0.1:0\n{yaml}");
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), yaml).unwrap();
    let cfg = Config::load(Some(file.path()), &[]).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(preheat_scaler::server::run(
        cfg,
        Profile::default(),
        async {
            let _ = stop_rx.await;
        },
    ));
    (format!("http://127.0.0.1:{grpc}"), stop_tx)
}

/// Both pools discovered by a pod watch that has not listed yet, as right after a
/// scaler restart; the Deployments have 3 prefill and 2 decode replicas.
fn restarted_state() -> Shared {
    let state = Shared::default();
    {
        let mut f = state.lock().unwrap();
        f.list_hangs = true;
        f.scaled.insert("m-prefill".into(), 3);
        f.scaled.insert("m-decode".into(), 2);
    }
    state
}

fn pools_yaml(url: &str, mode: &str) -> String {
    format!(
        "interval_s: 0.1\nwindow_s: 2\nmode: {mode}\nkubernetes: {{namespace: llm, api_url: \"{url}\"}}\nmodels:\n  - name: m\n    prefill: {{selector: 'app=p', deployment: m-prefill, min_replicas: 0}}\n    decode: {{selector: 'app=d', deployment: m-decode, min_replicas: 0}}\n"
    )
}

#[tokio::test]
async fn regression_direct_mode_restart_scaled_blind_pools_to_zero() {
    // The bug: before the pod watch listed, a pool was blind, its current count fell
    // back to 0 and the blind hold held "current" — every restart patched both
    // Deployments to zero.
    let state = restarted_state();
    let url = fake_api(state.clone()).await;
    let (_grpc, stop) = start_scaler(pools_yaml(&url, "direct")).await;
    // Until it has held both pools (what it must do), nothing it patched may shrink.
    wait_for_async("both pools held", PATIENCE, async || {
        let f = state.lock().unwrap();
        f.history.contains(&("m-prefill".to_owned(), 3))
            && f.history.contains(&("m-decode".to_owned(), 2))
    })
    .await;
    // A few more ticks (interval 0.1 s): still nothing shrinks. (Deliberate: only time
    // passing shows it.)
    tokio::time::sleep(Duration::from_millis(500)).await;
    let f = state.lock().unwrap();
    for (deploy, replicas) in &f.history {
        let had = if deploy == "m-prefill" { 3 } else { 2 };
        assert!(
            *replicas >= had,
            "a restarted scaler shrank {deploy} from {had} to {replicas} (patches: {:?})",
            f.history
        );
    }
    assert_eq!((f.scaled["m-prefill"], f.scaled["m-decode"]), (3, 2));
    // It did act (held each pool at what its Deployment had), not just stay silent.
    for (deploy, had) in [("m-prefill", 3), ("m-decode", 2)] {
        assert!(
            f.history.contains(&(deploy.to_owned(), had)),
            "{deploy} was never held at {had}: {:?}",
            f.history
        );
    }
    drop(f);
    let _ = stop.send(());
}

#[tokio::test]
async fn regression_keda_mode_get_metrics_answered_zero_before_the_first_tick() {
    // In KEDA mode GetMetrics answered 0 until the first decision, and a blind pool
    // was held at 0 after that: HPA would shrink every pool on a scaler restart.
    use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
    use preheat_scaler::proto::{GetMetricsRequest, ScaledObjectRef};
    let state = restarted_state();
    let url = fake_api(state.clone()).await;
    let (grpc, stop) = start_scaler(pools_yaml(&url, "keda")).await;
    let t0 = Instant::now();
    // Looked for every 5 ms: the answers right after it listens are the point.
    let mut client = Wait::new("the scaler to listen", Duration::from_secs(10))
        .every(Duration::from_millis(5))
        .until_async(async || ExternalScalerClient::connect(grpc.clone()).await)
        .await;
    // Ask at once and for a while after: never fewer than the Deployment has, and,
    // once it read the Deployments, exactly that.
    let mut answered = [false; 2];
    while t0.elapsed() < Duration::from_millis(1500) {
        for (i, (pool, had)) in [("prefill", 3.0), ("decode", 2.0)].into_iter().enumerate() {
            let sref = ScaledObjectRef {
                name: format!("m-{pool}"),
                namespace: "llm".into(),
                scaler_metadata: [("pool".to_owned(), pool.to_owned())].into(),
            };
            let r = client
                .get_metrics(GetMetricsRequest {
                    scaled_object_ref: Some(sref),
                    metric_name: format!("preheat-m-{pool}"),
                })
                .await;
            match r {
                Ok(r) => {
                    let v = r.into_inner().metric_values[0].metric_value_float;
                    assert!(v >= had, "GetMetrics answered {v} for {pool} (has {had})");
                    answered[i] |= v == had;
                }
                // Not known yet: HPA keeps the replicas it has.
                Err(s) => assert_eq!(s.code(), tonic::Code::Unavailable, "{s}"),
            }
        }
        // Deliberate: asked for a while (1.5 s), at this pace.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        answered,
        [true, true],
        "the pools' real sizes were never answered"
    );
    assert!(
        state.lock().unwrap().history.is_empty(),
        "KEDA mode never patches"
    );
    let _ = stop.send(());
}

#[tokio::test]
async fn standbys_are_promoted_for_a_held_request_under_the_agents_pool_names() {
    // A request held at the gateway while decode is at zero: the scaler promotes a
    // parked standby on the agent its pod selector finds — under the agent's name for
    // the pool (`dec` here), which is what the agent's API knows.
    let calls: Arc<Mutex<Vec<String>>> = Arc::default();
    let agent = {
        let calls = Arc::clone(&calls);
        let app = Router::new()
            .route(
                "/standbys",
                get(|| async {
                    axum::Json(json!({"dec": {"count": 1, "parked": 1, "serving": []}}))
                }),
            )
            .route(
                "/standbys/{pool}/{verb}",
                axum::routing::post(move |Path((pool, verb)): Path<(String, String)>| {
                    let calls = Arc::clone(&calls);
                    async move {
                        calls.lock().unwrap().push(format!("{verb} {pool}"));
                        axum::Json(
                            json!({"url": "http://127.0.0.1:1", "port": 1, "promote_ms": 1.0}),
                        )
                    }
                }),
            );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        port
    };
    let gateway = {
        let app = Router::new().route(
            "/metrics",
            get(|| async { "preheat:gateway_pending_requests 1\n" }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        format!("http://{addr}/metrics")
    };
    let state = Shared::default();
    state.lock().unwrap().pods = vec![pod("agent-1", "127.0.0.1", true)];
    let url = fake_api(state.clone()).await;
    let yaml = format!(
        "interval_s: 0.1\nwindow_s: 2\nkubernetes: {{namespace: llm, api_url: \"{url}\"}}\nmodels:\n  - name: m\n    gateway: [\"{gateway}\"]\n    standbys: {{agent_selector: 'app=agent', agent_port: {agent}, prefill_pool: pre, decode_pool: dec}}\n    prefill: {{endpoints: [], min_replicas: 0}}\n    decode: {{endpoints: [], min_replicas: 0}}\n"
    );
    let (_grpc, stop) = start_scaler(yaml).await;
    wait_for_async("a decode standby promoted", PATIENCE, async || {
        calls.lock().unwrap().iter().any(|c| c == "promote dec")
    })
    .await;
    let seen = calls.lock().unwrap().clone();
    assert!(
        seen.iter().all(|c| c.ends_with(" dec")),
        "only the agent's pool names are used: {seen:?}"
    );
    let _ = stop.send(());
}

#[tokio::test]
async fn a_pool_losing_ready_pods_marks_them_with_their_load_before_it_scales_down() {
    // Three ready decode pods on three loopback addresses, one metrics port: idle,
    // busy and in between. The pool may keep one (max_replicas 1) and has three. (The
    // fake API lists every pod for every selector: prefill, held at three, sees them
    // too and never shrinks.)
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let mut listeners = vec![(l, 0u32)];
    for (ip, load) in [("127.0.0.2", 9u32), ("127.0.0.3", 2)] {
        listeners.push((
            tokio::net::TcpListener::bind((ip, port)).await.unwrap(),
            load,
        ));
    }
    for (l, load) in listeners {
        let text = format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {load}\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
        );
        let app = Router::new().route("/metrics", get(move || async move { text }));
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    }
    let state = Shared::default();
    {
        let mut f = state.lock().unwrap();
        f.pods = vec![
            pod("idle", "127.0.0.1", true),
            pod("busy", "127.0.0.2", true),
            pod("some", "127.0.0.3", true),
        ];
        for p in &mut f.pods {
            p["metadata"]["labels"] = json!({"app": "d"});
        }
        f.scaled.insert("m-decode".into(), 3);
    }
    let url = fake_api(state.clone()).await;
    let (_grpc, stop) = start_scaler(format!(
        "interval_s: 0.1\nwindow_s: 2\nmode: direct\nkubernetes: {{namespace: llm, api_url: \"{url}\", pod_deletion_cost: true}}\nmodels:\n  - name: m\n    prefill: {{selector: 'app=p', metrics_port: {port}, deployment: m-prefill, min_replicas: 3, max_replicas: 3}}\n    decode: {{selector: 'app=d', metrics_port: {port}, deployment: m-decode, min_replicas: 0, max_replicas: 1, scale_down_stabilization_s: 0}}\n"
    ))
    .await;
    wait_for_async("decode scaled down", PATIENCE, async || {
        let f = state.lock().unwrap();
        if f.scaled.get("m-decode").is_some_and(|&n| n < 3) {
            Ok(())
        } else {
            Err(format!("writes {:?}, scaled {:?}", f.writes, f.scaled))
        }
    })
    .await;
    let writes = state.lock().unwrap().writes.clone();
    let _ = stop.send(());
    let scale = writes
        .iter()
        .position(|w| w == "scale m-decode=1" || w == "scale m-decode=2")
        .expect("scaled down");
    let mut marked: Vec<&str> = writes[..scale]
        .iter()
        .filter(|w| w.starts_with("cost "))
        .map(String::as_str)
        .collect();
    marked.sort_unstable();
    // Each pod marked with its in-flight requests, before the scale-down.
    assert_eq!(
        marked,
        ["cost busy=9", "cost idle=0", "cost some=2"],
        "{writes:?}"
    );
}
