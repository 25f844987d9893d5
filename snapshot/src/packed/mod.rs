//! The packed encoding of a snapshot, for storage and transfer.
//!
//! The snapshot is cut into chunks of at most `chunk_size` bytes along its own region
//! boundaries (header+manifest, each blob, each tensor with its padding); every chunk is
//! compressed on its own with zstd, so chunks decompress in parallel and a transfer can
//! resume or fetch by chunk. Chunks inside 16-bit tensors are split into byte planes
//! first: the high byte of an f16/bf16 holds the sign and most of the exponent and
//! compresses well, the low byte is mostly mantissa noise and barely does; interleaved,
//! zstd sees neither pattern.
//!
//! ```text
//! header (64 B): magic b"PHPACK\0\0", version u32, flags u32, original length u64,
//!                chunk size u64, chunk count u64, table checksum u64, reserved u64,
//!                header checksum u64 (XXH3 of bytes 0..56)
//! chunk table:   count × 48 B: original offset u64, original length u64,
//!                packed offset u64, packed length u64, checksum of original u64,
//!                codec u8, 7 reserved bytes
//! chunk data
//! ```

use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::checksum::Checksum;
use crate::progress::Progress;
use crate::reader::Snapshot;
use crate::{Error, Result};

mod unpack;

pub use unpack::{UnpackSummary, check, partial_path, unpack};

pub const MAGIC: [u8; 8] = *b"PHPACK\0\0";
pub const VERSION: u32 = 1;
const HEADER_LEN: usize = 64;
const ENTRY_LEN: usize = 48;
/// Default chunk size: large enough for zstd to find structure, small enough for
/// parallelism and cheap resumption.
pub const DEFAULT_CHUNK: u64 = 4 << 20;

/// How a chunk's bytes are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Codec {
    /// Uncompressed (compression did not pay).
    Stored = 0,
    Zstd = 1,
    /// 16-bit elements split into low/high byte planes, then zstd.
    ZstdPlanes16 = 2,
}

impl Codec {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Codec::Stored,
            1 => Codec::Zstd,
            2 => Codec::ZstdPlanes16,
            _ => return None,
        })
    }
}

/// One entry of the chunk table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub orig_offset: u64,
    pub orig_len: u64,
    pub packed_offset: u64,
    pub packed_len: u64,
    pub checksum: Checksum,
    pub codec: Codec,
}

/// Options for [`pack`].
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct PackOptions {
    pub chunk_size: u64,
    pub level: i32,
    pub threads: usize,
    /// Split 16-bit tensors into byte planes (turn off to measure plain zstd).
    pub byte_planes: bool,
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            chunk_size: DEFAULT_CHUNK,
            level: 3,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            byte_planes: true,
        }
    }
}

/// Sizes of a finished pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackSummary {
    pub original_len: u64,
    pub packed_len: u64,
    pub chunks: usize,
}

impl PackSummary {
    #[must_use]
    pub fn ratio(&self) -> f64 {
        self.original_len as f64 / self.packed_len.max(1) as f64
    }
}

fn split_planes(src: &[u8]) -> Vec<u8> {
    let n = src.len() / 2;
    let mut out = vec![0u8; src.len()];
    let (lo, hi) = out.split_at_mut(n);
    for (i, e) in src.chunks_exact(2).enumerate() {
        lo[i] = e[0];
        hi[i] = e[1];
    }
    out
}

fn join_planes(planes: &[u8], out: &mut [u8]) {
    let n = planes.len() / 2;
    let (lo, hi) = planes.split_at(n);
    for (i, e) in out.chunks_exact_mut(2).enumerate() {
        e[0] = lo[i];
        e[1] = hi[i];
    }
}

/// Chunk boundaries over `snap`: (offset, length, 16-bit?).
fn plan(snap: &Snapshot, chunk_size: u64) -> Vec<(u64, u64, bool)> {
    let m = snap.manifest();
    let mut regions: Vec<(u64, bool)> = m
        .regions()
        .iter()
        .map(|(name, off, _)| {
            let sixteen = name
                .strip_prefix("tensor ")
                .and_then(|n| m.tensors.iter().find(|t| t.name == n))
                .is_some_and(|t| t.dtype().size() == 2);
            (*off, sixteen)
        })
        .collect();
    regions.sort_by_key(|r| r.0);
    let mut segments = Vec::new();
    let mut pos = 0;
    let mut sixteen = false;
    for (off, s) in regions {
        if off > pos {
            segments.push((pos, off, sixteen));
        }
        pos = off;
        sixteen = s;
    }
    segments.push((pos, snap.file_len(), sixteen));
    let mut chunks = Vec::new();
    for (start, end, s) in segments {
        let mut o = start;
        while o < end {
            let n = chunk_size.min(end - o);
            chunks.push((o, n, s && n % 2 == 0));
            o += n;
        }
    }
    chunks
}

/// Packs the snapshot at `src` into `dest` (written to a temp name, then renamed).
pub fn pack(
    src: &Path,
    dest: &Path,
    opts: PackOptions,
    progress: &dyn Progress,
) -> Result<PackSummary> {
    if opts.chunk_size == 0
        || !opts.chunk_size.is_multiple_of(2)
        || opts.chunk_size > u32::MAX as u64
    {
        return Err(Error::InvalidPacked(format!(
            "chunk size {} must be even, > 0 and < 4 GiB",
            opts.chunk_size
        )));
    }
    let snap = Snapshot::open(src)?;
    let bytes = snap.bytes();
    let plan = plan(&snap, opts.chunk_size);
    let (tmp, _) = crate::publish::temp_beside(dest)?;
    let io = |e| Error::io(tmp.path(), e);
    let table_len = plan.len() * ENTRY_LEN;
    let mut out = tmp.as_file();
    out.seek(SeekFrom::Start((HEADER_LEN + table_len) as u64))
        .map_err(io)?;
    let mut pos = (HEADER_LEN + table_len) as u64;
    let mut table = Vec::with_capacity(plan.len());
    progress.start("packing", snap.file_len());
    // Compress a window of chunks in parallel, write them in order.
    let window = opts.threads.max(1) * 4;
    for batch in plan.chunks(window) {
        let results: Vec<Mutex<Option<CompressedChunk>>> =
            batch.iter().map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..opts.threads.max(1).min(batch.len()) {
                s.spawn(|| {
                    let mut cctx = zstd::bulk::Compressor::new(opts.level).ok();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, len, sixteen)) = batch.get(i) else {
                            break;
                        };
                        let raw = &bytes[off as usize..(off + len) as usize];
                        let r = compress(cctx.as_mut(), raw, sixteen && opts.byte_planes);
                        *results[i].lock().expect("no panics while held") = Some(r);
                    }
                });
            }
        });
        for (&(off, len, _), r) in batch.iter().zip(results) {
            let (codec, data) = r
                .into_inner()
                .expect("no panics while held")
                .expect("every chunk of the batch was taken")?;
            out.write_all(&data).map_err(io)?;
            table.push(Chunk {
                orig_offset: off,
                orig_len: len,
                packed_offset: pos,
                packed_len: data.len() as u64,
                checksum: Checksum::of(&bytes[off as usize..(off + len) as usize]),
                codec,
            });
            pos += data.len() as u64;
            progress.advance(len);
        }
    }
    let mut tbytes = Vec::with_capacity(table_len);
    for c in &table {
        for v in [
            c.orig_offset,
            c.orig_len,
            c.packed_offset,
            c.packed_len,
            c.checksum.0,
        ] {
            tbytes.extend_from_slice(&v.to_le_bytes());
        }
        tbytes.push(c.codec as u8);
        tbytes.extend_from_slice(&[0u8; 7]);
    }
    let mut header = [0u8; HEADER_LEN];
    header[0..8].copy_from_slice(&MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    header[16..24].copy_from_slice(&snap.file_len().to_le_bytes());
    header[24..32].copy_from_slice(&opts.chunk_size.to_le_bytes());
    header[32..40].copy_from_slice(&(table.len() as u64).to_le_bytes());
    header[40..48].copy_from_slice(&Checksum::of(&tbytes).0.to_le_bytes());
    let hsum = Checksum::of(&header[0..56]);
    header[56..64].copy_from_slice(&hsum.0.to_le_bytes());
    out.write_all_at(&header, 0).map_err(io)?;
    out.write_all_at(&tbytes, HEADER_LEN as u64).map_err(io)?;
    crate::publish::publish_temp(tmp, dest)?;
    progress.finish();
    Ok(PackSummary {
        original_len: snap.file_len(),
        packed_len: pos,
        chunks: table.len(),
    })
}

/// A chunk's codec and bytes, or why compressing it failed.
type CompressedChunk = Result<(Codec, Vec<u8>)>;

fn compress(
    cctx: Option<&mut zstd::bulk::Compressor<'static>>,
    raw: &[u8],
    planes: bool,
) -> Result<(Codec, Vec<u8>)> {
    let cctx = cctx.ok_or_else(|| Error::InvalidPacked("zstd compressor unavailable".into()))?;
    let split;
    let input = if planes {
        split = split_planes(raw);
        &split[..]
    } else {
        raw
    };
    let data = cctx
        .compress(input)
        .map_err(|e| Error::InvalidPacked(format!("zstd: {e}")))?;
    if data.len() >= raw.len() {
        return Ok((Codec::Stored, raw.to_vec()));
    }
    Ok((
        if planes {
            Codec::ZstdPlanes16
        } else {
            Codec::Zstd
        },
        data,
    ))
}

/// The parsed header and chunk table of a packed file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedIndex {
    pub original_len: u64,
    pub chunk_size: u64,
    pub chunks: Vec<Chunk>,
}

impl PackedIndex {
    /// Bytes of header plus table: what a fetcher needs before any chunk.
    #[must_use]
    pub fn prefix_len(&self) -> u64 {
        (HEADER_LEN + self.chunks.len() * ENTRY_LEN) as u64
    }

    /// The same, read from the first bytes of a packed file (its fixed-size header:
    /// [`PackedIndex::HEADER_LEN`]), before the table is fetched; `None` when the
    /// header is short or its chunk count overflows. Nothing is checked but the
    /// arithmetic: [`PackedIndex::parse`] checks the rest.
    #[must_use]
    pub fn prefix_len_from_header(head: &[u8]) -> Option<u64> {
        let count = u64::from_le_bytes(head.get(32..40)?.try_into().ok()?);
        count
            .checked_mul(ENTRY_LEN as u64)?
            .checked_add(HEADER_LEN as u64)
    }

    /// Length of the fixed-size header every packed file starts with.
    pub const HEADER_LEN: usize = HEADER_LEN;

    /// Parses header and table from the start of a packed file of `file_len` bytes.
    /// The chunks must tile the original exactly and lie inside the file.
    pub fn parse(b: &[u8], file_len: u64) -> Result<Self> {
        let bad = |m: String| Error::InvalidPacked(m);
        if b.len() < 8 || b[..8] != MAGIC {
            return Err(bad("bad magic (not a packed snapshot)".into()));
        }
        if b.len() < HEADER_LEN {
            return Err(bad(format!("truncated header ({} bytes)", b.len())));
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(Error::UnsupportedVersion {
                found: version,
                supported: VERSION,
            });
        }
        if Checksum::of(&b[0..56]).0 != u64_at(56) {
            return Err(bad("header checksum mismatch".into()));
        }
        let original_len = u64_at(16);
        let chunk_size = u64_at(24);
        let count = u64_at(32);
        let table_end = count
            .checked_mul(ENTRY_LEN as u64)
            .and_then(|t| t.checked_add(HEADER_LEN as u64))
            .filter(|&e| e <= b.len() as u64 && e <= file_len)
            .ok_or_else(|| bad(format!("chunk table of {count} entries is past the end")))?;
        let tbytes = &b[HEADER_LEN..table_end as usize];
        if Checksum::of(tbytes).0 != u64_at(40) {
            return Err(bad("chunk table checksum mismatch".into()));
        }
        let mut chunks = Vec::with_capacity(count as usize);
        let mut expect = 0u64;
        for e in tbytes.chunks_exact(ENTRY_LEN) {
            let f = |i: usize| u64::from_le_bytes(e[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            let codec =
                Codec::from_u8(e[40]).ok_or_else(|| bad(format!("unknown codec {}", e[40])))?;
            let c = Chunk {
                orig_offset: f(0),
                orig_len: f(1),
                packed_offset: f(2),
                packed_len: f(3),
                checksum: Checksum(f(4)),
                codec,
            };
            let in_file = c.packed_offset >= table_end
                && c.packed_offset
                    .checked_add(c.packed_len)
                    .is_some_and(|end| end <= file_len);
            if c.orig_offset != expect || c.orig_len == 0 || c.orig_len > chunk_size || !in_file {
                return Err(bad(format!("chunk {} has bad bounds: {c:?}", chunks.len())));
            }
            if c.codec == Codec::Stored && c.packed_len != c.orig_len {
                return Err(bad(format!("stored chunk {} changes length", chunks.len())));
            }
            expect += c.orig_len;
            chunks.push(c);
        }
        if expect != original_len {
            return Err(bad(format!(
                "chunks cover {expect} of {original_len} bytes"
            )));
        }
        Ok(PackedIndex {
            original_len,
            chunk_size,
            chunks,
        })
    }
}

/// Decodes one chunk's packed bytes into `out` (exactly `c.orig_len` bytes) and checks
/// its digest. Used by [`unpack`] and by fetchers that stream chunks.
pub fn decode_chunk(
    c: &Chunk,
    packed: &[u8],
    dctx: &mut zstd::bulk::Decompressor<'_>,
    out: &mut Vec<u8>,
) -> Result<()> {
    let bad = |m: String| Error::InvalidPacked(m);
    out.clear();
    match c.codec {
        Codec::Stored => out.extend_from_slice(packed),
        Codec::Zstd | Codec::ZstdPlanes16 => {
            let mut plain = Vec::with_capacity(c.orig_len as usize);
            let n = dctx
                .decompress_to_buffer(packed, &mut plain)
                .map_err(|e| bad(format!("chunk at {}: zstd: {e}", c.orig_offset)))?;
            if n as u64 != c.orig_len {
                return Err(bad(format!(
                    "chunk at {} decodes to {n} bytes, not {}",
                    c.orig_offset, c.orig_len
                )));
            }
            if c.codec == Codec::ZstdPlanes16 {
                out.resize(plain.len(), 0);
                join_planes(&plain, out);
            } else {
                *out = plain;
            }
        }
    }
    let actual = Checksum::of(out);
    if actual != c.checksum {
        return Err(Error::ChecksumMismatch {
            what: format!("packed chunk at original offset {}", c.orig_offset),
            expected: c.checksum.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_round_trip() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let p = split_planes(&src);
        assert_eq!(p[0], src[0]);
        assert_eq!(p[500], src[1]);
        let mut back = vec![0; src.len()];
        join_planes(&p, &mut back);
        assert_eq!(back, src);
    }
}
