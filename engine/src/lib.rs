//! # preheat-engine
//!
//! The bundled engine: Llama-family models (Llama 2/3, Mistral, Qwen2) computed on a
//! [`backend::Backend`] over a paged [`kv`] cache, with tokenisation, sampling and
//! continuous batching, served through an OpenAI-compatible API.

pub mod backend;
pub mod disagg;
pub mod engine;
mod error;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod profile;
pub mod sampling;
pub mod scheduler;
pub mod serve;
pub mod server;
pub mod tokenizer;

pub use error::{EngineError, Result};
