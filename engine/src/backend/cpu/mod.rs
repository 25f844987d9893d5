//! The CPU backend: f32 compute over f32/f16/bf16 weights mapped from a snapshot,
//! with the paged KV cache in f32.

pub mod matmul;
pub mod ops;
mod pool;

use std::sync::Arc;

use preheat_snapshot::{ModelConfig, Snapshot};
use rayon::prelude::*;

use self::matmul::{axpy, dot, linear};
pub use self::pool::compute_pool;
use preheat_snapshot::tensors::{self, LayerTensors, Named};

use super::weights::Weight;
use super::{Backend, Dims, ForwardBatch, KvLayout};
use crate::Result;
use crate::kv::BlockId;

#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: Weight,
    k: Weight,
    v: Weight,
    o: Weight,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    gate: Weight,
    up: Weight,
    down: Weight,
}

/// A Llama-family model on the CPU.
#[derive(Debug)]
pub struct CpuBackend {
    config: ModelConfig,
    fingerprint: u64,
    layout: KvLayout,
    embed: Weight,
    lm_head: Weight,
    final_norm: Vec<f32>,
    layers: Vec<Layer>,
    inv_freq: Vec<f32>,
    /// Per layer: K then V, each `num_blocks × block_elems`.
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
}

impl CpuBackend {
    /// Builds the model over `snap` (weights stay in the mapping) with a KV cache of
    /// `num_blocks` blocks of `block_size` tokens.
    pub fn new(snap: Arc<Snapshot>, num_blocks: usize, block_size: usize) -> Result<Self> {
        let c = snap.manifest().model.clone();
        let Dims {
            kv_heads: nkv,
            head_dim: hd,
            ..
        } = Dims::of(&c);
        let w = |t: &Named| Weight::load_named(&snap, t);
        let bias = |t: &Named| -> Result<Option<Vec<f32>>> {
            Ok(Weight::load_bias(&snap, &c, t)?.map(|b| b.to_f32_vec()))
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers as usize);
        for l in 0..c.num_hidden_layers {
            let t = LayerTensors::of(&c, l);
            layers.push(Layer {
                input_norm: w(&t.input_norm)?.to_f32_vec(),
                post_norm: w(&t.post_norm)?.to_f32_vec(),
                q: w(&t.q)?,
                k: w(&t.k)?,
                v: w(&t.v)?,
                o: w(&t.o)?,
                q_bias: bias(&t.q_bias)?,
                k_bias: bias(&t.k_bias)?,
                v_bias: bias(&t.v_bias)?,
                gate: w(&t.gate)?,
                up: w(&t.up)?,
                down: w(&t.down)?,
            });
        }
        let embed = w(&tensors::embed(&c))?;
        let lm_head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            w(&tensors::lm_head(&c))?
        };
        let layout = KvLayout {
            num_layers: layers.len(),
            num_blocks,
            block_size,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        let cache_len = num_blocks * layout.block_elems();
        let fingerprint = super::weights_fingerprint(snap.manifest());
        Ok(CpuBackend {
            fingerprint,
            inv_freq: super::rope::inv_freq(&c),
            final_norm: w(&tensors::final_norm(&c))?.to_f32_vec(),
            k_cache: (0..layers.len()).map(|_| vec![0f32; cache_len]).collect(),
            v_cache: (0..layers.len()).map(|_| vec![0f32; cache_len]).collect(),
            config: c,
            layout,
            embed,
            lm_head,
            layers,
        })
    }

    /// Bytes of one KV block (K and V, every layer, f32) for `config`: what a KV-cache
    /// memory budget is divided by.
    #[must_use]
    pub fn kv_block_bytes(config: &ModelConfig, block_size: usize) -> usize {
        2 * config.num_hidden_layers as usize
            * block_size
            * config.num_key_value_heads as usize
            * config.head_dim as usize
            * std::mem::size_of::<f32>()
    }

    /// Bytes of weights one decode step reads (every matrix once; the embedding table
    /// only through the LM head).
    #[must_use]
    pub fn weight_bytes_per_step(&self) -> u64 {
        let lw = |w: &Weight| w.bytes().len() as u64;
        self.layers
            .iter()
            .map(|l| {
                lw(&l.q) + lw(&l.k) + lw(&l.v) + lw(&l.o) + lw(&l.gate) + lw(&l.up) + lw(&l.down)
            })
            .sum::<u64>()
            + lw(&self.lm_head)
    }

    /// Raw K and V of one block of one layer (for the KV transfer).
    #[must_use]
    pub fn block(&self, layer: usize, block: usize) -> (&[f32], &[f32]) {
        let n = self.layout.block_elems();
        (
            &self.k_cache[layer][block * n..(block + 1) * n],
            &self.v_cache[layer][block * n..(block + 1) * n],
        )
    }

    /// Overwrites one block of one layer (for the KV transfer).
    pub fn set_block(&mut self, layer: usize, block: usize, k: &[f32], v: &[f32]) {
        let n = self.layout.block_elems();
        self.k_cache[layer][block * n..(block + 1) * n].copy_from_slice(k);
        self.v_cache[layer][block * n..(block + 1) * n].copy_from_slice(v);
    }

    fn check(&self, b: &ForwardBatch<'_>) -> Result<()> {
        super::check_batch(b, &self.layout, self.config.vocab_size)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn uses_cpu_threads(&self) -> bool {
        true
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

    fn export_kv(&self, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<()> {
        let n = self.layout.block_elems();
        out.reserve(self.layout.num_layers * blocks.len() * n * 8);
        for layer in 0..self.layout.num_layers {
            for &b in blocks {
                let (k, v) = self.block(layer, b as usize);
                out.extend_from_slice(bytemuck::cast_slice(k));
                out.extend_from_slice(bytemuck::cast_slice(v));
            }
        }
        Ok(())
    }

    fn import_kv(&mut self, blocks: &[BlockId], data: &[u8]) -> Result<()> {
        let n = self.layout.block_elems();
        // Unaligned input: copy through bytes rather than casting in place.
        let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
        for (layer, b, kb, vb) in super::kv_import_items(&self.layout, blocks, data)? {
            bytemuck::cast_slice_mut::<f32, u8>(&mut k).copy_from_slice(kb);
            bytemuck::cast_slice_mut::<f32, u8>(&mut v).copy_from_slice(vb);
            self.set_block(layer, b as usize, &k, &v);
        }
        Ok(())
    }

    fn forward(&mut self, b: &ForwardBatch<'_>) -> Result<Vec<f32>> {
        self.check(b)?;
        let c = &self.config;
        let t = b.tokens.len();
        let Dims {
            hidden: h,
            ffn: ff,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            ..
        } = Dims::of(c);
        let eps = c.rms_norm_eps as f32;
        let bs = self.layout.block_size;
        let slot_elems = nkv * hd;

        let mut x = vec![0f32; t * h];
        for (row, &tok) in x.chunks_exact_mut(h).zip(b.tokens) {
            self.embed.rows_to_f32(tok as usize, tok as usize + 1, row);
        }
        let mut hn = vec![0f32; t * h];
        let mut q = vec![0f32; t * nh * hd];
        let mut k = vec![0f32; t * nkv * hd];
        let mut v = vec![0f32; t * nkv * hd];
        let mut attn = vec![0f32; t * nh * hd];
        let mut o = vec![0f32; t * h];
        let mut gate = vec![0f32; t * ff];
        let mut up = vec![0f32; t * ff];
        let slot = |i: usize| {
            let p = b.positions[i] as usize;
            b.seqs[b.seq_of[i] as usize].block_table[p / bs] as usize * bs + p % bs
        };
        for (li, layer) in self.layers.iter().enumerate() {
            ops::rms_norm(&x, &layer.input_norm, eps, &mut hn);
            linear(&hn, t, &layer.q, &mut q);
            linear(&hn, t, &layer.k, &mut k);
            linear(&hn, t, &layer.v, &mut v);
            for (out, bias) in [
                (&mut q, &layer.q_bias),
                (&mut k, &layer.k_bias),
                (&mut v, &layer.v_bias),
            ] {
                if let Some(bias) = bias {
                    for row in out.chunks_exact_mut(bias.len()) {
                        for (r, bv) in row.iter_mut().zip(bias) {
                            *r += bv;
                        }
                    }
                }
            }
            ops::rope(&mut q, b.positions, nh, &self.inv_freq);
            ops::rope(&mut k, b.positions, nkv, &self.inv_freq);
            let (kc, vc) = (&mut self.k_cache[li], &mut self.v_cache[li]);
            for i in 0..t {
                let s = slot(i) * slot_elems;
                kc[s..s + slot_elems].copy_from_slice(&k[i * slot_elems..(i + 1) * slot_elems]);
                vc[s..s + slot_elems].copy_from_slice(&v[i * slot_elems..(i + 1) * slot_elems]);
            }
            let (kc, vc) = (&self.k_cache[li], &self.v_cache[li]);
            let scale = 1.0 / (hd as f32).sqrt();
            let group = nh / nkv;
            // One task per (token, head): causal attention over the token's own
            // sequence, positions 0..=p, read through its block table.
            attn.par_chunks_mut(hd).enumerate().for_each(|(idx, out)| {
                let (i, head) = (idx / nh, idx % nh);
                let g = head / group;
                let p = b.positions[i] as usize;
                let table = b.seqs[b.seq_of[i] as usize].block_table;
                let qh = &q[(i * nh + head) * hd..(i * nh + head + 1) * hd];
                let mut scores = Vec::with_capacity(p + 1);
                for j in 0..=p {
                    let s = (table[j / bs] as usize * bs + j % bs) * slot_elems + g * hd;
                    scores.push(dot(qh, &kc[s..s + hd]) * scale);
                }
                ops::softmax(&mut scores);
                out.fill(0.0);
                for (j, wgt) in scores.iter().enumerate() {
                    let s = (table[j / bs] as usize * bs + j % bs) * slot_elems + g * hd;
                    axpy(*wgt, &vc[s..s + hd], out);
                }
            });
            linear(&attn, t, &layer.o, &mut o);
            for (xv, ov) in x.iter_mut().zip(&o) {
                *xv += ov;
            }
            ops::rms_norm(&x, &layer.post_norm, eps, &mut hn);
            linear(&hn, t, &layer.gate, &mut gate);
            linear(&hn, t, &layer.up, &mut up);
            ops::silu_mul(&mut gate, &up);
            linear(&gate, t, &layer.down, &mut o);
            for (xv, ov) in x.iter_mut().zip(&o) {
                *xv += ov;
            }
        }
        let rows = b.logits_rows.len();
        let mut sel = vec![0f32; rows * h];
        for (dst, &r) in sel.chunks_exact_mut(h).zip(b.logits_rows) {
            dst.copy_from_slice(&x[r as usize * h..(r as usize + 1) * h]);
        }
        let mut normed = vec![0f32; rows * h];
        ops::rms_norm(&sel, &self.final_norm, eps, &mut normed);
        let mut logits = vec![0f32; rows * c.vocab_size as usize];
        linear(&normed, rows, &self.lm_head, &mut logits);
        Ok(logits)
    }
}
