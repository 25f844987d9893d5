use std::path::PathBuf;

/// Errors of the warm-pool agent and of staging.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("fetching {url}: {message}")]
    Fetch { url: String, message: String },
    #[error(transparent)]
    Snapshot(#[from] preheat_snapshot::Error),
    #[error("{0} is corrupt: {1}")]
    Corrupt(String, String),
    #[error("disk budget: {0}")]
    OverBudget(String),
    #[error("invalid configuration:\n  {}", .0.join("\n  "))]
    Config(Vec<String>),
    #[error("{0}")]
    Invalid(String),
    #[error("kubernetes: {0}")]
    Kube(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
