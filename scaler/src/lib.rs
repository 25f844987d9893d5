//! # preheat-scaler
//!
//! Sizes the prefill and decode pools of a disaggregated LLM deployment independently,
//! and speaks KEDA's external-scaler gRPC protocol so KEDA can act on it unmodified.
//! Depends on no other preheat crate: it reads Prometheus text and talks gRPC, so it
//! sizes vLLM and SGLang deployments as well as preheat's own engine.
//!
//! - [`signals`]: scraped metrics → per-pool signals (rates, quantiles, staleness);
//! - [`policy`]: signals → desired replicas (the `preheat` policy);
//! - [`cache_plan`]: which model is staged, hot or parked on which node of a fleet;
//! - [`profile`]: per-replica capacity the policy sizes with;
//! - [`DecisionStore`]: what the control loop decided and saw, per (model, pool);
//! - [`grpc`]: the KEDA `ExternalScaler` service over a shared [`DecisionStore`].

pub mod cache_plan;
pub mod config;
pub mod controller;
mod decisions;
mod error;
pub mod grpc;
pub mod grpc_incoming;
pub mod kube;
pub mod percentile;
pub mod policy;
pub mod profile;
pub mod prom;
pub mod scrape;
pub mod server;
pub mod signals;
pub mod standbys;
pub mod state;
pub mod status;

pub use config::Config;
pub use decisions::{DecisionStore, PoolDecision, PoolStatus, SloView};
pub use error::{Result, ScalerError};
pub use policy::{LoadView, Pool, PoolPolicy};
pub use profile::Profile;
pub use standbys::AgentPool;
pub use status::{ModelReport, PoolReport, StatusReport};

/// Code generated from `proto/externalscaler.proto`.
#[allow(
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    unreachable_pub
)]
pub mod proto {
    tonic::include_proto!("externalscaler");
}
