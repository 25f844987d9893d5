//! The gateway process: the OpenAI API (the same server code as `engine serve`) over a
//! front [`Engine`] whose requests run on registered workers, the worker registry and
//! the router.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::StreamExt;
use prometheus::IntGauge;

use super::peers::Announcement;
use super::protocol::{
    GenerateBody, Heartbeat, Load, ModelInfo, Registration, WireError, WireEvent, WorkerRole,
    WorkerStatus,
};
use super::router::{PrefixIndex, pick_decode, pick_prefill};
use crate::engine::{Engine, Event, GenerateRequest, RemoteSubmit};
use crate::kv::block_hashes;
use crate::metrics::{EngineMetrics, Role};
use crate::server::{ApiState, DEFAULT_MAX_BODY, drain, public_router};
use crate::tokenizer::Tokenizer;
use crate::{EngineError, Result};
use preheat_edge::{ApiKeys, ClusterToken, WithClusterToken};
use preheat_snapshot::ModelCard;

/// Gateway settings.
#[derive(Clone, Debug)]
#[must_use]
pub struct GatewayOptions {
    /// Missed-heartbeat horizon after which a registered worker is dropped (a
    /// discovered one: at least [`DISCOVERED_SILENCE`] without an answer).
    pub worker_timeout: Duration,
    /// How long a request waits for a decode worker when there is none (scale from
    /// zero) before failing.
    pub hold_timeout: Duration,
    /// Prompts shorter than this are prefilled on the decode worker itself.
    pub disagg_min_tokens: usize,
    /// Longest silence in a decode worker's stream before it counts as dead.
    pub stream_idle_timeout: Duration,
    pub drain_grace: Duration,
    /// The model, known from the start (requests are then held even before the first
    /// worker registers); otherwise the first worker's.
    pub model: Option<ModelInfo>,
    /// Set by whoever runs the workers when they cannot start.
    pub outage: Arc<Outage>,
    /// Where workers come from when they do not register themselves; with it the
    /// gateway serves no registration endpoints. Needs `model` (workers are checked
    /// against it before use).
    pub discovery: Option<Arc<dyn WorkerSource>>,
    /// The deployment's cluster token: registration asks for it, and every request to
    /// a worker carries it.
    pub cluster_token: Option<Arc<ClusterToken>>,
    /// Keys the OpenAI API asks for.
    pub api_keys: Option<Arc<ApiKeys>>,
}

/// The workers that may serve now, as a platform lists them (Kubernetes: the pools'
/// EndpointSlices, Ready endpoints only). The gateway checks each one's model before
/// sending it anything and polls its load; a worker that leaves the list leaves the
/// rotation.
pub trait WorkerSource: Send + Sync + std::fmt::Debug {
    /// Base URLs of the listed workers, by the pool that lists them.
    fn workers(&self) -> Vec<(WorkerRole, String)>;
}

/// Why no worker can be had, set by whoever runs the workers (local mode's driver,
/// when a pool's workers keep dying at start) or by the gateway's own shutdown: held
/// and new requests then fail at once with that reason (503 + Retry-After) instead of
/// waiting out the hold time.
#[derive(Debug, Default)]
pub struct Outage(Mutex<Option<String>>);

impl Outage {
    /// Records why; the first reason stays (it is the cause, e.g. workers that cannot
    /// start, rather than the shutdown that follows it).
    pub fn set(&self, why: impl Into<String>) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_or_insert_with(|| why.into());
    }

    #[must_use]
    pub fn reason(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Default for GatewayOptions {
    fn default() -> Self {
        GatewayOptions {
            worker_timeout: Duration::from_secs(3),
            hold_timeout: Duration::from_secs(300),
            disagg_min_tokens: 32,
            stream_idle_timeout: Duration::from_secs(60),
            drain_grace: Duration::from_secs(30),
            model: None,
            outage: Arc::default(),
            discovery: None,
            cluster_token: None,
            api_keys: None,
        }
    }
}

#[derive(Debug)]
struct Entry {
    reg: Registration,
    load: Load,
    last_seen: Instant,
    /// Decode workers: the prefill addresses last announced to them, and when that
    /// announcement was sent. Only these are named to them in a request.
    told: Option<(Instant, Vec<String>)>,
}

impl Entry {
    fn new(reg: Registration, load: Load) -> Self {
        Entry {
            reg,
            load,
            last_seen: Instant::now(),
            told: None,
        }
    }

    /// Where a decode worker pulls this prefill worker's K/V from (its KV port, else
    /// its URL).
    fn kv_address(&self) -> String {
        self.reg.kv.clone().unwrap_or_else(|| self.reg.url.clone())
    }

    /// The prefill addresses this decode worker still holds from this gateway.
    fn told_now(&self) -> &[String] {
        match &self.told {
            Some((at, list)) if at.elapsed() < PEERS_TRUSTED => list,
            _ => &[],
        }
    }
}

#[derive(Debug, Default)]
struct Registry {
    workers: HashMap<String, Entry>,
    prefix: PrefixIndex,
    compat: Option<String>,
    block_size: usize,
}

/// Shared gateway state.
pub struct Gateway {
    reg: Mutex<Registry>,
    client: reqwest::Client,
    api: ApiState,
    opts: GatewayOptions,
    /// `preheat:gateway_pending_requests`: requests waiting for a worker.
    pending: IntGauge,
    /// `preheat:gateway_workers{role}`: the rotation's size.
    workers_gauge: prometheus::IntGaugeVec,
    front: OnceLock<()>,
    /// This gateway's id in its announcements to decode workers (a restarted gateway
    /// gets a new one; its old list expires there).
    instance: String,
    /// Wakes the announcer early: a worker joined.
    announce_now: tokio::sync::Notify,
    /// Sequence of this gateway's announcements (a late, older one is ignored).
    announcements: std::sync::atomic::AtomicU64,
    refusal_log: LogEvery,
}

/// Lets a repeated message through at most once per period.
#[derive(Debug)]
struct LogEvery {
    period: Duration,
    last: Mutex<Option<Instant>>,
}

impl LogEvery {
    fn ready(&self) -> bool {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_some_and(|t| t.elapsed() < self.period) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish_non_exhaustive()
    }
}

#[derive(Clone, Debug)]
struct Picked {
    id: String,
    url: String,
    /// Where a decode worker pulls K/V from (the KV transport, else the URL).
    kv: String,
}

impl Gateway {
    /// Starts serving `info`'s model: the front engine the OpenAI API runs on.
    fn install_front(self: &Arc<Self>, info: ModelInfo) -> Result<()> {
        let tok = Tokenizer::from_parts(info.tokenizer)?;
        let metrics = Arc::new(EngineMetrics::new(&info.model, Role::Gateway));
        let _ = metrics.registry.register(Box::new(self.pending.clone()));
        let _ = metrics
            .registry
            .register(Box::new(self.workers_gauge.clone()));
        {
            let mut g = self.lock();
            g.compat = Some(info.compat.clone());
            g.block_size = info.block_size;
        }
        if self.front.set(()).is_ok() {
            self.api.set_engine(Engine::remote(
                tok,
                info.model.clone(),
                info.max_model_len,
                info.vocab_size,
                info.compat,
                metrics,
                Arc::new(Submitter(Arc::clone(self))),
            ));
            tracing::info!(model = %info.model, "gateway serving");
        }
        Ok(())
    }

    fn token(&self) -> Option<&ClusterToken> {
        self.opts.cluster_token.as_deref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.reg
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn drop_worker(&self, id: &str, why: &str) {
        let mut g = self.lock();
        // Its prefix memory goes too: ids are addresses, and a new pod may get this one.
        g.prefix.0.remove(id);
        if g.workers.remove(id).is_some() {
            tracing::warn!(worker = %id, reason = why, "worker dropped");
        }
    }

    /// Whether decode workers may pull from this prefill worker: with a token, K/V moves
    /// only over a KV port (whose handshake keeps the token off the wire); a prefill
    /// worker without one is not used, and its requests are prefilled on the decode
    /// worker.
    fn can_serve_kv(&self, e: &Entry) -> bool {
        e.reg.role == WorkerRole::Prefill
            && (self.opts.cluster_token.is_none()
                || e.reg.kv.as_deref().is_some_and(|k| k.starts_with("tcp://")))
    }

    /// A worker of `role`; a prefill worker only among those announced to the decode
    /// worker `for_decode` (it pulls from no other).
    fn pick(
        &self,
        role: WorkerRole,
        hashes: &[u64],
        exclude: &[String],
        for_decode: Option<&str>,
    ) -> Option<Picked> {
        let g = self.lock();
        let told = for_decode
            .and_then(|d| g.workers.get(d))
            .map_or(&[][..], Entry::told_now);
        let cands: Vec<&Entry> = g
            .workers
            .values()
            .filter(|e| e.reg.role == role && !exclude.contains(&e.reg.id))
            .filter(|e| {
                role != WorkerRole::Prefill
                    || (self.can_serve_kv(e) && told.contains(&e.kv_address()))
            })
            .collect();
        let i = match role {
            WorkerRole::Decode => pick_decode(&cands.iter().map(|e| &e.load).collect::<Vec<_>>())?,
            WorkerRole::Prefill => {
                let empty = super::router::PrefixMemory::default();
                let pairs: Vec<_> = cands
                    .iter()
                    .map(|e| (&e.load, g.prefix.0.get(&e.reg.id).unwrap_or(&empty)))
                    .collect();
                pick_prefill(&pairs, hashes, 4.0)?
            }
        };
        let e = cands[i];
        Some(Picked {
            id: e.reg.id.clone(),
            url: e.reg.url.clone(),
            kv: e.kv_address(),
        })
    }

    /// Tells each decode worker which prefill workers it may pull from, when the list
    /// changed for it or its copy nears expiry.
    async fn announce_peers(&self) {
        let (list, due) = {
            let g = self.lock();
            // (Addresses were checked against the announcement's bounds when the
            // workers joined; the count is capped here.)
            let mut list: Vec<String> = g
                .workers
                .values()
                .filter(|e| self.can_serve_kv(e))
                .map(Entry::kv_address)
                .collect();
            list.sort();
            list.dedup();
            list.truncate(super::peers::MAX_PEERS);
            let due: Vec<(String, String)> = g
                .workers
                .values()
                .filter(|e| e.reg.role == WorkerRole::Decode)
                .filter(|e| {
                    e.told
                        .as_ref()
                        .is_none_or(|(at, told)| *told != list || at.elapsed() >= PEERS_REFRESH)
                })
                .map(|e| (e.reg.id.clone(), e.reg.url.clone()))
                .collect();
            (list, due)
        };
        if due.is_empty() {
            return;
        }
        let announcement = Announcement {
            from: self.instance.clone(),
            seq: self
                .announcements
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            prefill: list.clone(),
            ttl_ms: u64::try_from(PEERS_TTL.as_millis()).unwrap_or(u64::MAX),
        };
        let sends = due.into_iter().map(|(id, url)| {
            let announcement = &announcement;
            async move {
                let sent_at = Instant::now();
                let r = self
                    .client
                    .post(format!("{url}/internal/peers"))
                    .cluster_token(self.token())
                    .json(announcement)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().is_success() => Some((id, sent_at)),
                    Ok(r) => {
                        // Refused by a decode worker that is up: not a passing fault
                        // (said at most every 30 s, as it is retried every tick).
                        if self.refusal_log.ready() {
                            tracing::warn!(decode = %url, status = %r.status(), "peer announcement refused");
                        }
                        None
                    }
                    Err(e) => {
                        tracing::debug!(decode = %url, error = %e, "peer announcement failed");
                        None
                    }
                }
            }
        });
        let done = futures_util::future::join_all(sends).await;
        let mut g = self.lock();
        for (id, sent_at) in done.into_iter().flatten() {
            if let Some(e) = g.workers.get_mut(&id) {
                e.told = Some((sent_at, list.clone()));
            }
        }
    }

    /// Waits (up to [`FIRST_ANNOUNCEMENT_WAIT`]) until a decode worker that was never
    /// told about the prefill workers has been: one that just joined (scale from zero,
    /// a promoted standby) would otherwise prefill its first burst itself.
    async fn await_announcement(&self, decode: &str) {
        let waiting = || {
            let g = self.lock();
            let never_told = g.workers.get(decode).is_some_and(|d| d.told.is_none());
            never_told && g.workers.values().any(|e| self.can_serve_kv(e))
        };
        let deadline = Instant::now() + FIRST_ANNOUNCEMENT_WAIT;
        while waiting() && Instant::now() < deadline {
            self.announce_now.notify_one();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Forgets what a decode worker was told (it refused a prefill address, e.g. after
    /// a restart at the same address): the next round announces again.
    fn forget_told(&self, decode: &str) {
        if let Some(e) = self.lock().workers.get_mut(decode) {
            e.told = None;
        }
    }

    /// Waits for a decode worker (held at the gateway while the pool is at zero), up
    /// to the hold time, or until the workers are known not to start.
    async fn wait_decode(&self, exclude: &[String]) -> Result<Picked> {
        let outage = |why: String| EngineError::NoWorkers {
            message: format!("no decode worker can be had: {why}"),
            retry_after_secs: 30,
        };
        if let Some(p) = self.pick(WorkerRole::Decode, &[], exclude, None) {
            return Ok(p);
        }
        if let Some(why) = self.opts.outage.reason() {
            return Err(outage(why));
        }
        self.pending.inc();
        let deadline = Instant::now() + self.opts.hold_timeout;
        let got = loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Some(p) = self.pick(WorkerRole::Decode, &[], exclude, None) {
                break Ok(p);
            }
            if let Some(why) = self.opts.outage.reason() {
                break Err(outage(why));
            }
            if Instant::now() >= deadline {
                break Err(EngineError::NoWorkers {
                    message: format!(
                        "no decode worker became available within the hold time ({} s); the pool may still be starting",
                        self.opts.hold_timeout.as_secs()
                    ),
                    retry_after_secs: self.opts.hold_timeout.as_secs().clamp(1, 30),
                });
            }
        };
        self.pending.dec();
        got
    }

    async fn serve_request(
        self: Arc<Self>,
        id: u64,
        req: GenerateRequest,
        out: tokio::sync::mpsc::UnboundedSender<Event>,
    ) {
        let fail = |e: EngineError| {
            let _ = out.send(Event::Error(e));
        };
        let bs = self.lock().block_size.max(1);
        let hashes = block_hashes(&req.prompt, bs);
        let mut excluded: Vec<String> = Vec::new();
        // Decode workers that turned the request away before starting it (draining).
        let mut refused: Vec<String> = Vec::new();
        // Two tries on prefill workers, then prefill on the decode worker itself.
        for attempt in 0..3 {
            let decode = match self.wait_decode(&refused).await {
                Ok(d) => d,
                Err(e) => return fail(e),
            };
            let disagg = attempt < 2 && req.prompt.len() >= self.opts.disagg_min_tokens;
            if disagg {
                self.await_announcement(&decode.id).await;
            }
            let prefill = if disagg {
                self.pick(WorkerRole::Prefill, &hashes, &excluded, Some(&decode.id))
            } else {
                None
            };
            let body = GenerateBody {
                request_id: format!("gw-{id}"),
                prompt: req.prompt.clone(),
                params: req.params.clone(),
                prefill: prefill.as_ref().map(|p| p.kv.clone()),
            };
            // Headers come once the worker has the request in hand (K/V pulled, or
            // its local prefill queued): as long as a stream may stay silent.
            let sent = self
                .client
                .post(format!("{}/internal/generate", decode.url))
                .cluster_token(self.token())
                .json(&body)
                .send();
            let resp = match tokio::time::timeout(self.opts.stream_idle_timeout, sent).await {
                Ok(Ok(r)) => r,
                // Not connected: nothing was sent, another decode worker takes it.
                Ok(Err(e)) if e.is_connect() && attempt < 2 => {
                    tracing::warn!(decode = %decode.url, error = %e, "decode worker unreachable; trying another");
                    self.drop_worker(&decode.id, "unreachable");
                    refused.push(decode.id.clone());
                    continue;
                }
                Ok(Err(e)) => {
                    self.drop_worker(&decode.id, "unreachable");
                    return fail(EngineError::Unavailable(format!(
                        "decode worker {}: {e}",
                        decode.url
                    )));
                }
                Err(_) => {
                    self.drop_worker(&decode.id, "no answer");
                    return fail(EngineError::Unavailable(format!(
                        "decode worker {} did not answer within {} s",
                        decode.url,
                        self.opts.stream_idle_timeout.as_secs()
                    )));
                }
            };
            if !resp.status().is_success() {
                let status = resp.status();
                let w: WireError = match read_capped(resp, MAX_ERROR_BYTES).await {
                    Ok(b) => serde_json::from_slice(&b).ok(),
                    Err(_) => None,
                }
                .unwrap_or(WireError {
                    class: "internal".into(),
                    message: format!("decode worker answered HTTP {status}"),
                    prefill_failed: false,
                    unannounced: false,
                });
                // A worker draining for scale-down refuses new work: the request has not
                // started, so another decode worker takes it.
                if status == StatusCode::SERVICE_UNAVAILABLE && !w.prefill_failed && attempt < 2 {
                    tracing::info!(decode = %decode.url, "decode worker refused (draining); trying another");
                    refused.push(decode.id.clone());
                    continue;
                }
                // The decode worker lacks the list naming that prefill worker (it
                // restarted at the same address): tell it again; the prefill worker is
                // not at fault.
                if w.prefill_failed && w.unannounced && attempt < 2 {
                    tracing::info!(decode = %decode.url, "decode worker did not know the prefill worker; announcing again");
                    self.forget_told(&decode.id);
                    continue;
                }
                if w.prefill_failed && attempt < 2 {
                    if let Some(p) = &prefill {
                        tracing::warn!(prefill = %p.url, error = %w.message, "prefill failed before the first token; retrying elsewhere");
                        excluded.push(p.id.clone());
                    }
                    continue;
                }
                return fail(w.into_engine());
            }
            if let Some(p) = &prefill {
                self.lock()
                    .prefix
                    .0
                    .entry(p.id.clone())
                    .or_default()
                    .remember(&hashes);
            }
            let mut stream = resp.bytes_stream();
            let mut buf: Vec<u8> = Vec::new();
            loop {
                let next = tokio::time::timeout(self.opts.stream_idle_timeout, stream.next()).await;
                let chunk = match next {
                    Ok(Some(Ok(c))) => c,
                    Ok(Some(Err(e))) => {
                        self.drop_worker(&decode.id, "stream broke");
                        return fail(EngineError::Unavailable(format!(
                            "decode worker {} failed mid-stream: {e}",
                            decode.url
                        )));
                    }
                    Ok(None) => {
                        self.drop_worker(&decode.id, "stream ended early");
                        return fail(EngineError::Unavailable(format!(
                            "decode worker {} ended the stream early",
                            decode.url
                        )));
                    }
                    Err(_) => {
                        self.drop_worker(&decode.id, "stream stalled");
                        return fail(EngineError::Unavailable(format!(
                            "decode worker {} stalled",
                            decode.url
                        )));
                    }
                };
                buf.extend_from_slice(&chunk);
                if buf.len() > MAX_EVENT_LINE && !buf.contains(&b'\n') {
                    self.drop_worker(&decode.id, "oversized event");
                    return fail(EngineError::Internal(format!(
                        "decode worker {} sent an event line over {MAX_EVENT_LINE} bytes",
                        decode.url
                    )));
                }
                while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=pos).collect();
                    let ev = match serde_json::from_slice::<WireEvent>(&line) {
                        Ok(w) => w.into_event(),
                        Err(e) => {
                            return fail(EngineError::Internal(format!(
                                "decode worker sent garbage: {e}"
                            )));
                        }
                    };
                    let end = matches!(ev, Event::Finished { .. } | Event::Error(_));
                    if out.send(ev).is_err() || end {
                        return;
                    }
                }
            }
        }
        fail(EngineError::Internal("no attempt left".into()));
    }
}

struct Submitter(Arc<Gateway>);

impl RemoteSubmit for Submitter {
    fn run(
        &self,
        id: u64,
        req: GenerateRequest,
        out: tokio::sync::mpsc::UnboundedSender<Event>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(Arc::clone(&self.0).serve_request(id, req, out))
    }
}

fn conflict(msg: String) -> Response {
    (StatusCode::CONFLICT, msg).into_response()
}

/// Why a worker's addresses cannot be announced to decode workers, if they cannot.
fn unannounceable(url: &str, kv: Option<&str>) -> Option<String> {
    let max = super::peers::MAX_ADDRESS_LEN;
    (url.len() > max || kv.is_some_and(|k| k.len() > max))
        .then(|| format!("a worker's URL and KV address are at most {max} bytes"))
}

async fn register(State(gw): State<Arc<Gateway>>, Json(r): Json<Registration>) -> Response {
    if let Some(why) = unannounceable(&r.url, r.kv.as_deref()) {
        return (StatusCode::BAD_REQUEST, why).into_response();
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
    tracing::info!(worker = %r.id, role = r.role.as_str(), url = %r.url, "worker registered");
    gw.lock()
        .workers
        .insert(r.id.clone(), Entry::new(r, Load::default()));
    gw.announce_now.notify_one();
    StatusCode::OK.into_response()
}

async fn heartbeat(State(gw): State<Arc<Gateway>>, Json(mut h): Json<Heartbeat>) -> Response {
    h.blocks.truncate(MAX_PEER_BLOCKS);
    let mut g = gw.lock();
    match g.workers.get_mut(&h.id) {
        Some(e) => {
            e.load = h.load;
            e.last_seen = Instant::now();
            if e.reg.role == WorkerRole::Prefill {
                g.prefix.0.entry(h.id).or_default().replace(&h.blocks);
            }
            StatusCode::OK.into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[derive(serde::Deserialize)]
struct Deregister {
    id: String,
}

async fn deregister(State(gw): State<Arc<Gateway>>, Json(d): Json<Deregister>) -> Response {
    if gw.lock().workers.remove(&d.id).is_some() {
        tracing::info!(worker = %d.id, "worker deregistered");
    }
    StatusCode::OK.into_response()
}

async fn workers(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let g = gw.lock();
    let mut list: Vec<_> = g
        .workers
        .values()
        .map(|e| {
            let mut w = serde_json::json!({"id": e.reg.id, "role": e.reg.role, "url": e.reg.url, "load": e.load});
            if e.reg.role == WorkerRole::Decode {
                // How many prefill workers it was told it may pull from.
                w["prefill_peers"] = e.told_now().len().into();
            }
            w
        })
        .collect();
    list.sort_by_key(|v| v["id"].as_str().unwrap_or("").to_owned());
    Json(serde_json::json!({"workers": list}))
}

/// What workers serving the snapshot at `path` with `block_size` will report, read
/// without loading weights (so a gateway can front the model before any worker runs).
/// HF and GGUF sources are converted first, as a worker would.
pub fn model_info(
    path: &std::path::Path,
    block_size: usize,
    served_name: Option<&str>,
) -> Result<ModelInfo> {
    let (snap, _) = crate::model::open_model(path)?;
    let name = served_name.map_or_else(|| crate::serve::default_name(path), str::to_owned);
    model_info_from_card(&ModelCard::of(&snap)?, block_size, &name)
}

/// What workers serving the model of `card` under `name` with `block_size` report:
/// the gateway's view of its model from the manifest and tokenizer alone.
pub fn model_info_from_card(card: &ModelCard, block_size: usize, name: &str) -> Result<ModelInfo> {
    let c = &card.manifest.model;
    let layout = crate::backend::KvLayout {
        num_layers: c.num_hidden_layers as usize,
        num_blocks: 0,
        block_size,
        num_kv_heads: c.num_key_value_heads as usize,
        head_dim: c.head_dim as usize,
    };
    Ok(ModelInfo {
        model: name.to_owned(),
        compat: crate::kv::transfer::compat_hash(
            crate::backend::weights_fingerprint(&card.manifest),
            &layout,
        ),
        block_size,
        max_model_len: c.max_position_embeddings as usize,
        vocab_size: c.vocab_size as usize,
        tokenizer: Tokenizer::from_card(card)?.to_parts()?,
    })
}

/// How often a discovering gateway reads its source and its workers' load.
const DISCOVERY_PERIOD: Duration = Duration::from_millis(500);
/// A discovered worker silent this long leaves the rotation (it is re-admitted once
/// it answers while still listed): several missed reads, not one slow one.
const DISCOVERED_SILENCE: Duration = Duration::from_secs(10);
/// Most bytes read from a listed peer's `/internal/load` (65,536 block hashes as JSON
/// is about 1.3 MB) and `/internal/model` (its tokenizer): a peer cannot make the
/// gateway buffer more.
const MAX_STATUS_BYTES: usize = 4 << 20;
const MAX_MODEL_BYTES: usize = 64 << 20;
/// Longest line of a decode worker's event stream (a token with 20 top logprobs is
/// a few KiB): a peer cannot make the gateway buffer without end.
const MAX_EVENT_LINE: usize = 1 << 20;
/// Most bytes of a worker's error body.
const MAX_ERROR_BYTES: usize = 64 << 10;
/// Largest registration or heartbeat body (a heartbeat's 65,536 block hashes).
const MAX_REGISTRY_BODY: usize = 2 << 20;
/// Prefix-cache block hashes kept per prefill worker.
const MAX_PEER_BLOCKS: usize = 65_536;

/// A response body of at most `cap` bytes, refused (not truncated) beyond.
async fn read_capped(r: reqwest::Response, cap: usize) -> std::result::Result<Vec<u8>, String> {
    if r.content_length().is_some_and(|n| n > cap as u64) {
        return Err(format!("body larger than {cap} bytes"));
    }
    let mut body = Vec::new();
    let mut stream = r.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if body.len() + chunk.len() > cap {
            return Err(format!("body larger than {cap} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
/// How long a decode worker keeps an announced prefill list without a refresh.
const PEERS_TTL: Duration = Duration::from_secs(10);
/// An announcement is repeated this often even when nothing changed.
const PEERS_REFRESH: Duration = Duration::from_secs(3);
/// The gateway names a prefill worker to a decode worker only while the list that
/// holds it is this fresh (well inside its TTL there).
const PEERS_TRUSTED: Duration = Duration::from_secs(6);
/// Longest a request waits for a newly joined decode worker's first announcement.
const FIRST_ANNOUNCEMENT_WAIT: Duration = Duration::from_secs(1);
/// How often the gateway checks whether an announcement is due.
const PEERS_TICK: Duration = Duration::from_millis(200);

/// A listed worker that serves another model is asked again after this.
const REFUSED_RETRY: Duration = Duration::from_secs(30);

impl Gateway {
    /// One discovery pass: new listed workers are checked (model, role) and admitted,
    /// unlisted ones dropped, and every admitted one's load read (its heartbeat).
    async fn discover(&self, source: &dyn WorkerSource, refused: &mut HashMap<String, Instant>) {
        let listed = source.workers();
        let known: Vec<String> = self.lock().workers.keys().cloned().collect();
        for id in &known {
            if !listed.iter().any(|(_, u)| u == id) {
                self.drop_worker(id, "no longer a ready endpoint");
            }
        }
        refused.retain(|u, at| listed.iter().any(|(_, l)| l == u) && at.elapsed() < REFUSED_RETRY);
        let probes = listed.iter().map(|(role, url)| async move {
            let status = self.read_status(url).await;
            (*role, url, status)
        });
        let mut to_admit = Vec::new();
        for (role, url, status) in futures_util::future::join_all(probes).await {
            let Ok(mut status) = status else {
                continue; // unanswered: the reaper drops it once it stays silent
            };
            status.blocks.truncate(MAX_PEER_BLOCKS);
            let mut g = self.lock();
            if let Some(e) = g.workers.get_mut(url.as_str()) {
                e.load = status.load.clone();
                e.last_seen = Instant::now();
                if role == WorkerRole::Prefill {
                    g.prefix
                        .0
                        .entry(url.clone())
                        .or_default()
                        .replace(&status.blocks);
                }
            } else if !refused.contains_key(url.as_str()) {
                to_admit.push((role, url, status));
            }
        }
        // New workers are checked concurrently, after the known ones were refreshed, so
        // a slow newcomer delays nobody's liveness.
        let admits = to_admit.into_iter().map(|(role, url, status)| async move {
            (url, role, self.admit(role, url, status).await)
        });
        for (url, role, r) in futures_util::future::join_all(admits).await {
            match r {
                Ok(()) => tracing::info!(worker = %url, role = role.as_str(), "worker discovered"),
                Err(why) => {
                    tracing::warn!(worker = %url, reason = %why, "listed worker not used");
                    refused.insert(url.clone(), Instant::now());
                }
            }
        }
    }

    async fn read_status(&self, url: &str) -> std::result::Result<WorkerStatus, String> {
        let r = self
            .client
            .get(format!("{url}/internal/load"))
            .cluster_token(self.token())
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| e.to_string())?;
        let body = read_capped(r, MAX_STATUS_BYTES).await?;
        serde_json::from_slice(&body).map_err(|e| e.to_string())
    }

    /// Checks a listed worker against this gateway's model and its pool, then puts it in
    /// the rotation.
    async fn admit(
        &self,
        role: WorkerRole,
        url: &str,
        status: WorkerStatus,
    ) -> std::result::Result<(), String> {
        if let Some(why) = unannounceable(url, status.kv.as_deref()) {
            return Err(why);
        }
        if status.role != role {
            return Err(format!(
                "listed as {} but is a {} worker",
                role.as_str(),
                status.role.as_str()
            ));
        }
        let r = self
            .client
            .get(format!("{url}/internal/model"))
            .cluster_token(self.token())
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| format!("reading its model: {e}"))?;
        let body = read_capped(r, MAX_MODEL_BYTES)
            .await
            .map_err(|e| format!("reading its model: {e}"))?;
        let info: ModelInfo =
            serde_json::from_slice(&body).map_err(|e| format!("reading its model: {e}"))?;
        let mut g = self.lock();
        match &g.compat {
            Some(c) if *c == info.compat => {}
            Some(c) => {
                return Err(format!(
                    "it serves {} with KV compatibility hash {}, this gateway serves {c}: another model or KV layout",
                    info.model, info.compat
                ));
            }
            None => return Err("this gateway has no model to check it against".into()),
        }
        g.workers.insert(
            url.to_owned(),
            Entry::new(
                Registration {
                    id: url.to_owned(),
                    role,
                    url: url.to_owned(),
                    model: info.model,
                    compat: info.compat,
                    kv: status.kv,
                },
                status.load,
            ),
        );
        drop(g);
        self.announce_now.notify_one();
        Ok(())
    }
}

/// Runs the gateway until `stop` resolves: the OpenAI API on `public`, worker
/// registration (when workers register rather than being discovered) on `internal`,
/// behind the cluster token.
pub async fn run(
    public: tokio::net::TcpListener,
    internal: Option<tokio::net::TcpListener>,
    opts: GatewayOptions,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let listener = public;
    let api = ApiState::new(DEFAULT_MAX_BODY).with_api_keys(opts.api_keys.clone());
    let pending = IntGauge::new(
        crate::metrics::names::GATEWAY_PENDING,
        "Requests held at the gateway waiting for a worker",
    )
    .map_err(|e| EngineError::Internal(e.to_string()))?;
    let workers_gauge = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            crate::metrics::names::GATEWAY_WORKERS,
            "Workers in this gateway's rotation, by role",
        ),
        &["role"],
    )
    .map_err(|e| EngineError::Internal(e.to_string()))?;
    let gw = Arc::new(Gateway {
        workers_gauge,
        reg: Mutex::new(Registry::default()),
        // A worker that does not accept a connection within seconds is not there.
        client: preheat_edge::client::internal()
            .build()
            .map_err(|e| EngineError::Internal(e.to_string()))?,
        api: api.clone(),
        opts: opts.clone(),
        pending,
        front: OnceLock::new(),
        instance: format!(
            "gw-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ),
        announce_now: tokio::sync::Notify::new(),
        announcements: std::sync::atomic::AtomicU64::new(1),
        refusal_log: LogEvery {
            period: Duration::from_secs(30),
            last: Mutex::new(None),
        },
    });
    if let Some(info) = opts.model.clone() {
        gw.install_front(info)?;
    }
    let mut discovery = None;
    let mut registration = None;
    match &opts.discovery {
        Some(source) => {
            if opts.model.is_none() {
                return Err(EngineError::Model(
                    "a gateway that discovers its workers needs its model (--model) to check them against".into(),
                ));
            }
            let gw = Arc::clone(&gw);
            let source = Arc::clone(source);
            discovery = Some(tokio::spawn(async move {
                let mut refused = HashMap::new();
                loop {
                    gw.discover(source.as_ref(), &mut refused).await;
                    tokio::time::sleep(DISCOVERY_PERIOD).await;
                }
            }));
        }
        None => {
            let Some(internal) = internal else {
                return Err(EngineError::Unavailable(
                    "a gateway whose workers register needs an internal listener for them".into(),
                ));
            };
            let routes = axum::Router::new()
                .route("/internal/register", post(register))
                .route("/internal/heartbeat", post(heartbeat))
                .route("/internal/deregister", post(deregister))
                .route("/internal/workers", axum::routing::get(workers))
                .route("/health", axum::routing::get(|| async { "ok" }))
                .layer(axum::extract::DefaultBodyLimit::max(MAX_REGISTRY_BODY))
                .with_state(Arc::clone(&gw));
            let app = preheat_edge::routes::internal(routes, opts.cluster_token.clone());
            if opts.cluster_token.is_none() {
                tracing::warn!(
                    "no cluster token: worker registration accepts anyone (give --cluster-token-file)"
                );
            }
            registration = Some(tokio::spawn(async move {
                let limits = preheat_edge::listener::Limits::INTERNAL;
                if let Err(e) =
                    preheat_edge::listener::serve(internal, app, limits, std::future::pending())
                        .await
                {
                    tracing::error!(error = %e, "the gateway's internal listener failed");
                }
            }));
        }
    }
    let app = public_router(api.clone());
    let announcer = {
        let gw = Arc::clone(&gw);
        tokio::spawn(async move {
            loop {
                gw.announce_peers().await;
                tokio::select! {
                    () = tokio::time::sleep(PEERS_TICK) => {}
                    () = gw.announce_now.notified() => {}
                }
            }
        })
    };
    // Drop workers whose heartbeats stopped.
    let reaper = {
        let gw = Arc::clone(&gw);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let horizon = if gw.opts.discovery.is_some() {
                    gw.opts.worker_timeout.max(DISCOVERED_SILENCE)
                } else {
                    gw.opts.worker_timeout
                };
                let dead: Vec<String> = gw
                    .lock()
                    .workers
                    .values()
                    .filter(|e| e.last_seen.elapsed() > horizon)
                    .map(|e| e.reg.id.clone())
                    .collect();
                for id in dead {
                    gw.drop_worker(&id, "missed heartbeats");
                }
                let counts = {
                    let g = gw.lock();
                    [WorkerRole::Prefill, WorkerRole::Decode]
                        .map(|r| (r, g.workers.values().filter(|e| e.reg.role == r).count()))
                };
                for (role, n) in counts {
                    gw.workers_gauge
                        .with_label_values(&[role.as_str()])
                        .set(i64::try_from(n).unwrap_or(i64::MAX));
                }
            }
        })
    };
    tracing::info!(addr = %listener.local_addr().map_err(|e| EngineError::Unavailable(e.to_string()))?, model_known = opts.model.is_some(), discovery = opts.discovery.is_some(), "gateway listening");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let grace = opts.drain_grace;
    let outage = Arc::clone(&opts.outage);
    tokio::spawn(async move {
        stop.await;
        tracing::info!("gateway shutting down: draining in-flight requests");
        // Held requests have not started: they get 503 + Retry-After now, and the
        // client's retry reaches another replica, instead of a reset at the grace's end.
        outage.set("this gateway is shutting down; retry");
        drain(&api, grace).await;
        let _ = stop_tx.send(());
    });
    let r = preheat_edge::listener::serve(
        listener,
        app,
        preheat_edge::listener::Limits::PUBLIC,
        async move {
            let _ = stop_rx.await;
        },
    )
    .await;
    reaper.abort();
    announcer.abort();
    for t in [discovery, registration].into_iter().flatten() {
        t.abort();
    }
    r.map_err(|e| EngineError::Unavailable(format!("gateway: {e}")))
}
