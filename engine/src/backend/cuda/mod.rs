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

pub mod gemm;
pub mod nvrtc;
pub mod upload;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, LaunchConfig,
    PinnedHostSlice, PushKernelArg, sys,
};
use preheat_snapshot::kernel_cache::KernelCache;
use preheat_snapshot::{DType, ModelConfig, Snapshot};

use self::gemm::DeviceMatrix;
use self::upload::Uploader;
use super::cpu::ops;
use super::weights_fingerprint;
use super::{Backend, Dims, ForwardBatch, KvLayout};
use crate::kv::BlockId;
use crate::{EngineError, Result};

fn dev(e: impl std::fmt::Debug) -> EngineError {
    EngineError::Device(format!("CUDA: {e:?}"))
}

/// Launches kernel `$f` on stream `$st` with grid `$cfg` and the arguments in order.
macro_rules! launch {
    ($st:expr, $f:expr, $cfg:expr $(, $arg:expr)* $(,)?) => {{
        let mut b = $st.launch_builder($f);
        $( b.arg($arg); )*
        // SAFETY: every call site passes the arguments of the kernel's signature in
        // kernels.cu, in order and type, and buffers holding every element its grid
        // touches (the scratch holds `cap_tokens` ≥ t rows).
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(dev)
    }};
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

struct Kernels {
    _module: Arc<CudaModule>,
    f: BTreeMap<&'static str, CudaFunction>,
}

impl Kernels {
    fn get(&self, name: &str) -> &CudaFunction {
        // Every name in `nvrtc::KERNELS` was loaded at start (checked there).
        &self.f[name]
    }
}

#[derive(Debug)]
struct Layer {
    input_norm: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    q: DeviceMatrix,
    k: DeviceMatrix,
    v: DeviceMatrix,
    o: DeviceMatrix,
    q_bias: Option<CudaSlice<f32>>,
    k_bias: Option<CudaSlice<f32>>,
    v_bias: Option<CudaSlice<f32>>,
    gate: DeviceMatrix,
    up: DeviceMatrix,
    down: DeviceMatrix,
}

/// Activations and batch inputs, at fixed addresses so graphs can replay over them.
#[derive(Debug)]
struct Scratch {
    cap_tokens: usize,
    cap_bt: usize,
    x: CudaSlice<f32>,
    hn: CudaSlice<f32>,
    narrow: CudaSlice<u16>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    o: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    sel: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    tokens: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    seq_of: CudaSlice<u32>,
    block_tables: CudaSlice<u32>,
    logits_rows: CudaSlice<u32>,
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
    embed: DeviceMatrix,
    lm_head: Option<DeviceMatrix>,
    final_norm: CudaSlice<f32>,
    layers: Vec<Layer>,
    inv_freq: CudaSlice<f32>,
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

/// A captured decode step.
struct Graph(CudaGraph);

// SAFETY: a graph executable is not tied to the thread that captured it: cudarc binds
// the context before launching, and the backend (which owns it) is moved between
// threads, never shared, so no two threads launch it at once.
unsafe impl Send for Graph {}

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
        let mut f = BTreeMap::new();
        for name in nvrtc::KERNELS {
            f.insert(name, module.load_function(name).map_err(dev)?);
        }
        let k = Kernels { _module: module, f };
        startup.kernels_from_cache = origin == nvrtc::Origin::Cache;
        startup.kernels_s = t.elapsed().as_secs_f64();

        let c = snap.manifest().model.clone();
        let Dims {
            hidden: h,
            ffn: ff,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            ..
        } = Dims::of(&c);
        if hd > 512 || hd % 2 != 0 {
            return Err(EngineError::Model(format!(
                "head_dim {hd}: the CUDA kernels take even head sizes up to 512"
            )));
        }
        let vocab = c.vocab_size as usize;

        // Allocate every weight first (on the compute stream), then upload.
        let t = Instant::now();
        let mut up = Uploader::new(&ctx)?;
        let mut mat = |name: &str, shape: &[usize]| -> Result<DeviceMatrix> {
            let w = super::cpu::weights::Weight::load(&snap, name, shape)?;
            // SAFETY: fully written by the upload below before any kernel reads it.
            let mut data = unsafe { stream.alloc::<u8>(w.bytes().len()).map_err(dev)? };
            stream.synchronize().map_err(dev)?;
            up.upload(w.bytes(), &mut data)?;
            Ok(DeviceMatrix {
                data,
                dtype: w.dtype,
                rows: w.rows,
                cols: w.cols,
            })
        };
        let mut layers_m = Vec::with_capacity(c.num_hidden_layers as usize);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            layers_m.push([
                mat(&format!("{p}.self_attn.q_proj.weight"), &[nh * hd, h])?,
                mat(&format!("{p}.self_attn.k_proj.weight"), &[nkv * hd, h])?,
                mat(&format!("{p}.self_attn.v_proj.weight"), &[nkv * hd, h])?,
                mat(&format!("{p}.self_attn.o_proj.weight"), &[h, nh * hd])?,
                mat(&format!("{p}.mlp.gate_proj.weight"), &[ff, h])?,
                mat(&format!("{p}.mlp.up_proj.weight"), &[ff, h])?,
                mat(&format!("{p}.mlp.down_proj.weight"), &[h, ff])?,
            ]);
        }
        let embed = mat("model.embed_tokens.weight", &[vocab, h])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(mat("lm_head.weight", &[vocab, h])?)
        };
        up.finish()?;
        // Small f32 vectors (norms, biases, RoPE table) go up directly.
        let vecf = |v: &[f32]| stream.clone_htod(v).map_err(dev);
        let w32 = |name: &str, n: usize| -> Result<Vec<f32>> {
            Ok(super::cpu::weights::Weight::load(&snap, name, &[n])?.to_f32_vec())
        };
        let bias = |name: &str, n: usize| -> Result<Option<CudaSlice<f32>>> {
            if snap.tensor(name).is_some() {
                Ok(Some(vecf(&w32(name, n)?)?))
            } else if c.attention_bias {
                Err(EngineError::Model(format!(
                    "config declares q/k/v bias but {name} is missing"
                )))
            } else {
                Ok(None)
            }
        };
        let mut layers = Vec::with_capacity(layers_m.len());
        for (l, [q, k_, v, o, gate, upm, down]) in layers_m.into_iter().enumerate() {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                input_norm: vecf(&w32(&format!("{p}.input_layernorm.weight"), h)?)?,
                post_norm: vecf(&w32(&format!("{p}.post_attention_layernorm.weight"), h)?)?,
                q,
                k: k_,
                v,
                o,
                q_bias: bias(&format!("{p}.self_attn.q_proj.bias"), nh * hd)?,
                k_bias: bias(&format!("{p}.self_attn.k_proj.bias"), nkv * hd)?,
                v_bias: bias(&format!("{p}.self_attn.v_proj.bias"), nkv * hd)?,
                gate,
                up: upm,
                down,
            });
        }
        let final_norm = vecf(&w32("model.norm.weight", h)?)?;
        let inv_freq = vecf(&ops::inv_freq(&c))?;
        stream.synchronize().map_err(dev)?;
        startup.upload_bytes = up.bytes;
        startup.upload_s = t.elapsed().as_secs_f64();
        startup.upload_read_s = up.read_s;

        let layout = KvLayout {
            num_layers: layers.len(),
            num_blocks,
            block_size,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        let cache_len = (num_blocks + 1) * layout.block_elems();
        let mut k_cache = Vec::with_capacity(layers.len());
        let mut v_cache = Vec::with_capacity(layers.len());
        for _ in 0..layers.len() {
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
            embed,
            lm_head,
            final_norm,
            layers,
            inv_freq,
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

    fn scratch_block(&self) -> u32 {
        self.layout.num_blocks as u32
    }

    fn check(&self, b: &ForwardBatch<'_>) -> Result<()> {
        super::check_batch(b, &self.layout, self.config.vocab_size)
    }

    /// Copies a batch's inputs into the scratch buffers, padded to `pad_to` rows, with
    /// `bt_stride` block-table entries per sequence.
    fn stage_inputs(
        &mut self,
        b: &ForwardBatch<'_>,
        pad_to: usize,
        bt_stride: usize,
    ) -> Result<()> {
        let t = b.tokens.len();
        let mut tokens = b.tokens.to_vec();
        let mut positions = b.positions.to_vec();
        let mut seq_of = b.seq_of.to_vec();
        // Padding rows (graph replays only) are sequences of their own.
        let bt_rows = if pad_to > t { pad_to } else { b.seqs.len() };
        let mut bt = vec![self.scratch_block(); bt_rows * bt_stride];
        for (i, s) in b.seqs.iter().enumerate() {
            let n = s.block_table.len().min(bt_stride);
            bt[i * bt_stride..i * bt_stride + n].copy_from_slice(&s.block_table[..n]);
        }
        // Padding rows: token 0 at position 0 of a sequence of their own whose table
        // is all scratch block.
        for i in t..pad_to {
            tokens.push(0);
            positions.push(0);
            seq_of.push(i as u32);
        }
        let mut rows = b.logits_rows.to_vec();
        rows.resize(rows.len().max(pad_to), 0);
        let st = &self.stream;
        let s = &mut self.s;
        st.memcpy_htod(&tokens, &mut s.tokens.slice_mut(..tokens.len()))
            .map_err(dev)?;
        st.memcpy_htod(&positions, &mut s.positions.slice_mut(..positions.len()))
            .map_err(dev)?;
        st.memcpy_htod(&seq_of, &mut s.seq_of.slice_mut(..seq_of.len()))
            .map_err(dev)?;
        st.memcpy_htod(&bt, &mut s.block_tables.slice_mut(..bt.len()))
            .map_err(dev)?;
        st.memcpy_htod(&rows, &mut s.logits_rows.slice_mut(..rows.len()))
            .map_err(dev)?;
        Ok(())
    }

    /// Launches the whole forward pass over `t` staged tokens and `n_logits` rows: no
    /// host work, no copies, so it can be captured into a graph.
    fn launch_forward(&mut self, t: usize, n_logits: usize, bt_stride: usize) -> Result<()> {
        let c = &self.config;
        let Dims {
            hidden: h,
            ffn: ff,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            vocab,
        } = Dims::of(c);
        let eps = c.rms_norm_eps as f32;
        let (h_i, hd_i, nh_i, nkv_i) = (h as i32, hd as i32, nh as i32, nkv as i32);
        let bs_i = self.layout.block_size as i32;
        let bt_i = bt_stride as i32;
        let slot_i = (nkv * hd) as i32;
        let scale = 1.0 / (hd as f32).sqrt();
        let st = Arc::clone(&self.stream);
        let rows = |n: usize, threads: u32| LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let flat = |n: usize| LaunchConfig::for_num_elems(n as u32);
        let s = &mut self.s;
        let k = &self.k;

        let embed = match self.embed.dtype {
            DType::F32 => "embed_f32",
            DType::F16 => "embed_f16",
            DType::BF16 => "embed_bf16",
        };
        launch!(
            st,
            k.get(embed),
            rows(t, 256),
            &self.embed.data,
            &s.tokens,
            &mut s.x,
            &h_i
        )?;
        let narrow = |st: &CudaStream,
                      x: &CudaSlice<f32>,
                      out: &mut CudaSlice<u16>,
                      n: usize,
                      dt: DType|
         -> Result<()> {
            let name = match dt {
                DType::BF16 => "f32_to_bf16",
                DType::F16 => "f32_to_f16",
                DType::F32 => return Ok(()),
            };
            let n_i = n as i32;
            launch!(st, k.get(name), flat(n), x, out, &n_i)
        };
        for (li, layer) in self.layers.iter().enumerate() {
            launch!(
                st,
                k.get("rms_norm"),
                rows(t, 256),
                &s.x,
                &layer.input_norm,
                &mut s.hn,
                &h_i,
                &eps
            )?;
            narrow(&st, &s.hn, &mut s.narrow, t * h, layer.q.dtype)?;
            gemm::linear(&self.blas, &st, &s.hn, &s.narrow, t, &layer.q, &mut s.q)?;
            gemm::linear(&self.blas, &st, &s.hn, &s.narrow, t, &layer.k, &mut s.k)?;
            gemm::linear(&self.blas, &st, &s.hn, &s.narrow, t, &layer.v, &mut s.v)?;
            for (out, bias, n) in [
                (&mut s.q, &layer.q_bias, nh * hd),
                (&mut s.k, &layer.k_bias, nkv * hd),
                (&mut s.v, &layer.v_bias, nkv * hd),
            ] {
                if let Some(b) = bias {
                    let n_i = n as i32;
                    launch!(st, k.get("add_bias"), rows(t, 256), out, b, &n_i)?;
                }
            }
            for (x, heads) in [(&mut s.q, nh_i), (&mut s.k, nkv_i)] {
                let cfg = LaunchConfig {
                    grid_dim: (t as u32, heads as u32, 1),
                    block_dim: ((hd / 2) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                launch!(
                    st,
                    k.get("rope"),
                    cfg,
                    x,
                    &s.positions,
                    &self.inv_freq,
                    &heads,
                    &hd_i
                )?;
            }
            let (kc, vc) = (&mut self.k_cache[li], &mut self.v_cache[li]);
            launch!(
                st,
                k.get("kv_write"),
                rows(t, 128),
                &s.k,
                &s.v,
                &mut *kc,
                &mut *vc,
                &s.positions,
                &s.seq_of,
                &s.block_tables,
                &bt_i,
                &bs_i,
                &slot_i
            )?;
            let threads = 128u32;
            let attn_cfg = LaunchConfig {
                grid_dim: (t as u32, nh as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: ((hd + threads as usize + 32) * 4) as u32,
            };
            launch!(
                st,
                k.get("paged_attention"),
                attn_cfg,
                &s.q,
                &*kc,
                &*vc,
                &mut s.attn,
                &s.positions,
                &s.seq_of,
                &s.block_tables,
                &bt_i,
                &nh_i,
                &nkv_i,
                &hd_i,
                &bs_i,
                &scale
            )?;
            narrow(&st, &s.attn, &mut s.narrow, t * nh * hd, layer.o.dtype)?;
            gemm::linear(&self.blas, &st, &s.attn, &s.narrow, t, &layer.o, &mut s.o)?;
            let n_i = (t * h) as i32;
            launch!(st, k.get("add_inplace"), flat(t * h), &mut s.x, &s.o, &n_i)?;
            launch!(
                st,
                k.get("rms_norm"),
                rows(t, 256),
                &s.x,
                &layer.post_norm,
                &mut s.hn,
                &h_i,
                &eps
            )?;
            narrow(&st, &s.hn, &mut s.narrow, t * h, layer.gate.dtype)?;
            gemm::linear(
                &self.blas,
                &st,
                &s.hn,
                &s.narrow,
                t,
                &layer.gate,
                &mut s.gate,
            )?;
            gemm::linear(&self.blas, &st, &s.hn, &s.narrow, t, &layer.up, &mut s.up)?;
            let nf_i = (t * ff) as i32;
            launch!(
                st,
                k.get("silu_mul"),
                flat(t * ff),
                &mut s.gate,
                &s.up,
                &nf_i
            )?;
            narrow(&st, &s.gate, &mut s.narrow, t * ff, layer.down.dtype)?;
            gemm::linear(
                &self.blas,
                &st,
                &s.gate,
                &s.narrow,
                t,
                &layer.down,
                &mut s.o,
            )?;
            launch!(st, k.get("add_inplace"), flat(t * h), &mut s.x, &s.o, &n_i)?;
        }
        if n_logits == 0 {
            return Ok(());
        }
        launch!(
            st,
            k.get("gather_rows"),
            rows(n_logits, 256),
            &s.x,
            &s.logits_rows,
            &mut s.sel,
            &h_i
        )?;
        launch!(
            st,
            k.get("rms_norm"),
            rows(n_logits, 256),
            &s.sel,
            &self.final_norm,
            &mut s.normed,
            &h_i,
            &eps
        )?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        narrow(&st, &s.normed, &mut s.narrow, n_logits * h, head.dtype)?;
        gemm::linear(
            &self.blas,
            &st,
            &s.normed,
            &s.narrow,
            n_logits,
            head,
            &mut s.logits,
        )?;
        debug_assert!(s.logits.len() >= n_logits * vocab);
        Ok(())
    }

    /// Captures the decode step of `bucket` sequences (one token each) into a graph.
    fn capture(&mut self, bucket: usize) -> Result<()> {
        if bucket > self.s.cap_tokens {
            return Ok(());
        }
        // All rows are padding for the capture: it writes only the scratch block.
        let empty = ForwardBatch {
            tokens: &[],
            positions: &[],
            seq_of: &[],
            seqs: &[],
            logits_rows: &[],
        };
        self.stage_inputs(&empty, bucket, self.graph_bt_stride)?;
        self.stream.synchronize().map_err(dev)?;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(dev)?;
        let launched = self.launch_forward(bucket, bucket, self.graph_bt_stride);
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(dev)?;
        launched?;
        let graph = graph.ok_or_else(|| EngineError::Device("empty graph capture".into()))?;
        graph.upload().map_err(dev)?;
        self.graphs.insert(bucket, Graph(graph));
        Ok(())
    }

    /// The K/V staging buffer, at least `elems` floats, locked for one transfer.
    fn kv_staging(
        &self,
        elems: usize,
    ) -> Result<std::sync::MutexGuard<'_, Option<PinnedHostSlice<f32>>>> {
        let mut g = self
            .kv_pinned
            .lock()
            .map_err(|_| EngineError::Internal("KV staging lock poisoned".into()))?;
        let slot = g.take();
        *g = Some(pinned_at_least(&self.ctx, slot, elems)?);
        Ok(g)
    }

    /// `blocks`' K/V in the transfer layout (per layer, per block: K then V), copied
    /// device → pinned host in one batch of asynchronous copies.
    fn export_kv_pinned(&self, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<()> {
        let n = self.layout.block_elems();
        let total = self.layout.num_layers * blocks.len() * 2 * n;
        let mut g = self.kv_staging(total)?;
        let buf = g
            .as_mut()
            .ok_or_else(|| EngineError::Internal("no KV staging".into()))?
            .as_mut_slice()
            .map_err(dev)?;
        let mut off = 0;
        for layer in 0..self.layout.num_layers {
            for &b in blocks {
                let r = b as usize * n..(b as usize + 1) * n;
                for cache in [&self.k_cache[layer], &self.v_cache[layer]] {
                    self.stream
                        .memcpy_dtoh(&cache.slice(r.clone()), &mut buf[off..off + n])
                        .map_err(dev)?;
                    off += n;
                }
            }
        }
        self.stream.synchronize().map_err(dev)?;
        out.extend_from_slice(bytemuck::cast_slice(&buf[..total]));
        Ok(())
    }
}

/// `slot` if it holds at least `elems` floats, else a new pinned buffer of that size:
/// ordinary cached pinned memory (the CPU reads K/V back out of it, which
/// write-combined memory makes slow).
fn pinned_at_least(
    ctx: &Arc<CudaContext>,
    slot: Option<PinnedHostSlice<f32>>,
    elems: usize,
) -> Result<PinnedHostSlice<f32>> {
    match slot {
        Some(p) if p.len() >= elems => Ok(p),
        _ => {
            // SAFETY: every element handed out is first written by a copy.
            unsafe { ctx.alloc_pinned_with_flags::<f32>(elems.max(1), 0) }.map_err(dev)
        }
    }
}

impl Scratch {
    fn new(st: &Arc<CudaStream>, c: &ModelConfig, cap: usize, cap_bt: usize) -> Result<Self> {
        let Dims {
            hidden: h,
            ffn: ff,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            vocab,
        } = Dims::of(c);
        let f = |n: usize| st.alloc_zeros::<f32>(n.max(1)).map_err(dev);
        let u = |n: usize| st.alloc_zeros::<u32>(n.max(1)).map_err(dev);
        let widest = (h.max(ff).max(nh * hd)) * cap;
        Ok(Scratch {
            cap_tokens: cap,
            cap_bt,
            x: f(cap * h)?,
            hn: f(cap * h)?,
            narrow: st.alloc_zeros::<u16>(widest).map_err(dev)?,
            q: f(cap * nh * hd)?,
            k: f(cap * nkv * hd)?,
            v: f(cap * nkv * hd)?,
            attn: f(cap * nh * hd)?,
            o: f(cap * h)?,
            gate: f(cap * ff)?,
            up: f(cap * ff)?,
            sel: f(cap * h)?,
            normed: f(cap * h)?,
            logits: f(cap * vocab)?,
            tokens: u(cap)?,
            positions: u(cap)?,
            seq_of: u(cap)?,
            block_tables: u(cap_bt)?,
            logits_rows: u(cap)?,
        })
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
        self.check(b)?;
        let t = b.tokens.len();
        let rows = b.logits_rows.len();
        // A chunk of a longer prompt may want no logits, but its K/V must be written.
        if t == 0 {
            return Ok(Vec::new());
        }
        let vocab = self.config.vocab_size as usize;
        let max_table = b
            .seqs
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(1);
        // A pure decode step (one token per sequence, logits for each in order) that a
        // graph bucket covers replays it.
        let decode = t == b.seqs.len()
            && rows == t
            && b.seq_of.iter().enumerate().all(|(i, &s)| s as usize == i)
            && b.logits_rows
                .iter()
                .enumerate()
                .all(|(i, &r)| r as usize == i)
            && max_table <= self.graph_bt_stride;
        let bucket = GRAPH_BUCKETS
            .iter()
            .copied()
            .find(|&g| g >= t && g <= self.s.cap_tokens);
        if decode
            && self.use_graphs
            && let Some(g) = bucket
            && !self.graphs.contains_key(&g)
        {
            self.capture(g)?;
        }
        if decode && let Some(g) = bucket.filter(|g| self.graphs.contains_key(g)) {
            self.stage_inputs(b, g, self.graph_bt_stride)?;
            self.graphs[&g].0.launch().map_err(dev)?;
            let out = self
                .stream
                .clone_dtoh(&self.s.logits.slice(..rows * vocab))
                .map_err(dev)?;
            return Ok(out);
        }
        // Anything else: direct launches, growing the scratch when the batch is larger
        // than it (graphs captured over the old buffers are dropped).
        let bt_stride = max_table.max(1);
        if t > self.s.cap_tokens || b.seqs.len() * bt_stride > self.s.cap_bt {
            self.stream.synchronize().map_err(dev)?;
            self.graphs.clear();
            let cap = t.max(self.s.cap_tokens);
            let cap_bt = (b.seqs.len() * bt_stride).max(self.s.cap_bt);
            self.s = Scratch::new(&self.stream, &self.config, cap, cap_bt)?;
            tracing::info!(cap, "GPU activations grown; decode graphs dropped");
        }
        self.stage_inputs(b, t, bt_stride)?;
        self.launch_forward(t, rows, bt_stride)?;
        if rows == 0 {
            self.stream.synchronize().map_err(dev)?;
            return Ok(Vec::new());
        }
        self.stream
            .clone_dtoh(&self.s.logits.slice(..rows * vocab))
            .map_err(dev)
    }

    fn export_kv(&self, blocks: &[BlockId], out: &mut Vec<u8>) {
        let before = out.len();
        if let Err(e) = self.export_kv_pinned(blocks, out) {
            // The trait cannot fail here: nothing is appended, and the receiver's size
            // check refuses the short transfer, so the request fails, not silently.
            out.truncate(before);
            tracing::error!(error = %e, "KV export from the GPU failed");
        }
    }

    fn import_kv(&mut self, blocks: &[BlockId], data: &[u8]) -> Result<()> {
        let n = self.layout.block_elems();
        let items = super::kv_import_items(&self.layout, blocks, data)?;
        let total = data.len() / 4;
        let slot = self
            .kv_pinned
            .get_mut()
            .map_err(|_| EngineError::Internal("KV staging lock poisoned".into()))?
            .take();
        let mut pinned = pinned_at_least(&self.ctx, slot, total)?;
        let buf = pinned.as_mut_slice().map_err(dev)?;
        // Unaligned input: copied through bytes into the pinned floats.
        bytemuck::cast_slice_mut::<f32, u8>(&mut buf[..total]).copy_from_slice(data);
        for (i, (layer, b, _, _)) in items.enumerate() {
            let r = b as usize * n..(b as usize + 1) * n;
            let src = &buf[2 * i * n..(2 * i + 2) * n];
            self.stream
                .memcpy_htod(&src[..n], &mut self.k_cache[layer].slice_mut(r.clone()))
                .map_err(dev)?;
            self.stream
                .memcpy_htod(&src[n..], &mut self.v_cache[layer].slice_mut(r))
                .map_err(dev)?;
        }
        // The staging buffer is reused by the next transfer: these copies land first.
        self.stream.synchronize().map_err(dev)?;
        if let Ok(g) = self.kv_pinned.get_mut() {
            *g = Some(pinned);
        }
        Ok(())
    }
}
