//! Making a finished file visible under its final name, all or nothing: a reader (the
//! engine, the agent, a peer fetching it) sees either no file or a whole one, also
//! after a crash or power loss. One way, used by every writer of a snapshot, a packed
//! snapshot, a kernel-cache entry and a staged model: the bytes are fsynced, the file
//! renamed into place, and the directory fsynced so the rename itself is durable.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// A temporary file beside `dest` (same directory, so the rename stays on one
/// filesystem), named `.NAME.*.partial`, and that directory.
pub fn temp_beside(dest: &Path) -> Result<(tempfile::NamedTempFile, PathBuf)> {
    let dir = parent_of(dest).to_path_buf();
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".partial")
        .tempfile_in(&dir)
        .map_err(|e| Error::io(&dir, e))?;
    Ok((tmp, dir))
}

/// Publishes a finished temporary file as `dest`: fsync, readable by the node's other
/// users (workers run as another user than the agent that stages), rename, directory
/// fsync.
pub fn publish_temp(tmp: tempfile::NamedTempFile, dest: &Path) -> Result<()> {
    let file = tmp.as_file();
    file.sync_all()
        .and_then(|()| shareable(file))
        .map_err(|e| Error::io(tmp.path(), e))?;
    tmp.persist(dest).map_err(|e| Error::io(dest, e.error))?;
    sync_dir(parent_of(dest));
    Ok(())
}

/// Publishes `partial`, whose bytes its writer has already fsynced (a resumable file
/// kept by name across restarts), as `dest`: readable by the node's other users,
/// rename, directory fsync.
pub fn publish_synced(partial: &Path, dest: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(partial, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| Error::io(partial, e))?;
    std::fs::rename(partial, dest).map_err(|e| Error::io(dest, e))?;
    sync_dir(parent_of(dest));
    Ok(())
}

/// Read-only for everyone else: the mode a published file has whatever the umask.
pub(crate) fn shareable(file: &File) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(std::fs::Permissions::from_mode(0o644))
}

fn parent_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Makes a rename in `dir` durable. Some filesystems refuse a directory fsync; that is
/// not worth failing a publish for.
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_file_appears_whole_under_its_name_and_shareable() {
        use std::io::Write;
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("m.preheat");
        let (mut tmp, in_dir) = temp_beside(&dest).unwrap();
        assert_eq!(in_dir, dir.path());
        tmp.write_all(b"whole").unwrap();
        assert!(!dest.exists(), "visible before it was published");
        publish_temp(tmp, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"whole");
        let mode = std::fs::metadata(&dest).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
        // Nothing left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

        let partial = dir.path().join("n.partial");
        std::fs::write(&partial, b"synced").unwrap();
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o600)).unwrap();
        let dest2 = dir.path().join("n.preheat");
        publish_synced(&partial, &dest2).unwrap();
        assert!(!partial.exists());
        assert_eq!(std::fs::read(&dest2).unwrap(), b"synced");
        let mode = std::fs::metadata(&dest2).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
    }
}
