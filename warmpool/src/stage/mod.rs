//! Staging one snapshot into a directory: fetch ranges in parallel, decompress packed
//! chunks while writing, journal what is durable so an interrupted run resumes where it
//! stopped, verify every checksum, and only then rename into the final name.
//!
//! Files in the directory for a model `m`:
//! - `m.preheat`: the published snapshot (only ever created by rename of a verified
//!   file, so a reader never sees a partial or corrupt one under this name);
//! - `.m.stage.partial`: the file being filled, at its final length from the start;
//! - `.m.stage.journal`: the source's identity, then one line per piece whose bytes
//!   were synced to disk before the line was written;
//! - `.m.stage.lock`: held (flock) by whoever stages `m`, so two processes never stage
//!   the same model at once; the second waits and then finds it published.

mod journal;
mod name;

use self::name::side_path;
pub use self::name::{default_name, snapshot_path, validate_name};

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{StreamExt, stream};
use preheat_snapshot::packed::{Chunk, PackedIndex, decode_chunk};
use preheat_snapshot::{Checksum, Progress, Snapshot, format};

use crate::fetch::Fetcher;
use crate::{Error, Result};

use self::journal::Journal;

/// File extension of a published snapshot.
pub const EXTENSION: &str = "preheat";
/// Journal entries are only written after the data they describe is synced; syncing
/// this often bounds what an interruption can lose.
const SYNC_EVERY_BYTES: u64 = 64 << 20;
const SYNC_EVERY: Duration = Duration::from_secs(1);
/// Largest header + manifest (or chunk table), and largest packed chunk, a source may
/// declare: a corrupt or hostile header must not make the agent allocate gigabytes.
pub(crate) const MAX_PREFIX: u64 = 256 << 20;
const MAX_CHUNK: u64 = 1 << 30;

/// Options of one staging.
#[derive(Clone, Debug)]
#[must_use]
pub struct StageOptions {
    /// Ranges in flight at once.
    pub concurrency: usize,
    /// Size of a fetched range of an unpacked snapshot (packed ones fetch by chunk).
    pub piece_bytes: u64,
    /// Threads that verify the finished file.
    pub verify_threads: usize,
}

impl Default for StageOptions {
    fn default() -> Self {
        StageOptions {
            concurrency: 4,
            piece_bytes: 8 << 20,
            verify_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// What a staging did.
#[derive(Clone, Debug, PartialEq)]
pub struct StageOutcome {
    pub path: PathBuf,
    /// Size of the published snapshot.
    pub bytes: u64,
    /// Bytes fetched from the source by this run.
    pub fetched_bytes: u64,
    /// Bytes of the snapshot found done by an earlier, interrupted run.
    pub resumed_bytes: u64,
    /// The snapshot was already in place and verified; nothing was fetched.
    pub already_staged: bool,
    pub seconds: f64,
}

/// Whether the source is a plain snapshot or its packed encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    Snapshot,
    Packed,
}

/// One range to fetch and where its bytes go.
#[derive(Clone, Copy, Debug)]
struct Piece {
    src_offset: u64,
    src_len: u64,
    dst_offset: u64,
    dst_len: u64,
    /// Packed sources: the chunk to decode.
    chunk: Option<Chunk>,
}

/// What fetching a source involves, read from its header alone.
#[derive(Clone, Debug)]
pub struct Plan {
    pub kind: SourceKind,
    /// Size of the snapshot once staged.
    pub snapshot_bytes: u64,
    /// Digest of the source's header and manifest (or chunk table): a journal written
    /// for another version of the source is never trusted.
    identity: Checksum,
    pieces: Vec<Piece>,
}

/// Reads the source's header and plans the fetch.
pub async fn plan(fetcher: &Fetcher, piece_bytes: u64) -> Result<Plan> {
    let total = fetcher.len().await?;
    let bad = |m: String| Error::Corrupt(fetcher.source().to_string(), m);
    // Both encodings start with a fixed header of the same size.
    const HEAD: usize = format::HEADER_LEN;
    const _: () = assert!(HEAD == PackedIndex::HEADER_LEN);
    if total < HEAD as u64 {
        return Err(bad(format!("{total} bytes: too short to be a snapshot")));
    }
    let head = fetcher.read(0, HEAD as u64).await?;
    if head[..8] == format::MAGIC {
        let h = format::Header::decode(&head, total)?;
        if h.manifest_len > MAX_PREFIX {
            return Err(bad(format!("manifest of {} bytes", h.manifest_len)));
        }
        let prefix = fetcher.read(0, HEAD as u64 + h.manifest_len).await?;
        preheat_snapshot::parse_prefix(&prefix, total)?;
        let step = piece_bytes.max(format::ALIGN);
        let pieces = (0..total.div_ceil(step))
            .map(|i| {
                let off = i * step;
                let len = step.min(total - off);
                Piece {
                    src_offset: off,
                    src_len: len,
                    dst_offset: off,
                    dst_len: len,
                    chunk: None,
                }
            })
            .collect();
        Ok(Plan {
            kind: SourceKind::Snapshot,
            snapshot_bytes: total,
            identity: Checksum::of(&prefix),
            pieces,
        })
    } else if head[..8] == preheat_snapshot::packed::MAGIC {
        let (index, prefix) = read_packed_index(fetcher, &head, total).await?;
        let pieces = index
            .chunks
            .iter()
            .map(|c| Piece {
                src_offset: c.packed_offset,
                src_len: c.packed_len,
                dst_offset: c.orig_offset,
                dst_len: c.orig_len,
                chunk: Some(*c),
            })
            .collect();
        Ok(Plan {
            kind: SourceKind::Packed,
            snapshot_bytes: index.original_len,
            identity: Checksum::of(&prefix),
            pieces,
        })
    } else {
        Err(bad(
            "neither a snapshot nor a packed snapshot (bad magic)".into()
        ))
    }
}

/// Reads and checks a packed source's header and chunk table, given its first 64
/// bytes (`head`) and length: the table within bounds and no chunk over 1 GiB, so a
/// corrupt or hostile header cannot make the reader allocate gigabytes. Returns the
/// index and the bytes it was read from (the source's identity).
pub(crate) async fn read_packed_index(
    fetcher: &Fetcher,
    head: &[u8],
    total: u64,
) -> Result<(PackedIndex, Vec<u8>)> {
    let bad = |m: String| Error::Corrupt(fetcher.source().to_string(), m);
    let prefix_len = PackedIndex::prefix_len_from_header(head)
        .filter(|&n| n <= total && n <= MAX_PREFIX)
        .ok_or_else(|| bad("the chunk table is past the end of the source".into()))?;
    let prefix = fetcher.read(0, prefix_len).await?;
    let index = PackedIndex::parse(&prefix, total)?;
    if let Some(c) = index
        .chunks
        .iter()
        .find(|c| c.orig_len > MAX_CHUNK || c.packed_len > MAX_CHUNK)
    {
        return Err(bad(format!(
            "chunk at {} is larger than 1 GiB",
            c.orig_offset
        )));
    }
    Ok((index, prefix))
}

/// Stages `fetcher`'s source as model `name` in `dir`. Returns once a verified snapshot
/// is published under [`snapshot_path`]; on error, what was durably fetched is kept
/// for the next attempt.
pub async fn stage(
    fetcher: &Fetcher,
    dir: &Path,
    name: &str,
    opts: &StageOptions,
    progress: Arc<dyn Progress>,
) -> Result<StageOutcome> {
    stage_with_plan(fetcher, dir, name, opts, progress, None).await
}

/// [`stage`] with the source's [`Plan`] when the caller already read it (the store
/// does, to make room), so the header and manifest are fetched once.
pub async fn stage_with_plan(
    fetcher: &Fetcher,
    dir: &Path,
    name: &str,
    opts: &StageOptions,
    progress: Arc<dyn Progress>,
    plan: Option<Plan>,
) -> Result<StageOutcome> {
    validate_name(name)?;
    let t0 = Instant::now();
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|e| Error::io(dir, e))?;
    let lock = lock_model(dir, name).await?;
    let dest = snapshot_path(dir, name);
    if let Some(bytes) = verified(&dest, opts.verify_threads).await? {
        drop(lock);
        return Ok(StageOutcome {
            path: dest,
            bytes,
            fetched_bytes: 0,
            resumed_bytes: 0,
            already_staged: true,
            seconds: t0.elapsed().as_secs_f64(),
        });
    }
    let plan = match plan {
        Some(p) => p,
        None => self::plan(fetcher, opts.piece_bytes).await?,
    };
    let out = stage_planned(fetcher, dir, name, &plan, opts, progress).await;
    drop(lock);
    let (fetched, resumed) = out?;
    Ok(StageOutcome {
        path: dest,
        bytes: plan.snapshot_bytes,
        fetched_bytes: fetched,
        resumed_bytes: resumed,
        already_staged: false,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Opens (creating) the lock file at `path`, unlocked: its content is never read.
pub(crate) fn lock_file(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| Error::io(path, e))
}

/// Takes the per-model lock file, waiting while another process holds it.
async fn lock_model(dir: &Path, name: &str) -> Result<File> {
    let path = side_path(dir, name, "lock");
    tokio::task::spawn_blocking(move || {
        let f = lock_file(&path)?;
        if f.try_lock().is_err() {
            tracing::info!(lock = %path.display(), "another process is staging this model; waiting");
            f.lock().map_err(|e| Error::io(&path, e))?;
        }
        Ok(f)
    })
    .await
    .map_err(|e| Error::Invalid(format!("lock task: {e}")))?
}

/// The size of the snapshot at `dest` when it is there and every checksum holds; a
/// corrupt one is removed (it is never served) and `None` returned.
async fn verified(dest: &Path, threads: usize) -> Result<Option<u64>> {
    if !dest.exists() {
        return Ok(None);
    }
    let d = dest.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let check = Snapshot::open(&d).and_then(|s| {
            let len = s.file_len();
            s.verify(threads)?.into_result().map(|_| len)
        });
        match check {
            Ok(len) => Ok(Some(len)),
            Err(e) => {
                tracing::warn!(path = %d.display(), error = %e, "staged snapshot is corrupt; removing it and staging again");
                std::fs::remove_file(&d).map_err(|e| Error::io(&d, e))?;
                Ok(None)
            }
        }
    })
    .await
    .map_err(|e| Error::Invalid(format!("verify task: {e}")))?
}

/// Fetches the pieces not yet journaled, verifies and publishes. Returns (fetched,
/// resumed) bytes.
async fn stage_planned(
    fetcher: &Fetcher,
    dir: &Path,
    name: &str,
    plan: &Plan,
    opts: &StageOptions,
    progress: Arc<dyn Progress>,
) -> Result<(u64, u64)> {
    let partial = side_path(dir, name, "partial");
    let (mut journal, mut done) = Journal::open(side_path(dir, name, "journal"), plan)?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&partial)
        .map_err(|e| Error::io(&partial, e))?;
    let len = file.metadata().map_err(|e| Error::io(&partial, e))?.len();
    if len != plan.snapshot_bytes {
        // A partial of another size cannot hold what the journal claims.
        if !done.is_empty() {
            done.clear();
            journal = Journal::open_fresh(journal, plan)?;
        }
        file.set_len(plan.snapshot_bytes)
            .map_err(|e| Error::io(&partial, e))?;
    }
    let file = Arc::new(file);
    let resumed: u64 = plan
        .pieces
        .iter()
        .filter(|p| done.contains(&p.dst_offset))
        .map(|p| p.dst_len)
        .sum();
    if resumed > 0 {
        tracing::info!(
            model = name,
            resumed_bytes = resumed,
            "resuming an interrupted staging"
        );
    }
    progress.start("staging", plan.snapshot_bytes);
    progress.advance(resumed);
    let todo: Vec<Piece> = plan
        .pieces
        .iter()
        .filter(|p| !done.contains(&p.dst_offset))
        .copied()
        .collect();
    let mut fetched = fetch_pieces(
        fetcher,
        &file,
        &partial,
        &todo,
        opts,
        &*progress,
        &mut journal,
    )
    .await?;
    // Every byte is on disk; now check them all before anything is published.
    let bad = verify_partial(&partial, opts.verify_threads).await?;
    if !bad.is_empty() {
        // Pieces written before a crash are trusted from the journal only until
        // here: refetch what overlaps a corrupt item, once.
        let redo: Vec<Piece> = plan
            .pieces
            .iter()
            .filter(|p| {
                bad.iter().any(|&(o, n)| {
                    p.dst_offset < o.saturating_add(n) && o < p.dst_offset + p.dst_len
                })
            })
            .copied()
            .collect();
        tracing::warn!(
            model = name,
            items = bad.len(),
            pieces = redo.len(),
            "corrupt items in the staged file; fetching them again"
        );
        fetched += fetch_pieces(
            fetcher,
            &file,
            &partial,
            &redo,
            opts,
            &*progress,
            &mut journal,
        )
        .await?;
        let still = verify_partial(&partial, opts.verify_threads).await?;
        if !still.is_empty() {
            // The source itself is wrong: start from scratch next time.
            let _ = std::fs::remove_file(&journal.path);
            return Err(Error::Corrupt(
                fetcher.source().to_string(),
                format!(
                    "{} item(s) fail their checksum after a refetch (first at byte {})",
                    still.len(),
                    still[0].0
                ),
            ));
        }
    }
    drop(file);
    let dest = snapshot_path(dir, name);
    preheat_snapshot::publish::publish_synced(&partial, &dest)?;
    let _ = std::fs::remove_file(&journal.path);
    progress.finish();
    tracing::info!(model = name, path = %dest.display(), bytes = plan.snapshot_bytes, fetched, resumed, "staged");
    Ok((fetched, resumed))
}

/// Opens and verifies the partial file; returns the (offset, length) of every item
/// whose checksum fails, or of the whole file when its structure does not parse.
async fn verify_partial(partial: &Path, threads: usize) -> Result<Vec<(u64, u64)>> {
    let p = partial.to_path_buf();
    tokio::task::spawn_blocking(move || match Snapshot::open(&p) {
        Ok(s) => Ok(s
            .verify(threads)?
            .mismatches
            .iter()
            .map(|m| (m.offset, m.nbytes))
            .collect()),
        Err(preheat_snapshot::Error::Io { path, source }) => Err(Error::io(path, source)),
        Err(e) => {
            tracing::warn!(error = %e, "staged file does not open as a snapshot");
            Ok(vec![(0, u64::MAX)])
        }
    })
    .await
    .map_err(|e| Error::Invalid(format!("verify task: {e}")))?
}

/// Fetches `todo` with bounded concurrency into `file`, journaling synced pieces.
/// Returns the bytes fetched.
async fn fetch_pieces(
    fetcher: &Fetcher,
    file: &Arc<File>,
    partial: &Path,
    todo: &[Piece],
    opts: &StageOptions,
    progress: &dyn Progress,
    journal: &mut Journal,
) -> Result<u64> {
    let mut results = stream::iter(todo.iter().copied())
        .map(|p| {
            let file = Arc::clone(file);
            let partial = partial.to_path_buf();
            async move {
                let bytes = fetcher.read(p.src_offset, p.src_len).await?;
                tokio::task::spawn_blocking(move || write_piece(&file, &partial, &p, &bytes))
                    .await
                    .map_err(|e| Error::Invalid(format!("writer task: {e}")))??;
                Ok::<Piece, Error>(p)
            }
        })
        .buffer_unordered(opts.concurrency.max(1));
    let mut fetched = 0u64;
    let mut unsynced: Vec<u64> = Vec::new();
    let mut unsynced_bytes = 0u64;
    let mut last_sync = Instant::now();
    let mut failure = None;
    while let Some(r) = results.next().await {
        match r {
            Ok(p) => {
                fetched += p.src_len;
                progress.advance(p.dst_len);
                unsynced.push(p.dst_offset);
                unsynced_bytes += p.dst_len;
                if unsynced_bytes >= SYNC_EVERY_BYTES || last_sync.elapsed() >= SYNC_EVERY {
                    sync_and_record(file, partial, journal, &mut unsynced).await?;
                    unsynced_bytes = 0;
                    last_sync = Instant::now();
                }
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    drop(results);
    // Keep what did land, even on failure: the next attempt resumes from it.
    sync_and_record(file, partial, journal, &mut unsynced).await?;
    match failure {
        Some(e) => Err(e),
        None => Ok(fetched),
    }
}

async fn sync_and_record(
    file: &Arc<File>,
    partial: &Path,
    journal: &mut Journal,
    offsets: &mut Vec<u64>,
) -> Result<()> {
    if offsets.is_empty() {
        return Ok(());
    }
    let f = Arc::clone(file);
    tokio::task::spawn_blocking(move || f.sync_data())
        .await
        .map_err(|e| Error::Invalid(format!("sync task: {e}")))?
        .map_err(|e| Error::io(partial, e))?;
    journal.record(offsets)?;
    offsets.clear();
    Ok(())
}

fn write_piece(file: &File, partial: &Path, p: &Piece, bytes: &[u8]) -> Result<()> {
    match &p.chunk {
        None => file
            .write_all_at(bytes, p.dst_offset)
            .map_err(|e| Error::io(partial, e)),
        Some(c) => {
            let mut dctx = zstd::bulk::Decompressor::new()
                .map_err(|e| Error::Invalid(format!("zstd: {e}")))?;
            let mut out = Vec::new();
            decode_chunk(c, bytes, &mut dctx, &mut out)?;
            file.write_all_at(&out, p.dst_offset)
                .map_err(|e| Error::io(partial, e))
        }
    }
}
