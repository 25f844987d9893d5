//! `bench coldstart --fleet`: the start of a second and a third model at zero while
//! the first serves, by the tier each starts from. This is the serverless fleet's
//! case: the node is not idle when a model is asked for, its cores and disk are
//! shared with the models already serving.
//!
//! The second and third models are copies of the snapshot (their own files, so their
//! own page-cache pages: a start of "model 2" never finds model 1's pages hot). The
//! first model serves one stream after another for the whole run; the second keeps its
//! replica while the third starts. Each start is measured as the single-model bench
//! measures it (spawn or promote to first token).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use preheat_snapshot::residency;
use serde_json::{Value, json};

use super::prepare::Prepared;
use super::{
    Replica, Start, download, measure_standby_replica, measure_start_replica, median, read_all,
    spawn_serve, wait_until,
};

/// Requests the first model answers back to back while the others start.
struct Load {
    stop: Arc<AtomicBool>,
    tokens: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<u64>>>,
}

impl Load {
    fn start(base: &str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tokens = Arc::new(AtomicU64::new(0));
        let (s, t, base) = (Arc::clone(&stop), Arc::clone(&tokens), base.to_owned());
        let thread = std::thread::spawn(move || -> anyhow::Result<u64> {
            let c = reqwest::blocking::Client::new();
            let mut answered = 0;
            while !s.load(Ordering::SeqCst) {
                let r = c
                    .post(format!("{base}/v1/completions"))
                    .json(
                        &json!({"prompt": "The history of the fleet", "max_tokens": 32,
                                  "temperature": 0}),
                    )
                    .timeout(Duration::from_secs(300))
                    .send()?;
                let status = r.status();
                let v: Value = r.json()?;
                anyhow::ensure!(status.is_success(), "the first model failed: {status} {v}");
                t.fetch_add(
                    v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
                    Ordering::SeqCst,
                );
                answered += 1;
            }
            Ok(answered)
        });
        Load {
            stop,
            tokens,
            thread: Some(thread),
        }
    }

    /// Tokens per second the first model generates over `d`.
    fn rate_over(&self, d: Duration) -> f64 {
        let t0 = self.tokens.load(Ordering::SeqCst);
        std::thread::sleep(d);
        (self.tokens.load(Ordering::SeqCst) - t0) as f64 / d.as_secs_f64()
    }

    /// Stops the load; the requests it had answered (an error if any failed).
    fn finish(mut self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::SeqCst);
        match self.thread.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => anyhow::bail!("the load thread panicked"),
            None => Ok(0),
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Its own copy of the snapshot for model `n`, made once and kept in `work_dir`.
fn copy_for(p: &Prepared, work_dir: &Path, n: usize) -> anyhow::Result<PathBuf> {
    let dir = work_dir.join("fleet");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("model-{n}.preheat"));
    let want = std::fs::metadata(&p.snapshot)?.len();
    if std::fs::metadata(&path).map(|m| m.len()).ok() != Some(want) {
        let tmp = dir.join(format!(".model-{n}.preheat.partial"));
        std::fs::copy(&p.snapshot, &tmp)
            .with_context(|| format!("copying the snapshot to {}", tmp.display()))?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(path)
}

/// One start of a model at zero from `source`; the replica is returned serving.
fn start_one(
    c: &reqwest::blocking::Client,
    source: &str,
    snapshot: &Path,
    p: &Prepared,
    http: Option<&str>,
    dl: &Path,
    kv_mib: usize,
) -> anyhow::Result<(Start, Replica)> {
    match source {
        "convert" => {
            let base = http.context("file server")?;
            let _ = std::fs::remove_dir_all(dl);
            let t0 = Instant::now();
            download(c, base, &p.convert_files, dl)?;
            let download_s = t0.elapsed().as_secs_f64();
            let model = if p.convert_is_dir {
                dl.to_path_buf()
            } else {
                dl.join(&p.convert_files[0])
            };
            let (mut s, r) = measure_start_replica(c, &model, snapshot, kv_mib)?;
            s.total_s += download_s;
            s.download_s = download_s;
            Ok((s, r))
        }
        "staged" => {
            residency::evict(snapshot)?;
            measure_start_replica(c, snapshot, snapshot, kv_mib)
        }
        "hot" => {
            let _ = read_all(snapshot)?;
            measure_start_replica(c, snapshot, snapshot, kv_mib)
        }
        "standby" => {
            let _ = read_all(snapshot)?;
            measure_standby_replica(c, snapshot, kv_mib)
        }
        other => anyhow::bail!("unknown source {other}"),
    }
}

/// Measures the second and third model's starts from each of `sources`, `runs` times,
/// while the first serves; returns the report's `fleet` object.
pub(super) fn measure(
    c: &reqwest::blocking::Client,
    p: &Prepared,
    work_dir: &Path,
    http: Option<&str>,
    sources: &[String],
    runs: usize,
    kv_mib: usize,
) -> anyhow::Result<Value> {
    let copies = [copy_for(p, work_dir, 2)?, copy_for(p, work_dir, 3)?];
    let mut first = spawn_serve(&p.snapshot, false, kv_mib)?;
    wait_until(&mut first, false, Duration::from_secs(900))?;
    let load = Load::start(&first.base);
    let alone = load.rate_over(Duration::from_secs(5));
    tracing::info!(tokens_per_s = alone, "the first model serves");
    let mut out = serde_json::Map::new();
    let mut during = Vec::new();
    for source in sources {
        let mut by_model: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for run in 0..runs {
            let tokens0 = load.tokens.load(Ordering::SeqCst);
            let t0 = Instant::now();
            // The second model's replica serves while the third starts.
            let mut serving = Vec::new();
            for (i, snapshot) in copies.iter().enumerate() {
                let dl = work_dir.join(format!("fleet-download-{}", i + 2));
                let (s, r) = start_one(c, source, snapshot, p, http, &dl, kv_mib)
                    .with_context(|| format!("model {} from {source}", i + 2))?;
                let _ = std::fs::remove_dir_all(&dl);
                tracing::info!(run, source = %source, model = i + 2, total_s = s.total_s, "start measured while the first model serves");
                by_model[i].push(s.total_s);
                serving.push(r);
            }
            drop(serving);
            let rate =
                (load.tokens.load(Ordering::SeqCst) - tokens0) as f64 / t0.elapsed().as_secs_f64();
            during.push(rate);
        }
        out.insert(
            source.clone(),
            json!({
                "second_first_token_s": median(by_model[0].clone()),
                "third_first_token_s": median(by_model[1].clone()),
                "second_runs_s": by_model[0],
                "third_runs_s": by_model[1],
            }),
        );
    }
    let answered = load.finish()?;
    drop(first);
    Ok(json!({
        "sources": out,
        "first_model_tokens_per_s_alone": alone,
        "first_model_tokens_per_s_during_starts": median(during),
        "first_model_requests_answered": answered,
    }))
}

/// The human form of [`measure`]'s report.
pub(super) fn print(f: &Value, sources: &[String], read_s: f64) -> anyhow::Result<()> {
    preheat_output::outln!(
        "while a first model serves ({:.1} tokens/s alone, {:.1} during the starts):",
        f["first_model_tokens_per_s_alone"].as_f64().unwrap_or(0.0),
        f["first_model_tokens_per_s_during_starts"]
            .as_f64()
            .unwrap_or(0.0)
    );
    for source in sources {
        let v = &f["sources"][source];
        let (second, third) = (
            v["second_first_token_s"].as_f64().unwrap_or(0.0),
            v["third_first_token_s"].as_f64().unwrap_or(0.0),
        );
        preheat_output::outln!(
            "  {source:>8}: second model {second:>8.3} s ({:>6.2}x read), third {third:>8.3} s ({:>6.2}x read)",
            second / read_s,
            third / read_s
        );
    }
    Ok(())
}
