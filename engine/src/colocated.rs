//! `preheat engine serve`: one process that loads a model and serves the OpenAI API,
//! prefill and decode colocated (the baseline the disaggregated path is measured
//! against).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::{ApiState, DEFAULT_MAX_BODY, control_router, drain, public_router};
use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::engine::{Engine, EngineConfig};
use crate::metrics::{EngineMetrics, Role};
use crate::model::open_model;
use crate::scheduler::SchedulerConfig;
use crate::tokenizer::Tokenizer;
use crate::{EngineError, Result};

/// Options of a serving process.
#[derive(Clone, Debug)]
#[must_use]
pub struct ServeOptions {
    pub model: PathBuf,
    pub served_model_name: Option<String>,
    /// A chat template rendered instead of the model's (`--chat-template`).
    pub chat_template: Option<String>,
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
    /// Which device runs the model.
    pub device: Device,
    /// Where compiled GPU kernels are kept across restarts (the warm-pool agent's
    /// kernel-cache directory on the node).
    pub kernel_cache: Option<PathBuf>,
    /// The deployment's cluster token: internal routes (and, for workers, the KV port)
    /// ask for it; requests to our other processes carry it.
    pub cluster_token: Option<Arc<preheat_edge::ClusterToken>>,
    /// Keys the OpenAI API asks for (`engine serve`; the gateway has its own).
    pub api_keys: Option<Arc<preheat_edge::ApiKeys>>,
    /// `engine serve`: where a standby's control routes (`/internal/state`,
    /// `/internal/promote`) listen; never on the public port.
    pub internal_addr: Option<SocketAddr>,
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The GPU when the build has the `cuda` feature and a driver and device are
    /// present, else the CPU (logged).
    #[default]
    Auto,
    Cpu,
    /// The GPU, or an error.
    Cuda,
}

impl Device {
    /// Parses `auto`, `cpu` or `cuda`.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "auto" => Device::Auto,
            "cpu" => Device::Cpu,
            "cuda" => Device::Cuda,
            _ => return None,
        })
    }
}

impl ServeOptions {
    pub fn new(model: PathBuf, addr: SocketAddr) -> Self {
        ServeOptions {
            model,
            served_model_name: None,
            chat_template: None,
            addr,
            block_size: 16,
            kv_cache_bytes: 512 << 20,
            scheduler: SchedulerConfig::default(),
            max_body_bytes: DEFAULT_MAX_BODY,
            drain_grace: Duration::from_secs(30),
            role: Role::Colocated,
            started: Instant::now(),
            standby: false,
            device: Device::Auto,
            kernel_cache: None,
            cluster_token: None,
            api_keys: None,
            internal_addr: None,
        }
    }
}

/// The backend `opts.device` asks for; `Auto` falls back to the CPU, saying why.
fn backend_for(
    opts: &ServeOptions,
    snap: &Arc<preheat_snapshot::Snapshot>,
    num_blocks: usize,
    metrics: &EngineMetrics,
    source: &str,
) -> Result<Box<dyn Backend>> {
    if opts.device != Device::Cpu {
        match gpu_backend(opts, snap, num_blocks, metrics, source) {
            Ok(b) => return Ok(b),
            Err(e) if opts.device == Device::Cuda => return Err(e),
            Err(e) => tracing::info!(reason = %e, "serving on the CPU"),
        }
    }
    Ok(Box::new(CpuBackend::new(
        Arc::clone(snap),
        num_blocks,
        opts.block_size,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn gpu_backend(
    _: &ServeOptions,
    _: &Arc<preheat_snapshot::Snapshot>,
    _: usize,
    _: &EngineMetrics,
    _: &str,
) -> Result<Box<dyn Backend>> {
    Err(EngineError::Device(
        "this build has no GPU backend (build with --features cuda)".into(),
    ))
}

/// Loads onto the GPU and records its start phases (kernels, weights upload, graph
/// capture) as seconds from the replica's start, like every other phase.
#[cfg(feature = "cuda")]
fn gpu_backend(
    opts: &ServeOptions,
    snap: &Arc<preheat_snapshot::Snapshot>,
    num_blocks: usize,
    metrics: &EngineMetrics,
    source: &str,
) -> Result<Box<dyn Backend>> {
    use crate::backend::cuda::{CudaBackend, CudaOptions, Probe};
    match CudaBackend::probe() {
        Probe::Ready { .. } => {}
        Probe::NoDriver => {
            return Err(EngineError::Device(
                "no CUDA driver library (libcuda.so) on this machine".into(),
            ));
        }
        Probe::NoDevice(why) => return Err(EngineError::Device(format!("no GPU: {why}"))),
        Probe::MissingLibrary(lib) => {
            return Err(EngineError::Device(format!("{lib} not found")));
        }
    }
    let before = opts.started.elapsed().as_secs_f64();
    let be = CudaBackend::new(
        Arc::clone(snap),
        num_blocks,
        opts.block_size,
        &CudaOptions {
            device: 0,
            kernel_cache: opts.kernel_cache.clone(),
            kernel_cache_key: opts
                .cluster_token
                .as_ref()
                .map(|t| t.prove(preheat_edge::token::KERNEL_CACHE_LABEL, &[])),
            graphs: true,
            max_batch_tokens: opts.scheduler.max_batched_tokens,
        },
    )?;
    let g = be.startup();
    let kernels = before + g.kernels_s;
    let uploaded = kernels + g.upload_s;
    let kernel_phase = if g.kernels_from_cache {
        "kernels_restored"
    } else {
        "kernels_compiled"
    };
    for (phase, secs) in [
        (kernel_phase, kernels),
        ("weights_uploaded", uploaded),
        ("graphs_captured", uploaded + g.graph_capture_s),
    ] {
        metrics
            .startup
            .with_label_values(&[phase, source])
            .set(secs);
    }
    Ok(Box::new(be))
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
    let mut tokenizer = Tokenizer::from_snapshot(&snap)?;
    if let Some(t) = &opts.chat_template {
        tokenizer = tokenizer.with_chat_template(t.clone())?;
    }
    let metrics = Arc::new(EngineMetrics::new(&name, opts.role));
    metrics.set_startup_origin(opts.started, start_source);
    for (phase, secs) in [("snapshot_open", opened), ("weights_resident", resident)] {
        metrics
            .startup
            .with_label_values(&[phase, start_source])
            .set(secs);
    }
    let backend = backend_for(opts, &snap, num_blocks, &metrics, start_source)?;
    let engine = Engine::start(
        backend,
        tokenizer,
        EngineConfig {
            model_name: name.clone(),
            block_size: opts.block_size,
            num_blocks,
            scheduler: opts.scheduler,
            threads: None,
            prefix_key: crate::kv::PrefixKey::of_deployment(opts.cluster_token.as_deref()),
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

/// Binds `opts.addr` and serves until `stop` resolves (the binary: SIGTERM / Ctrl-C),
/// then drains.
pub async fn serve(
    opts: ServeOptions,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(opts.addr)
        .await
        .map_err(|e| EngineError::Unavailable(format!("binding {}: {e}", opts.addr)))?;
    serve_on(listener, opts, stop).await
}

/// Serves on an already bound listener until `stop` resolves (tests pass their own).
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    opts: ServeOptions,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let state = ApiState::new(opts.max_body_bytes).with_api_keys(opts.api_keys.clone());
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
                        "parked as a standby: POST /internal/promote on the internal port (or SIGUSR1) to serve"
                    );
                    state.park(e);
                } else {
                    state.set_engine(e);
                    if let Ok(e) = state.front() {
                        e.metrics().mark_startup("ready");
                    }
                }
            })
        })
    };
    #[cfg(unix)]
    if opts.standby {
        // Promotion without the network: the agent (or an operator) signals the process.
        let state = state.clone();
        if let Ok(mut usr1) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
        {
            tokio::spawn(async move {
                while usr1.recv().await.is_some() {
                    if let Some(secs) = state.promote() {
                        tracing::info!(promote_ms = secs * 1e3, "promoted by SIGUSR1");
                    }
                }
            });
        }
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let drain_state = state.clone();
    let grace = opts.drain_grace;
    tokio::spawn(async move {
        stop.await;
        tracing::info!("shutting down: draining in-flight requests");
        drain(&drain_state, grace).await;
        let _ = stop_tx.send(());
    });
    let control = match opts.internal_addr {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| EngineError::Unavailable(format!("binding {addr}: {e}")))?;
            let server = preheat_edge::listener::InternalServer::new(
                l,
                control_router(state.clone()),
                opts.cluster_token.clone(),
            )
            .warn_if_open("the standby control routes");
            Some(tokio::spawn(server.serve(std::future::pending())))
        }
        None => None,
    };
    let server = preheat_edge::listener::serve(
        listener,
        public_router(state),
        preheat_edge::listener::Limits::PUBLIC,
        async move {
            let _ = stop_rx.await;
        },
    );
    let server = tokio::spawn(async move {
        let r = server.await;
        if let Some(c) = control {
            c.abort();
        }
        r
    });
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
