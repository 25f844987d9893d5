//! One scrape of a Prometheus text endpoint, reduced to the values the policy reads.

use std::collections::BTreeMap;

use super::{names, text_format};
use crate::{Result, ScalerError};

/// Cumulative histogram buckets: (upper bound, cumulative count), ascending, `+Inf` last.
pub type Buckets = Vec<(f64, f64)>;

/// What one endpoint exposed at one instant. Gauges are summed over label sets
/// (several models or ranks behind one endpoint); counters and histograms are
/// cumulative and turned into rates and quantiles by [`super::window`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reading {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub kv_usage: Option<f64>,
    pub kv_reserved: Option<f64>,
    pub prefill_queue_tokens: Option<f64>,
    pub gateway_pending: Option<f64>,
    /// The same by the pool the requests wait for (its `pool` label; `""` for a
    /// gateway that does not say, whose held requests wait for every pool).
    pub gateway_pending_by_pool: BTreeMap<String, f64>,
    pub prompt_tokens: Option<f64>,
    pub generation_tokens: Option<f64>,
    pub prefix_queries: Option<f64>,
    pub prefix_hits: Option<f64>,
    pub ttft: Option<Buckets>,
    pub itl: Option<Buckets>,
    /// (phase, source) → seconds of the last start.
    pub startup: BTreeMap<(String, String), f64>,
}

/// Parses exposition text, keeping only samples whose labels match `model` (when
/// given, on `model_name`, as vLLM labels them). A malformed line fails the whole
/// scrape, as it does in Prometheus: the endpoint then counts as failed, never as idle.
pub fn parse(text: &str, model: Option<&str>) -> Result<Reading> {
    let mut scalars: BTreeMap<&str, f64> = BTreeMap::new();
    let mut hists: BTreeMap<&str, BTreeMap<u64, (f64, f64)>> = BTreeMap::new();
    let mut r = Reading::default();
    for s in text_format::samples(text) {
        let s = s.map_err(|e| ScalerError::Scrape(format!("exposition: {e}")))?;
        if model.is_some_and(|m| s.label("model_name").is_some_and(|v| v != m)) {
            continue;
        }
        if !s.value.is_finite() {
            continue;
        }
        if s.name == names::STARTUP_PHASE {
            let key = (
                s.label("phase").unwrap_or("").to_owned(),
                s.label("source").unwrap_or("").to_owned(),
            );
            r.startup.insert(key, s.value);
        } else if let Some(name) = known(&s.name, SCALARS) {
            *scalars.entry(name).or_default() += s.value;
            if names::GATEWAY_PENDING.contains(&name) {
                *r.gateway_pending_by_pool
                    .entry(s.label("pool").unwrap_or("").to_owned())
                    .or_default() += s.value;
            }
        } else if let Some(base) = s.name.strip_suffix("_bucket")
            && let Some(name) = known(base, HISTOGRAMS)
        {
            // Buckets are recognised by name and `le`, with or without a TYPE line.
            let Some(le) = s.label("le") else { continue };
            let le: f64 = le.parse().map_err(|_| {
                ScalerError::Scrape(format!(
                    "exposition: line {}: bucket bound le={le:?} is not a number",
                    s.line
                ))
            })?;
            let e = hists
                .entry(name)
                .or_default()
                .entry(le.to_bits())
                .or_insert((le, 0.0));
            e.1 += s.value;
        }
    }
    let first = |group: &[&str]| group.iter().find_map(|n| scalars.get(n).copied());
    let hist = |group: &[&str]| {
        group.iter().find_map(|n| hists.get(n)).map(|h| {
            let mut v: Buckets = h.values().copied().collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            v
        })
    };
    r.waiting = first(names::WAITING);
    r.running = first(names::RUNNING);
    r.kv_usage = first(names::KV_USAGE);
    r.kv_reserved = first(names::KV_RESERVED);
    r.prefill_queue_tokens = first(names::PREFILL_QUEUE_TOKENS);
    r.gateway_pending = first(names::GATEWAY_PENDING);
    r.prompt_tokens = first(names::PROMPT_TOKENS);
    r.generation_tokens = first(names::GENERATION_TOKENS);
    r.prefix_queries = first(names::PREFIX_QUERIES);
    r.prefix_hits = first(names::PREFIX_HITS);
    r.ttft = hist(names::TTFT);
    r.itl = hist(names::ITL);
    Ok(r)
}

/// Gauges and counters the scaler reads; everything else in a scrape is skipped.
const SCALARS: &[&[&str]] = &[
    names::WAITING,
    names::RUNNING,
    names::KV_USAGE,
    names::KV_RESERVED,
    names::PREFILL_QUEUE_TOKENS,
    names::GATEWAY_PENDING,
    names::PROMPT_TOKENS,
    names::GENERATION_TOKENS,
    names::PREFIX_QUERIES,
    names::PREFIX_HITS,
];

const HISTOGRAMS: &[&[&str]] = &[names::TTFT, names::ITL];

/// `name` as the `&'static str` of `groups` it equals.
fn known(name: &str, groups: &[&[&'static str]]) -> Option<&'static str> {
    groups
        .iter()
        .flat_map(|g| g.iter())
        .find(|n| **n == name)
        .copied()
}

/// Prometheus' `histogram_quantile`: linear interpolation inside the bucket that holds
/// quantile `q` of `buckets` (cumulative counts, typically a window's deltas).
#[must_use]
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                // Above the largest finite bound: report that bound, as Prometheus does.
                return Some(prev.0);
            }
            let in_bucket = count - prev.1;
            let frac = if in_bucket > 0.0 {
                (rank - prev.1) / in_bucket
            } else {
                1.0
            };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, count);
    }
    Some(prev.0)
}

/// Fraction of the observations in `buckets` (cumulative counts) at most `x`, with the
/// same linear interpolation inside a bucket as [`quantile`]: the share of requests
/// (or tokens) that met a latency target. `None` without observations.
#[must_use]
pub fn fraction_within(buckets: &[(f64, f64)], x: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total.is_nan() || total <= 0.0 || x.is_nan() {
        return None;
    }
    fraction_within_unclamped(buckets, x, total).map(|f| f.clamp(0.0, 1.0))
}

/// [`fraction_within`] before clamping: buckets that are not cumulative (a broken
/// exposition) could push it outside [0, 1].
fn fraction_within_unclamped(buckets: &[(f64, f64)], x: f64, total: f64) -> Option<f64> {
    let mut prev = (0.0, 0.0);
    for &(le, count) in buckets {
        if x <= le {
            if le.is_infinite() {
                // Beyond the largest finite bound nothing is known: count none of it.
                return Some(prev.1 / total);
            }
            let span = le - prev.0;
            let frac = if span > 0.0 {
                ((x - prev.0) / span).clamp(0.0, 1.0)
            } else {
                1.0
            };
            return Some((prev.1 + (count - prev.1) * frac) / total);
        }
        prev = (le, count);
    }
    Some(prev.1 / total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fraction_within_interpolates_like_histogram_quantile() {
        // 10 observations ≤ 0.5, 30 ≤ 1.0, 40 in all (10 above 1.0).
        let b = [(0.5, 10.0), (1.0, 30.0), (f64::INFINITY, 40.0)];
        assert_eq!(fraction_within(&b, 0.5), Some(0.25));
        assert_eq!(fraction_within(&b, 0.75), Some(0.5));
        assert_eq!(fraction_within(&b, 1.0), Some(0.75));
        // Above the largest bound: what lies beyond it is not known to be within.
        assert_eq!(fraction_within(&b, 100.0), Some(0.75));
        assert_eq!(fraction_within(&b, 0.0), Some(0.0));
        assert_eq!(
            fraction_within(&[(1.0, 0.0), (f64::INFINITY, 0.0)], 1.0),
            None
        );
        // The inverse of quantile inside a bucket.
        let q = quantile(&b, 0.6).unwrap();
        assert!((fraction_within(&b, q).unwrap() - 0.6).abs() < 1e-12);
    }

    const VLLM: &str = r#"# HELP vllm:num_requests_waiting Requests waiting
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3
vllm:num_requests_waiting{model_name="b"} 100
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="a"} 0.25
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="a"} 1200
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{model_name="a",le="0.1"} 5
vllm:time_to_first_token_seconds_bucket{model_name="a",le="1"} 9
vllm:time_to_first_token_seconds_bucket{model_name="a",le="+Inf"} 10
vllm:time_to_first_token_seconds_sum{model_name="a"} 3
vllm:time_to_first_token_seconds_count{model_name="a"} 10
# TYPE preheat:startup_phase_seconds gauge
preheat:startup_phase_seconds{phase="first_token",source="hot"} 2.5
"#;

    #[test]
    fn old_vllm_names_filtered_by_model() {
        let r = parse(VLLM, Some("a")).unwrap();
        assert_eq!(r.waiting, Some(3.0));
        assert_eq!(r.kv_usage, Some(0.25), "old gpu_cache_usage_perc name");
        assert_eq!(r.prompt_tokens, Some(1200.0));
        assert_eq!(r.ttft.as_ref().unwrap().last().unwrap().1, 10.0);
        assert_eq!(r.startup[&("first_token".into(), "hot".into())], 2.5);
        let all = parse(VLLM, None).unwrap();
        assert_eq!(all.waiting, Some(103.0), "gauges sum over label sets");
    }

    #[test]
    fn regression_prometheus_parse_dropped_names_with_colons() {
        // The parser's `\w+` name regex silently skipped every `vllm:` sample.
        let text = "# HELP vllm:num_requests_running Running\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"org/m:v2\"} 4\n";
        let r = parse(text, Some("org/m:v2")).unwrap();
        assert_eq!(
            r.running,
            Some(4.0),
            "colon in the name and in a label value"
        );
    }

    #[test]
    fn sglang_names() {
        let text = "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 7\n# TYPE sglang:token_usage gauge\nsglang:token_usage 0.5\n# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 2\n";
        let r = parse(text, None).unwrap();
        assert_eq!(
            (r.waiting, r.kv_usage, r.running),
            (Some(7.0), Some(0.5), Some(2.0))
        );
    }

    #[test]
    fn quantiles_interpolate_like_prometheus() {
        let b = vec![(0.1, 5.0), (1.0, 9.0), (f64::INFINITY, 10.0)];
        assert!((quantile(&b, 0.5).unwrap() - 0.1).abs() < 1e-12);
        // rank 7 of 10: 2 of the 4 in (0.1, 1] → 0.1 + 0.9 / 2.
        assert!((quantile(&b, 0.7).unwrap() - 0.55).abs() < 1e-12);
        assert_eq!(quantile(&b, 0.99), Some(1.0));
        assert_eq!(quantile(&[(1.0, 0.0), (f64::INFINITY, 0.0)], 0.5), None);
    }

    #[test]
    fn buckets_without_a_type_line_and_bad_bounds() {
        // Some exporters omit TYPE lines; buckets are known by name and `le`.
        let text = "sglang:time_to_first_token_seconds_bucket{le=\"0.5\"} 2\nsglang:time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n";
        let r = parse(text, None).unwrap();
        assert_eq!(r.ttft, Some(vec![(0.5, 2.0), (f64::INFINITY, 3.0)]));
        let bad = "a 1\nvllm:inter_token_latency_seconds_bucket{le=\"x\"} 1\n";
        let e = parse(bad, None).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("le=\"x\""), "{e}");
    }

    #[test]
    fn a_malformed_line_fails_the_scrape_and_says_where() {
        let text = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3\nvllm:num_requests_running{model_name=\"m\" 4\n";
        let e = parse(text, None).unwrap_err().to_string();
        assert!(e.contains("line 3"), "{e}");
        for t in ["x y z", "vllm:num_requests_waiting", "{} 1"] {
            assert!(parse(t, None).is_err(), "{t:?}");
        }
        // Non-finite values are read and skipped, not errors.
        let r = parse("vllm:num_requests_waiting NaN\n", None).unwrap();
        assert_eq!(r.waiting, None);
        assert_eq!(parse("", None).unwrap(), Reading::default());
    }
}
