//! `bench coldstart --fleet`: the start of a second and a third model at zero while
//! the first serves, by the tier each starts from. This is the serverless fleet's
//! case: the node is not idle when a model is asked for, its cores and disk are
//! shared with the models already serving.
//!
//! The second and third models are copies of the snapshot (their own files, so their
//! own page-cache pages: a start of "model 2" never finds model 1's pages hot). The
//! first model serves one request after another for the whole run; once the second
//! has started it is loaded the same way while the third starts. Each start is
//! measured as the single-model bench measures it (spawn or promote to first token).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use super::prepare::Prepared;
use super::{median, spawn_serve, start_from, wait_until};

/// Requests a serving model answers back to back while others start.
struct Load {
    stop: Arc<AtomicBool>,
    tokens: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<u64>>>,
}

impl Load {
    fn start(base: &str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tokens = Arc::new(AtomicU64::new(0));
        let answered = Arc::new(AtomicU64::new(0));
        let (s, t, n, base) = (
            Arc::clone(&stop),
            Arc::clone(&tokens),
            Arc::clone(&answered),
            base.to_owned(),
        );
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
                n.fetch_add(1, Ordering::SeqCst);
                answered += 1;
            }
            Ok(answered)
        });
        Load {
            stop,
            tokens,
            answered,
            thread: Some(thread),
        }
    }

    /// Tokens per second over `n` whole requests (from one answer to the n-th after
    /// it: tokens are counted per answer, so a window must start and end on one).
    fn rate_over_requests(&self, n: u64, limit: Duration) -> anyhow::Result<f64> {
        let wait_past = |count: u64| -> anyhow::Result<()> {
            let t0 = Instant::now();
            while self.answered.load(Ordering::SeqCst) < count {
                anyhow::ensure!(
                    !self
                        .thread
                        .as_ref()
                        .is_some_and(std::thread::JoinHandle::is_finished),
                    "the load stopped"
                );
                anyhow::ensure!(t0.elapsed() < limit, "no answer within {limit:?}");
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(())
        };
        wait_past(self.answered.load(Ordering::SeqCst) + 1)?;
        let (a0, t0, at) = (
            self.answered.load(Ordering::SeqCst),
            self.tokens.load(Ordering::SeqCst),
            Instant::now(),
        );
        wait_past(a0 + n)?;
        Ok((self.tokens.load(Ordering::SeqCst) - t0) as f64 / at.elapsed().as_secs_f64())
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

/// Its own copy of the snapshot for model `n`, made once and kept in `work_dir`
/// (made again when the snapshot is newer or another size).
fn copy_for(p: &Prepared, work_dir: &Path, n: usize) -> anyhow::Result<PathBuf> {
    let dir = work_dir.join("fleet");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("model-{n}.preheat"));
    let src = std::fs::metadata(&p.snapshot)?;
    let current = std::fs::metadata(&path).ok().is_some_and(|m| {
        m.len() == src.len()
            && matches!((m.modified(), src.modified()), (Ok(copy), Ok(orig)) if copy >= orig)
    });
    if !current {
        let tmp = dir.join(format!(".model-{n}.preheat.partial"));
        std::fs::copy(&p.snapshot, &tmp)
            .with_context(|| format!("copying the snapshot to {}", tmp.display()))?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(path)
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
    let alone = load.rate_over_requests(4, Duration::from_secs(600))?;
    tracing::info!(tokens_per_s = alone, "the first model serves");
    let mut out = serde_json::Map::new();
    let (tokens0, phase) = (load.tokens.load(Ordering::SeqCst), Instant::now());
    for source in sources {
        let mut by_model: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut resident: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for run in 0..runs {
            // The second model's replica is loaded too while the third starts.
            let mut serving = Vec::new();
            let mut second_load = None;
            for (i, snapshot) in copies.iter().enumerate() {
                let dl = work_dir.join(format!("fleet-download-{}", i + 2));
                let (s, r) = start_from(c, source, snapshot, p, http, &dl, kv_mib)
                    .with_context(|| format!("model {} from {source}", i + 2))?;
                let _ = std::fs::remove_dir_all(&dl);
                tracing::info!(run, source = %source, model = i + 2, total_s = s.total_s, "start measured while the first model serves");
                by_model[i].push(s.total_s);
                resident[i].push(s.resident_at_start);
                if i == 0 {
                    second_load = Some(Load::start(&r.base));
                }
                serving.push(r);
            }
            if let Some(l) = second_load {
                l.finish().context("the second model's load")?;
            }
            drop(serving);
        }
        out.insert(
            source.clone(),
            json!({
                "second_first_token_s": median(by_model[0].clone()),
                "third_first_token_s": median(by_model[1].clone()),
                "second_runs_s": by_model[0],
                "third_runs_s": by_model[1],
                "second_resident_at_start": resident[0],
                "third_resident_at_start": resident[1],
            }),
        );
    }
    // Over the whole phase (a minute or more), so counting tokens per answer errs by
    // one request's tokens at most.
    let during =
        (load.tokens.load(Ordering::SeqCst) - tokens0) as f64 / phase.elapsed().as_secs_f64();
    let answered = load.finish()?;
    drop(first);
    Ok(json!({
        "sources": out,
        "first_model_tokens_per_s_alone": alone,
        "first_model_tokens_per_s_during_starts": during,
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
