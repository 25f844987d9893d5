//! The scaler's state file: what it learnt that a restart would otherwise lose. Today
//! that is each pool's season (its load by time of day), which a scaler reading the
//! pods itself — no Prometheus to read it back from — would otherwise relearn over a
//! whole period.
//!
//! The file is written whole to a temporary file beside it, synced, and renamed over
//! it, so a crash mid-write leaves the previous state, never half of one. It is read
//! once at start, bounded in size before it is parsed; one that cannot be used is
//! reported by name and set aside, and the scaler starts learning afresh (a state
//! file never keeps a scaler from starting: one held by another scaler past
//! [`LOCK_WAIT_S`] is done without).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::policy::season::SeasonState;

/// The format this scaler writes and reads.
pub const FORMAT: &str = "preheat-scaler-state/1";

/// Largest state file read: 2,000 buckets per season as JSON are under 60 KB, so this
/// holds over a hundred models' pools.
pub const MAX_STATE_BYTES: u64 = 16 << 20;

/// Seconds between saves: what a crash can lose of a season (its buckets are minutes).
pub const SAVE_EVERY_S: f64 = 30.0;

/// A state file older than this is not resumed: the load it learnt may be gone.
/// A week, or four periods when that is longer (a weekly season), so a scaler that
/// was down over a weekend or a holiday still resumes its daily season.
#[must_use]
pub fn max_age_s(period_s: f64) -> f64 {
    (7.0 * 86_400.0_f64).max(4.0 * period_s)
}

/// Everything the state file holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedState {
    /// [`FORMAT`]: a file from another version is refused by name, not misread.
    pub format: String,
    /// Unix time it was written.
    pub saved_unix: f64,
    pub pools: Vec<SavedPool>,
}

/// One pool's learnt state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedPool {
    pub model: String,
    /// `prefill` or `decode`.
    pub pool: String,
    /// Unix time this pool's season was learnt up to: the save for a live pool; for
    /// one carried over unused (its model gone from the config, its season
    /// configured differently), the save it was last used in, so a rollback within
    /// [`max_age_s`] still finds it.
    pub saved_unix: f64,
    pub season: SeasonState,
    /// The model's identity when it was saved (`models[].identity`), if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

impl SavedState {
    /// A state of this format, saved at `saved_unix`.
    #[must_use]
    pub fn new(saved_unix: f64, pools: Vec<SavedPool>) -> Self {
        SavedState {
            format: FORMAT.to_owned(),
            saved_unix,
            pools,
        }
    }
}

/// Why a state file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state file {path}: {size} bytes, more than the {MAX_STATE_BYTES} one may hold")]
    TooLarge { path: PathBuf, size: u64 },
    #[error("state file {path}: not a scaler state file: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("state file {path}: format {found:?}; this scaler reads {FORMAT:?}")]
    Format { path: PathBuf, found: String },
    #[error("state file {path}: not a regular file")]
    NotAFile { path: PathBuf },
    #[error(
        "state file {path}: in use by another scaler (it holds {lock}); two scalers \
         sharing one state file would overwrite each other's seasons"
    )]
    InUse { path: PathBuf, lock: PathBuf },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads the state at `path`; `None` when there is none yet (a first start).
pub fn load(path: &Path) -> Result<Option<SavedState>, StateError> {
    // Not opened unless a regular file: opening a FIFO would wait for a writer.
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => {}
        Ok(_) => {
            return Err(StateError::NotAFile {
                path: path.to_path_buf(),
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(path)(e)),
    }
    let file = std::fs::File::open(path).map_err(io(path))?;
    let mut bytes = Vec::new();
    // One byte past the limit tells a file at the limit from a longer one.
    file.take(MAX_STATE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io(path))?;
    if bytes.len() as u64 > MAX_STATE_BYTES {
        let size = std::fs::metadata(path).map_or(bytes.len() as u64, |m| m.len());
        return Err(StateError::TooLarge {
            path: path.to_path_buf(),
            size,
        });
    }
    // The format first, so a newer file is refused for that and not for its fields.
    let parse = |reason: serde_json::Error| StateError::Parse {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(parse)?;
    let found = v.get("format").and_then(|f| f.as_str()).unwrap_or("");
    if found != FORMAT {
        return Err(StateError::Format {
            path: path.to_path_buf(),
            found: found.to_owned(),
        });
    }
    serde_json::from_value(v).map(Some).map_err(parse)
}

/// Writes `state` to `path` whole: to a temporary file beside it, synced, then renamed
/// over it (and the directory synced, so the rename survives a power loss).
pub fn save(path: &Path, state: &SavedState) -> Result<(), StateError> {
    let bytes = serde_json::to_vec(state).map_err(|e| StateError::Parse {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // A new file of its own (O_EXCL, a random name, mode 0600): never one a link
    // points at, nor another process's temporary file on a shared volume.
    let written = (|| {
        let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
        tmp.write_all(&bytes)?;
        tmp.as_file().sync_all()?;
        tmp.persist(path).map_err(|e| e.error)?;
        Ok::<(), std::io::Error>(())
    })();
    written.map_err(io(path))?;
    // Some filesystems cannot sync a directory; the file itself is whole either way.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Moves a state file that cannot be used to `<path>.rejected` (replacing an older
/// one), so the next save does not overwrite what a newer scaler, or a person, may
/// still want; returns where it went.
pub fn set_aside(path: &Path) -> Result<PathBuf, StateError> {
    let mut aside = path.as_os_str().to_owned();
    aside.push(".rejected");
    let aside = PathBuf::from(aside);
    std::fs::rename(path, &aside).map_err(io(path))?;
    Ok(aside)
}

/// How long a starting scaler waits for another to let go of its state file: a pod
/// replaced outside a rollout starts while the old one still drains (up to its
/// grace period), and both mount the same claim.
pub const LOCK_WAIT_S: f64 = 90.0;

/// [`lock`], retried every second for up to `wait` while another scaler holds it.
pub fn lock_waiting(path: &Path, wait: std::time::Duration) -> Result<std::fs::File, StateError> {
    let until = std::time::Instant::now() + wait;
    let mut said = false;
    loop {
        match lock(path) {
            Err(e @ StateError::InUse { .. }) if std::time::Instant::now() < until => {
                if !said {
                    said = true;
                    tracing::warn!(error = %e, wait_s = wait.as_secs_f64(), "waiting for the other scaler to let go of the state file");
                }
                std::thread::sleep(std::time::Duration::from_millis(250).min(wait));
            }
            r => return r,
        }
    }
}

/// Holds `<path>.lock` for as long as the returned file is kept: one scaler per state
/// file. [`StateError::InUse`] when another holds it; any other error means the
/// filesystem cannot lock (some network filesystems), which the caller may accept.
pub fn lock(path: &Path) -> Result<std::fs::File, StateError> {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let lock = PathBuf::from(name);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)
        .map_err(io(&lock))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(StateError::InUse {
            path: path.to_path_buf(),
            lock,
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io(&lock)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::season::Season;

    fn state() -> SavedState {
        let mut s = Season::new(86_400.0, 300.0).expect("season");
        let mut t = 0.0;
        while t < 3600.0 {
            s.record(t, 100.0, 5.0);
            t += 5.0;
        }
        SavedState::new(
            3600.0,
            vec![SavedPool {
                model: "llama".into(),
                pool: "prefill".into(),
                saved_unix: 3600.0,
                season: s.state(),
                identity: None,
            }],
        )
    }

    #[test]
    fn a_saved_state_reads_back_as_it_was_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert!(load(&path).unwrap().is_none(), "none before the first save");
        save(&path, &state()).unwrap();
        let mut again = state();
        again.saved_unix = 7200.0;
        save(&path, &again).unwrap();
        assert_eq!(load(&path).unwrap(), Some(again));
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
    }

    #[test]
    fn a_file_that_is_not_a_state_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let good = serde_json::to_string(&state()).unwrap();
        let cases: [(&[u8], &str); 5] = [
            (b"", "not a scaler state file"),
            (
                &good.as_bytes()[..good.len() / 2],
                "not a scaler state file",
            ),
            (
                br#"{"format": "preheat-scaler-state/2", "x": 1}"#,
                "format \"preheat-scaler-state/2\"",
            ),
            (br#"[1, 2]"#, "format \"\""),
            (
                br#"{"format": "preheat-scaler-state/1", "saved_unix": 1, "pools": [], "x": 1}"#,
                "unknown field",
            ),
        ];
        for (bytes, want) in cases {
            std::fs::write(&path, bytes).unwrap();
            let e = load(&path).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("state.json"), "{e}");
        }
    }

    #[test]
    fn a_state_file_past_the_limit_is_refused_before_it_is_parsed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(MAX_STATE_BYTES + 10).unwrap();
        let e = load(&path).unwrap_err();
        assert!(
            matches!(e, StateError::TooLarge { size, .. } if size == MAX_STATE_BYTES + 10),
            "{e}"
        );
    }

    #[test]
    fn a_save_that_cannot_be_written_says_where_and_keeps_the_last_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        save(&path, &state()).unwrap();
        // The target is now a directory: the rename fails, the temporary file goes.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir_all(blocked.join("inner")).unwrap();
        let e = save(&blocked, &state()).unwrap_err().to_string();
        assert!(e.contains("blocked"), "{e}");
        assert_eq!(load(&path).unwrap(), Some(state()));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo (coreutils)");
        let e = load(&path).unwrap_err();
        assert!(matches!(e, StateError::NotAFile { .. }), "{e}");
    }

    #[test]
    fn an_unusable_file_is_set_aside_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(&path, b"{\"format\": \"preheat-scaler-state/9\"}").unwrap();
        let aside = set_aside(&path).unwrap();
        assert_eq!(aside, dir.path().join("state.json.rejected"));
        assert!(load(&path).unwrap().is_none());
        assert!(std::fs::read_to_string(&aside).unwrap().contains("/9"));
    }

    #[test]
    fn one_scaler_holds_a_state_file_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let held = lock(&path).unwrap();
        let e = lock(&path).unwrap_err();
        assert!(matches!(e, StateError::InUse { .. }), "{e}");
        assert!(e.to_string().contains("another scaler"), "{e}");
        drop(held);
        lock(&path).expect("free again once the holder is gone");
    }

    #[test]
    fn a_starting_scaler_waits_for_the_old_one_to_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let held = lock(&path).unwrap();
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(held);
        });
        lock_waiting(&path, std::time::Duration::from_secs(10)).expect("free within the wait");
        letting_go.join().unwrap();
        // Held past the wait: InUse, after waiting for it.
        let _held = lock(&path.with_extension("b")).unwrap();
        let t0 = std::time::Instant::now();
        let e = lock_waiting(
            &path.with_extension("b"),
            std::time::Duration::from_millis(400),
        );
        assert!(matches!(e, Err(StateError::InUse { .. })), "{e:?}");
        assert!(t0.elapsed() >= std::time::Duration::from_millis(400));
    }

    #[test]
    fn a_week_old_state_still_resumes_a_daily_season_and_a_weekly_one_lasts_four_weeks() {
        assert_eq!(max_age_s(86_400.0), 7.0 * 86_400.0);
        assert_eq!(max_age_s(7.0 * 86_400.0), 28.0 * 86_400.0);
    }
}
