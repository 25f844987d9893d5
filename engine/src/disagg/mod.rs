//! Disaggregated serving: a gateway (OpenAI API + router) in front of prefill and
//! decode worker processes.
//!
//! Request path: the gateway tokenises, then the router picks a decode worker (least
//! loaded) and a prefill worker (KV-aware: most cached prefix blocks, then least
//! loaded); prompts shorter than a threshold skip prefill and are computed on the
//! decode worker (conditional disaggregation). The gateway calls the decode worker's
//! `POST /internal/generate`, naming the prefill worker — one the gateway announced to
//! that decode worker beforehand (`POST /internal/peers`, [`peers`]): a decode worker
//! pulls from no other address, whatever a body says; the decode worker **reserves
//! the KV blocks first** (back-pressure: 429 when it has no room), then pulls the K/V
//! and first token from the prefill worker's KV port, or its `POST /internal/prefill`
//! (one K/V message; what crosses between processes is in [`wire`]), installs them and
//! decodes, streaming events back as NDJSON. Any failure of the transfer releases the
//! reservation; a prefill failure before the first token is reported as such, and the
//! gateway retries once on another prefill worker, then falls back to prefilling on
//! the decode worker.
//!
//! Membership, one of two ways. Registered (local mode, `engine` commands): workers
//! register (`POST /internal/register`) with their role, URL and KV compatibility hash,
//! heartbeat every second with their load, and deregister on SIGTERM; the gateway drops
//! a worker after three missed heartbeats and refuses one whose compatibility hash
//! differs from its model's. Discovered (Kubernetes): the gateway lists the Ready
//! endpoints of the pools' Services ([`gateway::WorkerSource`]), checks each worker's
//! role and model before use and reads its load (`GET /internal/load`); workers do not
//! register and the gateway serves no registration routes.

pub mod gateway;
pub mod peers;
pub mod router;
pub mod wire;
pub mod worker;

pub use wire::messages::{ModelInfo, WorkerRole};
