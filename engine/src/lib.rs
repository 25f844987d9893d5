//! # preheat-engine
//!
//! The bundled engine: Llama-family models (Llama 2/3, Mistral, Qwen2) computed on a
//! [`backend::Backend`] over a paged [`kv`] cache, with tokenisation, sampling and
//! continuous batching, served through an OpenAI-compatible API.
//!
//! - [`engine`]: the [`Engine`] handle and the thread that owns the model and KV cache;
//! - [`api`]: the OpenAI-compatible HTTP API over a [`Frontend`] (the engine, or a
//!   gateway's front);
//! - [`colocated`]: `engine serve`, one process with prefill and decode together;
//! - [`disagg`]: the disaggregated path (gateway, prefill and decode workers, KV
//!   transfer).

mod api;
pub mod backend;
pub mod colocated;
pub mod disagg;
pub mod engine;
mod error;
mod frontend;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod profile;
mod python_json;
pub mod sampling;
pub mod scheduler;
pub mod tokenizer;

pub use engine::Engine;
pub use error::{EngineError, Result};
pub use frontend::Frontend;
