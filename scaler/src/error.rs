//! Errors of the scaler library.

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScalerError {
    #[error("scrape: {0}")]
    Scrape(String),
    #[error("config: {}", .0.join("; "))]
    Config(Vec<String>),
    #[error("kubernetes: {0}")]
    Kube(String),
    #[error("prometheus: {0}")]
    Prometheus(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = ScalerError> = std::result::Result<T, E>;
