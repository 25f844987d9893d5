//! The forward pass on the GPU: batch inputs staged into fixed scratch buffers, then
//! every layer launched (GEMMs on cuBLAS, the rest through the typed kernels) with no
//! host work in between, so a decode step can be captured into a graph.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use preheat_snapshot::{DType, ModelConfig};

use super::kernels::Kernels;
use super::{CudaBackend, GRAPH_BUCKETS, dev, gemm};
use crate::Result;
use crate::backend::{Dims, ForwardBatch};

/// Activations and batch inputs, at fixed addresses so graphs can replay over them.
#[derive(Debug)]
pub(super) struct Scratch {
    pub(super) cap_tokens: usize,
    pub(super) cap_bt: usize,
    pub(super) x: CudaSlice<f32>,
    pub(super) hn: CudaSlice<f32>,
    pub(super) narrow: CudaSlice<u16>,
    pub(super) q: CudaSlice<f32>,
    pub(super) k: CudaSlice<f32>,
    pub(super) v: CudaSlice<f32>,
    pub(super) attn: CudaSlice<f32>,
    pub(super) o: CudaSlice<f32>,
    pub(super) gate: CudaSlice<f32>,
    pub(super) up: CudaSlice<f32>,
    pub(super) sel: CudaSlice<f32>,
    pub(super) normed: CudaSlice<f32>,
    pub(super) logits: CudaSlice<f32>,
    pub(super) tokens: CudaSlice<u32>,
    pub(super) positions: CudaSlice<u32>,
    pub(super) seq_of: CudaSlice<u32>,
    pub(super) block_tables: CudaSlice<u32>,
    pub(super) logits_rows: CudaSlice<u32>,
}

impl Scratch {
    pub(super) fn new(
        st: &Arc<CudaStream>,
        c: &ModelConfig,
        cap: usize,
        cap_bt: usize,
    ) -> Result<Self> {
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

impl CudaBackend {
    /// A forward pass: a decode step a graph bucket covers replays its graph; anything
    /// else launches directly.
    pub(super) fn run_forward(&mut self, b: &ForwardBatch<'_>) -> Result<Vec<f32>> {
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

    /// Copies a batch's inputs into the scratch buffers, padded to `pad_to` rows, with
    /// `bt_stride` block-table entries per sequence.
    pub(super) fn stage_inputs(
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
    pub(super) fn launch_forward(
        &mut self,
        t: usize,
        n_logits: usize,
        bt_stride: usize,
    ) -> Result<()> {
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

        let w = &self.w;
        let embed = match w.embed.dtype {
            DType::F32 => Kernels::embed_f32,
            DType::F16 => Kernels::embed_f16,
            DType::BF16 => Kernels::embed_bf16,
        };
        // SAFETY: tokens were checked against the vocabulary (`check_batch`), so every table row read exists; x holds cap_tokens ≥ t rows of h.
        unsafe {
            embed(
                k,
                &st,
                rows(t, 256),
                &w.embed.data,
                &s.tokens,
                &mut s.x,
                &h_i,
            )
        }?;
        let narrow = |st: &CudaStream,
                      x: &CudaSlice<f32>,
                      out: &mut CudaSlice<u16>,
                      n: usize,
                      dt: DType|
         -> Result<()> {
            let narrow = match dt {
                DType::BF16 => Kernels::f32_to_bf16,
                DType::F16 => Kernels::f32_to_f16,
                DType::F32 => return Ok(()),
            };
            let n_i = n as i32;
            // SAFETY: `out` (the widest activation × cap_tokens elements) holds n, `x` n.
            unsafe { narrow(k, st, flat(n), x, out, &n_i) }
        };
        for (li, layer) in w.layers.iter().enumerate() {
            // SAFETY: input and output hold the grid's rows of h (scratch rows ≥ t ≥ n_logits), the weight h.
            unsafe {
                k.rms_norm(
                    &st,
                    rows(t, 256),
                    &s.x,
                    &layer.input_norm,
                    &mut s.hn,
                    &h_i,
                    &eps,
                )
            }?;
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
                    // SAFETY: q/k/v hold t rows of the bias's n elements.
                    unsafe { k.add_bias(&st, rows(t, 256), out, b, &n_i) }?;
                }
            }
            for (x, heads) in [(&mut s.q, nh_i), (&mut s.k, nkv_i)] {
                let cfg = LaunchConfig {
                    grid_dim: (t as u32, heads as u32, 1),
                    block_dim: ((hd / 2) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: x holds t rows of `heads` × hd; positions t entries; inv_freq hd / 2.
                unsafe { k.rope(&st, cfg, x, &s.positions, &w.inv_freq, &heads, &hd_i) }?;
            }
            let (kc, vc) = (&mut self.k_cache[li], &mut self.v_cache[li]);
            // SAFETY: k and v hold t slots; positions, seq_of and the block tables were checked (`check_batch`) to address blocks of this cache, whose extra last block takes padding rows.
            unsafe {
                k.kv_write(
                    &st,
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
                    &slot_i,
                )
            }?;
            let threads = 128u32;
            let attn_cfg = LaunchConfig {
                grid_dim: (t as u32, nh as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: ((hd + threads as usize + 32) * 4) as u32,
            };
            // SAFETY: as for kv_write; attn holds t rows of nh × hd, and the dynamic shared memory is what the kernel asks for.
            unsafe {
                k.paged_attention(
                    &st,
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
                    &scale,
                )
            }?;
            narrow(&st, &s.attn, &mut s.narrow, t * nh * hd, layer.o.dtype)?;
            gemm::linear(&self.blas, &st, &s.attn, &s.narrow, t, &layer.o, &mut s.o)?;
            let n_i = (t * h) as i32;
            // SAFETY: both hold t rows of h.
            unsafe { k.add_inplace(&st, flat(t * h), &mut s.x, &s.o, &n_i) }?;
            // SAFETY: input and output hold the grid's rows of h (scratch rows ≥ t ≥ n_logits), the weight h.
            unsafe {
                k.rms_norm(
                    &st,
                    rows(t, 256),
                    &s.x,
                    &layer.post_norm,
                    &mut s.hn,
                    &h_i,
                    &eps,
                )
            }?;
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
            // SAFETY: gate and up hold t rows of ff.
            unsafe { k.silu_mul(&st, flat(t * ff), &mut s.gate, &s.up, &nf_i) }?;
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
            // SAFETY: both hold t rows of h.
            unsafe { k.add_inplace(&st, flat(t * h), &mut s.x, &s.o, &n_i) }?;
        }
        if n_logits == 0 {
            return Ok(());
        }
        // SAFETY: logits_rows holds n_logits row numbers, each < t (`check_batch`); sel holds cap_tokens ≥ n_logits rows.
        unsafe {
            k.gather_rows(
                &st,
                rows(n_logits, 256),
                &s.x,
                &s.logits_rows,
                &mut s.sel,
                &h_i,
            )
        }?;
        // SAFETY: input and output hold the grid's rows of h (scratch rows ≥ t ≥ n_logits), the weight h.
        unsafe {
            k.rms_norm(
                &st,
                rows(n_logits, 256),
                &s.sel,
                &w.final_norm,
                &mut s.normed,
                &h_i,
                &eps,
            )
        }?;
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
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
}
