//! What stands at every listener of a preheat deployment: who may call, and on which
//! port.
//!
//! - [`ClusterToken`]: the deployment's shared secret. Every request between our own
//!   processes (registration, heartbeats, `/internal/*`, the KV port, the warm-pool
//!   agent's API) carries it (`Authorization: Bearer`, or a challenge-response on the
//!   KV port that never sends it); without it a caller gets 401 and nothing else
//!   happens.
//! - [`ApiKeys`]: the clients' keys for the OpenAI API, reloaded when their file
//!   changes, logged and counted only by a short hash.
//! - [`routes`]: the two kinds of listener. A public one (OpenAI API, `/health`,
//!   `/metrics`) answers 404 to any `/internal/` path; an internal one asks for the
//!   token on everything but `/health` and `/metrics` (probes and Prometheus).
//! - [`listener::serve`]: every listener's connection cap and header/body deadlines.
//! - [`config_file`]: the one set of YAML rules the scaler and the agent read their
//!   config files with.

pub mod api_keys;
pub mod client;
pub mod config_file;
pub mod listener;
pub mod routes;
pub mod token;

pub use api_keys::ApiKeys;
pub use routes::WithClusterToken;
pub use token::ClusterToken;

/// Why a secret could not be had.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("reading {what} from {path}: {source}")]
    Read {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{what} in {path} is empty")]
    Empty { what: &'static str, path: String },
    #[error("{what} in {path} is too short ({len} bytes; at least {min})")]
    TooShort {
        what: &'static str,
        path: String,
        len: usize,
        min: usize,
    },
    #[error(
        "the cluster token in {path} has bytes other than printable ASCII (it travels in an HTTP header; e.g. `openssl rand -hex 32`)"
    )]
    NotPrintable { path: String },
    #[error("writing {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}
