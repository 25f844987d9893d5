//! The cluster token: one secret per deployment, read from a file (a mounted
//! Kubernetes Secret, or the one `preheat up` writes per run) so it never appears in a
//! process listing, an environment dump or a log.

use std::path::Path;

use ring::hmac;

use crate::EdgeError;

/// Environment variable naming the token file, for processes started without the
/// flag (standbys inherit it from their agent).
pub const TOKEN_FILE_ENV: &str = "PREHEAT_CLUSTER_TOKEN_FILE";
/// What the kernel-cache key is derived for ([`ClusterToken::prove`] with no parts):
/// the agent signs entries with it, workers check them.
pub const KERNEL_CACHE_LABEL: &str = "kernel-cache";
/// Shortest token accepted: 16 bytes of a random secret as hex.
const MIN_LEN: usize = 32;

/// The deployment's shared secret. Compared in constant time; never printed.
#[derive(Clone)]
pub struct ClusterToken {
    secret: Vec<u8>,
    key: hmac::Key,
}

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(<redacted>)")
    }
}

impl ClusterToken {
    /// A token from its secret bytes (surrounding whitespace, as a file's trailing
    /// newline, is not part of it).
    #[must_use]
    pub fn new(secret: &[u8]) -> Self {
        let secret = secret.trim_ascii().to_vec();
        let key = hmac::Key::new(hmac::HMAC_SHA256, &secret);
        ClusterToken { secret, key }
    }

    /// Reads the token from `path`: refused when empty or shorter than 32 bytes.
    pub fn from_file(path: &Path) -> Result<Self, EdgeError> {
        let shown = path.display().to_string();
        let raw = std::fs::read(path).map_err(|source| EdgeError::Read {
            what: "the cluster token",
            path: shown.clone(),
            source,
        })?;
        Self::checked(&raw, shown)
    }

    /// The token from bytes read elsewhere (a Kubernetes Secret's `token` key), with
    /// [`ClusterToken::from_file`]'s checks; errors name `source`.
    pub fn from_bytes(raw: &[u8], source: &str) -> Result<Self, EdgeError> {
        Self::checked(raw, source.to_owned())
    }

    fn checked(raw: &[u8], shown: String) -> Result<Self, EdgeError> {
        let t = Self::new(raw);
        if !t.secret.iter().all(|b| b.is_ascii_graphic()) {
            // It travels in an HTTP header: binary bytes would not survive.
            return Err(EdgeError::NotPrintable { path: shown });
        }
        match t.secret.len() {
            0 => Err(EdgeError::Empty {
                what: "the cluster token",
                path: shown,
            }),
            n if n < MIN_LEN => Err(EdgeError::TooShort {
                what: "the cluster token",
                path: shown,
                len: n,
                min: MIN_LEN,
            }),
            _ => Ok(t),
        }
    }

    /// The token named by `flag`, else by `$PREHEAT_CLUSTER_TOKEN_FILE`; `None` when
    /// neither names one.
    pub fn configured(flag: Option<&Path>) -> Result<Option<Self>, EdgeError> {
        let from_env = std::env::var_os(TOKEN_FILE_ENV).filter(|v| !v.is_empty());
        match flag.map(Path::to_path_buf).or(from_env.map(Into::into)) {
            Some(p) => Self::from_file(&p).map(Some),
            None => Ok(None),
        }
    }

    /// A fresh random token (32 random bytes as hex), written to `path` readable by
    /// its owner only.
    pub fn generate_to(path: &Path) -> Result<Self, EdgeError> {
        let mut bytes = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
            .expect("the system's random source works");
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            // A fresh file of our own (never one planted there, never through a link),
            // readable by its owner only.
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            let mut o = std::fs::OpenOptions::new();
            o.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
            o.open(path)?.write_all(hex.as_bytes())
        };
        write().map_err(|source| EdgeError::Write {
            path: path.display().to_string(),
            source,
        })?;
        Ok(Self::new(hex.as_bytes()))
    }

    /// The `Authorization` header value that carries it.
    #[must_use]
    pub fn bearer(&self) -> String {
        format!("Bearer {}", String::from_utf8_lossy(&self.secret))
    }

    /// Whether an `Authorization` header value carries this token, compared in
    /// constant time (through HMAC tags of both, so neither length nor prefix leaks).
    #[must_use]
    pub fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        let Some(presented) = authorization.and_then(|h| h.strip_prefix(b"Bearer ")) else {
            return false;
        };
        // Equal tags, equal tokens: `verify` compares in constant time.
        let want = hmac::sign(&self.key, &self.secret);
        hmac::verify(&self.key, presented.trim_ascii(), want.as_ref()).is_ok()
    }

    /// Proof of holding the token for `label` and `parts` (a challenge-response: the
    /// token itself never crosses the wire).
    #[must_use]
    pub fn prove(&self, label: &str, parts: &[&[u8]]) -> [u8; 32] {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(label.as_bytes());
        for p in parts {
            ctx.update(&(p.len() as u32).to_le_bytes());
            ctx.update(p);
        }
        let mut out = [0u8; 32];
        out.copy_from_slice(ctx.sign().as_ref());
        out
    }

    /// Checks a [`ClusterToken::prove`] answer in constant time.
    #[must_use]
    pub fn verify(&self, label: &str, parts: &[&[u8]], proof: &[u8]) -> bool {
        let mut msg = Vec::new();
        msg.extend_from_slice(label.as_bytes());
        for p in parts {
            msg.extend_from_slice(&(p.len() as u32).to_le_bytes());
            msg.extend_from_slice(p);
        }
        hmac::verify(&self.key, &msg, proof).is_ok()
    }

    /// A 64-bit key derived from the token for `label` (e.g. the prefix-cache hash
    /// seed): secret to anyone without the token, the same in every process that has
    /// it.
    #[must_use]
    pub fn derive_u64(&self, label: &str) -> u64 {
        let p = self.prove(label, &[]);
        u64::from_le_bytes(p[..8].try_into().expect("8 of 32 bytes"))
    }
}

/// 16 random bytes: a challenge.
#[must_use]
pub fn nonce() -> [u8; 16] {
    let mut n = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut n)
        .expect("the system's random source works");
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_token_itself_is_accepted() {
        let t = ClusterToken::new(b"0123456789abcdef0123456789abcdef\n");
        assert!(t.accepts(Some(b"Bearer 0123456789abcdef0123456789abcdef")));
        assert!(!t.accepts(Some(b"Bearer 0123456789abcdef0123456789abcde")));
        assert!(!t.accepts(Some(b"Bearer 0123456789abcdef0123456789abcdef0")));
        assert!(!t.accepts(Some(b"0123456789abcdef0123456789abcdef")));
        assert!(!t.accepts(Some(b"Bearer ")));
        assert!(!t.accepts(None));
        assert_eq!(format!("{t:?}"), "ClusterToken(<redacted>)");
    }

    #[test]
    fn a_short_or_empty_token_file_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        std::fs::write(&p, "\n").unwrap();
        assert!(matches!(
            ClusterToken::from_file(&p),
            Err(EdgeError::Empty { .. })
        ));
        std::fs::write(&p, b"\x00\x01binary-token-0123456789abcdef0123456789").unwrap();
        assert!(matches!(
            ClusterToken::from_file(&p),
            Err(EdgeError::NotPrintable { .. })
        ));
        std::fs::write(&p, "short").unwrap();
        let e = ClusterToken::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("too short") && !e.contains("short\""), "{e}");
        let g = ClusterToken::generate_to(&p).unwrap();
        let again = ClusterToken::from_file(&p).unwrap();
        assert!(again.accepts(Some(g.bearer().as_bytes())));
    }

    #[test]
    fn proofs_bind_label_and_parts() {
        let t = ClusterToken::new(b"0123456789abcdef0123456789abcdef");
        let other = ClusterToken::new(b"fedcba9876543210fedcba9876543210");
        let p = t.prove("kv-server", &[b"ab", b"c"]);
        assert!(t.verify("kv-server", &[b"ab", b"c"], &p));
        assert!(!t.verify("kv-client", &[b"ab", b"c"], &p));
        assert!(!t.verify("kv-server", &[b"a", b"bc"], &p));
        assert!(!other.verify("kv-server", &[b"ab", b"c"], &p));
        assert_ne!(t.derive_u64("prefix"), other.derive_u64("prefix"));
    }
}
