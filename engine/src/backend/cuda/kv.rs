//! K/V in and out of the GPU's paged cache for transfers: batched asynchronous copies
//! through one pinned staging buffer, grown to the largest transfer.

use std::sync::Arc;

use cudarc::driver::{CudaContext, PinnedHostSlice};

use super::{CudaBackend, dev};
use crate::kv::BlockId;
use crate::{EngineError, Result};

impl CudaBackend {
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
    pub(super) fn export_kv_pinned(&self, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<()> {
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

    /// Writes transferred K/V into `blocks` through the pinned staging buffer.
    pub(super) fn import_kv_pinned(&mut self, blocks: &[BlockId], data: &[u8]) -> Result<()> {
        let n = self.layout.block_elems();
        let items = crate::backend::kv_import_items(&self.layout, blocks, data)?;
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
