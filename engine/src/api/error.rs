//! Mapping engine error classes to HTTP statuses and OpenAI error objects, in one place.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::EngineError;

/// An error as the API returns it.
#[derive(Debug)]
pub struct ApiError(pub EngineError);

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        ApiError(e)
    }
}

impl ApiError {
    pub fn status_and_type(&self) -> (StatusCode, &'static str, Option<&'static str>) {
        match &self.0 {
            EngineError::InvalidRequest { .. } => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", None)
            }
            EngineError::UnknownModel { .. } => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
            ),
            EngineError::Overloaded { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("server_overloaded"),
            ),
            EngineError::Unavailable(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", None)
            }
            EngineError::NoWorkers { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                Some("no_workers"),
            ),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error", None),
        }
    }

    /// The `{"error": {...}}` body.
    #[must_use]
    pub fn body(&self) -> serde_json::Value {
        let (_, ty, code) = self.status_and_type();
        let param = match &self.0 {
            EngineError::InvalidRequest { param, .. } => param.clone(),
            EngineError::UnknownModel { .. } => Some("model".to_owned()),
            _ => None,
        };
        json!({"error": {"message": self.0.to_string(), "type": ty, "param": param, "code": code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, _, _) = self.status_and_type();
        if status.is_server_error() {
            tracing::error!(error = %self.0, "request failed");
        }
        let mut resp = (status, axum::Json(self.body())).into_response();
        if let EngineError::Overloaded { retry_after_secs }
        | EngineError::NoWorkers {
            retry_after_secs, ..
        } = self.0
            && let Ok(v) = HeaderValue::from_str(&retry_after_secs.to_string())
        {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        resp
    }
}
