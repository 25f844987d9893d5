//! A replica's claim on the snapshot it maps: a shared `flock` on the file, held for
//! the replica's life (pods and the agents' standbys alike). The node's store evicts
//! only snapshots nobody holds, so it never deletes a model a replica on the node
//! serves: the bytes would stay on disk until the replica exits (the budget would
//! lie), and its restart would stage the model again. `flock` works across
//! containers because the node directory is one file system on one kernel.

use std::fs::File;
use std::path::Path;

/// Held while it lives; dropping it (or the process exiting) releases the claim.
#[derive(Debug)]
pub struct Lease {
    _file: File,
}

impl Lease {
    /// Claims `path` (a staged snapshot) for as long as the lease lives. Shared: any
    /// number of replicas hold it together; blocks only while the store is evicting
    /// the file (then the replica maps the unlinked file, which it still reads).
    pub fn take(path: &Path) -> std::io::Result<Lease> {
        let file = File::open(path)?;
        file.lock_shared()?;
        Ok(Lease { _file: file })
    }
}

/// Whether a replica holds a lease on `path` (an exclusive try-lock would block).
/// A file that cannot be opened is held by nobody.
#[must_use]
pub fn held(path: &Path) -> bool {
    let Ok(file) = File::open(path) else {
        return false;
    };
    match file.try_lock() {
        Ok(()) => {
            let _ = file.unlock();
            false
        }
        Err(std::fs::TryLockError::WouldBlock) => true,
        Err(std::fs::TryLockError::Error(e)) => {
            tracing::warn!(path = %path.display(), error = %e, "lease check failed; treated as held");
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_seen_until_it_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.preheat");
        std::fs::write(&p, b"x").unwrap();
        assert!(!held(&p));
        let a = Lease::take(&p).unwrap();
        let b = Lease::take(&p).unwrap();
        assert!(held(&p), "two replicas share it");
        drop(a);
        assert!(held(&p), "one still holds it");
        drop(b);
        assert!(!held(&p));
        assert!(!held(&dir.path().join("missing.preheat")));
    }
}
