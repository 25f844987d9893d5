//! Handing the node's cache directories to the user the agent and workers run as. The
//! kubelet creates a hostPath root-owned; one short init step, root with only
//! CAP_CHOWN, gives the tree to that user, so the agent, its standbys and the staging
//! step run as non-root with no capabilities at all.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::{Error, Result};

/// Creates `dir` when missing and gives it, and everything under it, to `uid:gid`
/// (links themselves, never what they point to). Returns how many entries changed.
pub fn own_tree(dir: &Path, uid: u32, gid: u32) -> Result<usize> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    own(dir, uid, gid)
}

fn own(p: &Path, uid: u32, gid: u32) -> Result<usize> {
    let m = std::fs::symlink_metadata(p).map_err(|e| Error::io(p, e))?;
    let mut n = 0;
    if m.uid() != uid || m.gid() != gid {
        std::os::unix::fs::lchown(p, Some(uid), Some(gid)).map_err(|e| Error::io(p, e))?;
        n += 1;
    }
    if m.is_dir() {
        for e in std::fs::read_dir(p).map_err(|e| Error::io(p, e))? {
            let e = e.map_err(|e| Error::io(p, e))?;
            n += own(&e.path(), uid, gid)?;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_already_owned_is_left_alone_and_links_are_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let (uid, gid) = {
            let m = std::fs::metadata(d.path()).unwrap();
            (m.uid(), m.gid())
        };
        std::fs::create_dir_all(d.path().join("snapshots/x")).unwrap();
        std::fs::write(d.path().join("snapshots/x/m.preheat"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", d.path().join("snapshots/link")).unwrap();
        // Owned by us already (any user can run this): nothing changes, nothing
        // behind the link is touched.
        assert_eq!(own_tree(&d.path().join("snapshots"), uid, gid).unwrap(), 0);
        assert_eq!(own_tree(&d.path().join("kernels"), uid, gid).unwrap(), 0);
        assert!(
            d.path().join("kernels").is_dir(),
            "a missing directory is made"
        );
        let passwd = std::fs::metadata("/etc/passwd").unwrap();
        assert_eq!(passwd.uid(), 0);
    }
}
