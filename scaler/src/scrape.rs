//! Scraping `/metrics` endpoints concurrently, each with a timeout. A slow, dead or
//! garbled endpoint is reported as failed, never as an idle one.

use std::time::Duration;

use futures_util::future::join_all;

use crate::signals::exposition::{Reading, parse};

/// Scrapes every URL at once; returns the readings of those that answered well and the
/// URLs that did not.
pub async fn scrape_all(
    client: &reqwest::Client,
    urls: &[String],
    model: Option<&str>,
    timeout: Duration,
) -> (Vec<(String, Reading)>, Vec<String>) {
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
            let text = resp.text().await.map_err(|e| e.to_string())?;
            parse(&text, model).map_err(|e| e.to_string())
        }
        .await;
        (u.clone(), r)
    }))
    .await;
    let mut ok = Vec::new();
    let mut failed = Vec::new();
    for (u, r) in results {
        match r {
            Ok(reading) => ok.push((u, reading)),
            Err(e) => {
                tracing::debug!(endpoint = %u, error = %e, "scrape failed");
                failed.push(u);
            }
        }
    }
    (ok, failed)
}
