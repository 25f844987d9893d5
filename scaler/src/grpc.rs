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
use std::sync::Arc;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::decisions::{DecisionStore, PoolDecision};
use crate::policy::Pool;
use crate::proto::external_scaler_server::{ExternalScaler, ExternalScalerServer};
use crate::proto::{
    GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec,
    MetricValue, ScaledObjectRef,
};

/// Resolves `scalerMetadata` to a (model, pool), or the gRPC error that says why not.
fn resolve(
    store: &DecisionStore,
    meta: &HashMap<String, String>,
) -> Result<(String, Pool), Status> {
    let pool = meta.get("pool").map(String::as_str).unwrap_or("");
    let pool = Pool::parse(pool).ok_or_else(|| {
        Status::invalid_argument(format!(
            "scalerMetadata.pool must be \"prefill\" or \"decode\", got {pool:?}"
        ))
    })?;
    let model = match (meta.get("model"), store.models()) {
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

/// The latest decision, or the gRPC error KEDA gets while there is none: HPA
/// keeps a Deployment's replicas while its metric cannot be read, and KEDA keeps
/// activation as it was while `IsActive` fails, so a restart changes nothing.
fn decided(store: &DecisionStore, model: &str, pool: Pool) -> Result<PoolDecision, Status> {
    store.get(model, pool).ok_or_else(|| {
        Status::unavailable(format!(
            "no decision yet for {model}/{}: the scaler is starting and has not read the pool's replicas",
            pool.as_str()
        ))
    })
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
        let (model, pool) = resolve(&self.store, &req.get_ref().scaler_metadata)?;
        Ok(Response::new(IsActiveResponse {
            result: decided(&self.store, &model, pool)?.active,
        }))
    }

    type StreamIsActiveStream = Stream2<IsActiveResponse>;

    async fn stream_is_active(
        &self,
        req: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        let (model, pool) = resolve(&self.store, &req.get_ref().scaler_metadata)?;
        let store = Arc::clone(&self.store);
        let mut rx = store.subscribe();
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
        let (model, pool) = resolve(&self.store, &req.get_ref().scaler_metadata)?;
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
        let (model, pool) = resolve(&self.store, &meta)?;
        let d = decided(&self.store, &model, pool)?;
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
