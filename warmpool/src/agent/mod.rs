//! `preheat warmpool run`: the node agent. Every `refresh` it prefetches the configured
//! models that fit the disk budget (the most recently wanted first, each once; evicting
//! nothing), refreshes the hot set (the most recently wanted that fit the memory
//! budget), seeds the kernel cache, labels the node and keeps the standbys parked; a
//! model a replica maps counts as wanted now. Demand (`POST /models/{name}/stage`, and
//! a pod's own staging step) stages a model, evicting the least recently wanted one no
//! replica maps. Between refreshes it answers:
//!
//! | route | what |
//! |---|---|
//! | `GET /health` | 200 while the agent runs |
//! | `GET /metrics` | [`crate::metrics::names`] |
//! | `GET /models` | every configured model: state, bytes, resident bytes, progress, last error |
//! | `POST /models/{name}/stage` | stage a configured model now, making room (joins a staging in progress) |
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

mod demand;
mod routes;

use demand::{models_by_want, standby_shares};
use routes::PoolStandbys;

/// What the agent knows of one configured model.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct ModelStatus {
    pub name: String,
    /// `pending`, `staging`, `staged`, `hot` or `failed`.
    pub state: String,
    pub bytes: u64,
    pub resident_bytes: u64,
    pub progress: f64,
    /// A replica on this node (a pod or a standby) maps it: never evicted.
    #[serde(default)]
    pub mapped: bool,
    /// Unix seconds it was last wanted (a replica started from it or mapped it, or
    /// it was asked for); what eviction and the hot set go by. Absent: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_wanted_s: Option<f64>,
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
            if s.state == "pending" {
                "staging".clone_into(&mut s.state);
            }
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
                    count: p.target(),
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

    /// Stages `spec`: on `demand`, making room and recording the want; otherwise
    /// (prefetch) only where it fits beside what is staged.
    async fn stage(&self, spec: &ModelSpec, demand: bool) -> Result<crate::StageOutcome> {
        let fetcher = Fetcher::new(spec.source.clone(), std::time::Duration::from_secs(60))?;
        let progress = Arc::new(MetricProgress {
            model: spec.name.clone(),
            shared: self.clone(),
            total: 0.into(),
            done: 0.into(),
            t0: Instant::now(),
        });
        // A prefetch that does not fit stays `pending`: it shows `staging` from its
        // first progress on.
        if demand && self.store.path_of(&spec.name).is_none() {
            self.set_state(&spec.name, |s| s.state = "staging".into());
        }
        let r = if demand {
            self.store
                .ensure(
                    &spec.name,
                    &fetcher,
                    &self.cfg.stage,
                    &HashSet::new(),
                    progress,
                )
                .await
        } else {
            self.store
                .prefetch(&spec.name, &fetcher, &self.cfg.stage, progress)
                .await
        };
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
            Err(e @ Error::OverBudget(_)) if !demand => {
                // Not a failure: the disk holds other models; it waits for demand.
                tracing::debug!(model = %spec.name, error = %e, "not prefetched");
                self.set_state(&spec.name, |s| {
                    s.state = "pending".into();
                    s.error = Some(e.to_string());
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
    let app = routes::router(shared.clone());
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
    // A model a replica maps (a pod; standbys hold no lease) is wanted now.
    let mapped: HashSet<String> = shared
        .cfg
        .models
        .iter()
        .filter(|m| {
            shared
                .store
                .path_of(&m.name)
                .is_some_and(|p| crate::lease::held(&p))
        })
        .map(|m| m.name.clone())
        .collect();
    if !mapped.is_empty() {
        shared.store.touch_all(mapped.iter().map(String::as_str));
    }
    // Prefetching records no want: read once, it holds for the whole pass.
    let wants = wants(shared);
    let by_want = models_by_want(&shared.cfg.models, &wants);
    for spec in &by_want {
        let _ = shared.stage(spec, false).await;
    }
    let wanted: Vec<(String, std::path::PathBuf)> = by_want
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
            s.mapped = mapped.contains(name);
            s.last_wanted_s = wants.get(name).copied().filter(|t| *t > 0.0);
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
        let staged: Vec<(&crate::config::StandbySpec, std::path::PathBuf)> = shared
            .cfg
            .standbys
            .iter()
            .filter_map(|s| Some((s, shared.store.path_of(&s.model)?)))
            .collect();
        for (spec, path) in &staged {
            pools.entry(spec.pool.clone()).or_insert_with(|| {
                StandbyPool::new((*spec).clone(), path)
                    .with_host(&shared.cfg.advertise_host)
                    .with_token(shared.cfg.cluster_token.clone())
            });
        }
        let counts: Vec<(&str, &str, u32)> = staged
            .iter()
            .filter_map(|(s, _)| {
                Some((
                    s.pool.as_str(),
                    s.model.as_str(),
                    pools.get(&s.pool)?.spec().count,
                ))
            })
            .collect();
        let order: Vec<&str> = by_want.iter().map(|m| m.name.as_str()).collect();
        let shares = standby_shares(&counts, &order, shared.cfg.standby_budget);
        // A pool whose model was evicted parks none: its standbys would hold the
        // unlinked file's blocks (the room its eviction made).
        for (name, pool) in pools.iter_mut() {
            if !staged.iter().any(|(s, _)| &s.pool == name) {
                pool.set_cap(0);
                if let Err(e) = pool.reconcile().await {
                    tracing::warn!(pool = %name, error = %e, "standbys not reconciled");
                }
            }
        }
        for (spec, _) in &staged {
            let Some(pool) = pools.get_mut(&spec.pool) else {
                continue;
            };
            pool.set_cap(shares.get(spec.pool.as_str()).copied().unwrap_or(0));
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

/// When each staged model was last wanted (unix seconds; 0: never).
fn wants(shared: &Shared) -> BTreeMap<String, f64> {
    shared
        .store
        .list()
        .unwrap_or_default()
        .into_iter()
        .map(|m| (m.name, m.last_used))
        .collect()
}
