//! The gateway's workers the Kubernetes way: the Ready endpoints of each pool's
//! Service, read from its EndpointSlices through a watch (kube-rs reflector), so any
//! number of gateway replicas see the same workers and nothing has to register.
//! Promoted standbys, which are processes of the warm-pool agents rather than pods of
//! a pool, join from the agents' own lists (`GET /standbys`) — each reached at its
//! agent's address, so an agent can name a port of its own pod and nothing else.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use preheat_engine::disagg::WorkerRole;
use preheat_engine::disagg::gateway::WorkerSource;
use preheat_scaler::standbys;

/// One pool's Service, watched.
struct Pool {
    role: WorkerRole,
    service: String,
    store: Store<EndpointSlice>,
}

/// The prefill and decode pools' Ready endpoints.
pub struct EndpointSlices {
    pools: Vec<Pool>,
    /// Serving standbys read from the agents, refreshed by a task of their own.
    standbys: Arc<Mutex<Vec<(WorkerRole, String)>>>,
}

/// How often the agents' standby lists are read (the gateway's discovery pace).
const AGENT_POLL: Duration = Duration::from_millis(500);

impl std::fmt::Debug for EndpointSlices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.pools.iter().map(|p| &p.service))
            .finish()
    }
}

impl EndpointSlices {
    /// Watches the EndpointSlices of `services` (role, Service name) in `namespace`,
    /// and with `agents` (the warm-pool agents' Service, and the agents' names of the
    /// pools whose standbys join each role) reads each Ready agent's serving
    /// standbys; each watch reconnects with backoff while the runtime runs.
    pub fn watch(
        client: kube::Client,
        namespace: &str,
        services: &[(WorkerRole, String)],
        agents: Option<(&str, Vec<(WorkerRole, String)>)>,
        token: Option<Arc<preheat_edge::ClusterToken>>,
    ) -> Arc<Self> {
        let standbys = Arc::new(Mutex::new(Vec::new()));
        if let Some((service, pools)) = agents {
            let store = slice_store(client.clone(), namespace, service);
            tokio::spawn(poll_agents(store, pools, Arc::clone(&standbys), token));
        }
        let pools = services
            .iter()
            .map(|(role, service)| Pool {
                role: *role,
                service: service.clone(),
                store: slice_store(client.clone(), namespace, service),
            })
            .collect();
        Arc::new(EndpointSlices { pools, standbys })
    }
}

/// A reflector over `service`'s EndpointSlices.
fn slice_store(client: kube::Client, namespace: &str, service: &str) -> Store<EndpointSlice> {
    let api: Api<EndpointSlice> = Api::namespaced(client, namespace);
    let (reader, writer) = reflector::store();
    // Only slices the EndpointSlice controller made from the Service's selector:
    // whoever may create EndpointSlices cannot list an address of their own for the
    // gateway to send prompts to.
    let cfg = watcher::Config::default().labels(&format!(
        "kubernetes.io/service-name={service},endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io"
    ));
    let stream = reflector::reflector(writer, watcher(api, cfg)).default_backoff();
    let svc = service.to_owned();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            if let Err(e) = ev {
                tracing::warn!(service = %svc, error = %e, "EndpointSlice watch");
            }
        }
    });
    reader
}

/// Reads every Ready agent's serving standbys into `out`, every [`AGENT_POLL`]. An
/// agent that does not answer lists nothing: the gateway stops sending new requests
/// to standbys it cannot vouch for (in-flight ones finish).
async fn poll_agents(
    agents: Store<EndpointSlice>,
    pools: Vec<(WorkerRole, String)>,
    out: Arc<Mutex<Vec<(WorkerRole, String)>>>,
    token: Option<Arc<preheat_edge::ClusterToken>>,
) {
    // The agents' API asks for the cluster token; this client goes nowhere else.
    let client = preheat_edge::client::internal_with_token(token.as_deref());
    loop {
        let bases: Vec<String> = agents.state().iter().flat_map(|s| ready_urls(s)).collect();
        let read = standbys::read_agents(&client, &bases, Duration::from_secs(2)).await;
        let listed = pools
            .iter()
            .flat_map(|(role, pool)| {
                standbys::serving_urls(&read, pool, "")
                    .into_iter()
                    .map(move |u| (*role, u))
            })
            .collect();
        *out.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = listed;
        tokio::time::sleep(AGENT_POLL).await;
    }
}

impl WorkerSource for EndpointSlices {
    fn workers(&self) -> Vec<(WorkerRole, String)> {
        let mut out = Vec::new();
        for pool in &self.pools {
            for slice in pool.store.state() {
                out.extend(ready_urls(&slice).into_iter().map(|u| (pool.role, u)));
            }
        }
        out.extend(
            self.standbys
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .cloned(),
        );
        out.sort_by(|a, b| (a.0.as_str(), &a.1).cmp(&(b.0.as_str(), &b.1)));
        out.dedup();
        out
    }
}

/// `http://address:port` of each Ready endpoint of a slice, the port being the one
/// named `http` (or the slice's only port).
fn ready_urls(slice: &EndpointSlice) -> Vec<String> {
    // FQDN slices name hosts, not pods.
    if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
        return Vec::new();
    }
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = ports
        .iter()
        .find(|p| p.name.as_deref() == Some("http"))
        .or_else(|| (ports.len() == 1).then(|| &ports[0]))
        .and_then(|p| p.port);
    let Some(port) = port else {
        return Vec::new();
    };
    slice
        .endpoints
        .iter()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .filter_map(|e| e.addresses.first())
        .map(|a| {
            if a.contains(':') {
                format!("http://[{a}]:{port}")
            } else {
                format!("http://{a}:{port}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ready_endpoints_on_the_http_port() {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "d-abc"},
            "addressType": "IPv4",
            "ports": [{"name": "kv", "port": 8101}, {"name": "http", "port": 8100}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": false, "terminating": true}},
                {"addresses": ["10.0.0.3"]},
                {"addresses": ["fd00::7"], "conditions": {"ready": true}}
            ]
        }))
        .unwrap();
        assert_eq!(
            ready_urls(&slice),
            ["http://10.0.0.1:8100", "http://[fd00::7]:8100"]
        );
        let mut fqdn = slice;
        fqdn.address_type = "FQDN".into();
        assert!(ready_urls(&fqdn).is_empty());
    }
}
