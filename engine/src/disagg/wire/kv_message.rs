//! The K/V message: an exported sequence ([`ExportedSequence`]) as it crosses from a
//! prefill worker to a decode worker, over either transport.
//!
//! Wire format (one message per sequence; large contiguous writes, no per-token
//! messages):
//!
//! ```text
//! "PHKV" | u32 LE header length | header (JSON, ≤ 16 MiB) | payload
//! ```
//!
//! The payload is the sequence's K/V as [`PayloadShape`] lays it out; its XXH3 digest
//! is in the header. The header carries the request id, the compatibility hash
//! ([`compat_hash`]: model weights fingerprint, dtype, layers, KV heads, head dim, block
//! size, format version), the prompt tokens whose K/V are carried, their chained block
//! hashes, the first sampled token and the sampling state. A receiver refuses anything
//! whose hash, sizes or digest do not match, before touching its cache.
//!
//! [`compat_hash`]: crate::kv::payload::compat_hash

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::backend::KvLayout;
use crate::engine::ExportedSequence;
use crate::kv::BlockHash;
use crate::kv::payload::{FORMAT_VERSION, PayloadShape, ShapeError};
use crate::sampling::SamplingParams;

pub const MAGIC: &[u8; 4] = b"PHKV";
pub const MAX_HEADER: usize = 16 << 20;
/// Most payload bytes one read takes: each piece is hashed right after it lands,
/// while it is still in the core's cache, instead of in a second pass from memory;
/// and a socket read this size hands the sender its window back sooner than one of
/// megabytes (`bench kv`: 128 KiB moved the most).
const READ_PIECE: usize = 128 << 10;
/// Most payload bytes one write gives the socket: the sender's copies and the
/// receiver's then interleave, where one write of the whole payload made them take
/// turns (`bench kv`).
const WRITE_PIECE: usize = 1 << 20;

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

impl From<ShapeError> for TransferError {
    fn from(e: ShapeError) -> Self {
        match e {
            ShapeError::Shape(m) => TransferError::Header(m),
            ShapeError::TooLarge(m) => TransferError::Payload(m),
        }
    }
}

/// Everything but the K/V bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvHeader {
    pub version: u32,
    pub request_id: String,
    /// [`compat_hash`] of the sender, 16 hex digits.
    ///
    /// [`compat_hash`]: crate::kv::payload::compat_hash
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

impl KvHeader {
    fn shape(&self) -> PayloadShape {
        PayloadShape {
            num_layers: self.num_layers,
            num_blocks: self.num_blocks,
            block_bytes: self.block_bytes,
        }
    }
}

/// A header and its K/V bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct KvMessage {
    pub header: KvHeader,
    pub payload: Vec<u8>,
}

fn digest(payload: &[u8]) -> String {
    hex(xxhash_rust::xxh3::xxh3_64(payload))
}

fn hex(d: u64) -> String {
    format!("{d:016x}")
}

impl KvMessage {
    /// Builds a message, computing the payload digest.
    #[must_use]
    pub fn new(mut header: KvHeader, payload: Vec<u8>) -> Self {
        header.payload_xxh3 = digest(&payload);
        KvMessage { header, payload }
    }

    /// The message that carries `seq` from an engine whose compatibility hash is
    /// `compat`.
    #[must_use]
    pub fn of_sequence(seq: ExportedSequence, compat: &str) -> Self {
        let ExportedSequence {
            request_id,
            compat: _,
            prompt,
            block_hashes,
            first_token,
            first_logprob,
            first_top_logprobs,
            params,
            rng_state,
            shape,
            payload,
        } = seq;
        Self::new(
            KvHeader {
                version: FORMAT_VERSION,
                request_id,
                compat: compat.to_owned(),
                prompt,
                block_hashes,
                first_token,
                first_logprob,
                first_top_logprobs,
                params,
                rng_state,
                num_layers: shape.num_layers,
                num_blocks: shape.num_blocks,
                block_bytes: shape.block_bytes,
                payload_xxh3: String::new(),
            },
            payload,
        )
    }

    /// The sequence a message carries, for an engine to import: only from a message
    /// read with its checks ([`KvMessage::read_into`], [`KvMessage::from_vec`]).
    #[must_use]
    pub fn into_sequence(self) -> ExportedSequence {
        let h = self.header;
        ExportedSequence {
            shape: PayloadShape {
                num_layers: h.num_layers,
                num_blocks: h.num_blocks,
                block_bytes: h.block_bytes,
            },
            request_id: h.request_id,
            compat: h.compat,
            prompt: h.prompt,
            block_hashes: h.block_hashes,
            first_token: h.first_token,
            first_logprob: h.first_logprob,
            first_top_logprobs: h.first_top_logprobs,
            params: h.params,
            rng_state: h.rng_state,
            payload: self.payload,
        }
    }

    /// Checks the header against the receiver's compatibility hash and layout, and
    /// that the payload it announces is no larger than `max_payload`: the payload's
    /// size.
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
        Ok(h.shape()
            .check(h.prompt.len(), h.block_hashes.len(), layout, max_payload)?)
    }

    /// Checks the payload against the header's size and digest.
    pub fn check_payload(&self) -> Result<(), TransferError> {
        let want = self.header.shape().bytes().unwrap_or(u64::MAX);
        if self.payload.len() as u64 != want {
            return Err(TransferError::Payload(format!(
                "{} bytes, header announces {want}",
                self.payload.len()
            )));
        }
        check_digest(&digest(&self.payload), &self.header)
    }

    /// Writes the message: a small prefix and header, then the payload in large
    /// writes.
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
        for piece in self.payload.chunks(WRITE_PIECE) {
            w.write_all(piece).await?;
        }
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
    ///
    /// [`BufferPool`]: crate::kv::payload::BufferPool
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
        buf.clear();
        buf.reserve_exact(n);
        let d = read_hashed(r, &mut buf, n).await?;
        check_digest(&hex(d), &header)?;
        Ok(KvMessage {
            header,
            payload: buf,
        })
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

fn check_digest(d: &str, h: &KvHeader) -> Result<(), TransferError> {
    if d == h.payload_xxh3 {
        Ok(())
    } else {
        Err(TransferError::Payload(format!(
            "digest {d} does not match the header's {}",
            h.payload_xxh3
        )))
    }
}

/// Reads exactly `n` bytes onto the end of `buf` (into its spare capacity: nothing is
/// zero-filled first) and returns their XXH3 digest, each piece hashed as it lands.
async fn read_hashed<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    n: usize,
) -> Result<u64, TransferError> {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let start = buf.len();
    let end = start + n;
    while buf.len() < end {
        let before = buf.len();
        let piece = (end - before).min(READ_PIECE) as u64;
        if (&mut *r).take(piece).read_buf(buf).await? == 0 {
            return Err(TransferError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        hasher.update(&buf[before..]);
    }
    Ok(hasher.digest())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::payload::{block_bytes, compat_hash};

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_blocks: 8,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 2,
        }
    }

    fn sequence() -> ExportedSequence {
        let l = layout();
        let prompt: Vec<u32> = (0..6).collect();
        let n = (2 * 2 * block_bytes(&l)) as usize;
        ExportedSequence {
            request_id: "r1".into(),
            compat: compat_hash(7, &layout()),
            block_hashes: crate::kv::PrefixKey::UNKEYED.block_hashes(&prompt, 4),
            prompt,
            first_token: 9,
            first_logprob: Some(-0.5),
            first_top_logprobs: vec![(9, -0.5), (3, -1.5)],
            params: SamplingParams::default(),
            rng_state: 1,
            shape: PayloadShape::of(&l, 2),
            payload: (0..n).map(|i| i as u8).collect(),
        }
    }

    fn message() -> KvMessage {
        KvMessage::of_sequence(sequence(), &compat_hash(7, &layout()))
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
        assert_eq!(
            back.into_sequence(),
            sequence(),
            "the sequence comes back whole"
        );
        let whole = KvMessage::from_vec(buf, &m.header.compat, &layout(), 1 << 20).unwrap();
        assert_eq!(whole, m);
    }

    /// A payload read in many pieces (the TCP path reads at most `READ_PIECE` at a
    /// time, and a socket hands over what it has) hashes as one read in one go.
    #[tokio::test]
    async fn a_payload_read_in_pieces_digests_as_one() {
        let l = KvLayout {
            num_layers: 4,
            num_blocks: 64,
            block_size: 16,
            num_kv_heads: 8,
            head_dim: 64,
        };
        let prompt: Vec<u32> = (0..1000).collect();
        let blocks = prompt.len().div_ceil(16);
        let n = (4 * blocks as u64 * block_bytes(&l)) as usize;
        assert!(n > 3 * READ_PIECE, "{n} bytes cover several pieces");
        let seq = ExportedSequence {
            request_id: "big".into(),
            compat: compat_hash(1, &l),
            block_hashes: crate::kv::PrefixKey::UNKEYED.block_hashes(&prompt, 16),
            prompt,
            first_token: 1,
            first_logprob: None,
            first_top_logprobs: Vec::new(),
            params: SamplingParams::default(),
            rng_state: 0,
            shape: PayloadShape::of(&l, blocks),
            payload: (0..n).map(|i| (i * 7 % 251) as u8).collect(),
        };
        let compat = compat_hash(1, &l);
        let m = KvMessage::of_sequence(seq, &compat);
        let (mut tx, mut rx) = tokio::io::duplex(100_003);
        let sent = m.clone();
        let writer = tokio::spawn(async move { sent.write_to(&mut tx).await });
        let back = KvMessage::read_into(&mut rx, &compat, &l, u64::MAX, Vec::with_capacity(10))
            .await
            .unwrap();
        writer.await.unwrap().unwrap();
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
            let whole = KvMessage::from_vec(bytes.clone(), &compat, &layout(), max);
            let streamed = KvMessage::read_from(&mut bytes.as_slice(), &compat, &layout(), max)
                .await
                .unwrap_err()
                .to_string();
            assert!(whole.is_err(), "taken whole: {streamed}");
            streamed
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
