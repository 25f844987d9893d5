//! The OpenAI API's keys: one per line in a file (a mounted Secret), reloaded when the
//! file changes so keys rotate without a restart. A key is known to logs and metrics
//! only by a short hash of it (`key-1a2b3c4d`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::time::{Duration, Instant, SystemTime};

use prometheus::{IntCounterVec, Opts, Registry};
use ring::digest;

use crate::EdgeError;

/// `preheat:api_key_requests_total{key}`: requests accepted per key (by its hash).
pub const REQUESTS_METRIC: &str = "preheat:api_key_requests_total";
/// The file is looked at again at most this often.
const RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Loaded {
    /// SHA-256 of each key → its public id.
    keys: HashMap<Vec<u8>, String>,
    stamp: Option<(SystemTime, u64)>,
    checked: Instant,
}

/// The accepted API keys.
#[derive(Debug)]
pub struct ApiKeys {
    path: PathBuf,
    loaded: RwLock<Loaded>,
    requests: IntCounterVec,
    registry: Registry,
}

/// The public name of a key: a short hash, safe to log.
#[must_use]
pub fn key_id(key: &[u8]) -> String {
    let d = digest::digest(&digest::SHA256, key);
    let hex: String = d.as_ref()[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("key-{hex}")
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

fn read(path: &Path) -> Result<HashMap<Vec<u8>, String>, EdgeError> {
    let shown = path.display().to_string();
    let text = std::fs::read(path).map_err(|source| EdgeError::Read {
        what: "the API keys",
        path: shown.clone(),
        source,
    })?;
    let keys: HashMap<Vec<u8>, String> = text
        .split(|&b| b == b'\n')
        .map(<[u8]>::trim_ascii)
        .filter(|l| !l.is_empty() && !l.starts_with(b"#"))
        .map(|k| {
            (
                digest::digest(&digest::SHA256, k).as_ref().to_vec(),
                key_id(k),
            )
        })
        .collect();
    Ok(keys)
}

impl ApiKeys {
    /// Reads the keys in `path` (blank lines and `#` comments skipped).
    pub fn load(path: &Path) -> Result<Self, EdgeError> {
        let keys = read(path)?;
        if keys.is_empty() {
            // Refused at start rather than taken as "nobody may call": a process
            // started with an empty file is a mistake. (Emptied later, it revokes all.)
            return Err(EdgeError::Empty {
                what: "the API keys",
                path: path.display().to_string(),
            });
        }
        let requests = IntCounterVec::new(
            Opts::new(
                REQUESTS_METRIC,
                "OpenAI API requests accepted, by API key (a short hash of it)",
            ),
            &["key"],
        )
        .expect("a valid metric");
        let registry = Registry::new();
        registry
            .register(Box::new(requests.clone()))
            .expect("registered once");
        tracing::info!(path = %path.display(), keys = keys.len(), "API keys loaded");
        Ok(ApiKeys {
            path: path.to_owned(),
            loaded: RwLock::new(Loaded {
                keys,
                stamp: stamp(path),
                checked: Instant::now(),
            }),
            requests,
            registry,
        })
    }

    /// The per-key request counts, for `/metrics`.
    #[must_use]
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Picks up a changed file: an emptied one revokes every key; one that cannot be
    /// read keeps the keys in force (a Secret being swapped must not lock every client
    /// out).
    fn refresh(&self) {
        let due = self
            .loaded
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .checked
            .elapsed()
            >= RECHECK;
        if !due {
            return;
        }
        let mut l = self
            .loaded
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        l.checked = Instant::now();
        let now = stamp(&self.path);
        if now == l.stamp {
            return;
        }
        match read(&self.path) {
            Ok(keys) => {
                if keys.is_empty() {
                    tracing::warn!(path = %self.path.display(), "the API keys file is empty: every key is revoked");
                }
                tracing::info!(path = %self.path.display(), keys = keys.len(), "API keys reloaded");
                l.keys = keys;
                l.stamp = now;
            }
            Err(e) => {
                tracing::warn!(error = %e, "API keys not reloaded; the previous ones stay in force")
            }
        }
    }

    /// The id of the key an `Authorization` header value carries, `None` when it
    /// carries none or an unknown one. Keys are compared by their SHA-256, so timing
    /// tells nothing of a key.
    #[must_use]
    pub fn check(&self, authorization: Option<&[u8]>) -> Option<String> {
        self.refresh();
        let key = authorization?.strip_prefix(b"Bearer ")?.trim_ascii();
        let h = digest::digest(&digest::SHA256, key);
        let id = self
            .loaded
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys
            .get(h.as_ref())
            .cloned()?;
        self.requests.with_label_values(&[&id]).inc();
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_reloaded_and_known_only_by_hash() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("keys");
        std::fs::write(&p, "# clients\nsk-alpha\n\n  sk-beta  \n").unwrap();
        let k = ApiKeys::load(&p).unwrap();
        let alpha = k.check(Some(b"Bearer sk-alpha")).unwrap();
        assert_eq!(alpha, key_id(b"sk-alpha"));
        assert!(!alpha.contains("alpha"));
        assert!(k.check(Some(b"Bearer sk-beta")).is_some());
        assert!(k.check(Some(b"Bearer sk-gamma")).is_none());
        assert!(k.check(Some(b"sk-alpha")).is_none());
        assert!(k.check(None).is_none());
        // Rotation: beta out, gamma in, without a restart.
        std::fs::write(&p, "sk-alpha\nsk-gamma\n").unwrap();
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        assert!(k.check(Some(b"Bearer sk-gamma")).is_some());
        assert!(k.check(Some(b"Bearer sk-beta")).is_none());
        // An unreadable file keeps the keys in force...
        std::fs::remove_file(&p).unwrap();
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        assert!(k.check(Some(b"Bearer sk-gamma")).is_some());
        // ...an emptied one revokes them all (a leaked key is taken out by emptying it).
        std::fs::write(&p, "# revoked\n").unwrap();
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        assert!(k.check(Some(b"Bearer sk-gamma")).is_none());
        assert!(k.check(Some(b"Bearer sk-alpha")).is_none());
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&k.registry().gather())
            .unwrap();
        assert!(text.contains(&format!("key=\"{alpha}\"")), "{text}");
        assert!(!text.contains("sk-"), "{text}");
    }

    #[test]
    fn an_empty_key_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("keys");
        std::fs::write(&p, "# none yet\n").unwrap();
        assert!(matches!(ApiKeys::load(&p), Err(EdgeError::Empty { .. })));
    }
}
