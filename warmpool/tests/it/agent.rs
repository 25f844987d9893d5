//! The agent end to end, in process: it stages a good model and keeps it hot, reports a
//! model whose source is broken as failed (with the reason) without stopping, exports
//! its metrics, labels its node through a fake Kubernetes API server, seeds the kernel
//! cache, and stages on request.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::IntoResponse;
use axum::routing::get;
use preheat_snapshot::NoProgress;
use preheat_snapshot::synth::{SynthOptions, synthesize};
use preheat_testkit::wait_for_async;
use preheat_warmpool::config::AgentConfig;
use serde_json::{Value, json};

#[derive(Default)]
struct FakeNode {
    labels: serde_json::Map<String, Value>,
    patches: Vec<Value>,
}

type Node = Arc<Mutex<FakeNode>>;

async fn get_node(State(n): State<Node>, Path(name): Path<String>) -> impl IntoResponse {
    let labels = n.lock().unwrap().labels.clone();
    axum::Json(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "resourceVersion": "1", "labels": labels},
    }))
}

async fn patch_node(
    State(n): State<Node>,
    Path(name): Path<String>,
    body: Bytes,
) -> impl IntoResponse {
    let p: Value = serde_json::from_slice(&body).unwrap();
    let mut f = n.lock().unwrap();
    if let Some(l) = p["metadata"]["labels"].as_object() {
        for (k, v) in l {
            if v.is_null() {
                f.labels.remove(k);
            } else {
                f.labels.insert(k.clone(), v.clone());
            }
        }
    }
    f.patches.push(p);
    let labels = f.labels.clone();
    axum::Json(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "resourceVersion": "2", "labels": labels},
    }))
}

/// How long staging and labelling may take to show.
const PATIENCE: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_stages_keeps_hot_labels_and_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("good.preheat");
    synthesize("tiny", &src, SynthOptions::default(), &NoProgress).unwrap();
    let node = Node::default();
    node.lock()
        .unwrap()
        .labels
        .insert("preheat.dev/stale".into(), json!("hot"));
    let api = axum::Router::new()
        .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
        .with_state(Arc::clone(&node));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, api).await });

    let yaml = format!(
        r#"
dir: {dir}
disk_budget: 1GiB
memory_budget: 64MiB
listen: 127.0.0.1:0
refresh_secs: 0.2
kernel_cache_dir: {kernels}
kubernetes: {{node_name: node-1, api_url: "{api_url}"}}
models:
  - {{name: good, source: "{src}", hot: true}}
  - {{name: broken, source: "{missing}"}}
"#,
        dir = tmp.path().join("node").display(),
        kernels = tmp.path().join("kernels").display(),
        src = src.display(),
        missing = tmp.path().join("missing.preheat").display(),
    );
    let cfg = AgentConfig::from_yaml(&yaml, None).unwrap();
    let l = tokio::net::TcpListener::bind(cfg.listen).await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(preheat_warmpool::agent::run(cfg, l, async move {
        let _ = stop_rx.await;
    }));
    let c = reqwest::Client::new();
    let models = async || -> Vec<Value> {
        match c.get(format!("{url}/models")).send().await {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => Vec::new(),
        }
    };
    wait_for_async("good is hot", PATIENCE, async || {
        models()
            .await
            .iter()
            .any(|m| m["name"] == "good" && m["state"] == "hot")
    })
    .await;
    let ms = models().await;
    let good = ms.iter().find(|m| m["name"] == "good").unwrap();
    assert!(good["resident_bytes"].as_u64().unwrap() > 0, "{good}");
    assert_eq!(good["progress"], 1.0);
    let broken = ms.iter().find(|m| m["name"] == "broken").unwrap();
    assert_eq!(broken["state"], "failed", "{broken}");
    assert!(
        broken["error"]
            .as_str()
            .unwrap()
            .contains("missing.preheat"),
        "{broken}"
    );
    // The node carries our label and lost the stale one.
    wait_for_async("node labelled", PATIENCE, async || {
        let l = node.lock().unwrap().labels.clone();
        l.get("preheat.dev/good") == Some(&json!("hot")) && !l.contains_key("preheat.dev/stale")
    })
    .await;
    let patches = node.lock().unwrap().patches.len();
    // Deliberate: a few refreshes go by (every 0.2 s), which only time passing shows.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        node.lock().unwrap().patches.len(),
        patches,
        "unchanged labels are not patched again"
    );
    let metrics = c
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for needle in [
        "preheat:warmpool_staged_models 1",
        "preheat:warmpool_hot_models 1",
        "preheat:warmpool_staging_failures_total{model=\"broken\"}",
        "preheat:warmpool_staging_progress_ratio{model=\"good\"} 1",
        "preheat:warmpool_resident_bytes{model=\"good\"}",
        "preheat:warmpool_kernel_cache_entries 0",
        "preheat:warmpool_disk_budget_bytes 1073741824",
    ] {
        assert!(metrics.contains(needle), "{needle} missing:\n{metrics}");
    }
    // Staging on request: configured → already staged; unknown → 404.
    let r: Value = c
        .post(format!("{url}/models/good/stage"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["already_staged"], true, "{r}");
    let r = c
        .post(format!("{url}/models/nope/stage"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = c
        .post(format!("{url}/models/broken/stage"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(10), agent)
        .await
        .expect("agent stops")
        .unwrap()
        .unwrap();
}
