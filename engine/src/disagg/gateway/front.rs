//! The gateway's [`Frontend`]: the OpenAI server's requests, checked as the engine
//! checks them, run on the gateway's workers instead of a local model.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use tokio::sync::mpsc as tmpsc;

use super::Gateway;
use crate::engine::{GenerateRequest, InFlight, RequestHandle, request};
use crate::frontend::Frontend;
use crate::metrics::EngineMetrics;
use crate::tokenizer::Tokenizer;
use crate::{EngineError, Result};

/// A gateway serving the model its first worker taught it.
pub(super) struct GatewayFront {
    gateway: Arc<Gateway>,
    tokenizer: Arc<Tokenizer>,
    model_name: String,
    max_model_len: usize,
    vocab_size: usize,
    metrics: Arc<EngineMetrics>,
    next_id: AtomicU64,
    in_flight: Arc<AtomicUsize>,
    draining: AtomicBool,
}

impl GatewayFront {
    pub(super) fn new(
        gateway: Arc<Gateway>,
        tokenizer: Tokenizer,
        model_name: String,
        max_model_len: usize,
        vocab_size: usize,
        metrics: Arc<EngineMetrics>,
    ) -> Self {
        GatewayFront {
            gateway,
            tokenizer: Arc::new(tokenizer),
            model_name,
            max_model_len,
            vocab_size,
            metrics,
            next_id: AtomicU64::new(1),
            in_flight: Arc::new(AtomicUsize::new(0)),
            draining: AtomicBool::new(false),
        }
    }
}

impl Frontend for GatewayFront {
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

    fn submit(&self, req: GenerateRequest) -> Result<RequestHandle> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(EngineError::Unavailable("shutting down".into()));
        }
        // The workers check again; refusing here keeps a bad request from being held
        // for a pool at zero.
        request::check(&req, self.vocab_size, self.max_model_len)?;
        let guard = InFlight::count(&self.in_flight);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (out, events) = tmpsc::unbounded_channel();
        let work = Arc::clone(&self.gateway).serve_request(id, req, out);
        let task = tokio::spawn(async move {
            let _guard = guard;
            work.await;
        });
        Ok(RequestHandle::of_task(id, events, task.abort_handle()))
    }

    fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn is_alive(&self) -> bool {
        true
    }
}
