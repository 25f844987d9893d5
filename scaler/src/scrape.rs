//! Scraping `/metrics` endpoints concurrently, each with a timeout and a size limit. A
//! slow, dead, oversized or garbled endpoint is reported as failed, with the reason,
//! never as an idle one.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::future::join_all;

use crate::signals::exposition::{Reading, parse};

/// The largest response read from one endpoint. A vLLM pod serves ~30 KB; this bounds
/// what a misbehaving endpoint can make the scaler hold, as Prometheus'
/// `body_size_limit` does.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// An endpoint that did not answer well in one scrape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failed {
    pub url: String,
    pub reason: String,
}

/// Scrapes every URL at once; returns the readings of those that answered well and the
/// endpoints that did not, with why.
pub async fn scrape_all(
    client: &reqwest::Client,
    urls: &[String],
    model: Option<&str>,
    timeout: Duration,
) -> (Vec<(String, Reading)>, Vec<Failed>) {
    let results = join_all(urls.iter().map(|u| async move {
        let r = async {
            let resp = client
                .get(u)
                .timeout(timeout)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if !resp.status().is_success() {
                return Err(format!("HTTP {}", resp.status()));
            }
            let body = read_limited(resp, MAX_BODY_BYTES).await?;
            let text = std::str::from_utf8(&body).map_err(|e| format!("not UTF-8: {e}"))?;
            parse(text, model).map_err(|e| e.to_string())
        }
        .await;
        (u, r)
    }))
    .await;
    let mut ok = Vec::new();
    let mut failed = Vec::new();
    for (u, r) in results {
        match r {
            Ok(reading) => ok.push((u.clone(), reading)),
            Err(reason) => failed.push(Failed {
                url: u.clone(),
                reason,
            }),
        }
    }
    (ok, failed)
}

/// The body of `resp`, refused once it passes `limit` bytes (declared or received).
pub async fn read_limited(
    mut resp: reqwest::Response,
    limit: usize,
) -> std::result::Result<Vec<u8>, String> {
    let too_big = || format!("response larger than {limit} bytes");
    if resp
        .content_length()
        .is_some_and(|n| n > u64::try_from(limit).unwrap_or(u64::MAX))
    {
        return Err(too_big());
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > limit {
            return Err(too_big());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// What each endpoint last failed with, so the log says when an endpoint starts
/// failing, why, and when it recovers — once, not on every tick.
#[derive(Debug, Default)]
pub struct FailureLog {
    failing: HashMap<String, String>,
}

impl FailureLog {
    /// Records one scrape of `what` (a pool or the gateways) and logs the changes.
    pub fn note<'a>(
        &mut self,
        what: &str,
        answered: impl IntoIterator<Item = &'a str>,
        failed: &[Failed],
    ) {
        for url in answered {
            if self.failing.remove(url).is_some() {
                tracing::info!(scraping = what, endpoint = url, "endpoint answers again");
            }
        }
        for f in failed {
            if self.failing.get(&f.url) != Some(&f.reason) {
                tracing::warn!(
                    scraping = what,
                    endpoint = %f.url,
                    reason = %f.reason,
                    "endpoint failed (never read as idle while it fails)"
                );
                self.failing.insert(f.url.clone(), f.reason.clone());
            }
        }
        // Endpoints that are gone (scaled away) are forgotten.
        if self.failing.len() > failed.len() {
            let now: std::collections::HashSet<&str> =
                failed.iter().map(|f| f.url.as_str()).collect();
            self.failing.retain(|url, _| now.contains(url.as_str()));
        }
    }

    /// Endpoints failing as of the last scrape, with their reasons.
    #[must_use]
    pub fn failing(&self) -> &HashMap<String, String> {
        &self.failing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(url: &str, reason: &str) -> Failed {
        Failed {
            url: url.into(),
            reason: reason.into(),
        }
    }

    #[test]
    fn failure_log_keeps_the_current_reason_per_endpoint_and_forgets_the_rest() {
        let mut log = FailureLog::default();
        log.note(
            "p",
            ["a"],
            &[failed("b", "HTTP 500"), failed("c", "timeout")],
        );
        assert_eq!(log.failing().len(), 2);
        log.note("p", ["a", "b"], &[failed("c", "line 3: missing value")]);
        assert_eq!(
            log.failing().get("c").map(String::as_str),
            Some("line 3: missing value")
        );
        assert!(!log.failing().contains_key("b"), "b answers again");
        log.note("p", ["a"], &[]);
        assert!(log.failing().is_empty(), "c was scaled away");
    }
}
