//! The simulated replicas. A prefill replica serves its queue one prompt at a time at
//! the profile's prefill rate for that prompt length, skipping the prefix it holds in
//! its cache; a decode replica runs continuous batching: every running sequence gets
//! one token per step, a step lasting the profile's ITL at the current batch size, and
//! a sequence holds its prompt + output tokens of KV from admission to completion. A
//! prompt too short for the prefill pool is computed on its decode replica, in one of
//! its steps, which takes that much longer for every sequence in it.

mod decode;
mod prefill;
mod prefix_cache;

pub use decode::{DecodeReplica, Seq, Stepped};
pub use prefill::{PrefillJob, PrefillReplica};
pub use prefix_cache::PrefixCache;

#[cfg(test)]
mod tests;
