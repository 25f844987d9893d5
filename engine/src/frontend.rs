//! What the OpenAI server serves through: the local [`Engine`], or a gateway's front
//! whose requests run on its workers. The server only needs a model's name, limits and
//! tokenizer, a way to queue a tokenised request, and the process's health and drain.

use std::sync::Arc;

use crate::Result;
use crate::engine::{Engine, GenerateRequest, RequestHandle};
use crate::metrics::EngineMetrics;
use crate::tokenizer::Tokenizer;

/// A model the OpenAI server can serve requests through.
pub trait Frontend: Send + Sync + 'static {
    /// The name clients ask for.
    fn model_name(&self) -> &str;
    /// Longest prompt + completion a request may ask for.
    fn max_model_len(&self) -> usize;
    fn tokenizer(&self) -> &Arc<Tokenizer>;
    fn metrics(&self) -> &Arc<EngineMetrics>;
    /// Most sequences one request may run together (its `n`/`best_of`); `None` where
    /// the front cannot tell (a gateway: its workers decide, up to
    /// [`crate::api::openai::MAX_CHOICES`]).
    fn max_sequences(&self) -> Option<usize> {
        None
    }
    /// Validates and queues a request; events arrive on the returned handle, and
    /// dropping the handle cancels the request.
    fn submit(&self, req: GenerateRequest) -> Result<RequestHandle>;
    /// Stops accepting requests; [`Frontend::in_flight`] reaches 0 when all are done.
    fn drain(&self);
    fn in_flight(&self) -> usize;
    /// False once what runs the requests has died (health turns 503).
    fn is_alive(&self) -> bool;
}

impl Frontend for Engine {
    fn model_name(&self) -> &str {
        &self.model_name
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    fn metrics(&self) -> &Arc<EngineMetrics> {
        &self.metrics
    }

    fn max_sequences(&self) -> Option<usize> {
        Some(Engine::max_sequences(self))
    }

    fn submit(&self, req: GenerateRequest) -> Result<RequestHandle> {
        Engine::submit(self, req)
    }

    fn drain(&self) {
        Engine::drain(self);
    }

    fn in_flight(&self) -> usize {
        Engine::in_flight(self)
    }

    fn is_alive(&self) -> bool {
        Engine::is_alive(self)
    }
}
