//! The gateway process: the OpenAI API (the same server code as `engine serve`) over a
//! front per model ([`front`]) whose requests run on that model's workers
//! ([`requests`]), each model's worker registry (registered through [`routes`] or found
//! by [`discovery`]) and the announcements of which prefill workers decode workers may
//! pull from ([`announce`]); [`fleet`] runs one such gateway per model behind one pair
//! of listeners.

mod announce;
mod discovery;
mod fleet;
mod front;
mod in_flight;
mod requests;
mod room_queue;
mod routes;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use prometheus::IntGauge;

pub use self::fleet::run;
use self::front::GatewayFront;
use self::in_flight::{InFlight, InFlightCounts};
use self::routes::unannounceable;
use super::wire::messages::{
    GenerateBody, Heartbeat, Load, ModelInfo, Registration, WorkerRole, WorkerStatus, read_capped,
};
use crate::api::ApiState;
use crate::disagg::peers::Announcement;
use crate::disagg::router::{PrefixIndex, pick_decode, pick_prefill};
use crate::engine::{Event, GenerateRequest};
use crate::kv::PrefixKey;
use crate::metrics::{EngineMetrics, Role};
use crate::tokenizer::Tokenizer;
use crate::{EngineError, Result};
use preheat_edge::{ApiKeys, ClusterToken, WithClusterToken};
use preheat_snapshot::ModelCard;

/// Prompts shorter than this many tokens are prefilled on the decode worker that serves
/// them: for a prompt that short, shipping its K/V costs more than computing it there.
pub const DEFAULT_DISAGG_MIN_TOKENS: usize = 32;

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
    /// Prompts shorter than this are prefilled on the decode worker itself
    /// ([`DEFAULT_DISAGG_MIN_TOKENS`]).
    pub disagg_min_tokens: usize,
    /// Longest silence in a decode worker's stream before it counts as dead.
    pub stream_idle_timeout: Duration,
    pub drain_grace: Duration,
    /// The models served, known from the start (requests are then held even before
    /// the first worker registers); with none, the first worker's model is served.
    pub models: Vec<GatewayModel>,
    /// Set by whoever runs the workers when they cannot start.
    pub outage: Arc<Outage>,
    /// The deployment's cluster token: registration asks for it, and every request to
    /// a worker carries it.
    pub cluster_token: Option<Arc<ClusterToken>>,
    /// Keys the OpenAI API asks for.
    pub api_keys: Option<Arc<ApiKeys>>,
    /// A chat template rendered instead of the model's (`--chat-template`), for a
    /// model whose [`GatewayModel`] has none (the gateway renders every chat, so only
    /// its template counts).
    pub chat_template: Option<String>,
}

/// One model a gateway serves.
#[derive(Clone, Debug)]
#[must_use]
pub struct GatewayModel {
    /// The name clients give in `model`.
    pub name: String,
    /// What its workers report, read from its manifest; or why that could not be
    /// read: the model is then listed and answers 503 naming the cause, while the
    /// others serve.
    pub info: std::result::Result<ModelInfo, String>,
    /// Where its workers come from when they do not register themselves; with it the
    /// gateway serves no registration endpoints (workers are checked against `info`
    /// before use).
    pub discovery: Option<Arc<dyn WorkerSource>>,
    /// Its chat template, rendered instead of the model's own.
    pub chat_template: Option<String>,
}

impl GatewayModel {
    /// A model read from its manifest, served under the name in `info`.
    pub fn new(info: ModelInfo) -> Self {
        GatewayModel {
            name: info.model.clone(),
            info: Ok(info),
            discovery: None,
            chat_template: None,
        }
    }

    /// A model named `name` whose manifest could not be read (`why`).
    pub fn unreadable(name: impl Into<String>, why: impl Into<String>) -> Self {
        GatewayModel {
            name: name.into(),
            info: Err(why.into()),
            discovery: None,
            chat_template: None,
        }
    }
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
            disagg_min_tokens: DEFAULT_DISAGG_MIN_TOKENS,
            stream_idle_timeout: Duration::from_secs(60),
            drain_grace: Duration::from_secs(30),
            models: Vec::new(),
            outage: Arc::default(),
            cluster_token: None,
            api_keys: None,
            chat_template: None,
        }
    }
}

#[derive(Debug)]
struct Entry {
    reg: Registration,
    /// The worker's last report.
    load: Load,
    /// This gateway's requests there, which routing adds to `load`.
    in_flight: InFlightCounts,
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
            in_flight: InFlightCounts::default(),
            last_seen: Instant::now(),
            told: None,
        }
    }

    /// A load report arrived, taken when this gateway had `then` in flight there.
    fn report(&mut self, load: Load, then: in_flight::Snapshot) {
        self.load = load;
        self.in_flight.reported(then);
        self.last_seen = Instant::now();
    }

    /// What routing reads: the report, with this gateway's requests since counted.
    fn routing_load(&self) -> Load {
        self.in_flight.load(&self.load)
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

/// One model's gateway state: its workers, router and front.
pub struct Gateway {
    reg: Mutex<Registry>,
    client: reqwest::Client,
    api: ApiState,
    opts: GatewayOptions,
    /// Where this model's workers are listed, when they do not register.
    discovery: Option<Arc<dyn WorkerSource>>,
    /// Rendered instead of the model's chat template.
    chat_template: Option<String>,
    /// This model's gateway metrics, once its name is known.
    metrics: OnceLock<GatewayMetrics>,
    /// What the router's block hashes start from (the workers' key).
    prefix_key: PrefixKey,
    /// The served model's name, once the front is installed.
    model: OnceLock<String>,
    /// This gateway's id in its announcements to decode workers (a restarted gateway
    /// gets a new one; its old list expires there).
    instance: String,
    /// Wakes the announcer early: a worker joined.
    announce_now: tokio::sync::Notify,
    /// Sequence of this gateway's announcements (a late, older one is ignored).
    announcements: std::sync::atomic::AtomicU64,
    refusal_log: LogEvery,
    /// Turns the candidates' order each pick, so equally loaded workers share requests
    /// instead of the first in the map's order taking them all.
    rotation: std::sync::atomic::AtomicUsize,
    /// Requests waiting for room in a decode worker.
    room: Arc<room_queue::RoomQueue>,
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

/// A worker chosen for one request, counted in its load until dropped.
#[derive(Debug)]
struct Picked {
    id: String,
    url: String,
    /// Where a decode worker pulls K/V from (the KV transport, else the URL).
    kv: String,
    _in_flight: InFlight,
}

/// A model's gateway metrics, each labelled with its `model_name` (one process's
/// models share one `/metrics` page).
struct GatewayMetrics {
    /// `preheat:gateway_pending_requests{pool}`: requests waiting for a worker of
    /// that pool.
    pending: prometheus::IntGaugeVec,
    /// `preheat:gateway_workers{role}`: the rotation's size.
    workers: prometheus::IntGaugeVec,
    /// `preheat:gateway_replays_total`: requests run again after a decode worker was
    /// lost.
    replays: prometheus::IntCounter,
}

impl GatewayMetrics {
    fn new(model: &str) -> std::result::Result<Self, prometheus::Error> {
        let labels = HashMap::from([("model_name".to_owned(), model.to_owned())]);
        let opts =
            |name: &str, help: &str| prometheus::Opts::new(name, help).const_labels(labels.clone());
        Ok(GatewayMetrics {
            pending: prometheus::IntGaugeVec::new(
                opts(
                    crate::metrics::names::GATEWAY_PENDING,
                    "Requests held at the gateway waiting for a worker, by the pool they wait for",
                ),
                &["pool"],
            )?,
            workers: prometheus::IntGaugeVec::new(
                opts(
                    crate::metrics::names::GATEWAY_WORKERS,
                    "Workers in this gateway's rotation, by role",
                ),
                &["role"],
            )?,
            replays: prometheus::IntCounter::with_opts(opts(
                crate::metrics::names::GATEWAY_REPLAYS,
                "Requests run again from the start after their decode worker was lost",
            ))?,
        })
    }
}

impl Gateway {
    /// A gateway for one model (`None`: the first worker to register teaches it).
    fn new(
        api: ApiState,
        client: reqwest::Client,
        opts: &GatewayOptions,
        model: Option<&GatewayModel>,
        instance: String,
    ) -> Self {
        Gateway {
            prefix_key: PrefixKey::of_deployment(opts.cluster_token.as_deref()),
            reg: Mutex::new(Registry::default()),
            client,
            api,
            opts: opts.clone(),
            discovery: model.and_then(|m| m.discovery.clone()),
            chat_template: model
                .and_then(|m| m.chat_template.clone())
                .or_else(|| opts.chat_template.clone()),
            metrics: OnceLock::new(),
            model: OnceLock::new(),
            instance,
            announce_now: tokio::sync::Notify::new(),
            announcements: std::sync::atomic::AtomicU64::new(1),
            refusal_log: LogEvery {
                period: Duration::from_secs(30),
                last: Mutex::new(None),
            },
            rotation: std::sync::atomic::AtomicUsize::new(0),
            room: Arc::default(),
        }
    }

    /// The served model's name, once known.
    fn model_name(&self) -> Option<&str> {
        self.model.get().map(String::as_str)
    }

    /// Starts serving `info`'s model: the front engine the OpenAI API runs on.
    fn install_front(self: &Arc<Self>, info: ModelInfo) -> Result<()> {
        let mut tok = Tokenizer::from_parts(info.tokenizer)?;
        if let Some(t) = &self.chat_template {
            tok = tok.with_chat_template(t.clone())?;
        }
        let metrics = Arc::new(EngineMetrics::new(&info.model, Role::Gateway));
        let ours = GatewayMetrics::new(&info.model)
            .map_err(|e| EngineError::Internal(format!("gateway metrics: {e}")))?;
        let _ = metrics.registry.register(Box::new(ours.pending.clone()));
        let _ = metrics.registry.register(Box::new(ours.workers.clone()));
        let _ = metrics.registry.register(Box::new(ours.replays.clone()));
        {
            let mut g = self.lock();
            g.compat = Some(info.compat.clone());
            g.block_size = info.block_size;
        }
        if self.metrics.set(ours).is_ok() && self.model.set(info.model.clone()).is_ok() {
            // Both pools read 0 from the start, and the rotation as it is.
            for role in [WorkerRole::Prefill, WorkerRole::Decode] {
                if let Some(g) = self.pending_for(role) {
                    g.set(0);
                }
            }
            self.count_workers(&self.lock());
            self.api.set_frontend(Arc::new(GatewayFront::new(
                Arc::clone(self),
                tok,
                info.model.clone(),
                info.max_model_len,
                info.vocab_size,
                metrics,
            )));
            tracing::info!(model = %info.model, "gateway serving");
        }
        Ok(())
    }

    /// The count of this model's requests waiting for a worker of `pool` (none
    /// before the model is known, when no request can be taken).
    fn pending_for(&self, pool: WorkerRole) -> Option<IntGauge> {
        let m = self.metrics.get()?;
        Some(m.pending.with_label_values(&[pool.as_str()]))
    }

    fn token(&self) -> Option<&ClusterToken> {
        self.opts.cluster_token.as_deref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.reg
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a worker of `role` other than those in `exclude` is registered.
    fn has_worker(&self, role: WorkerRole, exclude: &[String]) -> bool {
        self.lock()
            .workers
            .values()
            .any(|e| e.reg.role == role && !exclude.contains(&e.reg.id))
    }

    fn drop_worker(&self, id: &str, why: &str) {
        let mut g = self.lock();
        // Its prefix memory goes too: ids are addresses, and a new pod may get this one.
        g.prefix.0.remove(id);
        if g.workers.remove(id).is_some() {
            tracing::warn!(worker = %id, reason = why, "worker dropped");
        }
        self.count_workers(&g);
    }

    /// Sets `preheat:gateway_workers` from `g`, at every change to the rotation and
    /// under its lock: a scrape never reads a rotation that has changed since, and two
    /// changes cannot set their counts in the wrong order.
    fn count_workers(&self, g: &Registry) {
        let Some(m) = self.metrics.get() else { return };
        for role in [WorkerRole::Prefill, WorkerRole::Decode] {
            let n = g.workers.values().filter(|e| e.reg.role == role).count();
            m.workers
                .with_label_values(&[role.as_str()])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
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
    let name = served_name.map_or_else(|| crate::colocated::default_name(path), str::to_owned);
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
        compat: crate::kv::payload::compat_hash(
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
/// Largest registration or heartbeat body (a heartbeat's 65,536 block hashes).
const MAX_REGISTRY_BODY: usize = 2 << 20;
/// Prefix-cache block hashes kept per prefill worker.
const MAX_PEER_BLOCKS: usize = 65_536;

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
