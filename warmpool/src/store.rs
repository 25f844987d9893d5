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

/// A staged model as the store sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct StagedModel {
    pub name: String,
    pub path: PathBuf,
    pub bytes: u64,
    /// Unix seconds of the last stage or use.
    pub last_used: f64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
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
        let state_path = dir.join(STATE_FILE);
        let state = match std::fs::read(&state_path) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                tracing::warn!(path = %state_path.display(), error = %e, "unreadable store state; usage times reset");
                State::default()
            }),
            Err(_) => State::default(),
        };
        Ok(Store {
            dir,
            disk_budget,
            state: Mutex::new(state),
            staging: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashSet::new()),
            evictions: 0.into(),
        })
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

    /// The usage record as this process and the others sharing the directory left
    /// it: for each model the later of the two times.
    fn merged_state(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().expect("no panics while held");
        if let Ok(b) = std::fs::read(self.dir.join(STATE_FILE))
            && let Ok(disk) = serde_json::from_slice::<State>(&b)
        {
            for (name, t) in disk.last_used {
                let e = s.last_used.entry(name).or_insert(t);
                *e = e.max(t);
            }
        }
        s
    }

    /// Published snapshots in the directory, least recently wanted first.
    pub fn list(&self) -> Result<Vec<StagedModel>> {
        let rd = std::fs::read_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        let state = self.merged_state();
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
        let mut s = self.merged_state();
        s.last_used.insert(name.to_owned(), now());
        self.save(&s);
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
                let plan = stage::plan(fetcher, opts.piece_bytes).await?;
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
            let mut s = self.merged_state();
            s.last_used.entry(name.to_owned()).or_insert(0.0);
            self.save(&s);
        }
        Ok(out)
    }

    /// Whether `incoming` more bytes fit beside what is staged, evicting nothing.
    fn fits(&self, name: &str, incoming: u64) -> Result<()> {
        let used: u64 = self.list()?.iter().map(|m| m.bytes).sum::<u64>() + self.partial_bytes();
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
        let mut used: u64 = models.iter().map(|m| m.bytes).sum::<u64>() + self.partial_bytes();
        for m in &models {
            if used + incoming <= self.disk_budget {
                break;
            }
            if m.name == name || keep.contains(&m.name) || crate::lease::held(&m.path) {
                continue;
            }
            self.evict(&m.name)?;
            used = used.saturating_sub(m.bytes);
        }
        if used + incoming > self.disk_budget {
            return Err(Error::OverBudget(format!(
                "{name} needs {incoming} bytes; {used} of {} are held by models that must stay (configured to, or mapped by a replica)",
                self.disk_budget
            )));
        }
        Ok(())
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
        let mut s = self.merged_state();
        s.last_used.remove(name);
        self.save(&s);
        self.evictions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(
            model = name,
            "evicted (least recently wanted, mapped by no replica, past the disk budget)"
        );
        Ok(())
    }
}
