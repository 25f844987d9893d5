//! A replica's claim on the snapshot it maps: a shared `flock` on the file, held for
//! the replica's life (pods and the agents' standbys alike). The node's store evicts
//! only snapshots nobody holds, so it never deletes a model a replica on the node
//! serves: the bytes would stay on disk until the replica exits (the budget would
//! lie), and its restart would stage the model again. `flock` works across
//! containers because the node directory is one file system on one kernel.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Held while it lives; dropping it (or the process exiting) releases the claim.
#[derive(Debug)]
pub struct Lease {
    _file: File,
}

impl Lease {
    /// Claims `path` (a staged snapshot) for as long as the lease lives. Shared: any
    /// number of replicas hold it together. It waits while the store evicts the file
    /// (the store unlinks it holding the exclusive lock), then finds the path gone or
    /// another file there: `NotFound` rather than a claim on an unlinked file.
    pub fn take(path: &Path) -> std::io::Result<Lease> {
        let file = File::open(path)?;
        file.lock_shared()?;
        let (held, now) = (file.metadata()?, std::fs::metadata(path)?);
        if (held.dev(), held.ino()) != (now.dev(), now.ino()) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{} was replaced while it was being claimed", path.display()),
            ));
        }
        Ok(Lease { _file: file })
    }
}

/// The exclusive lock on a snapshot nobody leases, held while the store removes it:
/// a replica claiming it meanwhile waits, then finds it gone.
#[derive(Debug)]
pub struct Unclaimed {
    _file: File,
}

/// [`Unclaimed`] when no replica holds a lease on `path`; `None` when one does, or
/// when the check fails (then it counts as held: never evict on a doubt).
#[must_use]
pub fn unclaimed(path: &Path) -> Option<Unclaimed> {
    let file = File::open(path).ok()?;
    match file.try_lock() {
        Ok(()) => Some(Unclaimed { _file: file }),
        Err(std::fs::TryLockError::WouldBlock) => None,
        Err(std::fs::TryLockError::Error(e)) => {
            tracing::warn!(path = %path.display(), error = %e, "lease check failed; treated as held");
            None
        }
    }
}

/// Whether a replica holds a lease on `path`. A file that is not there is held by
/// nobody.
#[must_use]
pub fn held(path: &Path) -> bool {
    path.is_file() && unclaimed(path).is_none()
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

    #[test]
    fn a_claim_on_a_file_evicted_meanwhile_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.preheat");
        std::fs::write(&p, b"x").unwrap();
        // The store holds the exclusive lock while it removes the file; a claim
        // waits for it, then finds the path gone.
        let evicting = unclaimed(&p).unwrap();
        let claim = {
            let p = p.clone();
            std::thread::spawn(move || Lease::take(&p))
        };
        // Deliberate: the claim is waiting on the lock when the file goes.
        std::thread::sleep(std::time::Duration::from_millis(100));
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, b"y").unwrap();
        drop(evicting);
        let err = claim.join().unwrap().unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
        assert!(Lease::take(&p).is_ok(), "the new file can be claimed");
    }
}
