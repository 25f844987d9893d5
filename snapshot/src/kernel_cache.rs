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
//!
//! Keyed ([`KernelCache::with_key`], the key derived from the deployment's cluster
//! token): `PHKS` magic, HMAC-SHA256 of the entry's id and payload, payload. A keyed
//! cache takes only entries signed with its key for their own id: whoever can write the
//! node's directory without the token (another pod with a hostPath, a planted file)
//! cannot get GPU code loaded, nor move a genuine entry under another key.

use std::path::{Path, PathBuf};

use crate::{Checksum, Error, Result, Snapshot};

const MAGIC: &[u8; 4] = b"PHKC";
const SIGNED: &[u8; 4] = b"PHKS";

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
    key: Option<ring::hmac::Key>,
}

impl KernelCache {
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        if !root.is_dir() {
            std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
        }
        Ok(KernelCache { root, key: None })
    }

    /// Signs what it stores with `key` and takes only entries signed with it.
    #[must_use]
    pub fn with_key(mut self, key: &[u8]) -> Self {
        self.key = Some(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key));
        self
    }

    fn tag(key: &ring::hmac::Key, id: &str, image: &[u8]) -> ring::hmac::Tag {
        let msg = [&(id.len() as u32).to_le_bytes()[..], id.as_bytes(), image].concat();
        ring::hmac::sign(key, &msg)
    }

    /// The payload of a stored entry, if it is intact (and, keyed, signed for `id`).
    fn check<'a>(&self, id: &str, b: &'a [u8]) -> Option<&'a [u8]> {
        match &self.key {
            None => (b.len() >= 12
                && &b[..4] == MAGIC
                && Checksum::of(&b[12..]).0
                    == u64::from_le_bytes(b[4..12].try_into().expect("8 bytes")))
            .then(|| &b[12..]),
            Some(key) => {
                if b.len() < 36 || &b[..4] != SIGNED {
                    return None;
                }
                let msg = [
                    &(id.len() as u32).to_le_bytes()[..],
                    id.as_bytes(),
                    &b[36..],
                ]
                .concat();
                // Compared in constant time.
                let ok = ring::hmac::verify(key, &msg, &b[4..36]).is_ok();
                ok.then(|| &b[36..])
            }
        }
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
        match self.check(id, &b) {
            Some(image) => Ok(Some(image.to_vec())),
            None => {
                // (A reader on a read-only mount cannot remove it; it still never
                // loads it.)
                tracing::warn!(path = %p.display(), signed = self.key.is_some(), "corrupt or unsigned kernel-cache entry ignored and removed");
                let _ = std::fs::remove_file(&p);
                Ok(None)
            }
        }
    }

    /// Stores `image` under `id` atomically ([`crate::publish`]).
    pub fn put(&self, id: &str, image: &[u8]) -> Result<()> {
        let p = self.path(id);
        let mut tmp =
            tempfile::NamedTempFile::new_in(&self.root).map_err(|e| Error::io(&self.root, e))?;
        use std::io::Write;
        let f = tmp.as_file_mut();
        let head = match &self.key {
            Some(key) => [&SIGNED[..], Self::tag(key, id, image).as_ref()].concat(),
            None => [&MAGIC[..], &Checksum::of(image).0.to_le_bytes()[..]].concat(),
        };
        f.write_all(&head)
            .and_then(|()| f.write_all(image))
            .map_err(|e| Error::io(&p, e))?;
        crate::publish::publish_temp(tmp, &p)
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

    #[test]
    fn a_keyed_cache_takes_only_entries_signed_for_their_id() {
        let d = tempfile::tempdir().unwrap();
        let agent = KernelCache::open(d.path())
            .unwrap()
            .with_key(b"deployment key");
        let worker = KernelCache::open(d.path())
            .unwrap()
            .with_key(b"deployment key");
        agent.put("a--cuda--sm_90--550", b"genuine image").unwrap();
        assert_eq!(
            worker.get("a--cuda--sm_90--550").unwrap().as_deref(),
            Some(&b"genuine image"[..])
        );
        // Planted without the key: an unsigned entry, one signed with another key, a
        // genuine entry copied under another id. None is ever handed out.
        KernelCache::open(d.path())
            .unwrap()
            .put("planted", b"evil")
            .unwrap();
        KernelCache::open(d.path())
            .unwrap()
            .with_key(b"another key")
            .put("forged", b"evil")
            .unwrap();
        std::fs::copy(
            d.path().join("a--cuda--sm_90--550.kcache"),
            d.path().join("b--cuda--sm_90--550.kcache"),
        )
        .unwrap();
        for id in ["planted", "forged", "b--cuda--sm_90--550"] {
            assert_eq!(worker.get(id).unwrap(), None, "{id}");
        }
        assert!(worker.get("a--cuda--sm_90--550").unwrap().is_some());
    }
}
