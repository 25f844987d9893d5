//! The engine: [`request`] (what it takes and streams back), [`handle`] (the
//! [`Engine`] handle callers hold), [`engine_loop`] (the thread that owns the model,
//! the scheduler and the KV cache) and [`exported`] (a sequence handed from one engine
//! to another).

mod engine_loop;
pub mod exported;
pub mod handle;
pub mod request;

pub use exported::ExportedSequence;
pub(crate) use handle::InFlight;
pub use handle::{Engine, EngineConfig, RequestHandle, Reservation};
pub use request::{Event, FinishReason, GenerateRequest, TokenOut, Usage};
