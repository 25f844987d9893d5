//! The two kinds of listener, as axum layers.
//!
//! - [`public`]: what clients reach (OpenAI API, `/health`, `/metrics`). Any
//!   `/internal/` path answers 404, whatever the router holds; with [`ApiKeys`],
//!   `/v1/*` asks for a key and answers 401 in the OpenAI error shape without one.
//! - [`internal`]: what only our own processes reach. Everything but `/health` and
//!   `/metrics` (kubelet probes, Prometheus) asks for the cluster token and answers
//!   401 without it, before the handler runs or the body is read.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};

use crate::{ApiKeys, ClusterToken};

/// Paths every listener answers without credentials.
fn open_path(path: &str) -> bool {
    matches!(path, "/health" | "/healthz" | "/metrics")
}

/// A client-facing listener: `/internal/` is not there; `/v1/` needs a key when
/// `keys` is given.
pub fn public<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    keys: Option<Arc<ApiKeys>>,
) -> Router<S> {
    router.layer(middleware::from_fn_with_state(keys, public_gate))
}

/// A listener for our own processes only: the cluster token on every path but the
/// open ones. Without a token (a hand-run process given none) it is open, as the
/// process said at start.
pub fn internal<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    token: Option<Arc<ClusterToken>>,
) -> Router<S> {
    router.layer(middleware::from_fn_with_state(token, internal_gate))
}

async fn public_gate(
    State(keys): State<Option<Arc<ApiKeys>>>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path();
    if path == "/internal" || path.starts_with("/internal/") {
        return StatusCode::NOT_FOUND.into_response();
    }
    if let Some(keys) = keys
        && path.starts_with("/v1/")
    {
        let auth = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        match keys.check(auth) {
            Some(id) => tracing::debug!(key = %id, path = %path, "API key accepted"),
            None => {
                let why = if auth.is_none() {
                    "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
                } else {
                    "Incorrect API key provided."
                };
                let body = serde_json::json!({"error": {
                    "message": why, "type": "invalid_request_error", "param": null,
                    "code": "invalid_api_key"}});
                return (
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Bearer")],
                    axum::Json(body),
                )
                    .into_response();
            }
        }
    }
    next.run(req).await
}

async fn internal_gate(
    State(token): State<Option<Arc<ClusterToken>>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(token) = token
        && !open_path(req.uri().path())
    {
        let auth = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        if !token.accepts(auth) {
            refused_log(req.uri().path());
            return unauthorized();
        }
    }
    next.run(req).await
}

/// Logs a refusal at most once a second (a flood of them must not flood the log),
/// the path escaped (a caller picks it).
fn refused_log(path: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    static SUPPRESSED: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LAST.swap(now, Ordering::Relaxed) == now {
        SUPPRESSED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let more = SUPPRESSED.swap(0, Ordering::Relaxed);
    tracing::warn!(path = ?path, refused_since_last_log = more, "internal request without the cluster token refused");
}

/// The 401 of an internal listener.
#[must_use]
pub fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        axum::Json(serde_json::json!({
            "error": "this endpoint needs the deployment's cluster token (Authorization: Bearer)"
        })),
    )
        .into_response()
}

/// Carries the cluster token, when there is one, on a request to another of our
/// processes.
pub trait WithClusterToken {
    #[must_use]
    fn cluster_token(self, token: Option<&ClusterToken>) -> Self;
}

impl WithClusterToken for reqwest::RequestBuilder {
    fn cluster_token(self, token: Option<&ClusterToken>) -> Self {
        match token {
            Some(t) => self.header(reqwest::header::AUTHORIZATION, t.bearer()),
            None => self,
        }
    }
}
