//! Errors of the scaler library.

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScalerError {
    #[error("scrape: {0}")]
    Scrape(String),
    #[error("config: {}", .0.join("; "))]
    Config(Vec<String>),
    #[error("kubernetes: no cluster configuration: {0}")]
    KubeConfig(#[from] kube::config::InferConfigError),
    /// A Kubernetes API call failed (`what` names it).
    #[error("kubernetes: {what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The gRPC server stopped with an error.
    #[error("grpc server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("prometheus: {0}")]
    Prometheus(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = ScalerError> = std::result::Result<T, E>;
