//! The GPU backend (feature `cuda`): cuBLAS GEMMs on the weights in their stored dtype,
//! NVRTC-compiled kernels for everything else (see `kernels.cu`), the paged KV cache
//! in device memory with the CPU backend's layout, and decode steps replayed from CUDA
//! graphs captured per batch-size bucket.
//!
//! cudarc loads the driver, cuBLAS and NVRTC at run time, so this builds anywhere;
//! [`CudaBackend::probe`] says whether a GPU can be used before anything touches the
//! driver (cudarc panics when the library is missing), and callers fall back to the CPU.
// FFI with the CUDA driver; every block says why it holds.
#![allow(unsafe_code)]

mod forward;
pub mod gemm;
mod graphs;
pub mod kernels;
mod kv;
pub mod nvrtc;
pub mod upload;
mod weights;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, PinnedHostSlice, sys};
use preheat_snapshot::kernel_cache::KernelCache;
use preheat_snapshot::{ModelConfig, Snapshot};

use self::forward::Scratch;
use self::graphs::Graph;
use self::kernels::Kernels;
use self::weights::DeviceWeights;
use super::weights_fingerprint;
use super::{Backend, Dims, ForwardBatch, KvLayout};
use crate::kv::BlockId;
use crate::{EngineError, Result};

fn dev(e: impl std::fmt::Debug) -> EngineError {
    EngineError::Device(format!("CUDA: {e:?}"))
}

/// Decode batch sizes captured as graphs; a decode step of `n` sequences replays the
/// smallest bucket ≥ `n` (padding rows write only the scratch block).
pub const GRAPH_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// Why no GPU is used, or which one would be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// No driver library (`libcuda.so`) on this machine.
    NoDriver,
    /// The driver is there but a library the backend needs is not (cudarc would panic
    /// on first use).
    MissingLibrary(&'static str),
    /// The driver loaded but reported no device, or failed.
    NoDevice(String),
    Ready {
        devices: i32,
    },
}

/// What a start on the GPU measured, for the start-up phases and the benchmark.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuStartup {
    pub arch: String,
    pub driver: String,
    /// Kernels restored from the kernel cache rather than compiled.
    pub kernels_from_cache: bool,
    pub kernels_s: f64,
    pub upload_bytes: u64,
    pub upload_s: f64,
    /// Of `upload_s`, time the CPU spent reading the snapshot into staging buffers.
    pub upload_read_s: f64,
    pub graphs: usize,
    pub graph_capture_s: f64,
}

impl GpuStartup {
    /// Upload throughput in bytes/s.
    #[must_use]
    pub fn upload_bytes_per_s(&self) -> f64 {
        self.upload_bytes as f64 / self.upload_s.max(1e-9)
    }
}

/// Options of a GPU start.
#[derive(Clone, Debug, Default)]
#[must_use]
pub struct CudaOptions {
    pub device: usize,
    /// Where compiled kernels are kept across restarts.
    pub kernel_cache: Option<std::path::PathBuf>,
    /// The deployment's kernel-cache key (from the cluster token): only entries signed
    /// with it are loaded.
    pub kernel_cache_key: Option<[u8; 32]>,
    /// Capture decode graphs at start (otherwise every step launches kernels).
    pub graphs: bool,
    /// Most tokens one forward pass carries (prefill chunk); larger batches reallocate
    /// the activations (dropping captured graphs).
    pub max_batch_tokens: usize,
}

/// A Llama-family model on one GPU.
pub struct CudaBackend {
    config: ModelConfig,
    fingerprint: u64,
    layout: KvLayout,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    _blas_ws: CudaSlice<u8>,
    k: Kernels,
    w: DeviceWeights,
    /// Per layer, `num_blocks + 1` blocks: the last is scratch for graph padding.
    k_cache: Vec<CudaSlice<f32>>,
    v_cache: Vec<CudaSlice<f32>>,
    s: Scratch,
    /// Block-table entries per sequence in a graph replay.
    graph_bt_stride: usize,
    graphs: BTreeMap<usize, Graph>,
    /// Decode steps replay graphs; buckets dropped when the activations grew are
    /// captured again on first use.
    use_graphs: bool,
    /// Pinned host staging for K/V transfers, grown to the largest one.
    kv_pinned: std::sync::Mutex<Option<PinnedHostSlice<f32>>>,
    startup: GpuStartup,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("layout", &self.layout)
            .field("startup", &self.startup)
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Whether a GPU can be used, without risking cudarc's panic on a missing driver.
    #[must_use]
    pub fn probe() -> Probe {
        // SAFETY: only tries to dlopen the driver library by its usual names.
        if !unsafe { sys::is_culib_present() } {
            return Probe::NoDriver;
        }
        // SAFETY: as above, for cuBLAS.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Probe::MissingLibrary("cuBLAS (libcublas.so.12)");
        }
        match CudaContext::device_count() {
            Ok(0) => Probe::NoDevice("the driver reports no device".into()),
            Ok(n) => Probe::Ready { devices: n },
            Err(e) => Probe::NoDevice(format!("{e:?}")),
        }
    }

    /// Loads the model onto device `opts.device`: kernels (cache or NVRTC), weights
    /// (pinned two-stream upload), KV cache of `num_blocks` blocks, and decode graphs.
    pub fn new(
        snap: Arc<Snapshot>,
        num_blocks: usize,
        block_size: usize,
        opts: &CudaOptions,
    ) -> Result<Self> {
        let ctx = CudaContext::new(opts.device).map_err(dev)?;
        // One compute stream orders everything; the upload streams are joined before
        // compute starts, so cudarc's per-allocation events are not needed (and they
        // would break graph capture).
        // SAFETY: see above: no allocation is used on two streams concurrently.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: graphs cannot be captured on the legacy default stream,
        // which also serialises with every other blocking stream.
        let stream = ctx.new_stream().map_err(dev)?;
        let (major, minor) = ctx.compute_capability().map_err(dev)?;
        let arch = format!("sm_{major}{minor}");
        let mut driver_v = 0i32;
        // SAFETY: valid out-pointer; the driver library is loaded (probe / context).
        unsafe { sys::cuDriverGetVersion(&mut driver_v) };
        let driver = format!("{}.{}", driver_v / 1000, (driver_v % 1000) / 10);
        let mut startup = GpuStartup {
            arch: arch.clone(),
            driver: driver.clone(),
            ..GpuStartup::default()
        };

        let t = Instant::now();
        let cache = match &opts.kernel_cache {
            Some(dir) => match KernelCache::open(dir) {
                Ok(c) => Some(match &opts.kernel_cache_key {
                    Some(k) => c.with_key(k),
                    None => c,
                }),
                Err(e) => {
                    tracing::warn!(error = %e, "kernel cache unusable; compiling");
                    None
                }
            },
            None => None,
        };
        nvrtc::ensure_loaded(&[]);
        let (image, origin) = nvrtc::image_for(&arch, &driver, cache.as_ref())?;
        let module = ctx.load_module(image.to_ptx()).map_err(dev)?;
        let k = Kernels::load(module)?;
        startup.kernels_from_cache = origin == nvrtc::Origin::Cache;
        startup.kernels_s = t.elapsed().as_secs_f64();

        let c = snap.manifest().model.clone();
        let Dims {
            kv_heads: nkv,
            head_dim: hd,
            ..
        } = Dims::of(&c);
        if hd > 512 || hd % 2 != 0 {
            return Err(EngineError::Model(format!(
                "head_dim {hd}: the CUDA kernels take even head sizes up to 512"
            )));
        }
        let w = DeviceWeights::upload(&snap, &c, &ctx, &stream, &mut startup)?;
        let num_layers = w.layers.len();

        let layout = KvLayout {
            num_layers,
            num_blocks,
            block_size,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        let cache_len = (num_blocks + 1) * layout.block_elems();
        let mut k_cache = Vec::with_capacity(num_layers);
        let mut v_cache = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            k_cache.push(stream.alloc_zeros::<f32>(cache_len).map_err(dev)?);
            v_cache.push(stream.alloc_zeros::<f32>(cache_len).map_err(dev)?);
        }
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(dev)?;
        let mut blas_ws = stream.alloc_zeros::<u8>(32 << 20).map_err(dev)?;
        gemm::set_workspace(&blas, &stream, &mut blas_ws)?;
        let max_pos = (c.max_position_embeddings as usize).max(block_size);
        let graph_bt_stride = max_pos.div_ceil(block_size).min(num_blocks).max(1);
        let cap_tokens = opts
            .max_batch_tokens
            .max(*GRAPH_BUCKETS.last().unwrap_or(&1));
        let s = Scratch::new(&stream, &c, cap_tokens, cap_tokens * graph_bt_stride)?;
        let mut be = CudaBackend {
            fingerprint: weights_fingerprint(snap.manifest()),
            config: c,
            layout,
            ctx,
            stream,
            blas,
            _blas_ws: blas_ws,
            k,
            w,
            k_cache,
            v_cache,
            s,
            graph_bt_stride,
            graphs: BTreeMap::new(),
            use_graphs: opts.graphs,
            kv_pinned: std::sync::Mutex::new(None),
            startup,
        };
        if opts.graphs {
            let t = Instant::now();
            for &b in &GRAPH_BUCKETS {
                be.capture(b)?;
            }
            be.startup.graphs = be.graphs.len();
            be.startup.graph_capture_s = t.elapsed().as_secs_f64();
        }
        tracing::info!(
            arch = %be.startup.arch, driver = %be.startup.driver,
            kernels_from_cache = be.startup.kernels_from_cache, kernels_s = be.startup.kernels_s,
            upload_gb_s = be.startup.upload_bytes_per_s() / 1e9, graphs = be.startup.graphs,
            graph_capture_s = be.startup.graph_capture_s, "model on the GPU"
        );
        Ok(be)
    }

    /// What this start measured.
    #[must_use]
    pub fn startup(&self) -> &GpuStartup {
        &self.startup
    }

    #[must_use]
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(super) fn scratch_block(&self) -> u32 {
        self.layout.num_blocks as u32
    }

    pub(super) fn check(&self, b: &ForwardBatch<'_>) -> Result<()> {
        super::check_batch(b, &self.layout, self.config.vocab_size)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn weights_fingerprint(&self) -> u64 {
        self.fingerprint
    }

    fn forward(&mut self, b: &ForwardBatch<'_>) -> Result<Vec<f32>> {
        self.run_forward(b)
    }

    fn export_kv(&self, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<()> {
        let before = out.len();
        self.export_kv_pinned(blocks, out)
            .inspect_err(|_| out.truncate(before))
    }

    fn import_kv(&mut self, blocks: &[BlockId], data: &[u8]) -> Result<()> {
        self.import_kv_pinned(blocks, data)
    }
}
