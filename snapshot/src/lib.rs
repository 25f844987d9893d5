//! # preheat-snapshot
//!
//! A model file format built for loading: a replica maps it and serves, with no parse
//! of tensor data and no copy where dtypes match.
//!
//! - [`Snapshot::open`] validates header and manifest bounds in milliseconds, whatever
//!   the file size, and hands out typed zero-copy tensor views;
//! - [`SnapshotBuilder::write`] lays out tensors at 4096-byte alignment and publishes
//!   atomically (temp file, fsync, rename);
//! - [`source`] converts Hugging Face checkpoints and GGUF files;
//! - [`packed`] is the compressed, chunked transport encoding;
//! - [`residency`] asks the kernel how much of a file is in page cache, and moves it in
//!   or out;
//! - [`synth`] writes full-size synthetic models for tests and benchmarks.
//!
//! The on-disk layout is documented in [`format`].

mod card;
mod checksum;
mod config;
mod dtype;
mod error;
pub mod format;
pub mod kernel_cache;
pub mod manifest;
pub mod packed;
mod progress;
pub mod publish;
mod reader;
pub mod residency;
pub mod source;
pub mod synth;
pub mod tensors;
mod writer;

pub use card::ModelCard;
pub use checksum::Checksum;
pub use config::{Architecture, GenerationDefaults, ModelConfig, RopeScaling};
pub use dtype::DType;
pub use error::{Error, Result};
pub use manifest::{Manifest, TensorEntry};
pub use progress::{NoProgress, Progress};
pub use reader::{AccessHint, Mismatch, Snapshot, TensorView, VerifyReport, parse, parse_prefix};
pub use source::{ModelSource, TargetDtype, convert};
pub use writer::{SnapshotBuilder, TensorSpec, TokenizerData, WriteSummary};
