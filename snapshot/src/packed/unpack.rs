//! Checking and unpacking a packed file: every chunk decoded in parallel and checked
//! against its checksum; an unpack resumes from a partial file and publishes only a
//! verified whole.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{PackedIndex, decode_chunk};
use crate::checksum::Checksum;
use crate::progress::Progress;
use crate::reader::Snapshot;
use crate::{Error, Result};

/// Decodes and checks every chunk of `src` on `threads` threads without writing
/// anything: validates a packed file in place, and measures pure decompression speed.
/// Returns the number of original bytes checked.
pub fn check(src: &Path, threads: usize) -> Result<u64> {
    let file = File::open(src).map_err(|e| Error::io(src, e))?;
    let len = file.metadata().map_err(|e| Error::io(src, e))?.len();
    // SAFETY: read-only map; every chunk is checksummed after decoding.
    #[allow(unsafe_code)]
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(src, e))?;
    let index = PackedIndex::parse(&map, len)?;
    let next = AtomicUsize::new(0);
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let r = (|| {
                    let mut dctx = zstd::bulk::Decompressor::new()
                        .map_err(|e| Error::InvalidPacked(format!("zstd: {e}")))?;
                    let mut buf = Vec::new();
                    while let Some(c) = index.chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let packed = &map
                            [c.packed_offset as usize..(c.packed_offset + c.packed_len) as usize];
                        decode_chunk(c, packed, &mut dctx, &mut buf)?;
                    }
                    Ok(())
                })();
                if let Err(e) = r {
                    first_err
                        .lock()
                        .expect("no panics while held")
                        .get_or_insert(e);
                    next.store(usize::MAX / 2, Ordering::Relaxed);
                }
            });
        }
    });
    match first_err.into_inner().expect("no panics while held") {
        Some(e) => Err(e),
        None => Ok(index.original_len),
    }
}

/// What [`unpack`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnpackSummary {
    pub original_len: u64,
    pub chunks: usize,
    /// Chunks found already complete in a partial file from an interrupted run.
    pub resumed_chunks: usize,
}

/// The deterministic name of the partial file an unpack into `dest` works in; an
/// interrupted unpack leaves it behind and the next one resumes from it.
#[must_use]
pub fn partial_path(dest: &Path) -> PathBuf {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dest.with_file_name(format!(".{name}.unpack.partial"))
}

/// Unpacks `src` into a snapshot at `dest` on `threads` threads. Chunks already intact
/// in a partial file left by an interrupted run are kept (each is checked against its
/// digest, so nothing written before a crash is trusted blindly). The result is opened
/// as a snapshot before it is renamed into place.
pub fn unpack(
    src: &Path,
    dest: &Path,
    threads: usize,
    progress: &dyn Progress,
) -> Result<UnpackSummary> {
    let file = File::open(src).map_err(|e| Error::io(src, e))?;
    let len = file.metadata().map_err(|e| Error::io(src, e))?.len();
    // SAFETY: read-only map of a packed file that this process does not modify; every
    // chunk is checksummed after decoding, so concurrent corruption is detected.
    #[allow(unsafe_code)]
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(src, e))?;
    let index = PackedIndex::parse(&map, len)?;
    let partial = partial_path(dest);
    let out = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&partial)
        .map_err(|e| Error::io(&partial, e))?;
    let io = |e| Error::io(&partial, e);
    let existing = out.metadata().map_err(io)?.len();
    if existing != index.original_len {
        out.set_len(index.original_len).map_err(io)?;
    }
    progress.start("unpacking", index.original_len);
    let next = AtomicUsize::new(0);
    let resumed = AtomicUsize::new(0);
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let Ok(mut dctx) = zstd::bulk::Decompressor::new() else {
                    *first_err.lock().expect("no panics while held") =
                        Some(Error::InvalidPacked("zstd decompressor unavailable".into()));
                    return;
                };
                let mut buf = Vec::new();
                loop {
                    if first_err.lock().expect("no panics while held").is_some() {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = index.chunks.get(i) else { break };
                    let r = (|| {
                        if existing == index.original_len {
                            buf.resize(c.orig_len as usize, 0);
                            if out.read_exact_at(&mut buf, c.orig_offset).is_ok()
                                && Checksum::of(&buf) == c.checksum
                            {
                                resumed.fetch_add(1, Ordering::Relaxed);
                                return Ok(());
                            }
                        }
                        let packed = &map
                            [c.packed_offset as usize..(c.packed_offset + c.packed_len) as usize];
                        decode_chunk(c, packed, &mut dctx, &mut buf)?;
                        out.write_all_at(&buf, c.orig_offset).map_err(io)
                    })();
                    match r {
                        Ok(()) => progress.advance(c.orig_len),
                        Err(e) => {
                            first_err
                                .lock()
                                .expect("no panics while held")
                                .get_or_insert(e);
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = first_err.into_inner().expect("no panics while held") {
        return Err(e);
    }
    out.sync_all().map_err(io)?;
    drop(out);
    // The chunk digests cover every byte; opening checks the snapshot's own structure
    // before it becomes visible under its final name.
    Snapshot::open(&partial)?;
    crate::publish::publish_synced(&partial, dest)?;
    progress.finish();
    Ok(UnpackSummary {
        original_len: index.original_len,
        chunks: index.chunks.len(),
        resumed_chunks: resumed.into_inner(),
    })
}
