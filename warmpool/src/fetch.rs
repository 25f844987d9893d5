//! Reading byte ranges of a snapshot (or packed snapshot) from where it is published:
//! a local path or an `http(s)://` URL served with Range requests.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{CONTENT_LENGTH, CONTENT_RANGE, RANGE};

use crate::{Error, Result};

/// Where a model is fetched from. Shown (Display, Debug: logs, errors, the agent's
/// API) without credentials: a URL's user info and query (signed-URL tokens) are
/// redacted.
#[derive(Clone, PartialEq, Eq)]
pub enum Source {
    Path(PathBuf),
    Http(String),
}

impl Source {
    /// `http://…`/`https://…` is a URL, anything else a path.
    #[must_use]
    pub fn parse(s: &str) -> Self {
        if s.starts_with("http://") || s.starts_with("https://") {
            Source::Http(s.to_owned())
        } else {
            Source::Path(PathBuf::from(s))
        }
    }

    /// The last path segment, for a default model name.
    #[must_use]
    pub fn file_name(&self) -> Option<String> {
        let s = match self {
            Source::Path(p) => p.file_name()?.to_string_lossy().into_owned(),
            Source::Http(u) => {
                let path = u.split(['?', '#']).next().unwrap_or(u);
                path.rsplit('/').next()?.to_owned()
            }
        };
        (!s.is_empty()).then_some(s)
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Path(p) => write!(f, "{}", p.display()),
            Source::Http(u) => f.write_str(&redact_url(u)),
        }
    }
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Path(p) => f.debug_tuple("Path").field(p).finish(),
            Source::Http(_) => f.debug_tuple("Http").field(&self.to_string()).finish(),
        }
    }
}

/// `url` without what may be a credential: user info (`user:pass@`) becomes `***@`,
/// a query string (`?X-Amz-Signature=…`) `?***`, a fragment is dropped.
#[must_use]
pub fn redact_url(url: &str) -> String {
    let url = url.split('#').next().unwrap_or(url);
    let (url, query) = match url.split_once('?') {
        Some((u, _)) => (u, "?***"),
        None => (url, ""),
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return format!("{url}{query}");
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let host = match authority.rsplit_once('@') {
        Some((_, host)) => format!("***@{host}"),
        None => authority.to_owned(),
    };
    format!("{scheme}://{host}{path}{query}")
}

/// Reads ranges of one source. Cheap to clone (the HTTP client is shared).
/// A client error with its causes — a TLS refusal says why ("invalid peer
/// certificate: UnknownIssuer") — without the URL, which the caller names once.
fn reason(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

#[derive(Clone, Debug)]
pub struct Fetcher {
    source: Source,
    client: reqwest::Client,
    /// Attempts per range before the staging fails (network errors and 5xx only).
    attempts: u32,
}

impl Fetcher {
    pub fn new(source: Source, timeout: Duration) -> Result<Self> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(timeout)
            .build()
            .map_err(|e| Error::Fetch {
                url: source.to_string(),
                message: e.to_string(),
            })?;
        Ok(Fetcher {
            source,
            client,
            attempts: 4,
        })
    }

    #[must_use]
    pub fn source(&self) -> &Source {
        &self.source
    }

    fn err(&self, message: impl Into<String>) -> Error {
        Error::Fetch {
            url: self.source.to_string(),
            message: message.into(),
        }
    }

    /// Total length of the source in bytes.
    pub async fn len(&self) -> Result<u64> {
        match &self.source {
            Source::Path(p) => Ok(tokio::fs::metadata(p)
                .await
                .map_err(|e| Error::io(p, e))?
                .len()),
            Source::Http(url) => {
                // A one-byte range answers with the total in Content-Range and proves
                // the server honours ranges, which resumption depends on.
                let r = self
                    .client
                    .get(url)
                    .header(RANGE, "bytes=0-0")
                    .send()
                    .await
                    .map_err(|e| self.err(reason(e)))?;
                match r.status() {
                    StatusCode::PARTIAL_CONTENT => {
                        let cr = r
                            .headers()
                            .get(CONTENT_RANGE)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("");
                        cr.rsplit_once('/')
                            .and_then(|(_, n)| n.trim().parse().ok())
                            .ok_or_else(|| self.err(format!("bad Content-Range {cr:?}")))
                    }
                    StatusCode::OK => {
                        let n = r
                            .headers()
                            .get(CONTENT_LENGTH)
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse::<u64>().ok());
                        match n {
                            // A file of one byte or less is not a snapshot anyway.
                            Some(n) if n <= 1 => Ok(n),
                            _ => Err(self.err(
                                "the server ignores Range requests (needed to fetch in parallel and resume)",
                            )),
                        }
                    }
                    s => Err(self.err(format!("HTTP {s}"))),
                }
            }
        }
    }

    /// Exactly `len` bytes at `offset`, retried on transient failures.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        match &self.source {
            Source::Path(p) => {
                let p = p.clone();
                tokio::task::spawn_blocking(move || {
                    let f = std::fs::File::open(&p).map_err(|e| Error::io(&p, e))?;
                    let mut buf = vec![0u8; len as usize];
                    f.read_exact_at(&mut buf, offset)
                        .map_err(|e| Error::io(&p, e))?;
                    Ok(buf)
                })
                .await
                .map_err(|e| self.err(format!("reader task: {e}")))?
            }
            Source::Http(url) => {
                let mut last = String::new();
                for attempt in 0..self.attempts {
                    if attempt > 0 {
                        tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
                    }
                    match self.try_range(url, offset, len).await {
                        Ok(b) => return Ok(b),
                        Err((retry, msg)) => {
                            tracing::debug!(url, offset, len, error = %msg, "range failed");
                            last = msg;
                            if !retry {
                                break;
                            }
                        }
                    }
                }
                Err(self.err(format!("bytes {offset}+{len}: {last}")))
            }
        }
    }

    /// One attempt; the error says whether retrying may help.
    async fn try_range(
        &self,
        url: &str,
        offset: u64,
        len: u64,
    ) -> std::result::Result<Vec<u8>, (bool, String)> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let r = self
            .client
            .get(url)
            .header(RANGE, format!("bytes={}-{}", offset, offset + len - 1))
            .send()
            .await
            .map_err(|e| (true, reason(e)))?;
        let status = r.status();
        if status != StatusCode::PARTIAL_CONTENT {
            return Err((status.is_server_error(), format!("HTTP {status}")));
        }
        let mut out = Vec::with_capacity(len as usize);
        let mut r = r;
        while let Some(chunk) = r.chunk().await.map_err(|e| (true, reason(e)))? {
            if out.len() + chunk.len() > len as usize {
                return Err((false, "server sent more than the range".into()));
            }
            out.extend_from_slice(&chunk);
        }
        if out.len() as u64 != len {
            return Err((true, format!("short body: {} of {len} bytes", out.len())));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_and_name() {
        assert_eq!(
            Source::parse("https://h/m/llama.preheat?sig=1")
                .file_name()
                .as_deref(),
            Some("llama.preheat")
        );
        assert_eq!(
            Source::parse("/data/x.phpack"),
            Source::Path("/data/x.phpack".into())
        );
        assert_eq!(Source::parse("http://h/").file_name(), None);
    }

    #[test]
    fn credentials_never_shown() {
        for (raw, shown) in [
            (
                "https://u:secret@h.example/m.phpack",
                "https://***@h.example/m.phpack",
            ),
            (
                "https://h.example/m.phpack?X-Amz-Signature=secret&a=b",
                "https://h.example/m.phpack?***",
            ),
            ("http://tok@h:8080/a/b?x#frag", "http://***@h:8080/a/b?***"),
            ("https://h.example/m.phpack", "https://h.example/m.phpack"),
            ("https://h.example/p@th", "https://h.example/p@th"),
        ] {
            let s = Source::parse(raw);
            assert_eq!(s.to_string(), shown);
            assert!(!format!("{s:?}").contains("secret"), "{s:?}");
        }
    }
}
