//! `preheat warmpool run`: the node agent. Every `refresh` it stages the configured
//! models (in order, each once), refreshes the hot set, seeds the kernel cache, labels
//! the node and keeps the standbys parked; between refreshes it answers:
//!
//! | route | what |
//! |---|---|
//! | `GET /health` | 200 while the agent runs |
//! | `GET /metrics` | [`crate::metrics::names`] |
//! | `GET /models` | every configured model: state, bytes, resident bytes, progress, last error |
//! | `POST /models/{name}/stage` | stage a configured model now (joins a staging in progress) |
//! | `GET /snapshots/{file}` | a staged snapshot, with Range support (peer staging) |
//! | `GET /standbys` | per pool: `count` to keep parked, `parked` ready, `serving` (ports of promoted standbys, at `advertise_host`) |
//! | `PUT /standbys/{pool}` | `{"count": n}`: how many to keep parked |
//! | `POST /standbys/{pool}/promote` | promote one parked standby; 503 when none is ready |
//! | `POST /standbys/{pool}/retire` | retire the newest promoted standby (unlisted, then drained); 409 when none serves |
//!
//! Gateways list a node's serving standbys from `GET /standbys` (at the agent pod's
//! address: an agent can only point them at its own pod); the scaler promotes and
//! retires them.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use preheat_snapshot::Progress;
use serde::Serialize;

use crate::config::{AgentConfig, ModelSpec};
use crate::fetch::Fetcher;
use crate::hot::HotSet;
use crate::kernel_cache::KernelCache;
use crate::labels::{ModelState, NodeLabeler};
use crate::metrics::AgentMetrics;
use crate::standby::StandbyPool;
use crate::store::Store;
use crate::{Error, Result};

/// What the agent knows of one configured model.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct ModelStatus {
    pub name: String,
    /// `pending`, `staging`, `staged`, `hot` or `failed`.
    pub state: String,
    pub bytes: u64,
    pub resident_bytes: u64,
    pub progress: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone)]
struct Shared {
    cfg: Arc<AgentConfig>,
    store: Arc<Store>,
    metrics: Arc<AgentMetrics>,
    status: Arc<Mutex<BTreeMap<String, ModelStatus>>>,
    standbys: Arc<tokio::sync::Mutex<BTreeMap<String, StandbyPool>>>,
    /// What `GET /standbys` answers, published whenever the pools change: readers never
    /// wait behind a promotion's HTTP call (gateways would drop serving standbys).
    listing: Arc<Mutex<BTreeMap<String, PoolStandbys>>>,
}

/// Staging progress into the agent's metrics and status.
struct MetricProgress {
    model: String,
    shared: Shared,
    total: AtomicU64,
    done: AtomicU64,
    t0: Instant,
}

impl Progress for MetricProgress {
    fn start(&self, _: &str, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
    }

    fn advance(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        let total = self.total.load(Ordering::Relaxed).max(1);
        let frac = done as f64 / total as f64;
        let m = &self.shared.metrics;
        m.staging_progress
            .with_label_values(&[&self.model])
            .set(frac);
        m.staging_bytes.inc_by(n);
        let secs = self.t0.elapsed().as_secs_f64().max(1e-3);
        m.staging_throughput
            .with_label_values(&[&self.model])
            .set(done as f64 / secs);
        if let Some(s) = self
            .shared
            .status
            .lock()
            .expect("no panics while held")
            .get_mut(&self.model)
        {
            s.progress = frac;
        }
    }
}

impl Shared {
    /// Publishes what `GET /standbys` answers from the pools' current state.
    fn publish(&self, pools: &mut BTreeMap<String, StandbyPool>) {
        let listing = pools
            .iter_mut()
            .map(|(name, p)| {
                let v = PoolStandbys {
                    count: p.spec().count,
                    parked: p.ready(),
                    serving: p.serving_ports(),
                };
                (name.clone(), v)
            })
            .collect();
        *self.listing.lock().expect("no panics while held") = listing;
    }

    fn set_state(&self, name: &str, f: impl FnOnce(&mut ModelStatus)) {
        let mut m = self.status.lock().expect("no panics while held");
        let s = m.entry(name.to_owned()).or_insert_with(|| ModelStatus {
            name: name.to_owned(),
            state: "pending".into(),
            ..ModelStatus::default()
        });
        f(s);
    }

    async fn stage(&self, spec: &ModelSpec) -> Result<crate::StageOutcome> {
        let fetcher = Fetcher::new(spec.source.clone(), std::time::Duration::from_secs(60))?;
        let keep: HashSet<String> = self.cfg.models.iter().map(|m| m.name.clone()).collect();
        let progress = Arc::new(MetricProgress {
            model: spec.name.clone(),
            shared: self.clone(),
            total: 0.into(),
            done: 0.into(),
            t0: Instant::now(),
        });
        if self.store.path_of(&spec.name).is_none() {
            self.set_state(&spec.name, |s| s.state = "staging".into());
        }
        let r = self
            .store
            .ensure(&spec.name, &fetcher, &self.cfg.stage, &keep, progress)
            .await;
        match &r {
            Ok(o) => {
                self.metrics
                    .staging_progress
                    .with_label_values(&[&spec.name])
                    .set(1.0);
                self.set_state(&spec.name, |s| {
                    if s.state != "hot" {
                        s.state = "staged".into();
                    }
                    s.bytes = o.bytes;
                    s.progress = 1.0;
                    s.error = None;
                });
            }
            Err(e) => {
                tracing::warn!(model = %spec.name, error = %e, "staging failed");
                self.metrics
                    .staging_failures
                    .with_label_values(&[&spec.name])
                    .inc();
                self.set_state(&spec.name, |s| {
                    s.state = "failed".into();
                    s.error = Some(e.to_string());
                });
            }
        }
        // Only ever forward: a reset between two scrapes would read as a counter
        // restart and spike `rate()`.
        let (total, shown) = (self.store.evictions(), self.metrics.evictions.get());
        if total > shown {
            self.metrics.evictions.inc_by(total - shown);
        }
        r
    }
}

/// Runs the agent on `listener` until `stop` resolves; standbys are stopped on exit.
pub async fn run(
    cfg: AgentConfig,
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let store = Arc::new(Store::open(&cfg.dir, cfg.disk_budget)?);
    let labeler = match &cfg.kubernetes {
        Some(k) => Some(NodeLabeler::new(k.node_name.clone(), k.api_url.as_deref()).await?),
        None => None,
    };
    let kernels = cfg
        .kernel_cache_dir
        .as_ref()
        .map(KernelCache::open)
        .transpose()?
        .map(|c| match &cfg.cluster_token {
            // Signed: workers load only what the agent put there.
            Some((t, _)) => c.with_key(&t.prove(preheat_edge::token::KERNEL_CACHE_LABEL, &[])),
            None => c,
        });
    let metrics = Arc::new(AgentMetrics::new());
    metrics
        .disk_budget
        .set(i64::try_from(cfg.disk_budget).unwrap_or(i64::MAX));
    let shared = Shared {
        cfg: Arc::new(cfg),
        store,
        metrics,
        status: Arc::default(),
        standbys: Arc::default(),
        listing: Arc::default(),
    };
    for m in &shared.cfg.models {
        shared.set_state(&m.name, |_| {});
        // Every model's series exist from the start (at 0): a dashboard's rate of
        // failures is 0, not "no data", until one fails.
        shared
            .metrics
            .staging_failures
            .with_label_values(&[&m.name]);
    }
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics_route))
        .route("/models", get(models_route))
        .route("/models/{name}/stage", post(stage_route))
        .route("/snapshots/{file}", get(snapshot_route))
        .route("/standbys", get(standbys_route))
        .route("/standbys/{pool}", put(standby_count_route))
        .route("/standbys/{pool}/promote", post(promote_route))
        .route("/standbys/{pool}/retire", post(retire_route))
        .with_state(shared.clone());
    // Only our own processes (the scaler, gateways, operators with the token) call it.
    let token = shared
        .cfg
        .cluster_token
        .as_ref()
        .map(|(t, _)| Arc::clone(t));
    let server = preheat_edge::listener::InternalServer::new(listener, app, token)
        .warn_if_open("the agent's API");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        stop.await;
        let _ = stop_tx.send(true);
    });
    let mut srv_stop = stop_rx.clone();
    let server = tokio::spawn(server.serve(async move {
        let _ = srv_stop.wait_for(|s| *s).await;
    }));
    let hot = Arc::new(Mutex::new(HotSet::new(
        shared.cfg.memory_budget,
        shared.cfg.mlock,
    )));
    let mut seeded: HashSet<std::path::PathBuf> = HashSet::new();
    loop {
        refresh(
            &shared,
            &hot,
            labeler.as_ref(),
            kernels.as_ref(),
            &mut seeded,
        )
        .await;
        tokio::select! {
            () = tokio::time::sleep(shared.cfg.refresh) => {}
            _ = stop_rx.wait_for(|s| *s) => break,
        }
    }
    // Every pool at once: the pod's grace period covers one drain, not their sum.
    let mut pools = std::mem::take(&mut *shared.standbys.lock().await);
    shared.listing.lock().expect("no panics while held").clear();
    futures_util::future::join_all(pools.values_mut().map(StandbyPool::shutdown)).await;
    let _ = server.await;
    Ok(())
}

/// One pass: stage, hot set, kernel cache, labels, standbys, metrics.
async fn refresh(
    shared: &Shared,
    hot: &Arc<Mutex<HotSet>>,
    labeler: Option<&NodeLabeler>,
    kernels: Option<&KernelCache>,
    seeded: &mut HashSet<std::path::PathBuf>,
) {
    for spec in &shared.cfg.models {
        let _ = shared.stage(spec).await;
    }
    let wanted: Vec<(String, std::path::PathBuf)> = shared
        .cfg
        .models
        .iter()
        .filter(|m| m.hot)
        .filter_map(|m| Some((m.name.clone(), shared.store.path_of(&m.name)?)))
        .collect();
    let hot2 = Arc::clone(hot);
    let hot_status = tokio::task::spawn_blocking(move || {
        hot2.lock().expect("no panics while held").refresh(&wanted)
    })
    .await
    .unwrap_or_default();
    let mut states: BTreeMap<String, ModelState> = BTreeMap::new();
    shared.metrics.resident_bytes.reset();
    for m in &shared.cfg.models {
        if shared.store.path_of(&m.name).is_some() {
            states.insert(m.name.clone(), ModelState::Staged);
        }
    }
    for h in &hot_status {
        states.insert(h.name.clone(), ModelState::Hot);
        shared
            .metrics
            .resident_bytes
            .with_label_values(&[&h.name])
            .set(i64::try_from(h.resident_bytes).unwrap_or(i64::MAX));
    }
    {
        let mut st = shared.status.lock().expect("no panics while held");
        for (name, s) in st.iter_mut() {
            match states.get(name) {
                Some(ModelState::Hot) => s.state = "hot".into(),
                Some(ModelState::Staged) => s.state = "staged".into(),
                None => {}
            }
            s.resident_bytes = hot_status
                .iter()
                .find(|h| &h.name == name)
                .map_or(0, |h| h.resident_bytes);
        }
    }
    if let Some(k) = kernels {
        for m in &shared.cfg.models {
            if let Some(p) = shared.store.path_of(&m.name)
                && seeded.insert(p.clone())
                && let Ok(snap) = preheat_snapshot::Snapshot::open(&p)
            {
                match k.seed_from(&snap) {
                    Ok(n) if n > 0 => {
                        tracing::info!(model = %m.name, entries = n, "kernel cache seeded from the snapshot")
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(model = %m.name, error = %e, "kernel cache seeding failed")
                    }
                }
            }
        }
        if let Ok(e) = k.entries() {
            shared.metrics.kernel_entries.set(e.len() as i64);
        }
    }
    if let Some(l) = labeler
        && let Err(e) = l.apply(&states).await
    {
        tracing::warn!(error = %e, "node labels not updated");
    }
    {
        let mut pools = shared.standbys.lock().await;
        for spec in &shared.cfg.standbys {
            let Some(path) = shared.store.path_of(&spec.model) else {
                continue;
            };
            let pool = pools.entry(spec.pool.clone()).or_insert_with(|| {
                StandbyPool::new(spec.clone(), &path)
                    .with_host(&shared.cfg.advertise_host)
                    .with_token(shared.cfg.cluster_token.clone())
            });
            if let Err(e) = pool.reconcile().await {
                tracing::warn!(pool = %spec.pool, error = %e, "standbys not reconciled");
            }
            shared
                .metrics
                .parked
                .with_label_values(&[&spec.pool])
                .set(pool.ready() as i64);
        }
        shared.publish(&mut pools);
    }
    if let Ok(list) = shared.store.list() {
        shared.metrics.staged_models.set(list.len() as i64);
        shared
            .metrics
            .staged_bytes
            .set(i64::try_from(list.iter().map(|m| m.bytes).sum::<u64>()).unwrap_or(i64::MAX));
    }
    shared.metrics.hot_models.set(hot_status.len() as i64);
}

async fn metrics_route(State(s): State<Shared>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        s.metrics.render(),
    )
        .into_response()
}

async fn models_route(State(s): State<Shared>) -> Json<Vec<ModelStatus>> {
    Json(
        s.status
            .lock()
            .expect("no panics while held")
            .values()
            .cloned()
            .collect(),
    )
}

fn error_response(status: StatusCode, e: &Error) -> Response {
    (status, Json(serde_json::json!({"error": e.to_string()}))).into_response()
}

async fn stage_route(State(s): State<Shared>, UrlPath(name): UrlPath<String>) -> Response {
    let Some(spec) = s.cfg.models.iter().find(|m| m.name == name).cloned() else {
        return error_response(
            StatusCode::NOT_FOUND,
            &Error::Invalid(format!("model {name:?} is not configured")),
        );
    };
    match s.stage(&spec).await {
        Ok(o) => Json(serde_json::json!({
            "path": o.path, "bytes": o.bytes, "fetched_bytes": o.fetched_bytes,
            "resumed_bytes": o.resumed_bytes, "already_staged": o.already_staged, "seconds": o.seconds,
        }))
        .into_response(),
        Err(e) => error_response(StatusCode::BAD_GATEWAY, &e),
    }
}

async fn snapshot_route(
    State(s): State<Shared>,
    UrlPath(file): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    crate::files::serve_file(s.store.dir(), &file, &headers).await
}

#[derive(serde::Deserialize)]
struct CountBody {
    count: u32,
}

async fn standby_count_route(
    State(s): State<Shared>,
    UrlPath(pool): UrlPath<String>,
    Json(b): Json<CountBody>,
) -> Response {
    let mut pools = s.standbys.lock().await;
    match pools.get_mut(&pool) {
        Some(p) => {
            p.set_count(b.count.min(64));
            let r = p.reconcile().await;
            let count = p.spec().count;
            s.publish(&mut pools);
            if let Err(e) = r {
                return error_response(StatusCode::INTERNAL_SERVER_ERROR, &e);
            }
            Json(serde_json::json!({"pool": pool, "count": count})).into_response()
        }
        None => error_response(
            StatusCode::NOT_FOUND,
            &Error::Invalid(format!("no standby pool {pool:?} (configured and staged)")),
        ),
    }
}

/// One pool's standbys as `GET /standbys` lists them.
#[derive(Clone, Debug, Serialize)]
struct PoolStandbys {
    count: u32,
    parked: usize,
    serving: Vec<u16>,
}

async fn standbys_route(State(s): State<Shared>) -> Json<BTreeMap<String, PoolStandbys>> {
    Json(s.listing.lock().expect("no panics while held").clone())
}

async fn retire_route(State(s): State<Shared>, UrlPath(pool): UrlPath<String>) -> Response {
    let mut pools = s.standbys.lock().await;
    let Some(p) = pools.get_mut(&pool) else {
        return error_response(
            StatusCode::NOT_FOUND,
            &Error::Invalid(format!("no standby pool {pool:?}")),
        );
    };
    let retired = p.retire();
    s.publish(&mut pools);
    match retired {
        Some(port) => Json(serde_json::json!({"pool": pool, "port": port})).into_response(),
        None => error_response(
            StatusCode::CONFLICT,
            &Error::Invalid(format!("no promoted standby of {pool:?} serves")),
        ),
    }
}

async fn promote_route(State(s): State<Shared>, UrlPath(pool): UrlPath<String>) -> Response {
    let mut pools = s.standbys.lock().await;
    let Some(p) = pools.get_mut(&pool) else {
        return error_response(
            StatusCode::NOT_FOUND,
            &Error::Invalid(format!("no standby pool {pool:?}")),
        );
    };
    // Each promotion starts a replacement: without a cap, promotions would start
    // processes without limit.
    let serving = p.serving_ports().len();
    if serving >= p.spec().count as usize {
        return error_response(
            StatusCode::CONFLICT,
            &Error::Invalid(format!(
                "{serving} standbys of {pool:?} already serve (the limit is its count, {})",
                p.spec().count
            )),
        );
    }
    let promoted = p.promote().await;
    if matches!(promoted, Ok(Some(_))) {
        // A replacement starts parking now, not at the next refresh.
        let _ = p.reconcile().await;
    }
    s.publish(&mut pools);
    match promoted {
        Ok(Some(done)) => Json(done).into_response(),
        Ok(None) => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &Error::Invalid(format!("no parked standby of {pool:?} is ready")),
        ),
        Err(e) => error_response(StatusCode::BAD_GATEWAY, &e),
    }
}
