//! A prefill or decode worker process: loads the model, serves its internal endpoints
//! (`/internal/load` for a gateway that discovers it), `/health` and `/metrics`,
//! registers with the gateway and heartbeats when given one; on SIGTERM it deregisters
//! (or, discovered, leaves as its endpoint turns not-ready), finishes what it holds
//! within the grace period, and exits.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use super::peers::{Announcement, KnownPeers};
use super::wire::http_pull::{HttpPull, prefill_answer};
use super::wire::kv_transport::{KvTransport, check_matches};
use super::wire::messages::{
    GenerateBody, Heartbeat, Load, ModelInfo, PrefillBody, Registration, WireError, WireEvent,
    WorkerRole, WorkerStatus,
};
use super::wire::tcp::{TcpTransport, serve_tcp};
use crate::colocated::{ServeOptions, load_engine};
use crate::engine::{Engine, Event, GenerateRequest};
use crate::frontend::Frontend;
use crate::{EngineError, Result};
use preheat_edge::{ClusterToken, WithClusterToken};

/// Options of a worker process.
#[derive(Clone, Debug)]
#[must_use]
pub struct WorkerOptions {
    pub serve: ServeOptions,
    pub role: WorkerRole,
    /// Gateway base URL to register with and heartbeat to; `None` where the gateway
    /// discovers workers itself (Kubernetes EndpointSlices) and reads
    /// `/internal/load` instead.
    pub gateway: Option<String>,
    /// Base URL others reach this worker at.
    pub advertise: String,
    pub heartbeat: Duration,
    /// Longest a decode worker waits for a prefill worker's K/V.
    pub transfer_timeout: Duration,
    /// Prefill workers: the bound KV transport listener and the address others reach
    /// it at (`tcp://host:port`).
    pub kv_listener: Option<(std::net::SocketAddr, String)>,
}

/// A promotion request: when it was asked for, and where to say how long it took.
type Promotion = (std::time::Instant, tokio::sync::oneshot::Sender<f64>);

#[derive(Clone)]
struct WorkerState {
    engine: Arc<OnceLock<Engine>>,
    /// `loading`, `standby` or `serving`.
    phase: Arc<std::sync::Mutex<&'static str>>,
    /// Set while parked as a standby.
    promote: Arc<std::sync::Mutex<Option<tokio::sync::oneshot::Sender<Promotion>>>>,
    role: WorkerRole,
    client: reqwest::Client,
    transfer_timeout: Duration,
    /// Prefill workers: where others pull K/V from.
    kv: Option<String>,
    token: Option<Arc<ClusterToken>>,
    /// Decode workers: the prefill workers the gateways announced, the only ones K/V is
    /// pulled from.
    peers: Arc<KnownPeers>,
    /// Turns true when a drain's grace runs out with K/V still being pulled.
    grace_over: tokio::sync::watch::Receiver<bool>,
}

impl WorkerState {
    fn engine(&self) -> std::result::Result<&Engine, Box<Response>> {
        self.engine.get().ok_or_else(|| {
            Box::new(wire_error(
                &EngineError::Unavailable("the model is still loading".into()),
                false,
            ))
        })
    }
}

fn wire_error(e: &EngineError, prefill_failed: bool) -> Response {
    WireError::from_engine(e, prefill_failed).into_response()
}

async fn health(State(st): State<WorkerState>) -> Response {
    crate::api::health_of(st.engine.get().map(|e| e as &dyn Frontend))
}

async fn metrics(State(st): State<WorkerState>) -> Response {
    crate::api::metrics_of(st.engine.get().map(|e| e as &dyn Frontend))
}

/// Role, KV address and load, for a gateway that discovers its workers.
async fn load(State(st): State<WorkerState>) -> Response {
    let e = match st.engine() {
        Ok(e) => e,
        Err(r) => return *r,
    };
    Json(status_of_worker(e, st.role, st.kv.clone())).into_response()
}

fn status_of_worker(e: &Engine, role: WorkerRole, kv: Option<String>) -> WorkerStatus {
    let mut blocks = if role == WorkerRole::Prefill {
        e.cached_blocks()
    } else {
        Vec::new()
    };
    blocks.truncate(MAX_REPORTED_BLOCKS);
    WorkerStatus {
        role,
        kv,
        load: load_of(e),
        blocks,
    }
}

async fn state(State(st): State<WorkerState>) -> Response {
    let phase = *st.phase.lock().expect("no panics while held");
    Json(serde_json::json!({"state": phase})).into_response()
}

/// Promotes a parked standby: answers once the worker is registered with the gateway
/// (serving), with how long that took.
async fn promote(State(st): State<WorkerState>) -> Response {
    let t0 = std::time::Instant::now();
    let Some(tx) = st.promote.lock().expect("no panics while held").take() else {
        let phase = *st.phase.lock().expect("no panics while held");
        return (
            StatusCode::CONFLICT,
            Json(serde_json::json!({"state": phase, "error": "not a parked standby"})),
        )
            .into_response();
    };
    let (reply_tx, reply_rx) = tokio::sync::oneshot::channel();
    if tx.send((t0, reply_tx)).is_err() {
        return (StatusCode::SERVICE_UNAVAILABLE, "worker stopping").into_response();
    }
    match reply_rx.await {
        Ok(secs) => {
            Json(serde_json::json!({"state": "serving", "promote_ms": secs * 1e3})).into_response()
        }
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "registration failed").into_response(),
    }
}

async fn model(State(st): State<WorkerState>) -> Response {
    let e = match st.engine() {
        Ok(e) => e,
        Err(r) => return *r,
    };
    match e.tokenizer.to_parts() {
        Ok(tokenizer) => Json(ModelInfo {
            model: e.model_name.clone(),
            compat: e.compat().to_owned(),
            block_size: e.kv_layout().block_size,
            max_model_len: e.max_model_len,
            vocab_size: e.vocab_size(),
            tokenizer,
        })
        .into_response(),
        Err(err) => wire_error(&err, false),
    }
}

/// Prefill role: compute the prompt's K/V and first token, answer with one KV
/// transfer message.
async fn prefill(State(st): State<WorkerState>, Json(b): Json<PrefillBody>) -> Response {
    if st.role != WorkerRole::Prefill {
        return wire_error(&EngineError::invalid("not a prefill worker", "role"), false);
    }
    if let Err(err) = b.params.check() {
        return wire_error(&err, false);
    }
    let e = match st.engine() {
        Ok(e) => e,
        Err(r) => return *r,
    };
    match prefill_answer(e, b).await {
        Ok(buf) => ([(header::CONTENT_TYPE, "application/octet-stream")], buf).into_response(),
        Err(err) => wire_error(&err, false),
    }
}

/// Decode role: a gateway's list of the prefill workers this worker may pull from.
async fn peers(State(st): State<WorkerState>, Json(a): Json<Announcement>) -> Response {
    if st.role != WorkerRole::Decode {
        return wire_error(&EngineError::invalid("not a decode worker", "role"), false);
    }
    match st.peers.announce(a) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => wire_error(&EngineError::invalid(err.to_string(), "prefill"), false),
    }
}

/// Decode role: reserve blocks, pull the K/V (or prefill here), decode, stream NDJSON.
async fn generate(State(st): State<WorkerState>, Json(b): Json<GenerateBody>) -> Response {
    if st.role != WorkerRole::Decode {
        return wire_error(&EngineError::invalid("not a decode worker", "role"), false);
    }
    // Held to the public API's bounds: a peer cannot ask for what a client may not.
    if let Err(err) = b.params.check() {
        return wire_error(&err, false);
    }
    let e = match st.engine() {
        Ok(e) => e.clone(),
        Err(r) => return *r,
    };
    // What could never run here is refused before anything is reserved or queued
    // (asked again, it would only wait), marked as this worker's limit where it is the
    // length, so the gateway may try a larger worker.
    let req = GenerateRequest {
        prompt: b.prompt.clone(),
        params: b.params.clone(),
    };
    if let Err(err) = crate::engine::request::check(&req, e.vocab_size(), e.max_model_len) {
        let mut w = WireError::from_engine(&err, false);
        w.too_large = b.prompt.len() + b.params.max_tokens > e.max_model_len;
        return (StatusCode::BAD_REQUEST, Json(w)).into_response();
    }
    let handle = match &b.prefill {
        None => e.submit(req),
        Some(url) => {
            // Only from a prefill worker a gateway announced, never from wherever a
            // body points (SSRF): refused as a prefill failure, so the gateway tries
            // another prefill worker or prefills here.
            if !st.peers.knows(url) {
                tracing::warn!(request = %b.request_id, prefill = %url, "refusing a prefill address no gateway announced");
                let mut w = WireError::from_engine(
                    &EngineError::Unavailable(format!(
                        "prefill address {url:?} is not one a gateway announced to this worker"
                    )),
                    true,
                );
                w.unannounced = true;
                return w.into_response();
            }
            // With a cluster token, K/V comes only over the KV port, whose handshake
            // proves the peer holds the token before the prompt is sent: an HTTP URL
            // would get the token itself.
            if st.token.is_some() && !url.starts_with("tcp://") {
                return wire_error(
                    &EngineError::invalid(
                        format!(
                            "prefill address {url:?}: only tcp:// (the KV port) is accepted where a cluster token is set"
                        ),
                        "prefill",
                    ),
                    false,
                );
            }
            let blocks = b.prompt.len().div_ceil(e.kv_layout().block_size);
            // Room first: nothing flows unless it can land.
            let reserving = std::time::Instant::now();
            let res = match e.reserve(blocks).await {
                Ok(r) => r,
                Err(err) => return wire_error(&err, false),
            };
            let reserved = reserving.elapsed();
            let req = PrefillBody {
                request_id: b.request_id.clone(),
                prompt: b.prompt.clone(),
                params: b.params.clone(),
            };
            let transport: Box<dyn KvTransport> = if url.starts_with("tcp://") {
                Box::new(TcpTransport {
                    timeout: st.transfer_timeout,
                    token: st.token.clone(),
                })
            } else {
                Box::new(HttpPull {
                    client: st.client.clone(),
                    timeout: st.transfer_timeout,
                    token: st.token.clone(),
                })
            };
            let pull = transport.pull(url, &req, &e);
            let mut grace = st.grace_over.clone();
            let grace_over = async move {
                if grace.wait_for(|over| *over).await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            let pulled = tokio::select! {
                p = pull => p,
                // Not started here: refused as a draining worker refuses, so the
                // gateway gives the request to another decode worker rather than
                // losing it when this one exits mid-pull.
                () = grace_over => {
                    tracing::warn!(request = %b.request_id, prefill = %url, "drain grace over with the K/V not here; handing the request back");
                    return wire_error(
                        &EngineError::Unavailable(
                            "this worker is shutting down and the K/V did not come within its drain grace".into(),
                        ),
                        false,
                    );
                }
            };
            // Where a request's first token waits beyond its prefill (compare with
            // `RUST_LOG=preheat_engine::handoff=debug`'s resume wait).
            tracing::debug!(
                target: "preheat_engine::handoff",
                request = %b.request_id,
                ok = pulled.is_ok(),
                reserve_ms = reserved.as_secs_f64() * 1e3,
                pull_ms = (reserving.elapsed() - reserved).as_secs_f64() * 1e3,
                "pulled"
            );
            let bs = e.kv_layout().block_size;
            let pulled = pulled.and_then(|mut seq| {
                check_matches(&mut seq, &req, bs, e.prefix_key()).map(|()| seq)
            });
            match pulled {
                Ok(seq) => e.resume_into(res, seq),
                Err(why) => {
                    // `res` drops here: the reserved blocks go back to the pool.
                    tracing::warn!(request = %b.request_id, prefill = %url, error = %why, "KV transfer failed");
                    return wire_error(
                        &EngineError::Unavailable(format!("prefill worker {url}: {why}")),
                        true,
                    );
                }
            }
        }
    };
    let handle = match handle {
        Ok(h) => h,
        Err(err) => return wire_error(&err, false),
    };
    let lines = futures_util::stream::unfold(Some(handle), |h| async move {
        let mut h = h?;
        loop {
            let ev = h.events.recv().await?;
            let end = matches!(ev, Event::Finished { .. } | Event::Error(_));
            if let Some(w) = WireEvent::from_event(ev) {
                let next = if end { None } else { Some(h) };
                return Some((
                    Ok::<_, std::io::Error>(axum::body::Bytes::from(w.to_line())),
                    next,
                ));
            }
        }
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response()
}

fn load_of(e: &Engine) -> Load {
    Load {
        running: e.metrics.running.get() as f64,
        waiting: e.metrics.waiting.get() as f64,
        kv_usage: e.metrics.kv_usage.get(),
        kv_blocks: e.kv_layout().num_blocks as u64,
    }
}

/// Most prefix-cache hashes one heartbeat carries.
const MAX_REPORTED_BLOCKS: usize = 65_536;

/// Registers, then heartbeats until cancelled; re-registers when the gateway forgot
/// this worker. A refusal (another model) ends the worker.
async fn membership(
    client: reqwest::Client,
    opts: WorkerOptions,
    e: Engine,
    id: String,
    mut on_registered: Option<tokio::sync::oneshot::Sender<f64>>,
) -> Result<()> {
    let token = opts.serve.cluster_token.as_deref();
    let reg = Registration {
        id: id.clone(),
        role: opts.role,
        url: opts.advertise.clone(),
        model: e.model_name.clone(),
        compat: e.compat().to_owned(),
        kv: opts.kv_listener.as_ref().map(|(_, a)| a.clone()),
        kv_format: crate::kv::payload::FORMAT_VERSION,
    };
    // Discovered workers (no gateway) do not register: serving is being listed as a
    // Ready endpoint, so they count as registered once they serve.
    let register = |gateway: String| {
        let (client, reg) = (&client, &reg);
        async move {
            loop {
                match client
                    .post(format!("{gateway}/internal/register"))
                    .cluster_token(token)
                    .json(reg)
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await
                {
                    Ok(r) if r.status().is_success() => {
                        tracing::info!(gateway = %gateway, id = %reg.id, role = reg.role.as_str(), "registered");
                        return Ok(());
                    }
                    Ok(r) if r.status() == StatusCode::CONFLICT => {
                        let why = r.text().await.unwrap_or_default();
                        tracing::error!(gateway = %gateway, reason = %why, "the gateway refused this worker");
                        return Err(EngineError::Unavailable(format!(
                            "refused by the gateway: {why}"
                        )));
                    }
                    Ok(r) => tracing::warn!(status = %r.status(), "registration failed; retrying"),
                    Err(err) => tracing::warn!(error = %err, "gateway unreachable; retrying"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    if let Some(gateway) = &opts.gateway {
        register(gateway.clone()).await?;
    }
    let secs = e.metrics.mark_startup("registered");
    if let Some(tx) = on_registered.take() {
        let _ = tx.send(secs);
    }
    loop {
        tokio::time::sleep(opts.heartbeat).await;
        if !e.is_alive() {
            // Leave (the caller deregisters) and exit non-zero so a supervisor
            // replaces this worker.
            return Err(EngineError::Internal("the engine thread died".into()));
        }
        let Some(gateway) = &opts.gateway else {
            continue;
        };
        let status = status_of_worker(&e, opts.role, None);
        let hb = Heartbeat {
            id: id.clone(),
            load: status.load,
            blocks: status.blocks,
        };
        match client
            .post(format!("{gateway}/internal/heartbeat"))
            .cluster_token(token)
            .json(&hb)
            .timeout(Duration::from_secs(2))
            .send()
            .await
        {
            Ok(r) if r.status() == StatusCode::NOT_FOUND => register(gateway.clone()).await?,
            Ok(_) => {}
            Err(err) => tracing::debug!(error = %err, "heartbeat failed"),
        }
    }
}

/// Runs a worker on `listener` until `stop` resolves.
pub async fn run(
    listener: tokio::net::TcpListener,
    opts: WorkerOptions,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let client = preheat_edge::client::internal()
        .build()
        .map_err(|e| EngineError::Internal(e.to_string()))?;
    let (grace_over, grace_over_rx) = tokio::sync::watch::channel(false);
    let st = WorkerState {
        engine: Arc::new(OnceLock::new()),
        phase: Arc::new(std::sync::Mutex::new("loading")),
        promote: Arc::default(),
        role: opts.role,
        client: client.clone(),
        transfer_timeout: opts.transfer_timeout,
        kv: opts.kv_listener.as_ref().map(|(_, a)| a.clone()),
        token: opts.serve.cluster_token.clone(),
        peers: Arc::default(),
        grace_over: grace_over_rx,
    };
    let app = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/internal/model", get(model))
        .route("/internal/state", get(state))
        .route("/internal/load", get(load))
        .route("/internal/promote", post(promote))
        .route("/internal/prefill", post(prefill))
        .route("/internal/generate", post(generate))
        .route("/internal/peers", post(peers))
        .layer(axum::extract::DefaultBodyLimit::max(
            opts.serve.max_body_bytes,
        ))
        .with_state(st.clone());
    // Everything here is for our own processes: the token on all but probes and metrics.
    let server = preheat_edge::listener::InternalServer::new(listener, app, st.token.clone())
        .warn_if_open("this worker's internal endpoints and KV port");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(server.serve(async move {
        let _ = stop_rx.await;
    }));
    let kv_server = match &opts.kv_listener {
        Some((addr, _)) if opts.role == WorkerRole::Prefill => {
            let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                EngineError::Unavailable(format!("binding the KV port {addr}: {e}"))
            })?;
            Some(tokio::spawn(serve_tcp(
                l,
                Arc::clone(&st.engine),
                st.token.clone(),
            )))
        }
        _ => None,
    };
    let serve = opts.serve.clone();
    let engine = tokio::task::spawn_blocking(move || load_engine(&serve))
        .await
        .map_err(|e| EngineError::Internal(format!("model loader: {e}")))??;
    let mut stop = Box::pin(stop);
    let mut on_registered = None;
    if opts.serve.standby {
        engine.metrics.mark_startup("parked");
        let (tx, rx) = tokio::sync::oneshot::channel::<Promotion>();
        *st.promote.lock().expect("no panics while held") = Some(tx);
        *st.phase.lock().expect("no panics while held") = "standby";
        tracing::info!("parked as a standby: POST /internal/promote to register and serve");
        tokio::select! {
            r = rx => {
                if let Ok((t0, reply)) = r {
                    engine.metrics.set_startup_origin(t0, "standby");
                    on_registered = Some(reply);
                }
            }
            () = &mut stop => {
                let _ = stop_tx.send(());
                let _ = server.await;
                if let Some(k) = kv_server {
                    k.abort();
                }
                return Ok(());
            }
        }
    }
    let _ = st.engine.set(engine.clone());
    *st.phase.lock().expect("no panics while held") = "serving";
    let id = format!(
        "{}-{}-{}",
        opts.role.as_str(),
        std::process::id(),
        opts.advertise
    );
    let member = tokio::spawn(membership(
        client.clone(),
        opts.clone(),
        engine.clone(),
        id.clone(),
        on_registered,
    ));
    let member_abort = member.abort_handle();
    let outcome = tokio::select! {
        () = &mut stop => Ok(()),
        r = member => match r {
            Ok(Err(e)) => Err(e),
            _ => Ok(()),
        },
    };
    member_abort.abort();
    // Leave the rotation first (discovered workers leave it as their endpoint turns
    // not-ready), then finish what is held.
    if let Some(gateway) = &opts.gateway {
        let _ = client
            .post(format!("{gateway}/internal/deregister"))
            .cluster_token(opts.serve.cluster_token.as_deref())
            .json(&serde_json::json!({"id": id}))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
    }
    engine.drain();
    let in_flight = || engine.in_flight();
    if crate::api::settle(in_flight, opts.serve.drain_grace).await > 0 {
        // Requests still waiting for their K/V go back to the gateway, which retries
        // them elsewhere; they answer within moments, so wait for those.
        let _ = grace_over.send(true);
        crate::api::settle(in_flight, Duration::from_secs(2)).await;
    }
    if engine.in_flight() > 0 {
        tracing::warn!(
            in_flight = engine.in_flight(),
            "grace period over; exiting with requests in flight"
        );
    }
    let _ = stop_tx.send(());
    let _ = server.await;
    if let Some(k) = kv_server {
        k.abort();
    }
    outcome
}
