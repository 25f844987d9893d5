//! A published snapshot's [`ModelCard`] read by ranges, without its weights: the
//! header and manifest, then the tokenizer blob. A packed source is read through its
//! chunk table, decoding only the chunks that hold those bytes (usually the first
//! one or two). This is how a gateway learns the model it fronts from the same URL the
//! warm pool stages, before any worker exists.

use preheat_snapshot::packed::{Chunk, PackedIndex, decode_chunk};
use preheat_snapshot::{ModelCard, format};

use crate::fetch::Fetcher;
use crate::stage::{MAX_PREFIX, read_packed_index};
use crate::{Error, Result};

/// Reads `fetcher`'s source (a snapshot or packed snapshot) for its card.
pub async fn fetch_card(fetcher: &Fetcher) -> Result<ModelCard> {
    let total = fetcher.len().await?;
    let bad = |m: String| Error::Corrupt(fetcher.source().to_string(), m);
    if total < 64 {
        return Err(bad(format!("{total} bytes: too short to be a snapshot")));
    }
    let head = fetcher.read(0, 64).await?;
    let reader = if head[..8] == format::MAGIC {
        Reader::Plain
    } else if head[..8] == preheat_snapshot::packed::MAGIC {
        Reader::Packed(read_packed_index(fetcher, &head, total).await?.0)
    } else {
        return Err(bad(
            "neither a snapshot nor a packed snapshot (bad magic)".into()
        ));
    };
    let snapshot_len = match &reader {
        Reader::Plain => total,
        Reader::Packed(index) => index.original_len,
    };
    let header_bytes = reader.read(fetcher, 0, 64).await?;
    let header = format::Header::decode(&header_bytes, snapshot_len)?;
    if header.manifest_len > MAX_PREFIX {
        return Err(bad(format!("manifest of {} bytes", header.manifest_len)));
    }
    let prefix_len = header
        .manifest_offset
        .checked_add(header.manifest_len)
        .ok_or_else(|| bad("manifest bounds overflow".into()))?;
    let prefix = reader.read(fetcher, 0, prefix_len).await?;
    let (_, manifest) = preheat_snapshot::parse_prefix(&prefix, snapshot_len)?;
    let tokenizer = match manifest.tokenizer.as_ref().map(|t| t.blob) {
        Some(blob) if blob.nbytes > MAX_PREFIX => {
            return Err(bad(format!("tokenizer of {} bytes", blob.nbytes)));
        }
        Some(blob) => Some(reader.read(fetcher, blob.offset, blob.nbytes).await?),
        None => None,
    };
    Ok(ModelCard::new(manifest, tokenizer)?)
}

/// How original snapshot bytes are read from the source.
enum Reader {
    Plain,
    Packed(PackedIndex),
}

impl Reader {
    /// `len` bytes of the snapshot at `offset` (the original, unpacked layout).
    async fn read(&self, fetcher: &Fetcher, offset: u64, len: u64) -> Result<Vec<u8>> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| Error::Corrupt(fetcher.source().to_string(), "range overflow".into()))?;
        match self {
            Reader::Plain => fetcher.read(offset, len).await,
            Reader::Packed(index) => {
                if end > index.original_len {
                    return Err(Error::Corrupt(
                        fetcher.source().to_string(),
                        format!("bytes {offset}..{end} are past the snapshot's end"),
                    ));
                }
                let covering: Vec<&Chunk> = index
                    .chunks
                    .iter()
                    .filter(|c| c.orig_offset < end && c.orig_offset + c.orig_len > offset)
                    .collect();
                let mut dctx = zstd::bulk::Decompressor::new().map_err(|e| {
                    Error::Corrupt(fetcher.source().to_string(), format!("zstd: {e}"))
                })?;
                let mut out = Vec::with_capacity(len as usize);
                let mut plain = Vec::new();
                for c in covering {
                    let packed = fetcher.read(c.packed_offset, c.packed_len).await?;
                    decode_chunk(c, &packed, &mut dctx, &mut plain)?;
                    let from = offset.saturating_sub(c.orig_offset) as usize;
                    let to = (end.min(c.orig_offset + c.orig_len) - c.orig_offset) as usize;
                    out.extend_from_slice(&plain[from..to]);
                }
                Ok(out)
            }
        }
    }
}
