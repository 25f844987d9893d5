//! Kubernetes: engine pods found by label selector through a watch (a reflector keeps
//! the set current without polling the API server), and **direct mode**, which sets a
//! Deployment's replicas through its `scale` subresource for clusters without KEDA.
//!
//! RBAC this needs and nothing more (namespace-scoped Role):
//!
//! ```yaml
//! rules:
//!   - apiGroups: [""]
//!     resources: [pods]
//!     verbs: [list, watch]          # discovery
//!     # + patch with `pod_deletion_cost` (the idlest pod goes first on a scale-down)
//!   - apiGroups: [apps]
//!     resources: [deployments/scale]
//!     resourceNames: [the pools' Deployments]
//!     verbs: [get]                  # a pool's real size when its metrics cannot say
//!     # + patch in direct mode
//! ```

use std::collections::BTreeMap;

use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Config};

use crate::{Result, ScalerError};

/// A client for the in-cluster service account or the local kubeconfig, or for
/// `url` when given (tests, `kubectl proxy`).
pub async fn client(url: Option<&str>) -> Result<Client> {
    let cfg = match url {
        Some(u) => {
            let uri = u
                .parse()
                .map_err(|e| ScalerError::Config(vec![format!("kubernetes.api_url {u:?}: {e}")]))?;
            Config::new(uri)
        }
        None => Config::infer().await?,
    };
    Client::try_from(cfg).map_err(|source| ScalerError::Kube {
        what: "client".into(),
        source,
    })
}

/// Pods matching one pool's selector, kept current by a watch.
#[derive(Clone)]
pub struct PodSet {
    store: Store<Pod>,
    port: u16,
    path: String,
}

impl std::fmt::Debug for PodSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodSet")
            .field("pods", &self.store.state().len())
            .field("port", &self.port)
            .finish()
    }
}

/// What a pool's pods are doing now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodView {
    /// `/metrics` URLs of ready pods, by pod name.
    pub ready: BTreeMap<String, String>,
    /// Pods that exist and are not terminating (ready or starting).
    pub current: u32,
    /// The deletion cost each ready pod carries now, by pod name (`None`: none set).
    pub deletion_cost: BTreeMap<String, Option<i32>>,
}

/// The annotation a ReplicaSet reads to choose which pods go first on a scale-down:
/// the lowest cost first (after pods that are not ready).
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

impl PodSet {
    /// Starts watching `selector` in `namespace`; the watch reconnects with backoff for
    /// as long as the returned set lives in a running runtime.
    #[must_use]
    pub fn watch(client: Client, namespace: &str, selector: &str, port: u16, path: &str) -> Self {
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let (reader, writer) = reflector::store();
        let cfg = watcher::Config::default().labels(selector);
        let sel = selector.to_owned();
        let stream = reflector::reflector(writer, watcher(api, cfg)).default_backoff();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                if let Err(e) = ev {
                    tracing::warn!(selector = %sel, error = %e, "pod watch");
                }
            }
        });
        PodSet {
            store: reader,
            port,
            path: path.to_owned(),
        }
    }

    /// Whether the first list has arrived (before it, the pool is unknown, not empty).
    #[must_use]
    pub fn synced(&self) -> bool {
        // A store is ready once the watcher's initial list completed.
        futures_util::FutureExt::now_or_never(self.store.wait_until_ready())
            .is_some_and(|r| r.is_ok())
    }

    #[must_use]
    pub fn view(&self) -> PodView {
        let mut v = PodView::default();
        for pod in self.store.state() {
            if pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let status = pod.status.as_ref();
            let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("");
            if matches!(phase, "Succeeded" | "Failed") {
                continue;
            }
            v.current += 1;
            let ready = status
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let ip = status.and_then(|s| s.pod_ip.as_deref());
            if let (true, Some(ip), Some(name)) = (ready, ip, pod.metadata.name.as_ref()) {
                let host = if ip.contains(':') {
                    format!("[{ip}]")
                } else {
                    ip.to_owned()
                };
                v.ready.insert(
                    name.clone(),
                    format!("http://{host}:{}{}", self.port, self.path),
                );
                let cost = pod
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(DELETION_COST))
                    .and_then(|c| c.parse().ok());
                v.deletion_cost.insert(name.clone(), cost);
            }
        }
        v
    }
}

/// `deployment`'s desired replicas, read through the scale subresource: what a pool
/// has when its metrics cannot say (a starting scaler, a watch not yet listed, a
/// Prometheus outage).
pub async fn deployment_replicas(client: Client, namespace: &str, deployment: &str) -> Result<u32> {
    let api: Api<Deployment> = Api::namespaced(client, namespace);
    let scale = api
        .get_scale(deployment)
        .await
        .map_err(|source| ScalerError::Kube {
            what: format!("read scale {namespace}/{deployment}"),
            source,
        })?;
    Ok(scale
        .spec
        .and_then(|s| s.replicas)
        .map_or(0, |r| u32::try_from(r).unwrap_or(0)))
}

/// Sets `deployment`'s replicas through the scale subresource (direct mode); returns
/// the replicas the API server reports afterwards.
pub async fn scale_deployment(
    client: Client,
    namespace: &str,
    deployment: &str,
    replicas: u32,
) -> Result<u32> {
    let api: Api<Deployment> = Api::namespaced(client, namespace);
    let patch = serde_json::json!({ "spec": { "replicas": replicas } });
    let scale = api
        .patch_scale(deployment, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|source| ScalerError::Kube {
            what: format!("scale {namespace}/{deployment}"),
            source,
        })?;
    Ok(scale
        .spec
        .and_then(|s| s.replicas)
        .map_or(0, |r| u32::try_from(r).unwrap_or(0)))
}

/// Sets `pod`'s deletion cost (a merge patch of that one annotation).
pub async fn set_deletion_cost(
    client: Client,
    namespace: &str,
    pod: &str,
    cost: i32,
) -> Result<()> {
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let patch = serde_json::json!({
        "metadata": { "annotations": { DELETION_COST: cost.to_string() } }
    });
    api.patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|source| ScalerError::Kube {
            what: format!("annotate {namespace}/{pod} with its deletion cost"),
            source,
        })?;
    Ok(())
}
