//! The compute seam: a backend runs the model over a batch of tokens against the paged
//! KV cache it stores. Tensor names and the KV layout (see [`crate::kv`]) are
//! backend-neutral, so the CPU backend here and a GPU backend are interchangeable.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod rope;
pub mod weights;

use crate::kv::BlockId;
use crate::{EngineError, Result};
use preheat_snapshot::ModelConfig;

/// The weights' identity for KV compatibility: every tensor's name and digest, from the
/// manifest (no tensor bytes are read), so a gateway holding only a model card computes
/// what a loaded worker reports.
#[must_use]
pub fn weights_fingerprint(manifest: &preheat_snapshot::Manifest) -> u64 {
    let mut ident = String::new();
    for t in &manifest.tensors {
        ident.push_str(&t.name);
        ident.push('=');
        ident.push_str(&serde_json::to_string(&t.checksum).unwrap_or_default());
        ident.push(';');
    }
    xxhash_rust::xxh3::xxh3_64(ident.as_bytes())
}

/// A model's sizes as backends index with them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
}

impl Dims {
    #[must_use]
    pub fn of(c: &ModelConfig) -> Self {
        Dims {
            hidden: c.hidden_size as usize,
            ffn: c.intermediate_size as usize,
            heads: c.num_attention_heads as usize,
            kv_heads: c.num_key_value_heads as usize,
            head_dim: c.head_dim as usize,
            vocab: c.vocab_size as usize,
        }
    }
}

/// Shape of the KV cache a backend holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements of one block of one layer's K (or V).
    #[must_use]
    pub fn block_elems(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim
    }
}

/// One sequence's part of a batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqSlice<'a> {
    /// The sequence's blocks, in position order; must cover every position in the batch.
    pub block_table: &'a [BlockId],
}

/// A flattened batch: tokens of several sequences, each at its own position.
#[derive(Clone, Copy, Debug)]
pub struct ForwardBatch<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// Index into `seqs` for every token.
    pub seq_of: &'a [u32],
    pub seqs: &'a [SeqSlice<'a>],
    /// Token rows whose next-token logits are wanted, in output order.
    pub logits_rows: &'a [u32],
}

/// A model on some device, with its KV cache.
pub trait Backend: Send {
    fn name(&self) -> &'static str;
    /// Whether its compute runs as rayon kernels on this host's cores (the engine then
    /// gives it a pool of compute threads; otherwise the loop's own thread is enough).
    fn uses_cpu_threads(&self) -> bool {
        false
    }
    fn config(&self) -> &ModelConfig;
    fn kv_layout(&self) -> KvLayout;
    /// Runs the model: writes every token's K/V into its slot, then returns the logits
    /// of `logits_rows` (row-major, `logits_rows.len() × vocab_size`).
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>>;
    /// Identifies the weights (two backends with equal fingerprints and layouts produce
    /// interchangeable K/V).
    fn weights_fingerprint(&self) -> u64;
    /// Appends `blocks`' K/V to `out`: for each layer, for each block, K then V, in
    /// the layout of [`crate::kv`] (f32 little-endian). On failure nothing is
    /// appended.
    fn export_kv(&self, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<()>;
    /// Writes K/V laid out as [`Backend::export_kv`] produces into `blocks`.
    fn import_kv(&mut self, blocks: &[BlockId], data: &[u8]) -> Result<()>;
}

/// Checks a batch against a backend's KV layout and vocabulary: equal lengths, known
/// sequences, block tables covering every position, ids and rows in range. Every
/// backend runs it first, so a bad batch is an error, never an out-of-bounds access.
pub fn check_batch(b: &ForwardBatch<'_>, layout: &KvLayout, vocab_size: u64) -> Result<()> {
    let t = b.tokens.len();
    if b.positions.len() != t || b.seq_of.len() != t {
        return Err(EngineError::Internal(
            "batch arrays differ in length".into(),
        ));
    }
    let bs = layout.block_size;
    for i in 0..t {
        let s = b
            .seqs
            .get(b.seq_of[i] as usize)
            .ok_or_else(|| EngineError::Internal("bad seq index".into()))?;
        let need = b.positions[i] as usize / bs + 1;
        if s.block_table.len() < need {
            return Err(EngineError::Internal(format!(
                "block table too short for position {}",
                b.positions[i]
            )));
        }
        if b.tokens[i] as u64 >= vocab_size {
            return Err(EngineError::Internal(format!(
                "token {} out of vocabulary",
                b.tokens[i]
            )));
        }
    }
    if b.seqs.iter().any(|s| {
        s.block_table
            .iter()
            .any(|&blk| blk as usize >= layout.num_blocks)
    }) {
        return Err(EngineError::Internal("block id out of range".into()));
    }
    if b.logits_rows.iter().any(|&r| r as usize >= t) {
        return Err(EngineError::Internal("logits row out of range".into()));
    }
    Ok(())
}

/// The (layer, block, K bytes, V bytes) items of a K/V import laid out as
/// [`Backend::export_kv`] writes it, after checking its size and block ids.
pub fn kv_import_items<'a>(
    layout: &KvLayout,
    blocks: &'a [BlockId],
    data: &'a [u8],
) -> Result<impl Iterator<Item = (usize, BlockId, &'a [u8], &'a [u8])> + 'a> {
    let per = layout.block_elems() * 4;
    let want = layout.num_layers * blocks.len() * 2 * per;
    if data.len() != want {
        return Err(EngineError::Internal(format!(
            "KV import of {} bytes, expected {want}",
            data.len()
        )));
    }
    if let Some(b) = blocks.iter().find(|&&b| b as usize >= layout.num_blocks) {
        return Err(EngineError::Internal(format!("KV import into block {b}")));
    }
    let layers = layout.num_layers;
    Ok((0..layers)
        .flat_map(move |l| blocks.iter().map(move |&b| (l, b)))
        .zip(data.chunks_exact(2 * per))
        .map(move |((l, b), kv)| (l, b, &kv[..per], &kv[per..])))
}
