//! The internal routes workers call: registration, heartbeats, leaving, and the
//! operators' `/internal/workers` view.

use super::fleet::Fleet;
use super::*;

pub(super) fn conflict(msg: String) -> Response {
    (StatusCode::CONFLICT, msg).into_response()
}

/// Why a worker's addresses cannot be announced to decode workers, if they cannot.
pub(super) fn unannounceable(url: &str, kv: Option<&str>) -> Option<String> {
    let max = crate::disagg::peers::MAX_ADDRESS_LEN;
    (url.len() > max || kv.is_some_and(|k| k.len() > max))
        .then(|| format!("a worker's URL and KV address are at most {max} bytes"))
}

pub(super) async fn register(
    State(fleet): State<Arc<Fleet>>,
    Json(r): Json<Registration>,
) -> Response {
    if let Some(why) = unannounceable(&r.url, r.kv.as_deref()) {
        return (StatusCode::BAD_REQUEST, why).into_response();
    }
    let gw = match fleet.for_worker(&r) {
        Ok(gw) => Arc::clone(gw),
        Err(msg) => {
            tracing::warn!("refusing worker: {msg}");
            return conflict(msg);
        }
    };
    // A worker that speaks another KV format version reads requests differently: an
    // older one would drop the fields it does not know (a grammar, say) without a word.
    let ours = crate::kv::payload::FORMAT_VERSION;
    if r.kv_format != ours {
        let msg = format!(
            "worker {} ({} at {}) speaks KV format version {}, this gateway {ours}",
            r.id, r.model, r.url, r.kv_format
        );
        tracing::warn!("refusing worker: {msg}");
        return conflict(msg);
    }
    let known = gw.lock().compat.clone();
    match known {
        Some(c) if c != r.compat => {
            let msg = format!(
                "worker {} ({} at {}) has KV compatibility hash {}, this gateway serves {}: another model or KV layout",
                r.id, r.model, r.url, r.compat, c
            );
            tracing::warn!("refusing worker: {msg}");
            return conflict(msg);
        }
        Some(_) => {}
        None => {
            // The first worker teaches the gateway its model.
            let info: ModelInfo = match async {
                gw.client
                    .get(format!("{}/internal/model", r.url))
                    .cluster_token(gw.token())
                    .timeout(Duration::from_secs(30))
                    .send()
                    .await?
                    .error_for_status()?
                    .json()
                    .await
            }
            .await
            {
                Ok(i) => i,
                Err(e) => {
                    return (
                        StatusCode::BAD_GATEWAY,
                        format!("reading {}/internal/model: {e}", r.url),
                    )
                        .into_response();
                }
            };
            if info.compat != r.compat {
                return conflict("the worker's model answer contradicts its registration".into());
            }
            if let Err(e) = gw.install_front(info) {
                return (StatusCode::BAD_GATEWAY, e.to_string()).into_response();
            }
        }
    }
    // One rotation per worker: an address another model's worker had (a restart on a
    // reused port) leaves that model's rotation, or its heartbeats would keep the old
    // entry alive and that model's requests would reach these weights.
    for other in fleet.gateways.iter().filter(|g| !Arc::ptr_eq(g, &gw)) {
        other.drop_worker(&r.id, "registered again for another model");
    }
    tracing::info!(worker = %r.id, role = r.role.as_str(), url = %r.url, "worker registered");
    {
        let mut g = gw.lock();
        g.workers
            .insert(r.id.clone(), Entry::new(r, Load::default()));
        gw.count_workers(&g);
    }
    gw.announce_now.notify_one();
    gw.room.room_may_have_freed();
    StatusCode::OK.into_response()
}

pub(super) async fn heartbeat(
    State(fleet): State<Arc<Fleet>>,
    Json(mut h): Json<Heartbeat>,
) -> Response {
    h.blocks.truncate(MAX_PEER_BLOCKS);
    let Some(gw) = fleet.holding(&h.id) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let mut g = gw.lock();
    match g.workers.get_mut(&h.id) {
        Some(e) => {
            let now = e.in_flight.snapshot();
            e.report(h.load, now);
            if e.reg.role == WorkerRole::Decode {
                gw.room.room_may_have_freed();
            }
            if e.reg.role == WorkerRole::Prefill {
                g.prefix.0.entry(h.id).or_default().replace(&h.blocks);
            }
            StatusCode::OK.into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[derive(serde::Deserialize)]
pub(super) struct Deregister {
    id: String,
}

pub(super) async fn deregister(
    State(fleet): State<Arc<Fleet>>,
    Json(d): Json<Deregister>,
) -> Response {
    let Some(gw) = fleet.holding(&d.id) else {
        return StatusCode::OK.into_response();
    };
    let mut g = gw.lock();
    if g.workers.remove(&d.id).is_some() {
        tracing::info!(worker = %d.id, "worker deregistered");
    }
    gw.count_workers(&g);
    drop(g);
    StatusCode::OK.into_response()
}

pub(super) async fn workers(State(fleet): State<Arc<Fleet>>) -> Json<serde_json::Value> {
    let mut list = Vec::new();
    for gw in &fleet.gateways {
        let model = gw.model_name().unwrap_or_default().to_owned();
        let g = gw.lock();
        list.extend(g.workers.values().map(|e| {
            let mut w = serde_json::json!({"id": e.reg.id, "model": model, "role": e.reg.role, "url": e.reg.url, "load": e.load, "in_flight": e.in_flight.requests()});
            if e.reg.role == WorkerRole::Decode {
                // How many prefill workers it was told it may pull from.
                w["prefill_peers"] = e.told_now().len().into();
            }
            w
        }));
    }
    list.sort_by_key(|v| v["id"].as_str().unwrap_or("").to_owned());
    Json(serde_json::json!({"workers": list}))
}
