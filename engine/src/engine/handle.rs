//! The [`Engine`] handle: what callers hold to queue requests, reserve KV blocks and
//! resume sequences prefilled elsewhere; the engine thread itself is in
//! [`super::engine_loop`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tmpsc;

use super::engine_loop::{Command, EngineLoop};
use super::exported::ExportedSequence;
use super::request::{self, Event, GenerateRequest};
use crate::backend::{Backend, KvLayout};
use crate::kv::payload::{self, BufferPool};
use crate::kv::{BlockId, BlockPool, PrefixKey};
use crate::metrics::EngineMetrics;
use crate::sampling::SamplingParams;
use crate::sampling::grammar::Constraint;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::tokenizer::Tokenizer;
use crate::{EngineError, Result};

/// Engine settings.
#[derive(Clone, Debug)]
#[must_use]
pub struct EngineConfig {
    pub model_name: String,
    pub block_size: usize,
    pub num_blocks: usize,
    pub scheduler: SchedulerConfig,
    /// Threads the model's kernels run on, the engine loop's own among them (`None`:
    /// rayon's default, `RAYON_NUM_THREADS` or one per core).
    pub threads: Option<usize>,
    /// What the prefix cache's block hashes start from: the deployment's key
    /// ([`PrefixKey::of_deployment`]), the same in every process of it.
    pub prefix_key: PrefixKey,
}

/// A handle to the running engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    pub tokenizer: Arc<Tokenizer>,
    pub metrics: Arc<EngineMetrics>,
    next_id: Arc<AtomicU64>,
    queued: Arc<AtomicUsize>,
    max_waiting: usize,
    max_running: usize,
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
    kv_buffers: BufferPool,
    /// The prefix cache's block hashes, refreshed at most twice a second.
    cached: Arc<std::sync::Mutex<Vec<crate::kv::BlockHash>>>,
    prefix_key: PrefixKey,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model_name", &self.model_name)
            .finish_non_exhaustive()
    }
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

impl RequestHandle {
    /// A request run by a task (a gateway's front): dropping the handle aborts it.
    pub(crate) fn of_task(
        id: u64,
        events: tmpsc::UnboundedReceiver<Event>,
        task: tokio::task::AbortHandle,
    ) -> Self {
        RequestHandle {
            id,
            events,
            cancel: Cancel::Task(task),
        }
    }
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
/// handed to [`Engine::resume_into`]. A request admitted before a drain: it counts as
/// in flight, so a draining worker waits for its K/V and then serves it.
#[derive(Debug)]
pub struct Reservation {
    blocks: Vec<BlockId>,
    tx: mpsc::Sender<Command>,
    _in_flight: InFlight,
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

/// The engine's answer to a reservation while it is awaited: if the caller goes away
/// (its client disconnected) after the engine took the blocks but before the answer
/// was read, the blocks go back rather than leak with the answer.
struct ReserveAnswer {
    rx: tokio::sync::oneshot::Receiver<Option<Vec<BlockId>>>,
    tx: mpsc::Sender<Command>,
    read: bool,
}

impl Drop for ReserveAnswer {
    fn drop(&mut self) {
        if !self.read {
            // Closed first: an answer sent after this fails, and the engine gives
            // those blocks back itself.
            self.rx.close();
            if let Ok(Some(blocks)) = self.rx.try_recv() {
                let _ = self.tx.send(Command::Release(blocks));
            }
        }
    }
}

/// Counts a request in flight until dropped.
#[derive(Debug)]
pub(crate) struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    pub(crate) fn count(n: &Arc<AtomicUsize>) -> Self {
        // SeqCst with the drain flag's store and load: a drain reads either this
        // count or, on the other side, the flag (`Engine::reserve`).
        n.fetch_add(1, Ordering::SeqCst);
        InFlight(Arc::clone(n))
    }
}

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
        // A GPU backend runs no CPU kernels: no idle compute thread per core for it.
        let threads = if backend.uses_cpu_threads() {
            cfg.threads
        } else {
            Some(1)
        };
        if layout.block_size != cfg.block_size || layout.num_blocks != cfg.num_blocks {
            return Err(EngineError::Internal(
                "backend KV layout differs from the engine config".into(),
            ));
        }
        let compat = payload::compat_hash(backend.weights_fingerprint(), &layout);
        let model_len = backend.config().max_position_embeddings as usize;
        let vocab_size = backend.config().vocab_size as usize;
        let max_model_len = model_len.min(cfg.block_size * cfg.num_blocks);
        let (tx, rx) = mpsc::channel();
        let dead = Arc::new(AtomicBool::new(false));
        let kv_buffers = BufferPool::default();
        let cached = Arc::new(std::sync::Mutex::new(Vec::new()));
        let tokenizer = Arc::new(tokenizer);
        let queued = Arc::new(AtomicUsize::new(0));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let worker = EngineLoop {
            backend,
            sched: Scheduler::new(
                cfg.scheduler,
                BlockPool::new(cfg.num_blocks, cfg.block_size),
            )
            .with_prefix_key(cfg.prefix_key),
            live: HashMap::new(),
            tokenizer: Arc::clone(&tokenizer),
            metrics: Arc::clone(&metrics),
            queued: Arc::clone(&queued),
            in_flight: Arc::clone(&in_flight),
            kv_buffers: kv_buffers.clone(),
            cached: Arc::clone(&cached),
            cached_at: Instant::now(),
            reserved: 0,
            handled: (0, Duration::ZERO),
        };
        // The loop runs inside its kernels' pool (see `compute_pool`); this thread only
        // waits for it.
        let pool = crate::backend::cpu::compute_pool(threads)
            .map_err(|e| EngineError::Internal(format!("starting the compute threads: {e}")))?;
        std::thread::Builder::new()
            .name("preheat-engine".into())
            .spawn({
                let dead = Arc::clone(&dead);
                move || {
                    // A panic here is a bug; make it visible instead of leaving a live
                    // process whose engine answers nothing.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        pool.install(|| worker.run(rx));
                    }));
                    if r.is_err() {
                        dead.store(true, Ordering::SeqCst);
                        tracing::error!("the engine thread panicked; this engine is dead");
                    }
                }
            })
            .map_err(|e| EngineError::Internal(format!("spawning the engine thread: {e}")))?;
        Ok(Engine {
            tx,
            tokenizer,
            metrics,
            next_id: Arc::new(AtomicU64::new(1)),
            queued,
            max_waiting: cfg.scheduler.max_waiting,
            max_running: cfg.scheduler.max_running,
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
            prefix_key: cfg.prefix_key,
        })
    }

    /// Takes `blocks` KV blocks for a sequence about to arrive (all or nothing);
    /// `Overloaded` when the cache has no room now, `Unavailable` once draining (the
    /// caller has pulled nothing yet, so another worker can take the request whole).
    pub async fn reserve(&self, blocks: usize) -> Result<Reservation> {
        // Counted before the drain flag is read: a drain that starts after this sees
        // the reservation in flight and waits for it.
        let in_flight = InFlight::count(&self.in_flight);
        if self.draining.load(Ordering::SeqCst) {
            return Err(EngineError::Unavailable("shutting down".into()));
        }
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(Command::Reserve { blocks, reply })
            .map_err(|_| EngineError::Unavailable("the engine has stopped".into()))?;
        let mut answer = ReserveAnswer {
            rx,
            tx: self.tx.clone(),
            read: false,
        };
        let got = (&mut answer.rx).await;
        answer.read = true;
        match got {
            Ok(Some(b)) => Ok(Reservation {
                blocks: b,
                tx: self.tx.clone(),
                _in_flight: in_flight,
            }),
            Ok(None) => {
                // Refused for want of room, as a full queue refuses: counted alike.
                self.metrics.rejected.inc();
                Err(EngineError::Overloaded {
                    retry_after_secs: 1,
                })
            }
            Err(_) => Err(EngineError::Unavailable("the engine has stopped".into())),
        }
    }

    /// [`Engine::resume`] into blocks reserved before the payload flowed.
    pub fn resume_into(&self, res: Reservation, seq: ExportedSequence) -> Result<RequestHandle> {
        if res.len() != seq.shape.num_blocks as usize {
            return Err(EngineError::invalid(
                format!(
                    "{} blocks reserved, the sequence carries {}",
                    res.len(),
                    seq.shape.num_blocks
                ),
                "kv",
            ));
        }
        self.resume_with(seq, Some(res))
    }

    /// What this engine's block hashes start from.
    #[must_use]
    pub fn prefix_key(&self) -> PrefixKey {
        self.prefix_key
    }

    /// The KV compatibility hash of this engine's model and layout.
    #[must_use]
    pub fn compat(&self) -> &str {
        &self.compat
    }

    /// Most sequences one request may run together (its `n`/`best_of`): what the
    /// engine runs at once and queues at most.
    #[must_use]
    pub fn max_sequences(&self) -> usize {
        self.max_running.min(self.max_waiting)
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
    pub fn kv_buffers(&self) -> &BufferPool {
        &self.kv_buffers
    }

    /// Payload bytes of `blocks` blocks' K/V: what a transfer into a reservation of
    /// that many blocks may carry, and no more.
    #[must_use]
    pub fn kv_payload_for(&self, blocks: usize) -> u64 {
        payload::block_bytes(&self.layout) * self.layout.num_layers as u64 * blocks as u64
    }

    /// Largest KV payload this engine could hold (its whole cache).
    #[must_use]
    pub fn max_kv_payload(&self) -> u64 {
        payload::block_bytes(&self.layout)
            * self.layout.num_layers as u64
            * self.layout.num_blocks as u64
    }

    /// Computes the prompt's K/V and first token only; the handle yields
    /// [`Event::KvReady`] with the sequence to ship under `transfer_id`.
    pub fn prefill(&self, mut req: GenerateRequest, transfer_id: &str) -> Result<RequestHandle> {
        // The decode side checks the full length; here only the prompt is computed.
        req.params.max_tokens = req.params.max_tokens.max(1);
        self.enqueue(req, Some(transfer_id.to_owned()))
    }

    /// [`Engine::prefill`], awaited: the sequence to ship, or why there is none.
    pub async fn prefill_sequence(
        &self,
        req: GenerateRequest,
        transfer_id: &str,
    ) -> Result<ExportedSequence> {
        let mut h = self.prefill(req, transfer_id)?;
        loop {
            match h.events.recv().await {
                Some(Event::KvReady(m)) => return Ok(*m),
                Some(Event::Error(err)) => return Err(err),
                Some(Event::Delta { .. } | Event::Replayed(_)) => {}
                Some(Event::Finished { .. }) | None => {
                    return Err(EngineError::Internal("prefill ended without K/V".into()));
                }
            }
        }
    }

    /// Continues a sequence prefilled elsewhere (one the wire checked on arrival, or
    /// another engine's export in this process): checks it fits this engine, takes
    /// blocks for it (all or nothing: `Overloaded` when the cache has no room), installs
    /// the K/V and decodes under continuous batching. The first event carries the first
    /// token that prefill sampled.
    pub fn resume(&self, seq: ExportedSequence) -> Result<RequestHandle> {
        self.resume_with(seq, None)
    }

    fn resume_with(
        &self,
        seq: ExportedSequence,
        mut res: Option<Reservation>,
    ) -> Result<RequestHandle> {
        // A reservation was taken before the drain: its request was admitted, and its
        // prompt already computed; refusing it now would send it back to be prefilled
        // again.
        if res.is_none() && self.draining.load(Ordering::SeqCst) {
            return Err(EngineError::Unavailable("shutting down".into()));
        }
        // The wire checked it against this engine already; an in-process caller may
        // hand over a sequence of another model with the same layout.
        if seq.compat != self.compat {
            return Err(EngineError::invalid(
                format!(
                    "incompatible K/V: sender {}, receiver {} (another model, dtype or block layout)",
                    seq.compat, self.compat
                ),
                "kv",
            ));
        }
        seq.check(&self.layout, self.max_kv_payload())
            .map_err(|e| EngineError::invalid(format!("K/V: {e}"), "kv"))?;
        let total = seq.prompt.len() + seq.params.max_tokens;
        if total > self.max_model_len {
            return Err(EngineError::invalid(
                format!(
                    "{} prompt tokens + {} more exceed this model's context of {}",
                    seq.prompt.len(),
                    seq.params.max_tokens,
                    self.max_model_len
                ),
                "max_tokens",
            ));
        }
        if let Some(bad) = seq
            .prompt
            .iter()
            .chain([&seq.first_token])
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return Err(EngineError::invalid(
                format!("token id {bad} is outside the vocabulary"),
                "kv",
            ));
        }
        seq.params.check_vocab(self.vocab_size)?;
        let constraint = self.constraint(&seq.params)?;
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (out, events) = tmpsc::unbounded_channel();
        if self
            .tx
            .send(Command::Resume {
                id,
                seq: Box::new(seq),
                constraint,
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
        request::check(&req, self.vocab_size, self.max_model_len)?;
        if self.queued.load(Ordering::Relaxed) >= self.max_waiting {
            self.metrics.rejected.inc();
            return Err(EngineError::Overloaded {
                retry_after_secs: 1,
            });
        }
        let constraint = self.constraint(&req.params)?;
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (out, events) = tmpsc::unbounded_channel();
        self.tx
            .send(Command::Submit {
                id,
                req: Box::new(req),
                out,
                arrival: Instant::now(),
                prefill_only,
                constraint,
            })
            .map_err(|_| EngineError::Unavailable("the engine has stopped".into()))?;
        Ok(RequestHandle {
            id,
            events,
            cancel: Cancel::Local(self.tx.clone()),
        })
    }

    /// The request's grammar compiled for this model, on the caller's thread rather than
    /// the engine's. Usually a copy of a compiled one ([`GrammarCompiler`]'s cache: the
    /// API compiled it to check it); the first grammar of a process also builds the
    /// vocabulary's trie (a few hundred ms at a 49k vocabulary), which on a worker
    /// happens on the runtime thread that took the request.
    ///
    /// [`GrammarCompiler`]: crate::sampling::grammar::GrammarCompiler
    fn constraint(&self, p: &SamplingParams) -> Result<Option<Box<Constraint>>> {
        match &p.grammar {
            None => Ok(None),
            Some(g) => Ok(Some(Box::new(
                self.tokenizer.grammar()?.compile(g, "grammar")?,
            ))),
        }
    }

    /// Stops accepting requests; [`Engine::in_flight`] reaches 0 when all are done.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// False once the engine thread has died.
    #[must_use]
    pub fn is_alive(&self) -> bool {
        !self.dead.load(Ordering::SeqCst)
    }

    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}
