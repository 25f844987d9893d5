//! What the control loop decided and saw, per (model, pool): written by the tick,
//! read by KEDA's gRPC service, the scaler's `/metrics` and `GET /status`.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use crate::policy::Pool;

/// The latest decision for one (model, pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PoolDecision {
    pub desired: u32,
    pub active: bool,
}

/// What the control loop saw and why it decided, for the scaler's own metrics and
/// `GET /status`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PoolStatus {
    pub current: u32,
    /// Replicas serving: ready pods (a pod source), else endpoints that answered.
    pub ready: u32,
    pub endpoints_ok: usize,
    pub endpoints_failed: usize,
    /// [`crate::signals::PoolSignals::is_blind`] of the tick: held, not sized.
    pub blind: bool,
    pub reason: &'static str,
    /// Endpoints failing now (scrape URLs, any user:password part removed).
    pub failing: Vec<String>,
    pub slo: SloView,
    /// `None` before the first decision and while blind.
    pub load: Option<crate::policy::LoadView>,
    /// Replicas the pool's policy wanted, before the fleet's GPU budget granted
    /// `desired` (the same unless the budget cut it); `None` when nothing was decided.
    pub wanted: Option<u32>,
}

/// A pool's latency over the scaler's window against the targets it sizes for.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SloView {
    /// TTFT target for prompts up to `slo_ttft_ref_tokens` (longer ones get more).
    pub ttft_target_s: f64,
    pub itl_target_s: f64,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub itl_p50_s: Option<f64>,
    pub itl_p90_s: Option<f64>,
    /// Share of the window's requests whose TTFT met the target (`None`: no requests,
    /// or a source that gives quantiles only).
    pub ttft_attainment: Option<f64>,
    /// Share of the window's tokens whose inter-token latency met the target.
    pub itl_attainment: Option<f64>,
}

impl SloView {
    /// The view of `s` against `(ttft, itl)` targets.
    #[must_use]
    pub fn of(s: &crate::signals::PoolSignals, ttft_target_s: f64, itl_target_s: f64) -> Self {
        use crate::signals::exposition::fraction_within;
        SloView {
            ttft_target_s,
            itl_target_s,
            ttft_p50_s: s.ttft_p50,
            ttft_p90_s: s.ttft_p90,
            itl_p50_s: s.itl_p50,
            itl_p90_s: s.itl_p90,
            ttft_attainment: s
                .ttft_hist
                .as_deref()
                .and_then(|b| fraction_within(b, ttft_target_s)),
            itl_attainment: s
                .itl_hist
                .as_deref()
                .and_then(|b| fraction_within(b, itl_target_s)),
        }
    }
}

/// Decisions shared between the control loop (writer) and the gRPC service (readers).
#[derive(Debug)]
pub struct DecisionStore {
    models: Vec<String>,
    state: RwLock<HashMap<(String, Pool), PoolDecision>>,
    status: RwLock<HashMap<(String, Pool), PoolStatus>>,
    version: watch::Sender<u64>,
    closed: std::sync::atomic::AtomicBool,
    /// Unix time of the state file's last successful save.
    state_saved: RwLock<Option<f64>>,
    /// GPU-seconds each model's replicas have held since the scaler started.
    gpu_seconds: RwLock<HashMap<String, f64>>,
    /// Since when each model has been granted fewer replicas than it wants by the
    /// fleet's GPU budget (absent: not waiting).
    budget_wait: RwLock<HashMap<String, std::time::Instant>>,
}

impl DecisionStore {
    /// A store for `models`; a pool has no decision until the control loop knows its
    /// real replica count (KEDA is then told "unavailable", never a made-up 0).
    #[must_use]
    pub fn new(models: Vec<String>) -> Arc<Self> {
        Arc::new(DecisionStore {
            models,
            state: RwLock::new(HashMap::new()),
            status: RwLock::new(HashMap::new()),
            version: watch::channel(0).0,
            closed: false.into(),
            state_saved: RwLock::new(None),
            gpu_seconds: RwLock::new(HashMap::new()),
            budget_wait: RwLock::new(HashMap::new()),
        })
    }

    /// Ends every `StreamIsActive` stream (shutdown: KEDA reconnects elsewhere, and
    /// a graceful shutdown would otherwise wait on streams that never end).
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.version.send_modify(|v| *v += 1);
    }

    /// The models decided for, as configured.
    #[must_use]
    pub fn models(&self) -> &[String] {
        &self.models
    }

    /// Changes whenever a decision changes (or the store closes).
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Records a decision; wakes `StreamIsActive` watchers when anything changed.
    pub fn set(&self, model: &str, pool: Pool, d: PoolDecision) {
        let mut st = self.state.write().unwrap_or_else(|e| e.into_inner());
        let key = (model.to_owned(), pool);
        if st.get(&key) != Some(&d) {
            st.insert(key, d);
            drop(st);
            self.version.send_modify(|v| *v += 1);
        }
    }

    /// The latest decision; `None` before the first (a starting scaler).
    #[must_use]
    pub fn get(&self, model: &str, pool: Pool) -> Option<PoolDecision> {
        let st = self.state.read().unwrap_or_else(|e| e.into_inner());
        st.get(&(model.to_owned(), pool)).copied()
    }

    /// Records a successful save of the state file, made at Unix time `unix`.
    pub fn set_state_saved(&self, unix: f64) {
        *self.state_saved.write().unwrap_or_else(|e| e.into_inner()) = Some(unix);
    }

    /// When the state file was last saved; `None` before the first save, or without one.
    #[must_use]
    pub fn state_saved(&self) -> Option<f64> {
        *self.state_saved.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Records what the last tick saw of a pool (KEDA never reads this; `/metrics` does).
    /// Counts `secs` GPU-seconds more for `model`.
    pub fn add_gpu_seconds(&self, model: &str, secs: f64) {
        let mut g = self.gpu_seconds.write().unwrap_or_else(|e| e.into_inner());
        *g.entry(model.to_owned()).or_default() += secs;
    }

    /// Records whether the fleet's budget granted `model` fewer replicas than it wants
    /// this tick: a wait starts at the first such tick and ends at the first without.
    pub fn set_budget_cut(&self, model: &str, cut: bool) {
        let mut w = self.budget_wait.write().unwrap_or_else(|e| e.into_inner());
        if cut {
            w.entry(model.to_owned())
                .or_insert_with(std::time::Instant::now);
        } else {
            w.remove(model);
        }
    }

    /// Seconds `model` has waited on the fleet's budget (0: not waiting).
    #[must_use]
    pub fn budget_wait_s(&self, model: &str) -> f64 {
        let w = self.budget_wait.read().unwrap_or_else(|e| e.into_inner());
        w.get(model).map_or(0.0, |t| t.elapsed().as_secs_f64())
    }

    /// GPU-seconds `model`'s replicas have held since the scaler started.
    #[must_use]
    pub fn gpu_seconds(&self, model: &str) -> f64 {
        let g = self.gpu_seconds.read().unwrap_or_else(|e| e.into_inner());
        g.get(model).copied().unwrap_or(0.0)
    }

    pub fn set_status(&self, model: &str, pool: Pool, s: PoolStatus) {
        let mut st = self.status.write().unwrap_or_else(|e| e.into_inner());
        st.insert((model.to_owned(), pool), s);
    }

    /// The last tick's status of a pool; default before its first tick.
    #[must_use]
    pub fn status(&self, model: &str, pool: Pool) -> PoolStatus {
        let st = self.status.read().unwrap_or_else(|e| e.into_inner());
        st.get(&(model.to_owned(), pool))
            .cloned()
            .unwrap_or_default()
    }
}
