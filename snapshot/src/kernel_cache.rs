//! Compiled kernels (CUDA modules, captured-graph plans) persisted on the node, keyed
//! by everything that makes them valid: model, backend, GPU architecture and driver.
//! A GPU backend asks [`KernelCache::get`] before compiling and [`KernelCache::put`]s
//! what it compiled; the warm-pool agent keeps the directory across pod restarts and
//! seeds it from the kernel-cache sections of staged snapshots. It lives here, beside
//! the snapshot's own kernel-cache sections, so the engine and the agent share it
//! without depending on each other.
//!
//! Each entry is one file: `PHKC` magic, XXH3-64 of the payload, payload. A corrupt
//! entry is removed and reported as a miss, never handed to a driver.

use std::path::{Path, PathBuf};

use crate::{Checksum, Error, Result, Snapshot};

const MAGIC: &[u8; 4] = b"PHKC";

/// What a compiled kernel image is valid for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    /// The model's weights fingerprint or name.
    pub model: String,
    /// e.g. `cuda`.
    pub backend: String,
    /// e.g. `sm_90`.
    pub arch: String,
    /// e.g. `550.54.15`.
    pub driver: String,
}

impl KernelKey {
    /// The key as stored in a snapshot's kernel-cache section and as a file name.
    #[must_use]
    pub fn id(&self) -> String {
        format!(
            "{}--{}--{}--{}",
            clean(&self.model),
            clean(&self.backend),
            clean(&self.arch),
            clean(&self.driver)
        )
    }
}

/// `s` with every character a file name cannot safely hold replaced by `_`.
fn clean(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A directory of kernel images.
#[derive(Clone, Debug)]
pub struct KernelCache {
    root: PathBuf,
}

impl KernelCache {
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
        Ok(KernelCache { root })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.root.join(format!("{id}.kcache"))
    }

    /// The image stored under `id`, if present and intact.
    pub fn get(&self, id: &str) -> Result<Option<Vec<u8>>> {
        let p = self.path(id);
        let b = match std::fs::read(&p) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(&p, e)),
        };
        let ok = b.len() >= 12
            && &b[..4] == MAGIC
            && Checksum::of(&b[12..]).0
                == u64::from_le_bytes(b[4..12].try_into().expect("8 bytes"));
        if !ok {
            tracing::warn!(path = %p.display(), "corrupt kernel-cache entry removed");
            let _ = std::fs::remove_file(&p);
            return Ok(None);
        }
        Ok(Some(b[12..].to_vec()))
    }

    /// Stores `image` under `id` atomically (temp file, fsync, rename).
    pub fn put(&self, id: &str, image: &[u8]) -> Result<()> {
        let p = self.path(id);
        let mut tmp =
            tempfile::NamedTempFile::new_in(&self.root).map_err(|e| Error::io(&self.root, e))?;
        use std::io::Write;
        let f = tmp.as_file_mut();
        f.write_all(MAGIC)
            .and_then(|()| f.write_all(&Checksum::of(image).0.to_le_bytes()))
            .and_then(|()| f.write_all(image))
            .and_then(|()| f.sync_all())
            .and_then(|()| crate::writer::shareable(f))
            .map_err(|e| Error::io(&p, e))?;
        tmp.persist(&p).map_err(|e| Error::io(&p, e.error))?;
        Ok(())
    }

    /// Entry ids with their sizes.
    pub fn entries(&self) -> Result<Vec<(String, u64)>> {
        let rd = std::fs::read_dir(&self.root).map_err(|e| Error::io(&self.root, e))?;
        let mut v: Vec<(String, u64)> = rd
            .flatten()
            .filter_map(|e| {
                let n = e
                    .file_name()
                    .to_string_lossy()
                    .strip_suffix(".kcache")?
                    .to_owned();
                Some((n, e.metadata().ok()?.len()))
            })
            .collect();
        v.sort();
        Ok(v)
    }

    /// Copies the kernel-cache sections of `snap` that the directory lacks; returns how
    /// many were added. Each section is checked against its digest first.
    pub fn seed_from(&self, snap: &Snapshot) -> Result<usize> {
        let mut added = 0;
        for k in &snap.manifest().kernel_cache {
            let name = clean(&k.key);
            if self.get(&name)?.is_some() {
                continue;
            }
            let bytes = snap.blob(&k.blob);
            if Checksum::of(bytes) != k.blob.checksum {
                tracing::warn!(key = %k.key, snapshot = %snap.path().display(), "kernel-cache section fails its checksum; skipped");
                continue;
            }
            self.put(&name, bytes)?;
            added += 1;
        }
        Ok(added)
    }

    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption_is_a_miss() {
        let d = tempfile::tempdir().unwrap();
        let c = KernelCache::open(d.path()).unwrap();
        let key = KernelKey {
            model: "llama-1b@abc".into(),
            backend: "cuda".into(),
            arch: "sm_90".into(),
            driver: "550.54".into(),
        };
        let id = key.id();
        assert_eq!(id, "llama-1b_abc--cuda--sm_90--550.54");
        assert_eq!(c.get(&id).unwrap(), None);
        c.put(&id, b"ptx image").unwrap();
        assert_eq!(c.get(&id).unwrap().as_deref(), Some(&b"ptx image"[..]));
        // Reopened (a restarted agent) it is still there.
        let c2 = KernelCache::open(d.path()).unwrap();
        assert_eq!(c2.entries().unwrap(), vec![(id.clone(), 12 + 9)]);
        let p = d.path().join(format!("{id}.kcache"));
        let mut b = std::fs::read(&p).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(&p, b).unwrap();
        assert_eq!(c2.get(&id).unwrap(), None);
        assert!(!p.exists(), "corrupt entries are removed");
    }
}
