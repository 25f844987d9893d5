//! The hot set: staged snapshots held in page cache within a memory budget, so a
//! replica started from them reads RAM. Blocking (page-ins read the disk): the agent
//! runs it off the async threads.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use memmap2::Mmap;
use preheat_snapshot::residency;

/// Below this resident fraction a hot model is paged in again.
const REFRESH_BELOW: f64 = 0.99;

/// State of one hot model after a refresh.
#[derive(Clone, Debug, PartialEq)]
pub struct HotStatus {
    pub name: String,
    pub bytes: u64,
    pub resident_bytes: u64,
    /// Pinned with mlock.
    pub locked: bool,
}

#[derive(Debug)]
struct Entry {
    path: PathBuf,
    inode: u64,
    map: Mmap,
    locked: bool,
}

/// Models kept resident, in priority order within `budget` bytes.
#[derive(Debug)]
pub struct HotSet {
    budget: u64,
    mlock: bool,
    entries: BTreeMap<String, Entry>,
}

impl HotSet {
    #[must_use]
    pub fn new(budget: u64, mlock: bool) -> Self {
        HotSet {
            budget,
            mlock,
            entries: BTreeMap::new(),
        }
    }

    /// Makes the first models of `wanted` (name, staged path; in priority order) that
    /// fit the budget resident, releases the rest, and reports residency (mincore).
    pub fn refresh(&mut self, wanted: &[(String, PathBuf)]) -> Vec<HotStatus> {
        let mut fit = Vec::new();
        let mut used = 0u64;
        for (name, path) in wanted {
            let Ok(meta) = std::fs::metadata(path) else {
                continue;
            };
            if used + meta.len() > self.budget {
                tracing::debug!(model = %name, bytes = meta.len(), "does not fit the memory budget; staged only");
                continue;
            }
            used += meta.len();
            fit.push((name.clone(), path.clone(), meta.ino()));
        }
        self.entries.retain(|n, e| {
            fit.iter()
                .any(|(f, p, ino)| f == n && *p == e.path && *ino == e.inode)
        });
        let mut out = Vec::new();
        for (name, path, inode) in fit {
            if !self.entries.contains_key(&name) {
                match map(&path) {
                    Ok(map) => {
                        let locked = self.mlock && lock(&name, &map);
                        self.entries.insert(
                            name.clone(),
                            Entry {
                                path: path.clone(),
                                inode,
                                map,
                                locked,
                            },
                        );
                    }
                    Err(e) => {
                        tracing::warn!(model = %name, error = %e, "cannot map for the hot set");
                        continue;
                    }
                }
            }
            let e = &self.entries[&name];
            let mut r = residency::of_map(&e.map).unwrap_or_default();
            if r.fraction() < REFRESH_BELOW {
                let t0 = std::time::Instant::now();
                if let Err(err) = residency::populate(&e.map) {
                    tracing::warn!(model = %name, error = %err, "page-in failed");
                }
                let after = residency::of_map(&e.map).unwrap_or_default();
                tracing::info!(model = %name, before = r.fraction(), after = after.fraction(), secs = t0.elapsed().as_secs_f64(), "paged in");
                r = after;
            }
            out.push(HotStatus {
                name,
                bytes: r.total_bytes,
                resident_bytes: r.resident_bytes,
                locked: e.locked,
            });
        }
        out
    }
}

fn map(path: &PathBuf) -> std::io::Result<Mmap> {
    let f = std::fs::File::open(path)?;
    // SAFETY: read-only mapping of a published snapshot; published files are never
    // modified in place (replaced by rename, which the inode check above notices), and
    // no byte is interpreted through this mapping: it exists to hold pages resident.
    #[allow(unsafe_code)]
    let m = unsafe { Mmap::map(&f) }?;
    let _ = m.advise(memmap2::Advice::WillNeed);
    Ok(m)
}

fn lock(name: &str, map: &Mmap) -> bool {
    match map.lock() {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(model = name, error = %e, "mlock refused (RLIMIT_MEMLOCK / CAP_IPC_LOCK); kept resident by touch only");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_decides_who_is_hot_and_residency_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::write(&a, vec![1u8; 3 << 20]).unwrap();
        std::fs::write(&b, vec![2u8; 3 << 20]).unwrap();
        let mut h = HotSet::new(4 << 20, false);
        let s = h.refresh(&[("a".into(), a.clone()), ("b".into(), b.clone())]);
        assert_eq!(s.len(), 1, "only one fits: {s:?}");
        assert_eq!(s[0].name, "a");
        assert_eq!(s[0].bytes, 3 << 20);
        assert!(s[0].resident_bytes > 0);
        // Priorities change: b first.
        let s = h.refresh(&[("b".into(), b), ("a".into(), a)]);
        assert_eq!(s[0].name, "b");
        assert_eq!(h.entries.len(), 1);
    }
}
