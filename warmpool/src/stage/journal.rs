//! The staging journal: which pieces of the partial file are known to be on disk, so an
//! interrupted staging resumes where it stopped.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, Write};
use std::path::PathBuf;

use super::{Plan, SourceKind};
use crate::{Error, Result};

/// The journal of an interrupted staging: which pieces (by destination offset) are
/// known to be on disk.
pub(super) struct Journal {
    pub(super) path: PathBuf,
    file: File,
}

impl Journal {
    pub(super) fn header(plan: &Plan) -> String {
        format!(
            "preheat-stage-journal v1 {} {} {}",
            match plan.kind {
                SourceKind::Snapshot => "snapshot",
                SourceKind::Packed => "packed",
            },
            plan.snapshot_bytes,
            plan.identity
        )
    }

    /// Opens the journal, returning the destination offsets it lists when it was
    /// written for this very source; otherwise starts a new one.
    pub(super) fn open(path: PathBuf, plan: &Plan) -> Result<(Self, HashSet<u64>)> {
        let header = Self::header(plan);
        let mut done = HashSet::new();
        let mut valid = false;
        if let Ok(f) = File::open(&path) {
            let mut lines = std::io::BufReader::new(f).lines();
            if lines.next().and_then(|l| l.ok()).as_deref() == Some(header.as_str()) {
                valid = true;
                for l in lines.map_while(|l| l.ok()) {
                    // A torn last line (crash mid-write) simply does not parse.
                    if let Some(off) = l.strip_prefix("done ").and_then(|v| v.parse().ok()) {
                        done.insert(off);
                    }
                }
            }
        }
        let file = if valid {
            OpenOptions::new().append(true).open(&path)
        } else {
            File::create(&path).and_then(|mut f| {
                writeln!(f, "{header}")?;
                f.sync_data()?;
                Ok(f)
            })
        }
        .map_err(|e| Error::io(&path, e))?;
        Ok((Journal { path, file }, done))
    }

    pub(super) fn record(&mut self, offsets: &[u64]) -> Result<()> {
        let mut s = String::new();
        for o in offsets {
            s.push_str(&format!("done {o}\n"));
        }
        self.file
            .write_all(s.as_bytes())
            .and_then(|()| self.file.sync_data())
            .map_err(|e| Error::io(&self.path, e))
    }
}

impl Journal {
    pub(super) fn open_fresh(old: Journal, plan: &Plan) -> Result<Journal> {
        let path = old.path.clone();
        drop(old);
        let _ = std::fs::remove_file(&path);
        Ok(Journal::open(path, plan)?.0)
    }
}
