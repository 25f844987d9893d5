//! Restarting replicas that die at start: exponential back-off between attempts, and
//! a verdict after a few quick deaths in a row, carrying the replica's own last words,
//! so a worker that cannot start (a stale model, a bad flag, no memory) is reported
//! instead of being respawned as fast as the loop turns.

use std::path::Path;
use std::time::{Duration, Instant};

/// Back-off state of one pool's starts.
#[derive(Clone, Debug)]
#[must_use]
pub struct RestartBackoff {
    base: Duration,
    cap: Duration,
    give_up_after: u32,
    quick_deaths: u32,
    next_start: Option<Instant>,
    last_reason: Option<String>,
}

impl Default for RestartBackoff {
    /// 0.5 s, doubling to at most 30 s; a verdict after 4 quick deaths in a row.
    fn default() -> Self {
        RestartBackoff::new(Duration::from_millis(500), Duration::from_secs(30), 4)
    }
}

impl RestartBackoff {
    pub fn new(base: Duration, cap: Duration, give_up_after: u32) -> Self {
        RestartBackoff {
            base,
            cap,
            give_up_after: give_up_after.max(1),
            quick_deaths: 0,
            next_start: None,
            last_reason: None,
        }
    }

    /// Whether a start may be attempted at `now`.
    #[must_use]
    pub fn may_start(&self, now: Instant) -> bool {
        self.next_start.is_none_or(|t| now >= t)
    }

    /// A replica died before it served; the next start waits twice as long as the last.
    pub fn died_at_start(&mut self, now: Instant, reason: impl Into<String>) {
        self.quick_deaths = self.quick_deaths.saturating_add(1);
        let wait = self
            .base
            .saturating_mul(1 << (self.quick_deaths - 1).min(16))
            .min(self.cap);
        self.next_start = Some(now + wait);
        self.last_reason = Some(reason.into());
    }

    /// A replica started and served: the count starts over.
    pub fn started_ok(&mut self) {
        self.quick_deaths = 0;
        self.next_start = None;
        self.last_reason = None;
    }

    /// Quick deaths in a row.
    #[must_use]
    pub fn quick_deaths(&self) -> u32 {
        self.quick_deaths
    }

    /// After `give_up_after` quick deaths in a row: why the last one died.
    #[must_use]
    pub fn gave_up(&self) -> Option<&str> {
        (self.quick_deaths >= self.give_up_after)
            .then(|| self.last_reason.as_deref().unwrap_or("no reason recorded"))
    }
}

/// The last `lines` non-empty lines of a replica's log (its own account of why it
/// stopped), joined by " | "; empty when the log cannot be read.
#[must_use]
pub fn log_tail(path: &Path, lines: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    // Only the end matters, and a runaway log must not be read whole.
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let mut text = Vec::new();
    if f.seek(SeekFrom::Start(len.saturating_sub(16 * 1024)))
        .is_err()
        || f.read_to_end(&mut text).is_err()
    {
        return String::new();
    }
    let text = String::from_utf8_lossy(&text);
    let tail: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    tail[tail.len().saturating_sub(lines)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_and_a_verdict_comes_after_the_limit() {
        let mut b = RestartBackoff::new(Duration::from_secs(1), Duration::from_secs(3), 3);
        let t = Instant::now();
        assert!(b.may_start(t));
        b.died_at_start(t, "one");
        assert!(!b.may_start(t + Duration::from_millis(999)));
        assert!(b.may_start(t + Duration::from_secs(1)));
        b.died_at_start(t, "two");
        assert!(!b.may_start(t + Duration::from_millis(1999)));
        assert!(b.gave_up().is_none());
        b.died_at_start(t, "three");
        assert!(b.may_start(t + Duration::from_secs(3)), "capped at 3 s");
        assert_eq!(b.gave_up(), Some("three"));
        b.started_ok();
        assert!(b.gave_up().is_none() && b.may_start(t));
    }

    #[test]
    fn log_tail_keeps_the_last_lines() {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), "a\n\nb\nc\n").unwrap();
        assert_eq!(log_tail(f.path(), 2), "b | c");
        assert_eq!(log_tail(Path::new("/nonexistent/x"), 2), "");
    }
}
