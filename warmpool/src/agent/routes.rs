//! The agent's HTTP API (the table in the module above): handlers over its shared
//! state.

use std::collections::BTreeMap;

use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Serialize;

use super::{ModelStatus, Shared};
use crate::Error;

/// Every route, over the agent's shared state.
pub(super) fn router(shared: Shared) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics_route))
        .route("/models", get(models_route))
        .route("/models/{name}/stage", post(stage_route))
        .route("/snapshots/{file}", get(snapshot_route))
        .route("/standbys", get(standbys_route))
        .route("/standbys/{pool}", put(standby_count_route))
        .route("/standbys/{pool}/promote", post(promote_route))
        .route("/standbys/{pool}/retire", post(retire_route))
        .with_state(shared)
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
    match s.stage(&spec, true).await {
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
/// One pool's line of `GET /standbys`.
#[derive(Clone, Debug, Serialize)]
pub(super) struct PoolStandbys {
    pub(super) count: u32,
    pub(super) parked: usize,
    pub(super) serving: Vec<u16>,
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
