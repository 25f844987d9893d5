//! HTTP clients for calls between our own processes.

use std::time::Duration;

use crate::ClusterToken;

/// A client builder for our own processes: never through an HTTP proxy from the
/// environment (the cluster token must not reach one), idle pooled connections dropped
/// before our listeners close them (they do at 10 s), connected within 5 s.
pub fn internal() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
}

/// [`internal`], carrying `token` on every request: for a client that calls nothing
/// but our own processes.
#[must_use]
pub fn internal_with_token(token: Option<&ClusterToken>) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(t) = token
        && let Ok(mut v) = reqwest::header::HeaderValue::from_str(&t.bearer())
    {
        v.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, v);
    }
    internal()
        .default_headers(headers)
        .build()
        .expect("a client without TLS settings of its own builds")
}
