//! The engine loop: one thread owns the scheduler and the backend, runs a forward pass
//! per step, samples, detokenises, and streams events to each request's channel. A
//! request whose channel is closed (client gone) is aborted and its blocks freed at the
//! next step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;

use crate::backend::KvLayout;
use crate::backend::{Backend, ForwardBatch, SeqSlice};
use crate::kv::transfer::{self, KvHeader, KvMessage, TransferError};
use crate::kv::{BlockId, BlockPool};
use crate::metrics::EngineMetrics;
use crate::sampling::penalties;
use crate::sampling::{Rng, SamplingParams, sample_with_state};
use crate::scheduler::{Scheduler, SchedulerConfig, SeqState};
use crate::tokenizer::{IncrementalDetokenizer, StopMatcher, StopOutcome, Tokenizer};
use crate::{EngineError, Result};

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Cancelled or failed.
    Abort,
}

impl FinishReason {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    pub id: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

/// What a request's stream carries.
#[derive(Debug)]
pub enum Event {
    /// New tokens and the text they complete (text may lag tokens by a held-back
    /// partial character or a possible stop string).
    Delta {
        tokens: Vec<TokenOut>,
        text: String,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Error(EngineError),
    /// Prefill-only requests: the prompt's K/V and the first token, ready to ship to a
    /// decode worker (a `Finished` follows).
    KvReady(Box<KvMessage>),
}

/// A request as the engine takes it: already tokenised.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// Engine settings.
#[derive(Clone, Debug)]
#[must_use]
pub struct EngineConfig {
    pub model_name: String,
    pub block_size: usize,
    pub num_blocks: usize,
    pub scheduler: SchedulerConfig,
}

enum Command {
    Submit {
        id: u64,
        req: GenerateRequest,
        out: tmpsc::UnboundedSender<Event>,
        arrival: Instant,
        /// Prefill only, shipping the K/V under this transfer id.
        prefill_only: Option<String>,
    },
    Resume {
        id: u64,
        msg: Box<KvMessage>,
        /// Blocks reserved before the payload flowed ([`Engine::reserve`]).
        blocks: Option<Vec<BlockId>>,
        out: tmpsc::UnboundedSender<Event>,
        arrival: Instant,
    },
    Reserve {
        blocks: usize,
        reply: tokio::sync::oneshot::Sender<Option<Vec<BlockId>>>,
    },
    Release(Vec<BlockId>),
    Abort(u64),
}

/// Per-request state the scheduler does not need.
struct Live {
    params: SamplingParams,
    rng: Rng,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    out: tmpsc::UnboundedSender<Event>,
    arrival: Instant,
    scheduled: Option<Instant>,
    last_token: Option<Instant>,
    stopped_by_string: bool,
    prefill_only: Option<String>,
    /// What the penalties read of the sequence, kept as tokens are appended.
    penalties: penalties::State,
}

/// A handle to the running engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    /// Set for a gateway's front: requests run on remote workers.
    remote: Option<Arc<dyn RemoteSubmit>>,
    pub tokenizer: Arc<Tokenizer>,
    pub metrics: Arc<EngineMetrics>,
    next_id: Arc<AtomicU64>,
    queued: Arc<AtomicUsize>,
    max_waiting: usize,
    /// Longest prompt + completion a request may ask for.
    pub max_model_len: usize,
    pub model_name: String,
    vocab_size: usize,
    draining: Arc<AtomicBool>,
    /// Set when the engine thread died (a bug): health goes 503 and workers leave.
    dead: Arc<AtomicBool>,
    in_flight: Arc<AtomicUsize>,
    layout: KvLayout,
    compat: String,
    kv_buffers: transfer::BufferPool,
    /// The prefix cache's block hashes, refreshed at most twice a second.
    cached: Arc<std::sync::Mutex<Vec<crate::kv::BlockHash>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model_name", &self.model_name)
            .finish_non_exhaustive()
    }
}

/// Runs requests somewhere else (a gateway's workers) behind the same [`Engine`]
/// handle, so the OpenAI server code serves both.
pub trait RemoteSubmit: Send + Sync + 'static {
    /// The work of one request: streams its events to `out` until it ends or `out`
    /// closes. Dropped (cancelled) when the client goes away.
    fn run(
        &self,
        id: u64,
        req: GenerateRequest,
        out: tmpsc::UnboundedSender<Event>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
}

#[derive(Debug)]
enum Cancel {
    Local(mpsc::Sender<Command>),
    Task(tokio::task::AbortHandle),
}

/// Guard that aborts the request when the consumer drops it.
#[derive(Debug)]
pub struct RequestHandle {
    pub id: u64,
    pub events: tmpsc::UnboundedReceiver<Event>,
    cancel: Cancel,
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        // Harmless if the request already finished.
        match &self.cancel {
            Cancel::Local(tx) => {
                let _ = tx.send(Command::Abort(self.id));
            }
            Cancel::Task(t) => t.abort(),
        }
    }
}

/// Blocks held for a sequence whose K/V have not arrived yet; released on drop unless
/// handed to [`Engine::resume_into`].
#[derive(Debug)]
pub struct Reservation {
    blocks: Vec<BlockId>,
    tx: mpsc::Sender<Command>,
}

impl Reservation {
    #[must_use]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.blocks.is_empty() {
            let _ = self
                .tx
                .send(Command::Release(std::mem::take(&mut self.blocks)));
        }
    }
}

struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Engine {
    /// Starts the engine thread over `backend`.
    pub fn start(
        backend: Box<dyn Backend>,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
        metrics: Arc<EngineMetrics>,
    ) -> Result<Self> {
        let layout = backend.kv_layout();
        if layout.block_size != cfg.block_size || layout.num_blocks != cfg.num_blocks {
            return Err(EngineError::Internal(
                "backend KV layout differs from the engine config".into(),
            ));
        }
        let compat = transfer::compat_hash(backend.weights_fingerprint(), &layout);
        let model_len = backend.config().max_position_embeddings as usize;
        let vocab_size = backend.config().vocab_size as usize;
        let max_model_len = model_len.min(cfg.block_size * cfg.num_blocks);
        let (tx, rx) = mpsc::channel();
        let dead = Arc::new(AtomicBool::new(false));
        let kv_buffers = transfer::BufferPool::default();
        let cached = Arc::new(std::sync::Mutex::new(Vec::new()));
        let tokenizer = Arc::new(tokenizer);
        let queued = Arc::new(AtomicUsize::new(0));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let worker = Worker {
            backend,
            sched: Scheduler::new(
                cfg.scheduler,
                BlockPool::new(cfg.num_blocks, cfg.block_size),
            ),
            live: HashMap::new(),
            tokenizer: Arc::clone(&tokenizer),
            metrics: Arc::clone(&metrics),
            queued: Arc::clone(&queued),
            in_flight: Arc::clone(&in_flight),
            kv_buffers: kv_buffers.clone(),
            cached: Arc::clone(&cached),
            cached_at: Instant::now(),
        };
        std::thread::Builder::new()
            .name("preheat-engine".into())
            .spawn({
                let dead = Arc::clone(&dead);
                move || {
                    // A panic here is a bug; make it visible instead of leaving a live
                    // process whose engine answers nothing.
                    let r =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run(rx)));
                    if r.is_err() {
                        dead.store(true, Ordering::SeqCst);
                        tracing::error!("the engine thread panicked; this engine is dead");
                    }
                }
            })
            .map_err(|e| EngineError::Internal(format!("spawning the engine thread: {e}")))?;
        Ok(Engine {
            tx,
            remote: None,
            tokenizer,
            metrics,
            next_id: Arc::new(AtomicU64::new(1)),
            queued,
            max_waiting: cfg.scheduler.max_waiting,
            max_model_len,
            model_name: cfg.model_name,
            vocab_size,
            draining: Arc::new(AtomicBool::new(false)),
            dead,
            in_flight,
            layout,
            compat,
            kv_buffers,
            cached,
        })
    }

    /// A front whose requests run on `remote` (a gateway): same API, no local model.
    pub fn remote(
        tokenizer: Tokenizer,
        model_name: String,
        max_model_len: usize,
        vocab_size: usize,
        compat: String,
        metrics: Arc<EngineMetrics>,
        remote: Arc<dyn RemoteSubmit>,
    ) -> Self {
        // Nothing reads this channel: local-only calls fail cleanly on a front.
        let (tx, _) = mpsc::channel();
        Engine {
            tx,
            remote: Some(remote),
            tokenizer: Arc::new(tokenizer),
            metrics,
            next_id: Arc::new(AtomicU64::new(1)),
            queued: Arc::new(AtomicUsize::new(0)),
            max_waiting: usize::MAX,
            max_model_len,
            model_name,
            vocab_size,
            draining: Arc::new(AtomicBool::new(false)),
            dead: Arc::new(AtomicBool::new(false)),
            in_flight: Arc::new(AtomicUsize::new(0)),
            layout: KvLayout {
                num_layers: 0,
                num_blocks: 0,
                block_size: 1,
                num_kv_heads: 0,
                head_dim: 0,
            },
            compat,
            kv_buffers: transfer::BufferPool::default(),
            cached: Arc::new(std::sync::Mutex::new(Vec::new())),
        }
    }

    /// Takes `blocks` KV blocks for a sequence about to arrive (all or nothing);
    /// `Overloaded` when the cache has no room now.
    pub async fn reserve(&self, blocks: usize) -> Result<Reservation> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Command::Reserve { blocks, reply })
            .map_err(|_| EngineError::Unavailable("the engine has stopped".into()))?;
        match rx.await {
            Ok(Some(b)) => Ok(Reservation {
                blocks: b,
                tx: self.tx.clone(),
            }),
            Ok(None) => Err(EngineError::Overloaded {
                retry_after_secs: 1,
            }),
            Err(_) => Err(EngineError::Unavailable("the engine has stopped".into())),
        }
    }

    /// [`Engine::resume`] into blocks reserved before the payload flowed.
    pub fn resume_into(&self, res: Reservation, msg: KvMessage) -> Result<RequestHandle> {
        if res.len() != msg.header.num_blocks as usize {
            return Err(EngineError::invalid(
                format!(
                    "{} blocks reserved, the message carries {}",
                    res.len(),
                    msg.header.num_blocks
                ),
                "kv",
            ));
        }
        self.resume_with(msg, Some(res))
    }

    /// The KV compatibility hash of this engine's model and layout.
    #[must_use]
    pub fn compat(&self) -> &str {
        &self.compat
    }

    #[must_use]
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    #[must_use]
    pub fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    /// Block hashes in this engine's prefix cache (what a worker reports so the router
    /// can send it prompts it already holds).
    #[must_use]
    pub fn cached_blocks(&self) -> Vec<crate::kv::BlockHash> {
        self.cached
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Receive buffers for incoming K/V; payloads come back here once installed.
    #[must_use]
    pub fn kv_buffers(&self) -> &transfer::BufferPool {
        &self.kv_buffers
    }

    /// Payload bytes of `blocks` blocks' K/V: what a transfer into a reservation of
    /// that many blocks may carry, and no more.
    #[must_use]
    pub fn kv_payload_for(&self, blocks: usize) -> u64 {
        transfer::block_bytes(&self.layout) * self.layout.num_layers as u64 * blocks as u64
    }

    /// Largest KV payload this engine could hold (its whole cache).
    #[must_use]
    pub fn max_kv_payload(&self) -> u64 {
        transfer::block_bytes(&self.layout)
            * self.layout.num_layers as u64
            * self.layout.num_blocks as u64
    }

    /// Computes the prompt's K/V and first token only; the handle yields
    /// [`Event::KvReady`] with the message to ship under `transfer_id`.
    pub fn prefill(&self, mut req: GenerateRequest, transfer_id: &str) -> Result<RequestHandle> {
        // The decode side checks the full length; here only the prompt is computed.
        req.params.max_tokens = req.params.max_tokens.max(1);
        self.enqueue(req, Some(transfer_id.to_owned()))
    }

    /// [`Engine::prefill`], awaited: the message to ship, or why there is none.
    pub async fn prefill_message(
        &self,
        req: GenerateRequest,
        transfer_id: &str,
    ) -> Result<KvMessage> {
        let mut h = self.prefill(req, transfer_id)?;
        loop {
            match h.events.recv().await {
                Some(Event::KvReady(m)) => return Ok(*m),
                Some(Event::Error(err)) => return Err(err),
                Some(Event::Delta { .. }) => {}
                Some(Event::Finished { .. }) | None => {
                    return Err(EngineError::Internal("prefill ended without K/V".into()));
                }
            }
        }
    }

    /// Continues a sequence prefilled elsewhere: validates the message, takes blocks
    /// for it (all or nothing: `Overloaded` when the cache has no room), installs the
    /// K/V and decodes under continuous batching. The first event carries the first
    /// token that prefill sampled.
    pub fn resume(&self, msg: KvMessage) -> Result<RequestHandle> {
        self.resume_with(msg, None)
    }

    fn resume_with(&self, msg: KvMessage, mut res: Option<Reservation>) -> Result<RequestHandle> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(EngineError::Unavailable("shutting down".into()));
        }
        let bad = |e: TransferError| EngineError::invalid(e.to_string(), "kv");
        KvMessage::check_header(
            &msg.header,
            &self.compat,
            &self.layout,
            self.max_kv_payload(),
        )
        .map_err(bad)?;
        msg.check_payload().map_err(bad)?;
        let h = &msg.header;
        let total = h.prompt.len() + h.params.max_tokens;
        if total > self.max_model_len {
            return Err(EngineError::invalid(
                format!(
                    "{} prompt tokens + {} more exceed this model's context of {}",
                    h.prompt.len(),
                    h.params.max_tokens,
                    self.max_model_len
                ),
                "max_tokens",
            ));
        }
        if let Some(bad) = h
            .prompt
            .iter()
            .chain([&h.first_token])
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return Err(EngineError::invalid(
                format!("token id {bad} is outside the vocabulary"),
                "kv",
            ));
        }
        h.params.check_vocab(self.vocab_size)?;
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (out, events) = tmpsc::unbounded_channel();
        if self
            .tx
            .send(Command::Resume {
                id,
                msg: Box::new(msg),
                blocks: res.as_mut().map(|r| std::mem::take(&mut r.blocks)),
                out,
                arrival: Instant::now(),
            })
            .is_err()
        {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err(EngineError::Unavailable("the engine has stopped".into()));
        }
        Ok(RequestHandle {
            id,
            events,
            cancel: Cancel::Local(self.tx.clone()),
        })
    }

    /// Validates and queues a request; events arrive on the returned handle, and
    /// dropping the handle cancels the request.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestHandle> {
        self.enqueue(req, None)
    }

    fn enqueue(&self, req: GenerateRequest, prefill_only: Option<String>) -> Result<RequestHandle> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(EngineError::Unavailable("shutting down".into()));
        }
        if req.prompt.is_empty() {
            return Err(EngineError::invalid("the prompt is empty", "prompt"));
        }
        // Token ids must index the embedding table (the tokenizer may know fewer).
        let vocab = self.vocab_size;
        if let Some(bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::invalid(
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
                "prompt",
            ));
        }
        req.params.check_vocab(vocab)?;
        let total = req.prompt.len() + req.params.max_tokens;
        if total > self.max_model_len {
            return Err(EngineError::invalid(
                format!(
                    "this model's maximum context length is {} tokens; the request has {} prompt tokens and asks for {} more",
                    self.max_model_len,
                    req.prompt.len(),
                    req.params.max_tokens
                ),
                "max_tokens",
            ));
        }
        if let Some(remote) = &self.remote {
            if prefill_only.is_some() {
                return Err(EngineError::Internal(
                    "a gateway front does not prefill".into(),
                ));
            }
            self.in_flight.fetch_add(1, Ordering::Relaxed);
            let guard = InFlight(Arc::clone(&self.in_flight));
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (out, events) = tmpsc::unbounded_channel();
            let work = remote.run(id, req, out);
            let task = tokio::spawn(async move {
                let _guard = guard;
                work.await;
            });
            return Ok(RequestHandle {
                id,
                events,
                cancel: Cancel::Task(task.abort_handle()),
            });
        }
        if self.queued.load(Ordering::Relaxed) >= self.max_waiting {
            self.metrics.rejected.inc();
            return Err(EngineError::Overloaded {
                retry_after_secs: 1,
            });
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (out, events) = tmpsc::unbounded_channel();
        self.tx
            .send(Command::Submit {
                id,
                req,
                out,
                arrival: Instant::now(),
                prefill_only,
            })
            .map_err(|_| EngineError::Unavailable("the engine has stopped".into()))?;
        Ok(RequestHandle {
            id,
            events,
            cancel: Cancel::Local(self.tx.clone()),
        })
    }

    /// Stops accepting requests; [`Engine::in_flight`] reaches 0 when all are done.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// False once the engine thread has died.
    #[must_use]
    pub fn is_alive(&self) -> bool {
        !self.dead.load(Ordering::SeqCst)
    }

    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

struct Worker {
    kv_buffers: transfer::BufferPool,
    cached: Arc<std::sync::Mutex<Vec<crate::kv::BlockHash>>>,
    cached_at: Instant,
    backend: Box<dyn Backend>,
    sched: Scheduler,
    live: HashMap<u64, Live>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<EngineMetrics>,
    queued: Arc<AtomicUsize>,
    in_flight: Arc<AtomicUsize>,
}

impl Worker {
    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            let first = if self.sched.is_idle() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                self.handle(cmd);
            }
            self.drop_abandoned();
            if let Err(e) = self.step() {
                tracing::error!(error = %e, "engine step failed; failing the batch");
                let ids: Vec<u64> = self.live.keys().copied().collect();
                for id in ids {
                    self.finish(
                        id,
                        FinishReason::Abort,
                        Some(EngineError::Internal(e.to_string())),
                    );
                }
            }
            self.update_gauges();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                id,
                req,
                out,
                arrival,
                prefill_only,
            } => {
                let rng = req.params.seed.map_or_else(Rng::entropy, Rng::new);
                let penalties = penalties::State::new(&req.params, &req.prompt);
                self.live.insert(
                    id,
                    Live {
                        stop: StopMatcher::new(req.params.stop.clone()),
                        params: req.params,
                        rng,
                        detok: IncrementalDetokenizer::default(),
                        out,
                        arrival,
                        scheduled: None,
                        last_token: None,
                        stopped_by_string: false,
                        prefill_only,
                        penalties,
                    },
                );
                self.sched.add(SeqState::new(id, req.prompt));
            }
            Command::Resume {
                id,
                msg,
                blocks,
                out,
                arrival,
            } => self.resume(id, *msg, blocks, out, arrival),
            Command::Reserve { blocks, reply } => {
                let got = self.sched.pool.allocate(blocks);
                if let Err(Some(b)) = reply.send(got) {
                    // The requester is gone: give the blocks back.
                    self.sched.pool.release(&b);
                }
            }
            Command::Release(blocks) => self.sched.pool.release(&blocks),
            Command::Abort(id) => {
                if self.live.contains_key(&id) {
                    self.finish(id, FinishReason::Abort, None);
                }
            }
        }
    }

    fn drop_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| l.out.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            tracing::debug!(request = id, "client went away; aborting");
            self.finish(id, FinishReason::Abort, None);
        }
    }

    fn finish(&mut self, id: u64, reason: FinishReason, error: Option<EngineError>) {
        let Some(seq) = self.sched.remove(id) else {
            return;
        };
        let Some(mut live) = self.live.remove(&id) else {
            return;
        };
        if live.scheduled.is_none() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        let generated = seq.generated();
        // Flush text held back for a partial character or a possible stop string,
        // unless a stop string ended the request (nothing after it may be sent).
        if reason != FinishReason::Abort && error.is_none() && !live.stopped_by_string {
            let tail = live
                .detok
                .flush(&self.tokenizer, generated)
                .unwrap_or_default();
            let tail = match live.stop.push(&tail) {
                StopOutcome::Emit(t) => t + &live.stop.flush(),
                StopOutcome::Stopped(t) => t,
            };
            if !tail.is_empty() {
                let _ = live.out.send(Event::Delta {
                    tokens: Vec::new(),
                    text: tail,
                });
            }
        }
        let usage = Usage {
            prompt_tokens: seq.prompt_len,
            completion_tokens: generated.len(),
            cached_tokens: seq.cached_tokens,
        };
        let _ = live.out.send(match error {
            Some(e) => Event::Error(e),
            None => Event::Finished { reason, usage },
        });
        self.metrics.finished(reason.as_str());
        self.metrics
            .e2e
            .observe(live.arrival.elapsed().as_secs_f64());
    }

    fn step(&mut self) -> Result<()> {
        let work = self.sched.schedule();
        if work.is_empty() {
            if !self.sched.is_idle() {
                // Nothing fits right now (blocks held by others); do not spin hot.
                std::thread::sleep(Duration::from_millis(1));
            }
            return Ok(());
        }
        let now = Instant::now();
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut seq_of = Vec::new();
        let mut rows = Vec::new();
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(work.len());
        for (k, w) in work.iter().enumerate() {
            let s = self
                .sched
                .get(w.seq)
                .ok_or_else(|| EngineError::Internal("scheduled an unknown sequence".into()))?;
            tokens.extend_from_slice(&s.tokens[w.start..w.start + w.len]);
            positions.extend((w.start..w.start + w.len).map(|p| p as u32));
            seq_of.extend(std::iter::repeat_n(k as u32, w.len));
            if w.sample {
                rows.push((tokens.len() - 1) as u32);
            }
            tables.push(s.blocks.clone());
            if let Some(l) = self.live.get_mut(&w.seq)
                && l.scheduled.is_none()
            {
                l.scheduled = Some(now);
                self.queued.fetch_sub(1, Ordering::Relaxed);
                self.metrics
                    .queue_time
                    .observe((now - l.arrival).as_secs_f64());
            }
            if w.start < s.prompt_len {
                self.metrics
                    .prompt_tokens
                    .inc_by((w.len.min(s.prompt_len - w.start)) as u64);
            }
        }
        let seqs: Vec<SeqSlice<'_>> = tables.iter().map(|t| SeqSlice { block_table: t }).collect();
        let logits = self.backend.forward(&ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            seq_of: &seq_of,
            seqs: &seqs,
            logits_rows: &rows,
        })?;
        let vocab = self.backend.config().vocab_size as usize;
        let mut row = 0;
        for w in &work {
            self.sched.complete(w);
            if !w.sample {
                continue;
            }
            let l = &logits[row * vocab..(row + 1) * vocab];
            row += 1;
            self.emit(w.seq, l);
        }
        Ok(())
    }

    /// Samples the next token of `id` from `logits`, streams it, and finishes the
    /// request when a stop condition holds.
    fn emit(&mut self, id: u64, logits: &[f32]) {
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        let s = sample_with_state(
            logits,
            &live.params,
            &mut live.rng,
            &live.penalties,
            self.tokenizer.eos_ids(),
        );
        if live.prefill_only.is_some() {
            self.ship(id, s.token, s.logprob, s.top);
            return;
        }
        self.accept(id, s.token, s.logprob, s.top);
    }

    /// Prefill-only: hands the prompt's K/V and first token to the caller, then ends
    /// the request here (its blocks stay in the prefix cache).
    fn ship(&mut self, id: u64, token: u32, logprob: Option<f32>, top: Vec<(u32, f32)>) {
        let (Some(live), Some(seq)) = (self.live.get(&id), self.sched.get(id)) else {
            return;
        };
        self.metrics
            .observe_ttft(live.arrival.elapsed().as_secs_f64());
        self.metrics.generation_tokens.inc();
        let layout = self.backend.kv_layout();
        let bs = layout.block_size;
        let prompt = seq.tokens[..seq.prompt_len].to_vec();
        let n = prompt.len().div_ceil(bs);
        let mut payload = Vec::new();
        self.backend.export_kv(&seq.blocks[..n], &mut payload);
        let header = KvHeader {
            version: transfer::FORMAT_VERSION,
            request_id: live.prefill_only.clone().unwrap_or_default(),
            compat: transfer::compat_hash(self.backend.weights_fingerprint(), &layout),
            block_hashes: crate::kv::block_hashes(&prompt, bs),
            prompt,
            first_token: token,
            first_logprob: logprob,
            first_top_logprobs: top,
            params: live.params.clone(),
            rng_state: live.rng.state(),
            num_layers: layout.num_layers as u32,
            num_blocks: n as u32,
            block_bytes: transfer::block_bytes(&layout),
            payload_xxh3: String::new(),
        };
        let _ = live
            .out
            .send(Event::KvReady(Box::new(KvMessage::new(header, payload))));
        self.finish(id, FinishReason::Length, None);
    }

    /// Installs a transferred sequence and streams its first token.
    fn resume(
        &mut self,
        id: u64,
        msg: KvMessage,
        reserved: Option<Vec<BlockId>>,
        out: tmpsc::UnboundedSender<Event>,
        arrival: Instant,
    ) {
        let refuse = |this: &mut Self, e: EngineError| {
            this.in_flight.fetch_sub(1, Ordering::Relaxed);
            let _ = out.send(Event::Error(e));
        };
        let h = msg.header;
        let busy = EngineError::Overloaded {
            retry_after_secs: 1,
        };
        if self.sched.num_running() >= self.sched.config.max_running {
            if let Some(b) = &reserved {
                self.sched.pool.release(b);
            }
            return refuse(self, busy);
        }
        let blocks = match reserved {
            Some(b) => b,
            None => match self.sched.pool.allocate(h.num_blocks as usize) {
                Some(b) => b,
                None => return refuse(self, busy),
            },
        };
        let imported = self.backend.import_kv(&blocks, &msg.payload);
        self.kv_buffers.give(msg.payload);
        if let Err(e) = imported {
            self.sched.pool.release(&blocks);
            return refuse(self, e);
        }
        for (b, hash) in blocks.iter().zip(&h.block_hashes) {
            self.sched.pool.register(*b, *hash);
        }
        let penalties = penalties::State::new(&h.params, &h.prompt);
        self.live.insert(
            id,
            Live {
                penalties,
                stop: StopMatcher::new(h.params.stop.clone()),
                rng: Rng::from_state(h.rng_state),
                params: h.params,
                detok: IncrementalDetokenizer::default(),
                out,
                arrival,
                scheduled: Some(arrival),
                last_token: None,
                stopped_by_string: false,
                prefill_only: None,
            },
        );
        self.sched
            .add_running(SeqState::resumed(id, h.prompt, blocks, h.block_hashes));
        self.accept(id, h.first_token, h.first_logprob, h.first_top_logprobs);
    }

    /// Appends a sampled token to `id`, streams it, and finishes the request when a
    /// stop condition holds.
    fn accept(&mut self, id: u64, token: u32, logprob: Option<f32>, top: Vec<(u32, f32)>) {
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        let s = crate::sampling::Sampled {
            token,
            logprob,
            top,
        };
        let now = Instant::now();
        match live.last_token {
            None => self
                .metrics
                .observe_ttft((now - live.arrival).as_secs_f64()),
            Some(t) => self.metrics.itl.observe((now - t).as_secs_f64()),
        }
        live.last_token = Some(now);
        self.metrics.generation_tokens.inc();
        let Some(seq) = self.sched.get_mut(id) else {
            return;
        };
        seq.tokens.push(s.token);
        live.penalties.push(s.token);
        let n_gen = seq.generated().len();
        let at_context_end =
            seq.tokens.len() >= self.backend.config().max_position_embeddings as usize;
        let is_eos = !live.params.ignore_eos && self.tokenizer.eos_ids().contains(&s.token);
        let is_stop_token = live.params.stop_token_ids.contains(&s.token);
        let text = if is_eos || is_stop_token {
            String::new()
        } else {
            live.detok
                .next(&self.tokenizer, seq.generated())
                .unwrap_or_default()
        };
        // Stop strings count only once min_tokens are out (as vLLM).
        let (text, stopped_by_string) = if n_gen < live.params.min_tokens {
            (text, false)
        } else {
            match live.stop.push(&text) {
                StopOutcome::Emit(t) => (t, false),
                StopOutcome::Stopped(t) => (t, true),
            }
        };
        live.stopped_by_string = stopped_by_string;
        let tok = TokenOut {
            id: s.token,
            logprob: s.logprob,
            top: s.top,
        };
        let _ = live.out.send(Event::Delta {
            tokens: vec![tok],
            text,
        });
        let reason = if is_eos || is_stop_token || stopped_by_string {
            Some(FinishReason::Stop)
        } else if n_gen >= live.params.max_tokens || at_context_end {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(r) = reason {
            self.finish(id, r, None);
        }
    }

    fn update_gauges(&mut self) {
        // Twice a second while busy, and whenever the engine goes idle (so the last
        // prompts' blocks are reported before the thread sleeps).
        if self.sched.is_idle() || self.cached_at.elapsed() >= Duration::from_millis(500) {
            self.cached_at = Instant::now();
            let hashes: Vec<_> = self.sched.pool.cached_hashes().collect();
            *self
                .cached
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = hashes;
        }
        let m = &self.metrics;
        m.running.set(self.sched.num_running() as i64);
        m.waiting.set(self.sched.num_waiting() as i64);
        m.kv_usage.set(self.sched.pool.usage());
        m.prefill_queue_tokens
            .set(self.sched.queued_prompt_tokens() as i64);
        m.prefix_queries
            .inc_by(self.sched.prefix_queries - m.prefix_queries.get());
        m.prefix_hits
            .inc_by(self.sched.prefix_hits - m.prefix_hits.get());
        m.preemptions
            .inc_by(self.sched.preemptions - m.preemptions.get());
    }
}
