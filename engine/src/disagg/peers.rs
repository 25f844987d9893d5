//! The prefill workers a decode worker may pull K/V from: the lists its gateways
//! announce (`POST /internal/peers`), each kept for a bounded time unless refreshed.
//!
//! A decode worker never connects to an address only because a request body names it:
//! the body's prefill address must be on a list a gateway announced (SSRF through a
//! request body). Announcements, like every internal call, need the cluster token, the
//! one credential between preheat's processes. A gateway that stops announcing (gone,
//! restarted under a new id) has its list expire; a gateway picks a prefill worker for
//! a decode worker only once that decode worker was told about it.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Most gateways whose lists are kept at once (gateway replicas, plus restarts whose
/// old lists have not expired yet).
pub const MAX_SOURCES: usize = 64;
/// Most prefill addresses in one announcement.
pub const MAX_PEERS: usize = 4096;
/// Longest address accepted (`tcp://` plus a DNS name and port).
pub const MAX_ADDRESS_LEN: usize = 300;
/// Longest a list is kept without a refresh, whatever the announcement asks.
pub const MAX_TTL: Duration = Duration::from_secs(60);

/// `POST /internal/peers` on a decode worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Announcement {
    /// The announcing gateway's instance id: its list replaces its previous one.
    pub from: String,
    /// Rises with each of the gateway's announcements: one that arrives after a later
    /// one is ignored.
    #[serde(default)]
    pub seq: u64,
    /// Where this decode worker may pull K/V from (`tcp://host:port`, or an HTTP base
    /// URL for prefill workers without a KV port where no cluster token is set).
    pub prefill: Vec<String>,
    /// How long the list holds without a refresh (capped at [`MAX_TTL`]).
    pub ttl_ms: u64,
}

/// Why an announcement was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum AnnouncementError {
    #[error("an announcement lists at most {MAX_PEERS} prefill addresses, got {0}")]
    TooMany(usize),
    #[error("a prefill address is at most {MAX_ADDRESS_LEN} bytes")]
    TooLong,
    #[error("the announcing gateway's id must be 1 to 128 bytes")]
    BadSource,
}

#[derive(Debug)]
struct Listed {
    seq: u64,
    addresses: HashSet<String>,
    until: Instant,
}

/// The prefill addresses announced to this decode worker, by gateway.
#[derive(Debug, Default)]
pub struct KnownPeers(Mutex<HashMap<String, Listed>>);

impl KnownPeers {
    /// Takes `a` as its gateway's current list. Lists past their time are dropped
    /// first; with [`MAX_SOURCES`] live lists, the one closest to expiry makes room.
    pub fn announce(&self, a: Announcement) -> Result<(), AnnouncementError> {
        if a.prefill.len() > MAX_PEERS {
            return Err(AnnouncementError::TooMany(a.prefill.len()));
        }
        if a.prefill.iter().any(|p| p.len() > MAX_ADDRESS_LEN) {
            return Err(AnnouncementError::TooLong);
        }
        if a.from.is_empty() || a.from.len() > 128 {
            return Err(AnnouncementError::BadSource);
        }
        let now = Instant::now();
        let ttl = Duration::from_millis(a.ttl_ms).min(MAX_TTL);
        let mut g = self.lock();
        g.retain(|_, l| l.until > now);
        if g.get(&a.from).is_some_and(|l| l.seq > a.seq) {
            return Ok(()); // overtaken by a later announcement
        }
        if !g.contains_key(&a.from) && g.len() >= MAX_SOURCES {
            let soonest = g
                .iter()
                .min_by_key(|(_, l)| l.until)
                .map(|(k, _)| k.clone());
            if let Some(k) = soonest {
                g.remove(&k);
            }
        }
        g.insert(
            a.from,
            Listed {
                seq: a.seq,
                addresses: a.prefill.into_iter().collect(),
                until: now + ttl,
            },
        );
        Ok(())
    }

    /// Whether a gateway's live list names `address`.
    #[must_use]
    pub fn knows(&self, address: &str) -> bool {
        let now = Instant::now();
        self.lock()
            .values()
            .any(|l| l.until > now && l.addresses.contains(address))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Listed>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(from: &str, prefill: &[&str], ttl_ms: u64) -> Announcement {
        Announcement {
            from: from.into(),
            seq: 0,
            prefill: prefill.iter().map(|s| (*s).to_owned()).collect(),
            ttl_ms,
        }
    }

    #[test]
    fn only_announced_addresses_are_known_and_lists_expire() {
        let k = KnownPeers::default();
        assert!(
            !k.knows("tcp://p:1"),
            "nothing is known before an announcement"
        );
        k.announce(ann("gw-a", &["tcp://p:1"], 10_000)).unwrap();
        k.announce(ann("gw-b", &["tcp://p:2"], 50)).unwrap();
        assert!(k.knows("tcp://p:1") && k.knows("tcp://p:2"));
        assert!(!k.knows("tcp://evil:1"));
        // A gateway's new list replaces its old one.
        k.announce(ann("gw-a", &["tcp://p:3"], 10_000)).unwrap();
        assert!(!k.knows("tcp://p:1") && k.knows("tcp://p:3"));
        // One that arrives after a later one is ignored.
        k.announce(Announcement {
            seq: 5,
            ..ann("gw-a", &["tcp://p:5"], 10_000)
        })
        .unwrap();
        k.announce(Announcement {
            seq: 4,
            ..ann("gw-a", &["tcp://p:4"], 10_000)
        })
        .unwrap();
        assert!(k.knows("tcp://p:5") && !k.knows("tcp://p:4"));
        std::thread::sleep(Duration::from_millis(80));
        assert!(!k.knows("tcp://p:2"), "an unrefreshed list expires");
        // The TTL asked for is capped.
        k.announce(ann("gw-c", &["tcp://p:6"], u64::MAX)).unwrap();
        let until = k.lock()["gw-c"].until;
        assert!(until <= Instant::now() + MAX_TTL);
    }

    #[test]
    fn announcements_are_bounded() {
        let k = KnownPeers::default();
        let many: Vec<String> = (0..=MAX_PEERS).map(|i| format!("tcp://p:{i}")).collect();
        let r = k.announce(Announcement {
            from: "gw".into(),
            seq: 0,
            prefill: many,
            ttl_ms: 1000,
        });
        assert_eq!(r, Err(AnnouncementError::TooMany(MAX_PEERS + 1)));
        let long = format!("tcp://{}:1", "a".repeat(MAX_ADDRESS_LEN));
        assert_eq!(
            k.announce(ann("gw", &[&long], 1000)),
            Err(AnnouncementError::TooLong)
        );
        assert_eq!(
            k.announce(ann("", &["tcp://p:1"], 1000)),
            Err(AnnouncementError::BadSource)
        );
        // Sources beyond the cap push out the one closest to expiry, never grow the map.
        for i in 0..MAX_SOURCES + 10 {
            k.announce(ann(&format!("gw-{i}"), &["tcp://p:1"], 10_000 + i as u64))
                .unwrap();
        }
        assert_eq!(k.lock().len(), MAX_SOURCES);
        assert!(!k.lock().contains_key("gw-0"));
        assert!(k.lock().contains_key(&format!("gw-{}", MAX_SOURCES + 9)));
    }
}
