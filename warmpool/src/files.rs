//! Serving files of a directory over HTTP with single-range `Range` support: what
//! [`crate::stage`] needs from a source, so a node can stage from a peer's agent.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// Largest range answered in one response; bigger ones are streamed in pieces.
const PIECE: u64 = 1 << 20;

/// Parses `bytes=a-b`, `bytes=a-` or `bytes=-n` against a file of `len` bytes into an
/// inclusive range; `None` for a range that cannot be satisfied.
#[must_use]
pub fn parse_range(v: &str, len: u64) -> Option<(u64, u64)> {
    let spec = v.trim().strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", n) => {
            let n: u64 = n.parse().ok()?;
            if n == 0 || len == 0 {
                return None;
            }
            (len.saturating_sub(n), len - 1)
        }
        (a, "") => (a.parse().ok()?, len.checked_sub(1)?),
        (a, b) => {
            let (s, e): (u64, u64) = (a.parse().ok()?, b.parse().ok()?);
            (s, e.min(len.saturating_sub(1)))
        }
    };
    if start > end || start >= len {
        return None;
    }
    Some((start, end))
}

/// The response for `GET dir/name` with the request's headers: 200, 206, 404 or 416.
/// `name` must be a plain file name (no separators, no leading dot).
pub async fn serve_file(dir: &Path, name: &str, headers: &HeaderMap) -> Response {
    if name.is_empty() || name.starts_with('.') || name.contains(['/', '\\']) {
        return (StatusCode::NOT_FOUND, "no such file").into_response();
    }
    let path: PathBuf = dir.join(name);
    let Ok(meta) = tokio::fs::metadata(&path).await else {
        return (StatusCode::NOT_FOUND, "no such file").into_response();
    };
    if !meta.is_file() {
        return (StatusCode::NOT_FOUND, "no such file").into_response();
    }
    let len = meta.len();
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(|v| parse_range(v, len));
    let (status, start, end) = match range {
        None => (StatusCode::OK, 0, len),
        Some(Some((s, e))) => (StatusCode::PARTIAL_CONTENT, s, e + 1),
        Some(None) => {
            let mut r = StatusCode::RANGE_NOT_SATISFIABLE.into_response();
            if let Ok(v) = HeaderValue::from_str(&format!("bytes */{len}")) {
                r.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return r;
        }
    };
    let file = match std::fs::File::open(&path) {
        Ok(f) => std::sync::Arc::new(f),
        Err(_) => return (StatusCode::NOT_FOUND, "no such file").into_response(),
    };
    let body = futures_util::stream::unfold(start, move |pos| {
        let file = std::sync::Arc::clone(&file);
        async move {
            if pos >= end {
                return None;
            }
            let n = PIECE.min(end - pos);
            let r = tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; n as usize];
                file.read_exact_at(&mut buf, pos).map(|()| buf)
            })
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r);
            Some((r, pos + n))
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Ok(v) = HeaderValue::from_str(&(end - start).to_string()) {
        h.insert(header::CONTENT_LENGTH, v);
    }
    if status == StatusCode::PARTIAL_CONTENT
        && let Ok(v) = HeaderValue::from_str(&format!("bytes {start}-{}/{len}", end - 1))
    {
        h.insert(header::CONTENT_RANGE, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::parse_range;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-0", 10), Some((0, 0)));
        assert_eq!(parse_range("bytes=5-", 10), Some((5, 9)));
        assert_eq!(parse_range("bytes=-3", 10), Some((7, 9)));
        assert_eq!(parse_range("bytes=2-100", 10), Some((2, 9)));
        for bad in [
            "bytes=10-",
            "bytes=5-2",
            "items=0-1",
            "bytes=0-1,3-4",
            "bytes=-0",
            "bytes=x-1",
        ] {
            assert_eq!(parse_range(bad, 10), None, "{bad}");
        }
    }
}
