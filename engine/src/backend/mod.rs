//! The compute seam: a backend runs the model over a batch of tokens against the paged
//! KV cache it stores. Tensor names and the KV layout (see [`crate::kv`]) are
//! backend-neutral, so the CPU backend here and a GPU backend are interchangeable.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::Result;
use crate::kv::BlockId;
use preheat_snapshot::ModelConfig;

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
    fn config(&self) -> &ModelConfig;
    fn kv_layout(&self) -> KvLayout;
    /// Runs the model: writes every token's K/V into its slot, then returns the logits
    /// of `logits_rows` (row-major, `logits_rows.len() × vocab_size`).
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>>;
    /// Identifies the weights (two backends with equal fingerprints and layouts produce
    /// interchangeable K/V).
    fn weights_fingerprint(&self) -> u64;
    /// Appends `blocks`' K/V to `out`: for each layer, for each block, K then V, in
    /// the layout of [`crate::kv`] (f32 little-endian).
    fn export_kv(&self, blocks: &[BlockId], out: &mut Vec<u8>);
    /// Writes K/V laid out as [`Backend::export_kv`] produces into `blocks`.
    fn import_kv(&mut self, blocks: &[BlockId], data: &[u8]) -> Result<()>;
}
