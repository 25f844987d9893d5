//! Page-cache residency: how much of a file the kernel holds in memory, and moving it
//! in (so a replica's first forward pass reads RAM, not NVMe) or out (so a benchmark
//! can measure a cold start without root).

use std::fs::File;
use std::io;
use std::path::Path;

/// Resident and total bytes of a file or mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Residency {
    pub resident_bytes: u64,
    pub total_bytes: u64,
}

impl Residency {
    /// Resident fraction in `[0, 1]` (1 for an empty file).
    #[must_use]
    pub fn fraction(&self) -> f64 {
        if self.total_bytes == 0 {
            1.0
        } else {
            self.resident_bytes as f64 / self.total_bytes as f64
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    #[allow(unsafe_code)]
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Asks the kernel (mincore) which pages of `map` are resident.
pub fn of_map(map: &[u8]) -> io::Result<Residency> {
    if map.is_empty() {
        return Ok(Residency::default());
    }
    let page = page_size();
    let pages = map.len().div_ceil(page);
    let mut vec = vec![0u8; pages];
    // SAFETY: `map` is a live mapping whose start is page-aligned (mmap returns page
    // aligned addresses and callers pass whole mappings); `vec` has one byte for each
    // page of `map.len()` bytes, as mincore requires.
    #[allow(unsafe_code)]
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            vec.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let resident_pages = vec.iter().filter(|&&b| b & 1 == 1).count();
    let resident = (resident_pages * page).min(map.len());
    Ok(Residency {
        resident_bytes: resident as u64,
        total_bytes: map.len() as u64,
    })
}

/// Residency of the file at `path` (mapped just for the question).
pub fn of_file(path: &Path) -> io::Result<Residency> {
    let file = File::open(path)?;
    if file.metadata()?.len() == 0 {
        return Ok(Residency::default());
    }
    // SAFETY: read-only mapping used only for mincore; no byte is read through it.
    #[allow(unsafe_code)]
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    of_map(&map)
}

/// Faults every page of `map` into this process's page tables, reading from disk
/// what is not cached. `MADV_POPULATE_READ` (Linux 5.14) does it in one call; older
/// kernels get a read of one byte per page.
pub fn populate(map: &memmap2::Mmap) -> io::Result<()> {
    if map.is_empty() {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    if map.advise(memmap2::Advice::PopulateRead).is_ok() {
        return Ok(());
    }
    let _ = map.advise(memmap2::Advice::WillNeed);
    let page = page_size();
    let mut acc = 0u8;
    for i in (0..map.len()).step_by(page) {
        acc ^= map[i];
    }
    std::hint::black_box(acc);
    Ok(())
}

/// Drops the file's clean pages from page cache (`POSIX_FADV_DONTNEED`). Needs no
/// privilege; pages other processes have locked stay.
pub fn evict(path: &Path) -> io::Result<()> {
    fadvise(path, libc::POSIX_FADV_DONTNEED)
}

/// Starts reading the whole file into page cache (`POSIX_FADV_WILLNEED`); returns at
/// once.
pub fn prefetch(path: &Path) -> io::Result<()> {
    fadvise(path, libc::POSIX_FADV_WILLNEED)
}

fn fadvise(path: &Path, advice: libc::c_int) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let file = File::open(path)?;
    // SAFETY: a valid open descriptor; the advice only affects cache state.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, advice) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reading_a_file_makes_it_resident_and_evict_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let mut f = File::create(&p).unwrap();
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        let _ = std::fs::read(&p).unwrap();
        let r = of_file(&p).unwrap();
        assert_eq!(r.total_bytes, 1 << 20);
        // Just read: resident unless the machine is under heavy memory pressure.
        assert!(r.fraction() > 0.5, "{r:?}");
        evict(&p).unwrap();
        prefetch(&p).unwrap();
        assert_eq!(
            of_file(&dir.path().join("missing")).err().map(|e| e.kind()),
            Some(io::ErrorKind::NotFound)
        );
    }

    #[test]
    fn empty_files_are_fully_resident() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e");
        File::create(&p).unwrap();
        assert_eq!(of_file(&p).unwrap().fraction(), 1.0);
    }
}
