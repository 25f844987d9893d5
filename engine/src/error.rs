//! Engine errors, classified by what went wrong rather than by HTTP status; the server
//! maps each class to a status and an OpenAI error type at the edge.

/// Failures of the engine and its API.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The request itself is wrong (bad field, too long, unknown model).
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    /// The model named in the request is not served here (`known`: those that are).
    #[error("model {model:?} is not served here; served: {}", known.join(", "))]
    UnknownModel { model: String, known: Vec<String> },
    /// The waiting queue is full; retry after the given seconds.
    #[error("server is at capacity; retry later")]
    Overloaded { retry_after_secs: u64 },
    /// The engine is not ready (loading) or is shutting down.
    #[error("{0}")]
    Unavailable(String),
    /// No worker took the request: a pool at zero did not wake within the hold time,
    /// or its workers cannot start. Retry after the given seconds.
    #[error("{message}")]
    NoWorkers {
        message: String,
        retry_after_secs: u64,
    },
    /// Model files are missing or inconsistent.
    #[error("model: {0}")]
    Model(String),
    #[error("snapshot: {0}")]
    Snapshot(#[from] preheat_snapshot::Error),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    /// The accelerator failed (driver, cuBLAS, out of device memory).
    #[error("device: {0}")]
    Device(String),
    /// A bug: an invariant the engine maintains was broken.
    #[error("internal error: {0}")]
    Internal(String),
}

impl EngineError {
    pub fn invalid(message: impl Into<String>, param: &str) -> Self {
        EngineError::InvalidRequest {
            message: message.into(),
            param: Some(param.to_owned()),
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
