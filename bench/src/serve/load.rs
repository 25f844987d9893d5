//! The requests a run sends, when, and how each one went: planned from a trace or a
//! fixed rate, streamed from an OpenAI-compatible `/v1/completions`, with a preheat
//! gateway's workers sampled meanwhile.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use preheat_engine::metrics::names::GATEWAY_WORKERS;
use preheat_sim::trace;
use serde::{Deserialize, Serialize};

use crate::args::LoadArgs;

/// One request to send.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Planned {
    pub(crate) at: f64,
    pub(crate) input_tokens: u32,
    pub(crate) output_tokens: u32,
}

/// What happened to one request.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Outcome {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_have_the_requested_word_count() {
        assert_eq!(prompt(5, 3).split(' ').count(), 5);
        assert_ne!(prompt(5, 3), prompt(5, 4));
    }
}
