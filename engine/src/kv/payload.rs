//! A sequence's K/V as it leaves or enters an engine: how its payload is shaped and
//! sized, which engines may take it (the compatibility hash), and the buffers payloads
//! are received into. The message that carries it between processes is
//! [`crate::disagg::wire::kv_message`].

use crate::backend::KvLayout;

/// The K/V transfer format's version, part of every compatibility hash: bumped
/// whenever the K/V message's header or the payload layout changes.
/// 2: sampling parameters carry the penalties, `logit_bias` and `min_tokens` (a
/// version-1 peer would drop them without a word).
/// 3: sampling parameters carry the grammar (structured outputs).
pub const FORMAT_VERSION: u32 = 3;

/// Identifies what K/V a backend produces: a receiver accepts only its own hash.
#[must_use]
pub fn compat_hash(weights_fingerprint: u64, layout: &KvLayout) -> String {
    let s = format!(
        "v{FORMAT_VERSION}|w{weights_fingerprint:016x}|f32|l{}|kv{}|d{}|b{}",
        layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
    );
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(s.as_bytes()))
}

/// Bytes of one block of one layer (K and V) in `layout`.
#[must_use]
pub fn block_bytes(layout: &KvLayout) -> u64 {
    (layout.block_elems() * 2 * std::mem::size_of::<f32>()) as u64
}

/// How a payload is laid out: `num_layers × num_blocks × (K block, V block)` in the
/// layout of [`crate::kv`] (f32 little-endian), `block_bytes` per K+V pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayloadShape {
    pub num_layers: u32,
    pub num_blocks: u32,
    /// Bytes of one block of one layer, K and V together.
    pub block_bytes: u64,
}

impl PayloadShape {
    /// The shape of `blocks` blocks of `layout`.
    #[must_use]
    pub fn of(layout: &KvLayout, blocks: usize) -> Self {
        PayloadShape {
            num_layers: layout.num_layers as u32,
            num_blocks: blocks as u32,
            block_bytes: block_bytes(layout),
        }
    }

    /// Bytes of a payload of this shape (`None`: it overflows).
    #[must_use]
    pub fn bytes(&self) -> Option<u64> {
        u64::from(self.num_layers)
            .checked_mul(u64::from(self.num_blocks))?
            .checked_mul(self.block_bytes)
    }

    /// Checks the shape against a receiver's `layout` and a prompt of `prompt_len`
    /// tokens with `hashes` full-block hashes, and that its payload is no larger than
    /// `max_payload`: the bytes the payload must hold, or why it cannot be taken.
    pub fn check(
        &self,
        prompt_len: usize,
        hashes: usize,
        layout: &KvLayout,
        max_payload: u64,
    ) -> Result<u64, ShapeError> {
        let bs = layout.block_size;
        if prompt_len == 0 {
            return Err(ShapeError::Shape("empty prompt".into()));
        }
        if self.num_blocks as usize != prompt_len.div_ceil(bs) || hashes != prompt_len / bs {
            return Err(ShapeError::Shape(format!(
                "{prompt_len} tokens need {} blocks ({} full), header says {} ({hashes} hashes)",
                prompt_len.div_ceil(bs),
                prompt_len / bs,
                self.num_blocks,
            )));
        }
        if self.num_layers as usize != layout.num_layers || self.block_bytes != block_bytes(layout)
        {
            return Err(ShapeError::Shape(format!(
                "{} layers × {} bytes per block, expected {} × {}",
                self.num_layers,
                self.block_bytes,
                layout.num_layers,
                block_bytes(layout)
            )));
        }
        let n = self
            .bytes()
            .ok_or_else(|| ShapeError::Shape("payload size overflows".into()))?;
        if n > max_payload {
            return Err(ShapeError::TooLarge(format!(
                "{n} bytes exceed the receiver's limit of {max_payload}"
            )));
        }
        Ok(n)
    }
}

/// Why a payload's shape was refused.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    /// Its numbers do not fit the prompt or the receiver's layout.
    #[error("{0}")]
    Shape(String),
    /// It is larger than the receiver takes.
    #[error("{0}")]
    TooLarge(String),
}

/// Receive buffers kept for reuse: a large payload landing in memory already touched
/// skips a page fault per 4 KiB page. Holds a few buffers at most.
#[derive(Clone, Debug, Default)]
pub struct BufferPool(std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>);

impl BufferPool {
    const KEEP: usize = 2;

    /// A buffer to receive into (empty; capacity from an earlier use if any).
    #[must_use]
    pub fn take(&self) -> Vec<u8> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop()
            .unwrap_or_default()
    }

    /// Returns a buffer once its contents are no longer needed.
    pub fn give(&self, mut buf: Vec<u8>) {
        buf.clear();
        let mut v = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if v.len() < Self::KEEP && buf.capacity() > 0 {
            v.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_pool_keeps_a_few_buffers_with_their_memory() {
        let pool = BufferPool::default();
        assert_eq!(pool.take().capacity(), 0);
        for _ in 0..3 {
            pool.give(Vec::with_capacity(1024));
        }
        let a = pool.take();
        assert!(a.is_empty() && a.capacity() >= 1024);
        let _b = pool.take();
        assert_eq!(pool.take().capacity(), 0, "at most two kept");
    }

    #[test]
    fn a_shape_must_fit_the_prompt_and_the_layout() {
        let l = KvLayout {
            num_layers: 2,
            num_blocks: 8,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let s = PayloadShape::of(&l, 2);
        assert_eq!(s.check(6, 1, &l, 1 << 20).unwrap(), 2 * 2 * block_bytes(&l));
        assert!(
            s.check(6, 1, &l, 10)
                .unwrap_err()
                .to_string()
                .contains("limit")
        );
        assert!(
            s.check(9, 2, &l, 1 << 20).is_err(),
            "9 tokens need 3 blocks"
        );
        assert!(s.check(0, 0, &l, 1 << 20).is_err());
        let other = KvLayout { head_dim: 4, ..l };
        assert!(s.check(6, 1, &other, 1 << 20).is_err());
    }
}
