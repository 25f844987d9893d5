//! `preheat bench serve`: a load generator for any OpenAI-compatible endpoint. Replays a
//! trace (Azure CSV or Mooncake JSONL) at its own pace (or sped up), or sends a fixed
//! rate of synthetic requests; streams every completion and reports TTFT, ITL and
//! end-to-end latency percentiles, throughput and SLO attainment.

mod load;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use preheat_output::{outln, print_json};
use preheat_scaler::percentile::percentile as pct;
use serde::Serialize;

use crate::args::BenchServeArgs;

pub(crate) use self::load::{Outcome, Planned, plan, replay, request_bar};

#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub url: String,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_p50: Option<f64>,
    pub ttft_p90: Option<f64>,
    pub ttft_p99: Option<f64>,
    pub itl_p50: Option<f64>,
    pub itl_p99: Option<f64>,
    pub e2e_p50: Option<f64>,
    pub e2e_p99: Option<f64>,
    pub slo_ttft_s: f64,
    pub slo_itl_s: f64,
    /// Fraction of all requests (failures count as misses) within both SLOs.
    pub slo_attainment: f64,
    /// The first few distinct errors.
    pub errors: Vec<String>,
    /// (seconds, prefill, decode) workers registered with a preheat gateway, twice a
    /// second; empty against other servers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<(f64, u32, u32)>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub outcomes: Vec<Outcome>,
}

/// Load (requests/s sent), p90 TTFT per 10 s, and replicas over time.
fn plot(r: &Report, outcomes: &[Outcome]) -> String {
    use preheat_output::plot::{Panel, Series, svg};
    let bin = 10.0;
    let end = outcomes.iter().map(|o| o.sent_at).fold(0.0, f64::max);
    let n = (end / bin).floor() as usize + 1;
    let mut sent = vec![0.0; n];
    let mut ttfts: Vec<Vec<f64>> = vec![Vec::new(); n];
    for o in outcomes {
        let i = ((o.sent_at / bin) as usize).min(n - 1);
        sent[i] += 1.0 / bin;
        if let Some(t) = o.ttft {
            ttfts[i].push(t);
        }
    }
    let t = |i: usize| i as f64 * bin;
    let mut panels = vec![
        Panel {
            y_label: "requests/s".into(),
            series: vec![Series {
                name: "load".into(),
                points: sent.iter().enumerate().map(|(i, v)| (t(i), *v)).collect(),
                step: false,
            }],
        },
        Panel {
            y_label: "TTFT p90 (s)".into(),
            series: vec![Series {
                name: "ttft p90".into(),
                points: ttfts
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(i, v)| pct(v, 0.9).map(|p| (t(i), p)))
                    .collect(),
                step: false,
            }],
        },
    ];
    if !r.replicas.is_empty() {
        panels.push(Panel {
            y_label: "replicas".into(),
            series: vec![
                Series {
                    name: "prefill".into(),
                    points: r.replicas.iter().map(|x| (x.0, f64::from(x.1))).collect(),
                    step: true,
                },
                Series {
                    name: "decode".into(),
                    points: r.replicas.iter().map(|x| (x.0, f64::from(x.2))).collect(),
                    step: true,
                },
            ],
        });
    }
    svg(
        &format!("{}: {} requests, {} failed", r.url, r.requests, r.failed),
        "seconds",
        &panels,
    )
}

pub(crate) fn run(a: &BenchServeArgs) -> anyhow::Result<ExitCode> {
    let planned = plan(&a.load)?;
    let url = a.url.trim_end_matches('/').to_owned();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let timeout = a.load.timeout.max(Duration::from_millis(1));
    let bar = request_bar(planned.len())?;
    let started = Instant::now();
    let (mut outcomes, replicas) = rt.block_on(replay(
        &url,
        a.model.as_deref(),
        &planned,
        timeout,
        tokio::time::Instant::now(),
        &bar,
    ))?;
    bar.finish_and_clear();
    let duration = started.elapsed().as_secs_f64();
    let mut report = summarise(
        &url,
        &mut outcomes,
        duration,
        a.slo_ttft,
        a.slo_itl,
        a.per_request,
    );
    report.replicas = replicas;
    let svg = a.plot.as_deref().map(|p| (p, plot(&report, &outcomes)));
    emit(&report, svg, a.out.json, print_text, report.failed)
}

/// A bench report's ending: its plot written, the report printed as JSON or text,
/// and exit 1 when requests failed.
pub(crate) fn emit<R: Serialize>(
    report: &R,
    svg: Option<(&std::path::Path, String)>,
    json: bool,
    text: fn(&R) -> anyhow::Result<()>,
    failed: usize,
) -> anyhow::Result<ExitCode> {
    if let Some((path, svg)) = svg {
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    if json {
        print_json(&serde_json::to_value(report)?)?;
    } else {
        text(report)?;
    }
    Ok(if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The first few distinct errors.
pub(crate) fn first_errors(outcomes: &[Outcome]) -> Vec<String> {
    let mut errors: Vec<String> = Vec::new();
    for e in outcomes.iter().filter_map(|o| o.error.as_ref()) {
        if errors.len() >= 5 {
            break;
        }
        if !errors.contains(e) {
            errors.push(e.clone());
        }
    }
    errors
}

fn summarise(
    url: &str,
    outcomes: &mut [Outcome],
    duration: f64,
    slo_ttft: f64,
    slo_itl: f64,
    keep: bool,
) -> Report {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|o| o.ttft).collect();
    let mut itl: Vec<f64> = ok.iter().filter_map(|o| o.itl).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|o| o.e2e).collect();
    let attained = ok
        .iter()
        .filter(|o| o.ttft.is_some_and(|t| t <= slo_ttft) && o.itl.is_none_or(|i| i <= slo_itl))
        .count();
    let out_tokens: u64 = ok
        .iter()
        .map(|o| o.completion_tokens.unwrap_or(u64::from(o.output_chunks)))
        .sum();
    let errors = first_errors(outcomes);
    let n = outcomes.len();
    Report {
        url: url.to_owned(),
        requests: n,
        completed: ok.len(),
        failed: n - ok.len(),
        duration_s: duration,
        requests_per_s: ok.len() as f64 / duration.max(1e-9),
        output_tokens_per_s: out_tokens as f64 / duration.max(1e-9),
        ttft_p50: pct(&mut ttft, 0.5),
        ttft_p90: pct(&mut ttft, 0.9),
        ttft_p99: pct(&mut ttft, 0.99),
        itl_p50: pct(&mut itl, 0.5),
        itl_p99: pct(&mut itl, 0.99),
        e2e_p50: pct(&mut e2e, 0.5),
        e2e_p99: pct(&mut e2e, 0.99),
        slo_ttft_s: slo_ttft,
        slo_itl_s: slo_itl,
        slo_attainment: attained as f64 / n.max(1) as f64,
        errors,
        replicas: Vec::new(),
        outcomes: if keep { outcomes.to_vec() } else { Vec::new() },
    }
}

fn print_text(r: &Report) -> anyhow::Result<()> {
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |x| format!("{:.1} ms", x * 1e3));
    outln!(
        "{}: {} requests, {} completed, {} failed in {:.1} s ({:.2} req/s, {:.1} output tokens/s)",
        r.url,
        r.requests,
        r.completed,
        r.failed,
        r.duration_s,
        r.requests_per_s,
        r.output_tokens_per_s
    );
    outln!(
        "TTFT p50 {}  p90 {}  p99 {}",
        ms(r.ttft_p50),
        ms(r.ttft_p90),
        ms(r.ttft_p99)
    );
    outln!("ITL  p50 {}  p99 {}", ms(r.itl_p50), ms(r.itl_p99));
    outln!("E2E  p50 {}  p99 {}", ms(r.e2e_p50), ms(r.e2e_p99));
    outln!(
        "SLO (TTFT ≤ {} s, ITL ≤ {} s): {:.2}% of requests",
        r.slo_ttft_s,
        r.slo_itl_s,
        r.slo_attainment * 100.0
    );
    for e in &r.errors {
        outln!("error: {e}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_attainment_count_failures_as_misses() {
        let mut o = vec![
            Outcome {
                ok: true,
                ttft: Some(0.1),
                itl: Some(0.01),
                e2e: 1.0,
                ..Outcome::default()
            },
            Outcome {
                ok: true,
                ttft: Some(3.0),
                itl: Some(0.01),
                e2e: 4.0,
                ..Outcome::default()
            },
            Outcome {
                ok: false,
                error: Some("HTTP 500".into()),
                e2e: 0.1,
                ..Outcome::default()
            },
            Outcome {
                ok: true,
                ttft: Some(0.2),
                itl: None,
                e2e: 0.2,
                ..Outcome::default()
            },
        ];
        let r = summarise("u", &mut o, 2.0, 1.0, 0.05, false);
        assert_eq!((r.completed, r.failed), (3, 1));
        assert_eq!(r.slo_attainment, 0.5);
        assert_eq!(r.ttft_p50, Some(0.2));
        assert_eq!(r.errors, ["HTTP 500"]);
    }
}
