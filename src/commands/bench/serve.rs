//! `preheat bench serve`: a load generator for any OpenAI-compatible endpoint. Replays a
//! trace (Azure CSV or Mooncake JSONL) at its own pace (or sped up), or sends a fixed
//! rate of synthetic requests; streams every completion and reports TTFT, ITL and
//! end-to-end latency percentiles, throughput and SLO attainment.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use preheat_scaler::percentile::percentile as pct;
use preheat_sim::trace;
use serde::{Deserialize, Serialize};

use crate::cli::{BenchServeArgs, LoadArgs};
use crate::output::{outln, print_json};
use preheat_engine::metrics::names::GATEWAY_WORKERS;

/// One request to send.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Planned {
    pub(crate) at: f64,
    pub(crate) input_tokens: u32,
    pub(crate) output_tokens: u32,
}

/// What happened to one request.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Outcome {
    pub sent_at: f64,
    pub ok: bool,
    pub error: Option<String>,
    pub ttft: Option<f64>,
    /// Mean gap between streamed chunks after the first.
    pub itl: Option<f64>,
    pub e2e: f64,
    pub output_chunks: u32,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct Report {
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

pub(crate) fn plan(a: &LoadArgs) -> anyhow::Result<Vec<Planned>> {
    let mut errs = Vec::new();
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        errs.push("--speedup must be > 0".to_owned());
    }
    if !(a.token_scale.is_finite() && a.token_scale > 0.0) {
        errs.push("--token-scale must be > 0".to_owned());
    }
    if a.trace.is_none() && !(a.rate.is_finite() && a.rate > 0.0) {
        errs.push("--rate must be > 0".to_owned());
    }
    if a.max_input_tokens == 0 || a.max_output_tokens == 0 {
        errs.push("--max-input-tokens and --max-output-tokens must be > 0".to_owned());
    }
    if !errs.is_empty() {
        bail!("{}", errs.join("\n"));
    }
    let scale = |n: u32, max: u32| ((f64::from(n) * a.token_scale).round() as u32).clamp(1, max);
    let mut out: Vec<Planned> = match &a.trace {
        Some(path) => trace::load(path)?
            .into_iter()
            .map(|r| Planned {
                at: r.t / a.speedup,
                input_tokens: scale(r.input_tokens, a.max_input_tokens),
                output_tokens: scale(r.output_tokens, a.max_output_tokens),
            })
            .collect(),
        None => (0..a.requests)
            .map(|i| Planned {
                at: i as f64 / a.rate,
                input_tokens: a.input_tokens.clamp(1, a.max_input_tokens),
                output_tokens: a.output_tokens.clamp(1, a.max_output_tokens),
            })
            .collect(),
    };
    if let Some(n) = a.max_requests {
        out.truncate(n);
    }
    if out.is_empty() {
        bail!("nothing to send (no requests planned)");
    }
    Ok(out)
}

/// A prompt of about `n` tokens for common BPE vocabularies (one short word each).
fn prompt(n: u32, salt: usize) -> String {
    const WORDS: [&str; 16] = [
        "the", "cat", "sat", "on", "a", "mat", "and", "we", "ran", "to", "see", "it", "go", "up",
        "by", "me",
    ];
    // A per-request first word keeps unrelated requests from sharing a whole prefix.
    let mut s = format!("{salt}");
    for i in 1..n as usize {
        s.push(' ');
        s.push_str(WORDS[(i * 7 + salt) % WORDS.len()]);
    }
    s
}

async fn one(
    client: &reqwest::Client,
    url: &str,
    model: Option<&str>,
    p: Planned,
    idx: usize,
    sent_at: f64,
    timeout: Duration,
) -> Outcome {
    let mut o = Outcome {
        sent_at,
        ..Outcome::default()
    };
    let start = Instant::now();
    let mut body = serde_json::json!({
        "prompt": prompt(p.input_tokens, idx),
        "max_tokens": p.output_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(m) = model {
        body["model"] = m.into();
    }
    let r = tokio::time::timeout(timeout, async {
        let resp = client
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("send: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!(
                "HTTP {status}: {}",
                text.chars().take(200).collect::<String>()
            ));
        }
        let mut stream = resp.bytes_stream();
        let mut buf = Vec::new();
        let mut last_chunk: Option<Instant> = None;
        let mut gaps = 0.0;
        let mut done = false;
        let mut finished = false;
        // First chunk carrying a choice: the TTFT of a token whose text is held back
        // (a partial UTF-8 character) when no text chunk ever comes.
        let mut first_choice: Option<f64> = None;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| format!("stream: {e}"))?;
            buf.extend_from_slice(&chunk);
            while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..pos + 2).collect();
                let text = String::from_utf8_lossy(&event);
                for line in text.lines() {
                    let Some(data) = line.strip_prefix("data: ") else {
                        continue;
                    };
                    if data.trim() == "[DONE]" {
                        done = true;
                        continue;
                    }
                    let v: serde_json::Value =
                        serde_json::from_str(data).map_err(|e| format!("bad event: {e}"))?;
                    if let Some(err) = v.get("error") {
                        return Err(format!("error event: {err}"));
                    }
                    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                        o.prompt_tokens = u["prompt_tokens"].as_u64();
                        o.completion_tokens = u["completion_tokens"].as_u64();
                    }
                    if v["choices"][0].is_object() && first_choice.is_none() {
                        first_choice = Some(start.elapsed().as_secs_f64());
                    }
                    if v["choices"][0]["finish_reason"].is_string() {
                        finished = true;
                    }
                    let has_text = v["choices"][0]["text"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty());
                    if has_text {
                        let now = Instant::now();
                        match last_chunk {
                            None => o.ttft = Some(start.elapsed().as_secs_f64()),
                            Some(prev) => gaps += (now - prev).as_secs_f64(),
                        }
                        last_chunk = Some(now);
                        o.output_chunks += 1;
                    }
                }
            }
        }
        if !done {
            return Err("stream ended without [DONE]".to_owned());
        }
        if !finished {
            return Err("stream ended without a finish_reason".to_owned());
        }
        if o.ttft.is_none() {
            o.ttft = first_choice;
        }
        if o.output_chunks > 1 {
            o.itl = Some(gaps / f64::from(o.output_chunks - 1));
        }
        Ok(())
    })
    .await;
    o.e2e = start.elapsed().as_secs_f64();
    match r {
        Ok(Ok(())) => o.ok = o.ttft.is_some(),
        Ok(Err(e)) => o.error = Some(e),
        Err(_) => o.error = Some(format!("timed out after {} s", timeout.as_secs_f64())),
    }
    if !o.ok && o.error.is_none() {
        o.error = Some("no tokens streamed".to_owned());
    }
    o
}

type ReplicaLog = std::sync::Arc<std::sync::Mutex<Vec<(f64, u32, u32)>>>;

/// One look at a preheat gateway's rotation (its public `/metrics`); `None` from
/// other servers.
async fn sample_replicas(
    client: &reqwest::Client,
    url: &str,
    t0: tokio::time::Instant,
) -> Option<(f64, u32, u32)> {
    let r = client
        .get(format!("{url}/metrics"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()
        .filter(|r| r.status().is_success())?;
    let text = r.text().await.ok()?;
    // `preheat:gateway_workers{…role="decode"…} 2`: only a preheat gateway has it.
    let n = |role: &str| {
        let label = format!("role=\"{role}\"");
        text.lines()
            .find(|l| l.starts_with(GATEWAY_WORKERS) && l.contains(&label))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|v| v as u32)
    };
    Some((t0.elapsed().as_secs_f64(), n("prefill")?, n("decode")?))
}

/// Samples the worker list twice a second into `out` until aborted; stops at the
/// first answer that is not a worker list.
async fn watch_replicas(
    client: reqwest::Client,
    url: String,
    t0: tokio::time::Instant,
    out: ReplicaLog,
) {
    while let Some(s) = sample_replicas(&client, &url, t0).await {
        out.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(s);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Load (requests/s sent), p90 TTFT per 10 s, and replicas over time.
fn plot(r: &Report, outcomes: &[Outcome]) -> String {
    use crate::plot::{Panel, Series, svg};
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

/// A progress bar over `n` requests, drawn only on a terminal.
pub(crate) fn request_bar(n: usize) -> anyhow::Result<indicatif::ProgressBar> {
    let bar = indicatif::ProgressBar::new(n as u64);
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg:>8} [{bar:40}] {pos}/{len} eta {eta}")
                .context("progress template")?
                .progress_chars("=> "),
        );
        bar.set_message("requests");
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    Ok(bar)
}

/// Sends `planned` at their times from `t0`, each streamed to its end; returns every
/// outcome (in plan order) and the gateway's workers sampled meanwhile.
pub(crate) async fn replay(
    url: &str,
    model: Option<&str>,
    planned: &[Planned],
    timeout: Duration,
    t0: tokio::time::Instant,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<(Vec<Outcome>, Vec<(f64, u32, u32)>)> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .context("HTTP client")?;
    let log = ReplicaLog::default();
    let watcher = tokio::spawn(watch_replicas(
        client.clone(),
        url.to_owned(),
        t0,
        log.clone(),
    ));
    let mut set = tokio::task::JoinSet::new();
    for (i, p) in planned.iter().copied().enumerate() {
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(p.at)).await;
        let (client, url, model, bar) = (
            client.clone(),
            url.to_owned(),
            model.map(str::to_owned),
            bar.clone(),
        );
        set.spawn(async move {
            let sent = t0.elapsed().as_secs_f64();
            let o = one(&client, &url, model.as_deref(), p, i, sent, timeout).await;
            bar.inc(1);
            (i, o)
        });
    }
    let mut all = vec![Outcome::default(); planned.len()];
    while let Some(r) = set.join_next().await {
        let (i, o) = r.context("request task")?;
        all[i] = o;
    }
    watcher.abort();
    // A last look: a short run may end between two samples.
    if let Some(s) = sample_replicas(&client, url, t0).await {
        log.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(s);
    }
    let replicas = log
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    Ok((all, replicas))
}

pub fn run(a: &BenchServeArgs) -> anyhow::Result<ExitCode> {
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

    #[test]
    fn prompts_have_the_requested_word_count() {
        assert_eq!(prompt(5, 3).split(' ').count(), 5);
        assert_ne!(prompt(5, 3), prompt(5, 4));
    }
}
