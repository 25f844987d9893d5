//! The KEDA external scaler service.
//!
//! KEDA sends a ScaledObject's trigger `metadata` as `scalerMetadata`: `pool`
//! (`prefill` | `decode`) and `model` select the decision. The metric reported is the
//! policy's desired replica count with a target of 1 per replica, so KEDA's HPA
//! (`AverageValue`: desired = ceil(value / target)) lands on exactly that count.
//!
//! HPA ignores changes while |1 − value / (target × current)| ≤ 0.1 (its default
//! tolerance): going from 10 to 11 replicas is a 10% change and would be ignored.
//! Set `behavior.scaleUp/scaleDown.tolerance` (Kubernetes ≥ 1.33) to a small value in
//! the ScaledObject's `advanced.horizontalPodAutoscalerConfig`, as the Helm chart does,
//! or use the direct mode that patches the Deployment's scale subresource.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::policy::Pool;
use crate::proto::external_scaler_server::{ExternalScaler, ExternalScalerServer};
use crate::proto::{
    GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec,
    MetricValue, ScaledObjectRef,
};

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
        })
    }

    /// Ends every `StreamIsActive` stream (shutdown: KEDA reconnects elsewhere, and
    /// a graceful shutdown would otherwise wait on streams that never end).
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.version.send_modify(|v| *v += 1);
    }

    fn is_closed(&self) -> bool {
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

    /// The latest decision, or the gRPC error KEDA gets while there is none: HPA
    /// keeps a Deployment's replicas while its metric cannot be read, and KEDA keeps
    /// activation as it was while `IsActive` fails, so a restart changes nothing.
    fn decided(&self, model: &str, pool: Pool) -> Result<PoolDecision, Status> {
        self.get(model, pool).ok_or_else(|| {
            Status::unavailable(format!(
                "no decision yet for {model}/{}: the scaler is starting and has not read the pool's replicas",
                pool.as_str()
            ))
        })
    }

    /// Records what the last tick saw of a pool (KEDA never reads this; `/metrics` does).
    /// Records a successful save of the state file, made at Unix time `unix`.
    pub fn set_state_saved(&self, unix: f64) {
        *self.state_saved.write().unwrap_or_else(|e| e.into_inner()) = Some(unix);
    }

    /// When the state file was last saved; `None` before the first save, or without one.
    #[must_use]
    pub fn state_saved(&self) -> Option<f64> {
        *self.state_saved.read().unwrap_or_else(|e| e.into_inner())
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

    /// Resolves `scalerMetadata` to a (model, pool), or the gRPC error that says why not.
    pub fn resolve(&self, meta: &HashMap<String, String>) -> Result<(String, Pool), Status> {
        let pool = meta.get("pool").map(String::as_str).unwrap_or("");
        let pool = Pool::parse(pool).ok_or_else(|| {
            Status::invalid_argument(format!(
                "scalerMetadata.pool must be \"prefill\" or \"decode\", got {pool:?}"
            ))
        })?;
        let model = match (meta.get("model"), self.models.as_slice()) {
            (Some(m), models) if models.contains(m) => m.clone(),
            (Some(m), models) => {
                return Err(Status::not_found(format!(
                    "model {m:?} is not configured (configured: {})",
                    models.join(", ")
                )));
            }
            (None, [only]) => only.clone(),
            (None, _) => {
                return Err(Status::invalid_argument(
                    "scalerMetadata.model is required when several models are configured",
                ));
            }
        };
        Ok((model, pool))
    }
}

/// Metric name KEDA sees for a (model, pool): lowercase, `[a-z0-9-]`.
#[must_use]
pub fn metric_name(model: &str, pool: Pool) -> String {
    let m: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    format!("preheat-{m}-{}", pool.as_str())
}

/// The tonic service.
#[derive(Clone, Debug)]
pub struct ScalerService {
    store: Arc<DecisionStore>,
}

impl ScalerService {
    #[must_use]
    pub fn new(store: Arc<DecisionStore>) -> Self {
        ScalerService { store }
    }

    #[must_use]
    pub fn into_server(self) -> ExternalScalerServer<Self> {
        ExternalScalerServer::new(self)
    }
}

type Stream2<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl ExternalScaler for ScalerService {
    async fn is_active(
        &self,
        req: Request<ScaledObjectRef>,
    ) -> Result<Response<IsActiveResponse>, Status> {
        let (model, pool) = self.store.resolve(&req.get_ref().scaler_metadata)?;
        Ok(Response::new(IsActiveResponse {
            result: self.store.decided(&model, pool)?.active,
        }))
    }

    type StreamIsActiveStream = Stream2<IsActiveResponse>;

    async fn stream_is_active(
        &self,
        req: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        let (model, pool) = self.store.resolve(&req.get_ref().scaler_metadata)?;
        let store = Arc::clone(&self.store);
        let mut rx = store.version.subscribe();
        let (tx, out) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            // The current state at once (once there is one: a starting scaler says
            // nothing rather than a made-up "inactive"), then every change.
            let mut last = loop {
                if store.is_closed() {
                    return;
                }
                if let Some(d) = store.get(&model, pool) {
                    break d.active;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            };
            if tx
                .send(Ok(IsActiveResponse { result: last }))
                .await
                .is_err()
            {
                return;
            }
            while rx.changed().await.is_ok() {
                if store.is_closed() {
                    return;
                }
                let Some(now) = store.get(&model, pool).map(|d| d.active) else {
                    continue;
                };
                if now != last {
                    last = now;
                    if tx.send(Ok(IsActiveResponse { result: now })).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    async fn get_metric_spec(
        &self,
        req: Request<ScaledObjectRef>,
    ) -> Result<Response<GetMetricSpecResponse>, Status> {
        let (model, pool) = self.store.resolve(&req.get_ref().scaler_metadata)?;
        Ok(Response::new(GetMetricSpecResponse {
            metric_specs: vec![MetricSpec {
                metric_name: metric_name(&model, pool),
                target_size: 1,
                target_size_float: 1.0,
            }],
        }))
    }

    async fn get_metrics(
        &self,
        req: Request<GetMetricsRequest>,
    ) -> Result<Response<GetMetricsResponse>, Status> {
        let r = req.get_ref();
        let meta = r
            .scaled_object_ref
            .as_ref()
            .map(|s| s.scaler_metadata.clone())
            .unwrap_or_default();
        let (model, pool) = self.store.resolve(&meta)?;
        let d = self.store.decided(&model, pool)?;
        Ok(Response::new(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: metric_name(&model, pool),
                metric_value: i64::from(d.desired),
                metric_value_float: f64::from(d.desired),
            }],
        }))
    }

    type StreamMetricSpecStream = Stream2<GetMetricSpecResponse>;

    async fn stream_metric_spec(
        &self,
        _req: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamMetricSpecStream>, Status> {
        Err(Status::unimplemented(
            "StreamMetricSpec is optional; the metric spec does not change",
        ))
    }
}
