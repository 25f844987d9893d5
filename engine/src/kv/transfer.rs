//! The KV transfer message: what a prefill worker hands a decode worker so the decode
//! side continues a sequence without recomputing its prompt.
//!
//! Wire format (one message per sequence; large contiguous writes, no per-token
//! messages):
//!
//! ```text
//! "PHKV" | u32 LE header length | header (JSON, ≤ 16 MiB) | payload
//! ```
//!
//! The payload is `num_layers × num_blocks × (K block, V block)` in the layout of
//! [`crate::kv`] (f32 little-endian), `block_bytes` per K+V pair; its XXH3 digest is in
//! the header. The header carries the request id, the compatibility hash (model
//! weights fingerprint, dtype, layers, KV heads, head dim, block size, format version),
//! the prompt tokens whose K/V are carried, their chained block hashes, the first
//! sampled token and the sampling state. A receiver refuses anything whose hash,
//! sizes or digest do not match, before touching its cache.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::backend::KvLayout;
use crate::kv::BlockHash;
use crate::sampling::SamplingParams;

pub const MAGIC: &[u8; 4] = b"PHKV";
/// Bumped whenever the header or payload layout changes.
/// 2: sampling parameters carry the penalties, `logit_bias` and `min_tokens` (a
/// version-1 peer would drop them without a word).
/// 3: sampling parameters carry the grammar (structured outputs).
pub const FORMAT_VERSION: u32 = 3;
pub const MAX_HEADER: usize = 16 << 20;

/// Why a message was refused.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("not a KV transfer message (bad magic)")]
    Magic,
    #[error("KV transfer header: {0}")]
    Header(String),
    #[error(
        "incompatible KV: sender {theirs}, receiver {ours} (another model, dtype or block layout)"
    )]
    Incompatible { ours: String, theirs: String },
    #[error("KV payload: {0}")]
    Payload(String),
    #[error("KV transfer I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Everything but the K/V bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvHeader {
    pub version: u32,
    pub request_id: String,
    /// [`compat_hash`] of the sender, 16 hex digits.
    pub compat: String,
    /// Tokens whose K/V are carried (positions `0..prompt.len()`).
    pub prompt: Vec<u32>,
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: Vec<BlockHash>,
    pub first_token: u32,
    pub first_logprob: Option<f32>,
    /// The first token's top alternatives, when the request asked for logprobs.
    #[serde(default)]
    pub first_top_logprobs: Vec<(u32, f32)>,
    pub params: SamplingParams,
    pub rng_state: u64,
    pub num_layers: u32,
    pub num_blocks: u32,
    /// Bytes of one block of one layer, K and V together.
    pub block_bytes: u64,
    pub payload_xxh3: String,
}

/// A header and its K/V bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct KvMessage {
    pub header: KvHeader,
    pub payload: Vec<u8>,
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

fn digest(payload: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(payload))
}

impl KvMessage {
    /// Builds a message, computing the payload digest.
    #[must_use]
    pub fn new(mut header: KvHeader, payload: Vec<u8>) -> Self {
        header.payload_xxh3 = digest(&payload);
        KvMessage { header, payload }
    }

    fn expected_payload(h: &KvHeader) -> Option<u64> {
        u64::from(h.num_layers)
            .checked_mul(u64::from(h.num_blocks))?
            .checked_mul(h.block_bytes)
    }

    /// Checks the header against the receiver's compatibility hash and layout, and
    /// that the payload it announces is no larger than `max_payload`.
    pub fn check_header(
        h: &KvHeader,
        compat: &str,
        layout: &KvLayout,
        max_payload: u64,
    ) -> Result<u64, TransferError> {
        if h.version != FORMAT_VERSION {
            return Err(TransferError::Header(format!(
                "format version {} (this build speaks {FORMAT_VERSION})",
                h.version
            )));
        }
        if h.compat != compat {
            return Err(TransferError::Incompatible {
                ours: compat.to_owned(),
                theirs: h.compat.clone(),
            });
        }
        let bs = layout.block_size;
        if h.prompt.is_empty() {
            return Err(TransferError::Header("empty prompt".into()));
        }
        if h.num_blocks as usize != h.prompt.len().div_ceil(bs)
            || h.block_hashes.len() != h.prompt.len() / bs
        {
            return Err(TransferError::Header(format!(
                "{} tokens need {} blocks ({} full), header says {} ({} hashes)",
                h.prompt.len(),
                h.prompt.len().div_ceil(bs),
                h.prompt.len() / bs,
                h.num_blocks,
                h.block_hashes.len()
            )));
        }
        if h.num_layers as usize != layout.num_layers || h.block_bytes != block_bytes(layout) {
            return Err(TransferError::Header(format!(
                "{} layers × {} bytes per block, expected {} × {}",
                h.num_layers,
                h.block_bytes,
                layout.num_layers,
                block_bytes(layout)
            )));
        }
        let n = Self::expected_payload(h)
            .ok_or_else(|| TransferError::Header("payload size overflows".into()))?;
        if n > max_payload {
            return Err(TransferError::Payload(format!(
                "{n} bytes exceed the receiver's limit of {max_payload}"
            )));
        }
        Ok(n)
    }

    /// Checks the payload against the header's size and digest.
    pub fn check_payload(&self) -> Result<(), TransferError> {
        let want = Self::expected_payload(&self.header).unwrap_or(u64::MAX);
        if self.payload.len() as u64 != want {
            return Err(TransferError::Payload(format!(
                "{} bytes, header announces {want}",
                self.payload.len()
            )));
        }
        let d = digest(&self.payload);
        if d != self.header.payload_xxh3 {
            return Err(TransferError::Payload(format!(
                "digest {d} does not match the header's {}",
                self.header.payload_xxh3
            )));
        }
        Ok(())
    }

    /// Writes the message: a small prefix and header, then the payload in one write.
    pub async fn write_to<W: AsyncWrite + Unpin>(&self, w: &mut W) -> Result<(), TransferError> {
        let header =
            serde_json::to_vec(&self.header).map_err(|e| TransferError::Header(e.to_string()))?;
        let len = u32::try_from(header.len())
            .ok()
            .filter(|&l| (l as usize) <= MAX_HEADER)
            .ok_or_else(|| TransferError::Header("header too large".into()))?;
        let mut prefix = Vec::with_capacity(8 + header.len());
        prefix.extend_from_slice(MAGIC);
        prefix.extend_from_slice(&len.to_le_bytes());
        prefix.extend_from_slice(&header);
        w.write_all(&prefix).await?;
        w.write_all(&self.payload).await?;
        w.flush().await?;
        Ok(())
    }

    /// Reads one message, validating the header (compatibility, sizes, `max_payload`)
    /// before reading the payload, and the payload's digest after.
    pub async fn read_from<R: AsyncRead + Unpin>(
        r: &mut R,
        compat: &str,
        layout: &KvLayout,
        max_payload: u64,
    ) -> Result<Self, TransferError> {
        Self::read_into(r, compat, layout, max_payload, Vec::new()).await
    }

    /// [`KvMessage::read_from`] into `buf`'s memory (a recycled, already-faulted buffer
    /// from a [`BufferPool`] saves the page faults of a fresh allocation).
    pub async fn read_into<R: AsyncRead + Unpin>(
        r: &mut R,
        compat: &str,
        layout: &KvLayout,
        max_payload: u64,
        mut buf: Vec<u8>,
    ) -> Result<Self, TransferError> {
        let mut prefix = [0u8; 8];
        r.read_exact(&mut prefix).await?;
        if &prefix[..4] != MAGIC {
            return Err(TransferError::Magic);
        }
        let len = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as usize;
        if len > MAX_HEADER {
            return Err(TransferError::Header(format!("{len} bytes of header")));
        }
        let mut hbytes = vec![0u8; len];
        r.read_exact(&mut hbytes).await?;
        let header: KvHeader =
            serde_json::from_slice(&hbytes).map_err(|e| TransferError::Header(e.to_string()))?;
        let n = Self::check_header(&header, compat, layout, max_payload)?;
        let n = usize::try_from(n).map_err(|_| TransferError::Payload("too large".into()))?;
        // Read into uninitialised capacity and hash each piece while it is hot in
        // cache, instead of zero-filling, reading, then hashing in a second pass.
        buf.clear();
        buf.reserve(n);
        let mut payload = buf;
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut limited = r.take(n as u64);
        loop {
            let before = payload.len();
            if limited.read_buf(&mut payload).await? == 0 {
                break;
            }
            hasher.update(&payload[before..]);
        }
        if payload.len() != n {
            return Err(TransferError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let d = format!("{:016x}", hasher.digest());
        if d != header.payload_xxh3 {
            return Err(TransferError::Payload(format!(
                "digest {d} does not match the header's {}",
                header.payload_xxh3
            )));
        }
        Ok(KvMessage { header, payload })
    }

    /// Parses a whole message already in memory (an HTTP body), checking it as
    /// [`KvMessage::read_from`] does; the buffer becomes the payload without a copy of
    /// its own size.
    pub fn from_vec(
        mut buf: Vec<u8>,
        compat: &str,
        layout: &KvLayout,
        max_payload: u64,
    ) -> Result<Self, TransferError> {
        if buf.len() < 8 || &buf[..4] != MAGIC {
            return Err(TransferError::Magic);
        }
        let len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
        if len > MAX_HEADER || buf.len() < 8 + len {
            return Err(TransferError::Header(format!("{len} bytes of header")));
        }
        let header: KvHeader = serde_json::from_slice(&buf[8..8 + len])
            .map_err(|e| TransferError::Header(e.to_string()))?;
        Self::check_header(&header, compat, layout, max_payload)?;
        buf.drain(..8 + len);
        let m = KvMessage {
            header,
            payload: buf,
        };
        m.check_payload()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_blocks: 8,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 2,
        }
    }

    fn message() -> KvMessage {
        let l = layout();
        let prompt: Vec<u32> = (0..6).collect();
        let header = KvHeader {
            version: FORMAT_VERSION,
            request_id: "r1".into(),
            compat: compat_hash(7, &l),
            block_hashes: crate::kv::PrefixKey::UNKEYED.block_hashes(&prompt, 4),
            prompt,
            first_token: 9,
            first_logprob: None,
            first_top_logprobs: Vec::new(),
            params: SamplingParams::default(),
            rng_state: 1,
            num_layers: 2,
            num_blocks: 2,
            block_bytes: block_bytes(&l),
            payload_xxh3: String::new(),
        };
        let n = (2 * 2 * block_bytes(&l)) as usize;
        KvMessage::new(header, (0..n).map(|i| i as u8).collect())
    }

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

    #[tokio::test]
    async fn round_trip() {
        let m = message();
        let mut buf = Vec::new();
        m.write_to(&mut buf).await.unwrap();
        let back = KvMessage::read_from(&mut buf.as_slice(), &m.header.compat, &layout(), 1 << 20)
            .await
            .unwrap();
        assert_eq!(back, m);
    }

    #[tokio::test]
    async fn every_corruption_is_refused_before_use() {
        let m = message();
        let mut good = Vec::new();
        m.write_to(&mut good).await.unwrap();
        let l = layout();
        let compat = m.header.compat.clone();
        let read = |bytes: Vec<u8>, compat: String, max: u64| async move {
            KvMessage::read_from(&mut bytes.as_slice(), &compat, &layout(), max)
                .await
                .unwrap_err()
                .to_string()
        };
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(
            read(flipped, compat.clone(), 1 << 20)
                .await
                .contains("digest")
        );
        let truncated = good[..good.len() - 3].to_vec();
        assert!(
            read(truncated, compat.clone(), 1 << 20)
                .await
                .contains("I/O")
        );
        assert!(
            read(b"NOPE\0\0\0\0".to_vec(), compat.clone(), 1 << 20)
                .await
                .contains("magic")
        );
        let other = compat_hash(8, &l);
        assert!(
            read(good.clone(), other, 1 << 20)
                .await
                .contains("incompatible")
        );
        assert!(
            read(good.clone(), compat.clone(), 10)
                .await
                .contains("limit")
        );
        let mut huge = good.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(read(huge, compat.clone(), 1 << 20).await.contains("header"));
        // A header lying about its block count.
        let mut h = m.header.clone();
        h.num_blocks = 3;
        let bad = KvMessage {
            header: h,
            payload: m.payload.clone(),
        };
        let mut buf = Vec::new();
        bad.write_to(&mut buf).await.unwrap();
        assert!(read(buf, compat, 1 << 20).await.contains("need 2 blocks"));
    }
}
