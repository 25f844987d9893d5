//! The node's snapshot directory under a disk budget: which models are staged, when
//! each was last wanted, eviction of the least recently wanted one that no replica
//! maps ([`crate::lease`]), and one staging per model however many ask for it at once.
//!
//! Two ways in: [`Store::ensure`] is demand (a replica is starting from the model, or
//! someone asked): it evicts to make room and records the want; [`Store::prefetch`] is
//! the agent filling spare room ahead of demand: it never evicts and records no want,
//! so prefetching cannot push out what was asked for. The agent and the pods' staging
//! step share the directory: the usage record is read back before each change.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use preheat_snapshot::Progress;
use serde::{Deserialize, Serialize};

use crate::fetch::Fetcher;
use crate::stage::{self, EXTENSION, StageOptions, StageOutcome};
use crate::{Error, Result};

const STATE_FILE: &str = ".preheat-store.json";
/// Held (flock) by whoever changes the state file.
const STATE_LOCK: &str = ".preheat-store.lock";

/// A staged model as the store sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct StagedModel {
    pub name: String,
    pub path: PathBuf,
    pub bytes: u64,
    /// Unix seconds of the last stage or use.
    pub last_used: f64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct State {
    /// Model name → unix seconds of its last use.
    last_used: BTreeMap<String, f64>,
}

/// The snapshot directory of one node.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    disk_budget: u64,
    state: Mutex<State>,
    /// One async mutex per model: concurrent requests for a model wait for the one
    /// staging it, then find it published.
    staging: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Models staged or fully verified by this store: the agent calls [`Store::ensure`]
    /// every refresh, and re-reading gigabytes each time to re-verify them would be
    /// wasted I/O (published files are only ever replaced by rename).
    verified: Mutex<HashSet<String>>,
    evictions: std::sync::atomic::AtomicU64,
    /// How long after a want a model is not evicted (see [`Store::with_want_grace`]).
    want_grace: std::time::Duration,
    /// Each model's snapshot size as its source last said: a prefetch that cannot fit
    /// is refused without reading the source's header again every refresh.
    sizes: Mutex<HashMap<String, u64>>,
}

/// A model wanted this recently is not evicted: the window between a pod's staging
/// step ending and its worker leasing the file is a container start, seconds.
pub const WANT_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// The usage record in `dir`; `None` when it is missing or unreadable. Bounded: other
/// processes (the pods' staging steps) write it, and a name and a time per model is
/// far below the bound.
fn read_record(dir: &Path) -> Option<State> {
    use std::io::Read as _;
    const MAX_RECORD: u64 = 4 << 20;
    let path = dir.join(STATE_FILE);
    let mut b = Vec::new();
    std::fs::File::open(&path)
        .and_then(|f| f.take(MAX_RECORD + 1).read_to_end(&mut b))
        .ok()?;
    let parsed = if b.len() as u64 <= MAX_RECORD {
        serde_json::from_slice::<State>(&b).map_err(|e| e.to_string())
    } else {
        Err(format!("over {MAX_RECORD} bytes"))
    };
    parsed
        .inspect_err(|e| tracing::warn!(path = %path.display(), error = %e, "unreadable store state; usage times not read"))
        .ok()
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Store {
    /// Opens (creating) `dir`; `disk_budget` bounds the bytes of staged snapshots.
    pub fn open(dir: impl Into<PathBuf>, disk_budget: u64) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let state = read_record(&dir).unwrap_or_default();
        Ok(Store {
            dir,
            disk_budget,
            state: Mutex::new(state),
            staging: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashSet::new()),
            evictions: 0.into(),
            want_grace: WANT_GRACE,
            sizes: Mutex::new(HashMap::new()),
        })
    }

    /// How long after a want a model is safe from eviction ([`WANT_GRACE`] by
    /// default).
    #[must_use]
    pub fn with_want_grace(mut self, grace: std::time::Duration) -> Self {
        self.want_grace = grace;
        self
    }

    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    #[must_use]
    pub fn disk_budget(&self) -> u64 {
        self.disk_budget
    }

    /// Snapshots evicted since the store was opened.
    #[must_use]
    pub fn evictions(&self) -> u64 {
        self.evictions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The usage record as it is on disk (the agent and the pods' staging steps share
    /// it: the disk copy is the truth), or this process's last copy when the file
    /// cannot be read.
    fn read_state(&self) -> State {
        let mine = self.state.lock().expect("no panics while held");
        self.disk_state_or(&mine)
    }

    /// Changes the usage record: read from disk, changed and written back under an
    /// exclusive lock on the directory's record, so two processes never lose each
    /// other's change.
    fn update(&self, f: impl FnOnce(&mut State)) {
        let mut mine = self.state.lock().expect("no panics while held");
        let path = self.dir.join(STATE_LOCK);
        let lock = stage::lock_file(&path)
            .and_then(|l| l.lock().map(|()| l).map_err(|e| Error::io(&path, e)));
        if let Err(e) = &lock {
            tracing::warn!(error = %e, "usage record not locked; another process's change may be lost");
        }
        let mut s = self.disk_state_or(&mine);
        f(&mut s);
        self.save(&s);
        *mine = s;
    }

    /// The record on disk, or `mine` when it cannot be read.
    fn disk_state_or(&self, mine: &State) -> State {
        read_record(&self.dir).unwrap_or_else(|| mine.clone())
    }

    /// Published snapshots in the directory, least recently wanted first.
    pub fn list(&self) -> Result<Vec<StagedModel>> {
        let rd = std::fs::read_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let state = self.read_state();
        let mut out = Vec::new();
        for e in rd.flatten() {
            let path = e.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(&format!(".{EXTENSION}")))
            else {
                continue;
            };
            if name.starts_with('.') {
                continue;
            }
            let Ok(meta) = e.metadata() else { continue };
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0.0, |d| d.as_secs_f64());
            out.push(StagedModel {
                name: name.to_owned(),
                bytes: meta.len(),
                last_used: state.last_used.get(name).copied().unwrap_or(mtime),
                path,
            });
        }
        out.sort_by(|a, b| {
            a.last_used
                .total_cmp(&b.last_used)
                .then(a.name.cmp(&b.name))
        });
        Ok(out)
    }

    /// Path of model `name` when it is staged.
    #[must_use]
    pub fn path_of(&self, name: &str) -> Option<PathBuf> {
        let p = stage::snapshot_path(&self.dir, name);
        p.is_file().then_some(p)
    }

    /// Records a want of `name` (a replica started from it, or maps it now): eviction
    /// goes by this.
    pub fn touch(&self, name: &str) {
        self.touch_all([name]);
    }

    /// [`Store::touch`] for several models, in one change of the record.
    pub fn touch_all<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        let t = now();
        self.update(|s| {
            for name in names {
                s.last_used.insert(name.to_owned(), t);
            }
        });
    }

    /// Writes the state the way every other file here is published (temp file, fsync,
    /// rename, directory fsync), so a crash leaves the old state or the new one.
    fn save(&self, s: &State) {
        use preheat_snapshot::publish::{publish_temp, temp_beside};
        use std::io::Write as _;
        let path = self.dir.join(STATE_FILE);
        let r = (|| -> std::result::Result<(), String> {
            let bytes = serde_json::to_vec(s).map_err(|e| e.to_string())?;
            let (mut tmp, _) = temp_beside(&path).map_err(|e| e.to_string())?;
            tmp.write_all(&bytes).map_err(|e| e.to_string())?;
            publish_temp(tmp, &path).map_err(|e| e.to_string())
        })();
        if let Err(e) = r {
            tracing::warn!(path = %path.display(), error = %e, "could not save store state");
        }
    }

    /// Stages `name` from `fetcher` unless it is already staged, first evicting the
    /// least recently wanted snapshots (never one in `keep`, never one a replica
    /// maps) until it fits the budget; records the want.
    pub async fn ensure(
        &self,
        name: &str,
        fetcher: &Fetcher,
        opts: &StageOptions,
        keep: &HashSet<String>,
        progress: Arc<dyn Progress>,
    ) -> Result<StageOutcome> {
        self.stage_in(name, fetcher, opts, Some(keep), progress)
            .await
    }

    /// Stages `name` ahead of demand when it fits the budget beside what is staged,
    /// evicting nothing ([`Error::OverBudget`] otherwise) and recording no want: a
    /// model only prefetched is the first to go when a wanted one needs room.
    pub async fn prefetch(
        &self,
        name: &str,
        fetcher: &Fetcher,
        opts: &StageOptions,
        progress: Arc<dyn Progress>,
    ) -> Result<StageOutcome> {
        self.stage_in(name, fetcher, opts, None, progress).await
    }

    /// `keep`: `Some` for demand (evicts others, records the want), `None` to
    /// prefetch.
    async fn stage_in(
        &self,
        name: &str,
        fetcher: &Fetcher,
        opts: &StageOptions,
        keep: Option<&HashSet<String>>,
        progress: Arc<dyn Progress>,
    ) -> Result<StageOutcome> {
        stage::validate_name(name)?;
        let gate = {
            let mut m = self.staging.lock().expect("no panics while held");
            Arc::clone(m.entry(name.to_owned()).or_default())
        };
        let _turn = gate.lock().await;
        let staged = self.path_of(name);
        if let Some(path) = &staged
            && self
                .verified
                .lock()
                .expect("no panics while held")
                .contains(name)
        {
            let bytes = std::fs::metadata(path)
                .map_err(|e| Error::io(path, e))?
                .len();
            if keep.is_some() {
                self.touch(name);
            }
            return Ok(StageOutcome {
                path: path.clone(),
                bytes,
                fetched_bytes: 0,
                resumed_bytes: 0,
                already_staged: true,
                seconds: 0.0,
            });
        }
        let plan = match staged {
            Some(_) => None,
            None => {
                let known = self
                    .sizes
                    .lock()
                    .expect("no panics while held")
                    .get(name)
                    .copied();
                if let (None, Some(bytes)) = (keep, known) {
                    self.fits(name, bytes)?;
                }
                let plan = stage::plan(fetcher, opts.piece_bytes).await?;
                self.sizes
                    .lock()
                    .expect("no panics while held")
                    .insert(name.to_owned(), plan.snapshot_bytes);
                match keep {
                    Some(keep) => self.make_room(name, plan.snapshot_bytes, keep)?,
                    None => self.fits(name, plan.snapshot_bytes)?,
                }
                Some(plan)
            }
        };
        let out = stage::stage_with_plan(fetcher, &self.dir, name, opts, progress, plan).await?;
        self.verified
            .lock()
            .expect("no panics while held")
            .insert(name.to_owned());
        if keep.is_some() {
            self.touch(name);
        } else {
            // Known, never wanted: first in line for eviction (not dated by its file).
            self.update(|s| {
                s.last_used.entry(name.to_owned()).or_insert(0.0);
            });
        }
        Ok(out)
    }

    /// Whether `incoming` more bytes fit beside what is staged, evicting nothing.
    fn fits(&self, name: &str, incoming: u64) -> Result<()> {
        let used = self.used_bytes(&self.list()?);
        if used + incoming > self.disk_budget {
            return Err(Error::OverBudget(format!(
                "{name} needs {incoming} bytes; {used} of {} are staged (it is staged when wanted, making room then)",
                self.disk_budget
            )));
        }
        Ok(())
    }

    /// Evicts the least recently wanted snapshots other than `name`, `keep` and those
    /// a replica maps until `incoming` more bytes fit the budget.
    pub fn make_room(&self, name: &str, incoming: u64, keep: &HashSet<String>) -> Result<()> {
        if incoming > self.disk_budget {
            return Err(Error::OverBudget(format!(
                "{name} needs {incoming} bytes, more than the whole budget of {}",
                self.disk_budget
            )));
        }
        let models = self.list()?;
        let mut used = self.used_bytes(&models);
        for m in &models {
            if used + incoming <= self.disk_budget {
                break;
            }
            // Just wanted: a pod that staged it may not have leased it yet (its
            // staging step has ended, its worker not yet mapped the file).
            let just_wanted = now() - m.last_used < self.want_grace.as_secs_f64();
            if m.name == name || keep.contains(&m.name) || just_wanted {
                continue;
            }
            // Removed under the exclusive lock: a replica claiming it meanwhile waits,
            // then finds it gone rather than leasing an unlinked file.
            let Some(_unclaimed) = crate::lease::unclaimed(&m.path) else {
                continue;
            };
            self.evict(&m.name)?;
            used = used.saturating_sub(m.bytes);
        }
        if used + incoming > self.disk_budget {
            return Err(Error::OverBudget(format!(
                "{name} needs {incoming} bytes; {used} of {} are held by models that must stay (kept, mapped by a replica, or wanted in the last {} s)",
                self.disk_budget,
                self.want_grace.as_secs()
            )));
        }
        Ok(())
    }

    /// Bytes `models` hold on disk, with the stagings in progress.
    fn used_bytes(&self, models: &[StagedModel]) -> u64 {
        models.iter().map(|m| m.bytes).sum::<u64>() + self.partial_bytes()
    }

    /// Bytes held by stagings in progress (their partial files).
    fn partial_bytes(&self) -> u64 {
        std::fs::read_dir(&self.dir).map_or(0, |rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".stage.partial"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
    }

    /// Removes model `name`. Replicas that have it mapped keep reading it: the kernel
    /// frees the blocks only when the last mapping goes.
    pub fn evict(&self, name: &str) -> Result<()> {
        let p = stage::snapshot_path(&self.dir, name);
        std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
        self.verified
            .lock()
            .expect("no panics while held")
            .remove(name);
        self.update(|s| {
            s.last_used.remove(name);
        });
        self.evictions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            model = name,
            "evicted (least recently wanted, mapped by no replica, past the disk budget)"
        );
        Ok(())
    }
}
