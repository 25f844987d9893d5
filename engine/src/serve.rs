//! `preheat engine serve`: one process that loads a model and serves the OpenAI API,
//! prefill and decode colocated (the baseline the disaggregated path is measured
//! against).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::cpu::CpuBackend;
use crate::engine::{Engine, EngineConfig};
use crate::metrics::{EngineMetrics, Role};
use crate::model::open_model;
use crate::scheduler::SchedulerConfig;
use crate::server::{ApiState, DEFAULT_MAX_BODY, drain, router, shutdown_signal};
use crate::tokenizer::Tokenizer;
use crate::{EngineError, Result};

/// Options of a serving process.
#[derive(Clone, Debug)]
#[must_use]
pub struct ServeOptions {
    pub model: PathBuf,
    pub served_model_name: Option<String>,
    pub addr: SocketAddr,
    pub block_size: usize,
    /// KV-cache memory budget.
    pub kv_cache_bytes: usize,
    pub scheduler: SchedulerConfig,
    pub max_body_bytes: usize,
    /// How long SIGTERM waits for in-flight requests.
    pub drain_grace: Duration,
    /// `role` label of the metrics.
    pub role: Role,
    /// When this replica's start began (the process start): start-up phases are
    /// measured from here.
    pub started: Instant,
    /// Load, page in and warm up, then wait parked for a promotion before serving.
    pub standby: bool,
}

impl ServeOptions {
    pub fn new(model: PathBuf, addr: SocketAddr) -> Self {
        ServeOptions {
            model,
            served_model_name: None,
            addr,
            block_size: 16,
            kv_cache_bytes: 512 << 20,
            scheduler: SchedulerConfig::default(),
            max_body_bytes: DEFAULT_MAX_BODY,
            drain_grace: Duration::from_secs(30),
            role: Role::Colocated,
            started: Instant::now(),
            standby: false,
        }
    }
}

/// Loads the model and builds the engine (blocking).
pub fn load_engine(opts: &ServeOptions) -> Result<Engine> {
    let t0 = Instant::now();
    let (snap, source) = open_model(&opts.model)?;
    let opened = opts.started.elapsed().as_secs_f64();
    // Where the bytes came from decides the start-up class the scaler learns from.
    let start_source = match source {
        crate::model::ModelSource::Converted => "convert",
        crate::model::ModelSource::Snapshot => match snap.residency() {
            Ok(r) if r.fraction() >= 0.9 => "hot",
            _ => "staged",
        },
    };
    if let Err(e) = snap.populate() {
        tracing::warn!(error = %e, "could not page in the weights; the first requests will");
    }
    let resident = opts.started.elapsed().as_secs_f64();
    let c = &snap.manifest().model;
    let block_bytes = CpuBackend::kv_block_bytes(c, opts.block_size);
    let num_blocks = (opts.kv_cache_bytes / block_bytes.max(1)).max(1);
    let name = opts
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_name(&opts.model));
    let tokenizer = Tokenizer::from_snapshot(&snap)?;
    let backend = CpuBackend::new(Arc::clone(&snap), num_blocks, opts.block_size)?;
    let metrics = Arc::new(EngineMetrics::new(&name, opts.role));
    metrics.set_startup_origin(opts.started, start_source);
    for (phase, secs) in [("snapshot_open", opened), ("weights_resident", resident)] {
        metrics
            .startup
            .with_label_values(&[phase, start_source])
            .set(secs);
    }
    let engine = Engine::start(
        Box::new(backend),
        tokenizer,
        EngineConfig {
            model_name: name.clone(),
            block_size: opts.block_size,
            num_blocks,
            scheduler: opts.scheduler,
        },
        metrics,
    )?;
    engine.metrics.mark_startup("loaded");
    tracing::info!(
        model = %name, source = start_source, kv_blocks = num_blocks, block_size = opts.block_size,
        max_model_len = engine.max_model_len, secs = t0.elapsed().as_secs_f64(), "model loaded"
    );
    Ok(engine)
}

/// The served name: the file stem of a snapshot or GGUF, the directory name of an HF
/// checkpoint.
#[must_use]
pub fn default_name(path: &std::path::Path) -> String {
    let p = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    p.map_or_else(|| "model".to_owned(), |s| s.to_string_lossy().into_owned())
}

/// Serves until SIGTERM / Ctrl-C, then drains.
pub async fn serve(opts: ServeOptions) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(opts.addr)
        .await
        .map_err(|e| EngineError::Unavailable(format!("binding {}: {e}", opts.addr)))?;
    serve_on(listener, opts, shutdown_signal()).await
}

/// Serves on an already bound listener until `stop` resolves (tests pass their own).
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    opts: ServeOptions,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let state = ApiState::new(opts.max_body_bytes);
    let local = listener
        .local_addr()
        .map_err(|e| EngineError::Unavailable(e.to_string()))?;
    tracing::info!(addr = %local, "listening (health is 503 until the model is loaded)");
    let loader = {
        let state = state.clone();
        let opts = opts.clone();
        tokio::task::spawn_blocking(move || {
            load_engine(&opts).map(|e| {
                if opts.standby {
                    e.metrics.mark_startup("parked");
                    tracing::info!(
                        "parked as a standby: POST /internal/promote (or SIGUSR1) to serve"
                    );
                    state.park(e);
                } else {
                    state.set_engine(e);
                    if let Ok(e) = state.engine() {
                        e.metrics.mark_startup("ready");
                    }
                }
            })
        })
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drain_state = state.clone();
    let grace = opts.drain_grace;
    tokio::spawn(async move {
        stop.await;
        tracing::info!("shutting down: draining in-flight requests");
        drain(&drain_state, grace).await;
        let _ = stop_tx.send(());
    });
    let server = axum::serve(listener, router(state)).with_graceful_shutdown(async move {
        let _ = stop_rx.await;
    });
    let server = tokio::spawn(async move { server.await });
    match loader.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            server.abort();
            return Err(e);
        }
        Err(e) => {
            server.abort();
            return Err(EngineError::Internal(format!("model loader panicked: {e}")));
        }
    }
    match server.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(EngineError::Unavailable(format!("server: {e}"))),
        Err(e) => Err(EngineError::Internal(format!("server task: {e}"))),
    }
}
