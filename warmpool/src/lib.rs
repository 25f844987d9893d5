//! # preheat-warmpool
//!
//! The node agent that makes replicas start in seconds:
//! - [`stage`] fetches a snapshot (plain or packed, local path or HTTP with Range
//!   requests) in parallel, resumes after interruption, verifies every checksum and
//!   publishes atomically;
//! - [`store`] keeps the node's snapshot directory within a disk budget (the least
//!   recently wanted model no replica maps goes first) and stages each model once
//!   however many ask;
//! - [`lease`] is a replica's claim on the snapshot it maps;
//! - [`hot`] keeps the hot set in page cache within a memory budget;
//! - [`files`] serves staged snapshots with Range support, so nodes (and tests) can
//!   stage from a peer;
//! - [`labels`] marks the node `preheat.dev/<model>=staged|hot` for pod affinity;
//! - [`standby`] keeps parked standby replicas per pool and promotes them;
//! - [`kernel_cache`] persists compiled kernels keyed by what they were built for;
//! - [`agent`] ties them together behind `/metrics` and a small HTTP API.

pub mod agent;
mod card;
pub mod config;
mod error;
mod fetch;
pub mod files;
mod hot;
/// Compiled-kernel cache, shared with the engine (defined in the snapshot crate).
pub use preheat_snapshot::kernel_cache;
mod labels;
pub mod lease;
pub mod metrics;
mod ownership;
pub mod restart_backoff;
pub mod stage;
pub mod standby;
mod store;
pub mod worker_process;

pub use card::fetch_card;
pub use config::AgentConfig;
pub use error::{Error, Result};
pub use fetch::{Fetcher, Source};
pub use ownership::own_tree;
pub use stage::{StageOptions, StageOutcome, stage};
pub use store::Store;
