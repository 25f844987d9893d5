//! The engine: [`request`] (what it takes and streams back), [`handle`] (the
//! [`Engine`] handle callers hold) and [`engine_loop`] (the thread that owns the model,
//! the scheduler and the KV cache).

mod engine_loop;
pub mod handle;
pub mod request;

pub(crate) use handle::InFlight;
pub use handle::{Engine, EngineConfig, RequestHandle, Reservation};
pub use request::{Event, FinishReason, GenerateRequest, TokenOut, Usage};
