//! A discrete-event simulator of a disaggregated deployment under a request trace, to
//! compare autoscaling policies: the scaler's own ([`preheat_scaler::policy::PreheatPolicy`],
//! the same code the KEDA scaler runs) and the baselines in [`autoscalers`].
//!
//! The model: requests arrive at a gateway; a KV-aware router sends each to the ready
//! prefill replica that would finish it first (its backlog plus the part of the prompt
//! not in that replica's prefix cache), having first reserved the prompt's KV on the
//! decode replica holding the least, as the gateway does; the prompt's K/V lands there
//! between decode steps, where the first token streams, and the rest decodes under
//! continuous batching (with no decode replica ready or with room at routing, the
//! first with room takes it once it is prefilled). A pool with no ready replica holds
//! requests at the gateway.
//! New replicas serve after the profile's start-up time; removed replicas drain what
//! they hold. GPU-seconds count every replica from its start to its exit. Everything is
//! deterministic: the same trace and settings give the same report.
//!
//! Layout: [`config`] (what a run is given), [`registry`] (policies by name, runs),
//! `replay` (the event loop), `observe` (what an autoscaler sees), `actuate` (how a
//! decision changes a pool), `sizing` (fixed sizes from the whole trace), [`report`];
//! the replicas in [`cluster`], the baselines in [`autoscalers`], traces in [`trace`]
//! and synthetic days in [`day`]. For fleets of many models: [`fleet_trace`] (their
//! traffic, one trace) and [`fleet_config`] (`FLEET.yaml`: the models, nodes, budgets
//! and the hardware a start is timed on).

mod actuate;
pub mod autoscalers;
mod block_id_hash;
mod block_map;
mod clairvoyant;
pub mod cluster;
mod config;
pub mod day;
pub mod fleet;
pub mod fleet_config;
pub mod fleet_trace;
pub mod hpa;
mod itl_histogram;
pub mod keda;
pub mod need;
mod observe;
mod on_cores;
mod per_pool;
mod prefix_index;
mod registry;
mod replay;
mod report;
mod rule_of_thumb;
mod sizing;
pub mod sweep;
pub mod trace;

pub use config::{SimConfig, StartClass};
pub use itl_histogram::ITL_BUCKETS;
pub use keda::Actuation;
pub use registry::{RunSpec, UnknownPolicy, run, run_many, run_policy};
pub use report::{PolicyReport, SimReport};

#[cfg(test)]
mod tests;
