//! The API server the emulated pods talk to: pods and EndpointSlices (list, and watch
//! as a stream of ADDED/MODIFIED/DELETED events computed from the emulator's state), and
//! the Deployments' scale subresource (get and patch, as the scaler in direct mode and
//! a restarted scaler read it), and a pod's annotations (merge patch: the scaler's
//! deletion cost).

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use super::emulator::{NS, Shared, endpoint_slice, matches, pod_json, set_scale};

type Q = Query<BTreeMap<String, String>>;

/// The objects of `kind` a query selects, by name, at `rv`.
fn objects(s: &Shared, kind: &str, selector: &str, rv: u64) -> BTreeMap<String, Value> {
    let st = s.lock().unwrap();
    match kind {
        "pods" => st
            .pods
            .values()
            .filter(|p| matches(selector, &p.labels))
            .map(|p| (p.name.clone(), pod_json(p, rv)))
            .collect(),
        _ => {
            let pods: Vec<_> = st.pods.values().collect();
            st.objects
                .iter()
                .filter(|o| o["kind"] == "Service")
                .map(|svc| endpoint_slice(svc, &pods, rv))
                .filter(|sl| {
                    let labels = sl["metadata"]["labels"]
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                        .collect();
                    matches(selector, &labels)
                })
                .map(|sl| (sl["metadata"]["name"].as_str().unwrap().to_owned(), sl))
                .collect()
        }
    }
}

/// Without the resourceVersion (which changes on every read), for comparing.
fn content(v: &Value) -> Value {
    let mut v = v.clone();
    v["metadata"]["resourceVersion"] = Value::Null;
    v
}

async fn list_or_watch(s: Shared, kind: &'static str, q: BTreeMap<String, String>) -> Response {
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    let (api_version, list_kind) = match kind {
        "pods" => ("v1", "PodList"),
        _ => ("discovery.k8s.io/v1", "EndpointSliceList"),
    };
    let rv = next_rv();
    if !q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        let items: Vec<Value> = objects(&s, kind, &selector, rv).into_values().collect();
        return axum::Json(json!({
            "apiVersion": api_version, "kind": list_kind,
            "metadata": {"resourceVersion": rv.to_string()}, "items": items,
        }))
        .into_response();
    }
    // A watch: every 100 ms, what changed since the last look.
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .unwrap_or(290u64);
    let start = objects(&s, kind, &selector, rv);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    let stream = futures_util::stream::unfold(
        (start, std::collections::VecDeque::<Value>::new()),
        move |(mut seen, mut queue)| {
            let s = s.clone();
            let selector = selector.clone();
            async move {
                loop {
                    if let Some(ev) = queue.pop_front() {
                        let mut line = serde_json::to_vec(&ev).unwrap();
                        line.push(b'\n');
                        return Some((Ok::<_, std::io::Error>(Bytes::from(line)), (seen, queue)));
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return None;
                    }
                    // Deliberate: the watch's own period (see above).
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let rv = next_rv();
                    let now = objects(&s, kind, &selector, rv);
                    for (name, obj) in &now {
                        match seen.get(name) {
                            None => queue.push_back(json!({"type": "ADDED", "object": obj})),
                            Some(old) if content(old) != content(obj) => {
                                queue.push_back(json!({"type": "MODIFIED", "object": obj}));
                            }
                            _ => {}
                        }
                    }
                    for (name, old) in &seen {
                        if !now.contains_key(name) {
                            let mut gone = old.clone();
                            gone["metadata"]["resourceVersion"] = json!(rv.to_string());
                            queue.push_back(json!({"type": "DELETED", "object": gone}));
                        }
                    }
                    seen = now;
                }
            }
        },
    );
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}

fn next_rv() -> u64 {
    static RV: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(100);
    RV.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
}

fn scale_json(name: &str, replicas: i64) -> Value {
    json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": next_rv().to_string()},
        "spec": {"replicas": replicas}, "status": {"replicas": replicas}
    })
}

fn not_found(what: &str) -> Response {
    let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": format!("{what} not found"), "reason": "NotFound", "code": 404});
    (StatusCode::NOT_FOUND, axum::Json(status)).into_response()
}

async fn get_scale(State(s): State<Shared>, Path((_ns, name)): Path<(String, String)>) -> Response {
    let r = s.lock().unwrap().scale.get(&name).copied();
    match r {
        Some(r) => axum::Json(scale_json(&name, r)).into_response(),
        None => not_found(&format!("deployments.apps \"{name}\"")),
    }
}

async fn patch_scale(
    State(s): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    if !s.lock().unwrap().scale.contains_key(&name) {
        return not_found(&format!("deployments.apps \"{name}\""));
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(r) = v["spec"]["replicas"].as_i64() else {
        return (StatusCode::BAD_REQUEST, "no spec.replicas").into_response();
    };
    set_scale(&s, &name, r, "scaler (direct)");
    axum::Json(scale_json(&name, r)).into_response()
}

/// A merge patch of a pod's annotations; anything else in it is refused, as the
/// scaler sends nothing else.
async fn patch_pod(
    State(s): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let only_annotations = v
        .as_object()
        .is_some_and(|o| o.keys().all(|k| k == "metadata"))
        && v["metadata"]
            .as_object()
            .is_some_and(|m| m.keys().all(|k| k == "annotations"));
    let Some(annotations) = v["metadata"]["annotations"]
        .as_object()
        .filter(|_| only_annotations)
    else {
        return (StatusCode::BAD_REQUEST, "only metadata.annotations").into_response();
    };
    let mut st = s.lock().unwrap();
    let Some(p) = st.pods.get_mut(&name) else {
        return not_found(&format!("pods \"{name}\""));
    };
    for (k, val) in annotations {
        match val.as_str() {
            Some(val) => p.annotations.insert(k.clone(), val.to_owned()),
            None => p.annotations.remove(k),
        };
    }
    axum::Json(pod_json(p, next_rv())).into_response()
}

/// Serves on `host` (the cluster network's host address); returns the base URL.
pub async fn serve(state: Shared, host: &str) -> String {
    let app = axum::Router::new()
        .route(
            &format!("/api/v1/namespaces/{NS}/pods"),
            get(|State(s): State<Shared>, Query(q): Q| list_or_watch(s, "pods", q)),
        )
        .route(
            &format!("/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"),
            get(|State(s): State<Shared>, Query(q): Q| list_or_watch(s, "endpointslices", q)),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            axum::routing::patch(patch_pod),
        )
        .route(
            "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
            get(get_scale).patch(patch_scale),
        )
        .with_state(state);
    let l = tokio::net::TcpListener::bind(format!("{host}:0"))
        .await
        .unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    url
}
