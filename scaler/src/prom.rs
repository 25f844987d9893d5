//! Signals from a Prometheus server instead of scraping pods: instant queries
//! (`/api/v1/query`) that sum a pool's series selected by label matchers, with every
//! engine's metric names tried in order (`a or b`), so one config sizes preheat, vLLM
//! and SGLang pools alike.

use std::time::Duration;

use serde::Deserialize;

use crate::scrape::{MAX_BODY_BYTES, read_limited};
use crate::signals::PoolSignals;
use crate::signals::names;
use crate::signals::window::window_quantile;
use crate::{Result, ScalerError};

/// A Prometheus server and the window rates and quantiles are computed over.
#[derive(Clone, Debug)]
pub struct PromSource {
    client: reqwest::Client,
    base: String,
    window_s: u64,
    interval_s: u64,
    scrape_s: u64,
}

/// An API answer: `T` is a vector's sample or a matrix's series.
#[derive(Deserialize)]
struct Response<T> {
    status: String,
    #[serde(default = "Option::default")]
    data: Option<Data<T>>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Deserialize)]
struct Data<T> {
    #[serde(rename = "resultType")]
    result_type: String,
    result: Vec<T>,
}

#[derive(Deserialize)]
struct Sample {
    #[serde(default)]
    metric: std::collections::HashMap<String, String>,
    value: (f64, String),
}

#[derive(Deserialize)]
struct Series {
    values: Vec<(f64, String)>,
}

/// Most points a range query may return (Prometheus' own limit is 11,000).
const MAX_RANGE_POINTS: f64 = 2_000.0;

/// `sum(a{sel}) or sum(b{sel}) …` with `f` wrapping each name.
fn any_of(list: &[&str], f: impl Fn(&str) -> String) -> String {
    list.iter().map(|n| f(n)).collect::<Vec<_>>().join(" or ")
}

impl PromSource {
    /// `base` is the server's root URL (`http://prometheus:9090`).
    #[must_use]
    pub fn new(client: reqwest::Client, base: &str, window_s: f64, interval_s: f64) -> Self {
        PromSource {
            client,
            base: base.trim_end_matches('/').to_owned(),
            window_s: window_s.round().max(1.0) as u64,
            interval_s: interval_s.round().max(1.0) as u64,
            scrape_s: 15,
        }
    }

    /// The server's scrape interval for these pools (default 15 s): peak rates need
    /// at least two samples in their range.
    #[must_use]
    pub fn with_scrape_interval(mut self, scrape_s: f64) -> Self {
        self.scrape_s = scrape_s.round().max(1.0) as u64;
        self
    }

    /// Seconds between the points [`PromSource::recent_prompt_rates`] returns (the
    /// scaler's tick).
    #[must_use]
    pub fn step_s(&self) -> f64 {
        self.interval_s.max(1) as f64
    }

    /// The range short-term peak rates are taken over: Grafana's `$__rate_interval`,
    /// max(step + scrape, 4 × scrape). Shorter, `rate()` often sees one sample and the
    /// peak reads as nothing.
    fn peak_range_s(&self) -> u64 {
        (self.interval_s + self.scrape_s).max(4 * self.scrape_s)
    }

    /// Runs one instant query; `None` when the result is empty or not a number.
    pub async fn query(&self, q: &str, timeout: Duration) -> Result<Option<f64>> {
        Ok(self
            .vector(q, timeout)
            .await?
            .first()
            .and_then(|s| s.value.1.parse::<f64>().ok())
            .filter(|v| v.is_finite()))
    }

    /// A histogram's bucket increases over the window, summed over the pool's series
    /// (cumulative, by `le`): what [`crate::signals::exposition::fraction_within`]
    /// reads for SLO attainment. `None` without observations.
    pub async fn buckets(
        &self,
        list: &[&str],
        sel: &str,
        timeout: Duration,
    ) -> Result<Option<crate::signals::exposition::Buckets>> {
        let w = self.window_s;
        let q = any_of(list, |n| {
            format!("sum by (le) (increase({n}_bucket{{{sel}}}[{w}s]))")
        });
        let mut b: Vec<(f64, f64)> = self
            .vector(&q, timeout)
            .await?
            .iter()
            .filter_map(|s| {
                let le = match s.metric.get("le")?.as_str() {
                    "+Inf" => f64::INFINITY,
                    v => v.parse().ok()?,
                };
                let count = s.value.1.parse::<f64>().ok().filter(|v| v.is_finite())?;
                Some((le, count))
            })
            .collect();
        b.sort_by(|x, y| x.0.total_cmp(&y.0));
        Ok((b.last().is_some_and(|l| l.0.is_infinite() && l.1 > 0.0)).then_some(b))
    }

    async fn vector(&self, q: &str, timeout: Duration) -> Result<Vec<Sample>> {
        self.api("query", q, &[], "vector", timeout).await
    }

    /// One API call for `q` (with `extra` parameters), its body read within the limit
    /// and its result checked to be of `kind`.
    async fn api<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        q: &str,
        extra: &[(&str, String)],
        kind: &str,
        timeout: Duration,
    ) -> Result<Vec<T>> {
        let err = |e: String| ScalerError::Prometheus(format!("{q}: {e}"));
        let resp = self
            .client
            .get(format!("{}/api/v1/{path}", self.base))
            .query(&[("query", q)])
            .query(extra)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| err(e.to_string()))?;
        let status = resp.status();
        let bytes = read_limited(resp, MAX_BODY_BYTES).await.map_err(err)?;
        let body: Response<T> = serde_json::from_slice(&bytes)
            .map_err(|e| err(format!("HTTP {status}: not a Prometheus response ({e})")))?;
        if body.status != "success" {
            return Err(err(body.error.unwrap_or(body.status)));
        }
        let data = body.data.ok_or_else(|| err("no data".into()))?;
        if data.result_type != kind {
            return Err(err(format!("expected a {kind}, got {}", data.result_type)));
        }
        Ok(data.result)
    }

    /// The pool's latest prompt-token rate (as `pool_signals` reads it) at each scaler
    /// tick over the last `span_s` seconds, oldest first, as (seconds before the
    /// newest point, tokens/s): the arrivals a restarted scaler had already seen.
    pub async fn recent_prompt_rates(
        &self,
        sel: &str,
        span_s: f64,
        timeout: Duration,
    ) -> Result<Vec<(f64, f64)>> {
        let r = self.peak_range_s();
        let q = any_of(names::PROMPT_TOKENS, |n| {
            format!("sum(irate({n}{{{sel}}}[{r}s]))")
        });
        let step = self.step_s();
        let span = span_s.clamp(0.0, step * MAX_RANGE_POINTS);
        let at = self.range_sum(&q, span, step, timeout).await?;
        let newest = at.last().map_or(0.0, |p| p.0);
        Ok(at.into_iter().map(|(t, v)| (newest - t, v)).collect())
    }

    /// The pool's mean load per `bucket_s` over the last `period_s`, as (Unix time,
    /// rate over the bucket before it), oldest first: prompt tokens/s for prefill,
    /// generated tokens/s for decode. What a restarted scaler's season is seeded with.
    pub async fn seasonal_rates(
        &self,
        sel: &str,
        pool: crate::policy::Pool,
        period_s: f64,
        bucket_s: f64,
        timeout: Duration,
    ) -> Result<Vec<(f64, f64)>> {
        let list = match pool {
            crate::policy::Pool::Prefill => names::PROMPT_TOKENS,
            crate::policy::Pool::Decode => names::GENERATION_TOKENS,
        };
        let b = bucket_s.round().max(1.0);
        let q = any_of(list, |n| format!("sum(rate({n}{{{sel}}}[{b}s]))"));
        let span = period_s.clamp(0.0, b * MAX_RANGE_POINTS);
        self.range_sum(&q, span, b, timeout).await
    }

    /// A range query of `q` over the `span_s` before the last `step_s` mark, its series summed
    /// per timestamp (one per name that answered `a or b`), as (Unix time, value),
    /// oldest first; values that are not non-negative numbers and timestamps outside
    /// the range are dropped.
    async fn range_sum(
        &self,
        q: &str,
        span_s: f64,
        step_s: f64,
        timeout: Duration,
    ) -> Result<Vec<(f64, f64)>> {
        let err = |e: String| ScalerError::Prometheus(format!("{q}: {e}"));
        let (span, step) = (span_s, step_s.max(1.0));
        // On the step's grid: each point then covers one whole step of the wall clock
        // (a season's bucket exactly), never a part of the one still running.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|e| err(e.to_string()))?
            .as_secs_f64();
        let end = (now / step).floor() * step;
        let result: Vec<Series> = self
            .api(
                "query_range",
                q,
                &[
                    ("start", format!("{}", end - span)),
                    ("end", format!("{end}")),
                    ("step", format!("{step}")),
                ],
                "matrix",
                timeout,
            )
            .await?;
        let mut at: std::collections::BTreeMap<i64, f64> = std::collections::BTreeMap::new();
        for series in &result {
            for (ts, v) in &series.values {
                let Some(v) = v.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0) else {
                    continue;
                };
                if ts.is_finite() && *ts >= end - span - step && *ts <= end + step {
                    *at.entry((ts * 1000.0).round() as i64).or_default() += v;
                }
            }
        }
        Ok(at
            .into_iter()
            .map(|(ms, v)| (ms as f64 / 1000.0, v))
            .collect())
    }

    /// The queries for one pool, in the order [`PromSource::pool_signals`] reads them.
    #[must_use]
    pub fn queries(&self, sel: &str) -> Vec<String> {
        let (w, i, r) = (self.window_s, self.interval_s, self.peak_range_s());
        let sum = |list: &[&str]| any_of(list, |n| format!("sum({n}{{{sel}}})"));
        let rate = |list: &[&str]| any_of(list, |n| format!("sum(rate({n}{{{sel}}}[{w}s]))"));
        vec![
            any_of(names::RUNNING, |n| format!("count({n}{{{sel}}})")),
            sum(names::WAITING),
            sum(names::RUNNING),
            any_of(names::KV_USAGE, |n| format!("avg({n}{{{sel}}})")),
            sum(names::PREFILL_QUEUE_TOKENS),
            rate(names::PROMPT_TOKENS),
            any_of(names::PROMPT_TOKENS, |n| {
                format!("max_over_time(sum(rate({n}{{{sel}}}[{r}s]))[{w}s:{i}s])")
            }),
            rate(names::GENERATION_TOKENS),
            rate(names::PREFIX_QUERIES),
            rate(names::PREFIX_HITS),
            format!(
                "max({}{{phase=\"first_token\",{sel}}})",
                names::STARTUP_PHASE
            ),
            // The last two samples' rate, not the range's mean (the range is often the
            // whole window: four scrapes of 15 s).
            any_of(names::PROMPT_TOKENS, |n| {
                format!("sum(irate({n}{{{sel}}}[{r}s]))")
            }),
            any_of(names::TTFT, |n| {
                format!("sum(rate({n}_count{{{sel}}}[{w}s]))")
            }),
            // Over every pod reporting usage, as the usage is averaged: a vLLM pod
            // beside preheat ones reserves nothing.
            format!(
                "({}) / ({})",
                any_of(names::KV_RESERVED, |n| format!("sum({n}{{{sel}}})")),
                any_of(names::KV_USAGE, |n| format!("count({n}{{{sel}}})"))
            ),
        ]
    }

    /// A pool's signals, its replica count (series reporting) and the slowest measured
    /// start-up to first token. Any failed query makes the whole pool blind for this
    /// tick rather than half-read.
    pub async fn pool_signals(
        &self,
        sel: &str,
        timeout: Duration,
    ) -> Result<(PoolSignals, u32, Option<f64>)> {
        let qs = self.queries(sel);
        let results =
            futures_util::future::join_all(qs.iter().map(|q| self.query(q, timeout))).await;
        let mut v = Vec::with_capacity(results.len());
        for r in results {
            v.push(r?);
        }
        let (ttft_hist, itl_hist) = futures_util::future::join(
            self.buckets(names::TTFT, sel, timeout),
            self.buckets(names::ITL, sel, timeout),
        )
        .await;
        let (ttft_hist, itl_hist) = (ttft_hist?, itl_hist?);
        let n = |i: usize| v[i].unwrap_or(0.0);
        let pods = n(0) as u32;
        let queries = n(8);
        let s = PoolSignals {
            endpoints_ok: pods as usize,
            endpoints_failed: 0,
            waiting: n(1),
            running: n(2),
            kv_usage: n(3),
            kv_reserved: n(13).clamp(0.0, n(3)),
            queued_prompt_tokens: n(4),
            prompt_rate: n(5),
            prompt_rate_peak: n(6),
            peak_span_s: self.peak_range_s() as f64,
            prompt_rate_recent: n(11),
            // irate: the last two samples, a scrape apart.
            recent_span_s: self.scrape_s as f64,
            generation_rate: n(7),
            first_token_rate: n(12),
            prefix_hit_rate: if queries > 0.0 {
                (n(9) / queries).clamp(0.0, 1.0)
            } else {
                0.0
            },
            // Quantiles from the same bucket increases the attainment reads (what
            // `histogram_quantile` computes, without two more queries per histogram).
            ttft_p50: window_quantile(&ttft_hist, 0.5),
            ttft_p90: window_quantile(&ttft_hist, 0.9),
            itl_p50: window_quantile(&itl_hist, 0.5),
            itl_p90: window_quantile(&itl_hist, 0.9),
            ttft_hist,
            itl_hist,
        };
        Ok((s, pods, v[10]))
    }
}
