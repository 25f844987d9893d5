//! `preheat bench coldstart`: time from "start a replica" to its first token, for each
//! way a replica can start, against the time to read the snapshot's bytes from page
//! cache measured in the same run.
//!
//! Sources:
//! - `convert`: the replica downloads a Hugging Face checkpoint (or GGUF) served over
//!   local HTTP and converts it at load, as a replica without preheat would;
//! - `staged`: the snapshot is on local disk but not in page cache (evicted with
//!   `POSIX_FADV_DONTNEED`, no root needed);
//! - `hot`: the snapshot is on disk and in page cache (what the warm-pool agent keeps);
//! - `standby`: a replica parked with `--standby` is promoted.
//!
//! Each start is a real `preheat engine serve` process; its phases come from its own
//! `preheat:startup_phase_seconds`, the total from this side (first token received).
//! With `--fleet`, a second and a third model start from each source while the first
//! serves ([`fleet`]).

mod fleet;
pub(crate) mod prepare;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use preheat_local::ports::free_port;
use preheat_output::{human_bytes, outln};
use preheat_snapshot::residency;
use serde_json::{Value, json};

use crate::args::BenchColdstartArgs;
use preheat_warmpool::worker_process::{healthy, reported_state};

use self::prepare::{prepare, serve_dir};

/// Phases in the order a start goes through them (server side).
const PHASES: [&str; 5] = [
    "snapshot_open",
    "weights_resident",
    "loaded",
    "ready",
    "first_token",
];

/// One measured start.
#[derive(Clone, Debug, Default)]
struct Start {
    /// Bench side: seconds to first token received.
    total_s: f64,
    /// Convert only: seconds downloading before the process started.
    download_s: f64,
    /// Standby only: the promote call.
    promote_ms: f64,
    /// Server side: phase → seconds from its origin.
    phases: BTreeMap<String, f64>,
    /// Resident fraction of the snapshot when the replica started.
    resident_at_start: f64,
}

struct Replica {
    child: std::process::Child,
    base: String,
    /// The control routes' listener (`/internal/state`, `/internal/promote`).
    internal: String,
    /// Its stderr, told when it exits before serving.
    log: PathBuf,
}

impl Replica {
    /// The end of its log, for an error.
    fn log_tail(&self) -> String {
        let text = std::fs::read(&self.log).unwrap_or_default();
        let tail = &text[text.len().saturating_sub(2048)..];
        String::from_utf8_lossy(tail).trim().to_owned()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A cluster token for the replicas this bench starts (their control routes ask
/// for it), written once per run.
fn bench_token() -> anyhow::Result<&'static (preheat_edge::ClusterToken, std::path::PathBuf)> {
    static TOKEN: std::sync::OnceLock<(preheat_edge::ClusterToken, std::path::PathBuf)> =
        std::sync::OnceLock::new();
    if let Some(t) = TOKEN.get() {
        return Ok(t);
    }
    let path = std::env::temp_dir().join(format!("preheat-bench-token-{}", std::process::id()));
    let t = preheat_edge::ClusterToken::generate_to(&path)?;
    Ok(TOKEN.get_or_init(|| (t, path)))
}

fn spawn_serve(model: &Path, standby: bool, kv_mib: usize) -> anyhow::Result<Replica> {
    let port = free_port()?;
    let internal = free_port()?;
    let mut args: Vec<std::ffi::OsString> = vec![
        "engine".into(),
        "serve".into(),
        "--model".into(),
        model.into(),
    ];
    for a in [
        "--port".to_owned(),
        port.to_string(),
        "--internal-port".to_owned(),
        internal.to_string(),
        "--kv-cache-mib".to_owned(),
        kv_mib.to_string(),
    ] {
        args.push(a.into());
    }
    if standby {
        args.push("--standby".into());
    }
    let mut cmd = preheat_warmpool::worker_process::worker_command(
        std::env::current_exe()?,
        args,
        Some(&bench_token()?.1),
        None,
    )?;
    let log = std::env::temp_dir().join(format!(
        "preheat-bench-replica-{}-{port}.log",
        std::process::id()
    ));
    let stderr =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    cmd.env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(stderr);
    Ok(Replica {
        child: cmd.spawn().context("starting a replica")?,
        base: format!("http://127.0.0.1:{port}"),
        internal: format!("http://127.0.0.1:{internal}"),
        log,
    })
}

/// Polls `/health` until 200 (or the state until `standby`).
fn wait_until(r: &mut Replica, standby: bool, limit: Duration) -> anyhow::Result<()> {
    let t0 = Instant::now();
    // Readiness is read the way the agent reads its standbys' (one implementation).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = reqwest::Client::new();
    let token = &bench_token()?.0;
    loop {
        if let Some(status) = r.child.try_wait()? {
            bail!(
                "the replica exited ({status}) before serving; its log ends:\n{}",
                r.log_tail()
            );
        }
        let ok = rt.block_on(async {
            if standby {
                reported_state(&client, &r.internal, Some(token))
                    .await
                    .as_deref()
                    == Some("standby")
            } else {
                healthy(&client, &r.base).await
            }
        });
        if ok {
            return Ok(());
        }
        if t0.elapsed() > limit {
            bail!("the replica did not come up within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn first_token(c: &reqwest::blocking::Client, base: &str) -> anyhow::Result<()> {
    let r = c
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "Hello", "max_tokens": 1, "temperature": 0}))
        .timeout(Duration::from_secs(300))
        .send()?;
    if !r.status().is_success() {
        bail!("first request failed: HTTP {}", r.status());
    }
    let v: Value = r.json()?;
    if v["usage"]["completion_tokens"].as_u64() != Some(1) {
        bail!("first request returned no token: {v}");
    }
    Ok(())
}

fn phases(c: &reqwest::blocking::Client, base: &str) -> BTreeMap<String, f64> {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_default();
    let mut out = BTreeMap::new();
    for l in text
        .lines()
        .filter(|l| l.starts_with("preheat:startup_phase_seconds{"))
    {
        let phase = l
            .split("phase=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap_or("");
        let source = l
            .split("source=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap_or("");
        if let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            out.insert(format!("{phase}/{source}"), v);
        }
    }
    out
}

/// A start from a model path: spawn, wait for health, first token; the replica is
/// returned serving.
fn measure_start_replica(
    c: &reqwest::blocking::Client,
    model: &Path,
    snapshot: &Path,
    kv_mib: usize,
) -> anyhow::Result<(Start, Replica)> {
    let resident_at_start = residency::of_file(snapshot).map_or(0.0, |r| r.fraction());
    let t0 = Instant::now();
    let mut r = spawn_serve(model, false, kv_mib)?;
    wait_until(&mut r, false, Duration::from_secs(900))?;
    first_token(c, &r.base)?;
    let total_s = t0.elapsed().as_secs_f64();
    let start = Start {
        total_s,
        phases: phases(c, &r.base),
        resident_at_start,
        ..Start::default()
    };
    Ok((start, r))
}

/// A parked standby promoted to its first token; the replica is returned serving.
fn measure_standby_replica(
    c: &reqwest::blocking::Client,
    snapshot: &Path,
    kv_mib: usize,
) -> anyhow::Result<(Start, Replica)> {
    let mut r = spawn_serve(snapshot, true, kv_mib)?;
    wait_until(&mut r, true, Duration::from_secs(900))?;
    let t0 = Instant::now();
    let p = c
        .post(format!("{}/internal/promote", r.internal))
        .header("authorization", bench_token()?.0.bearer())
        .send()?;
    let promote_ms = t0.elapsed().as_secs_f64() * 1e3;
    if !p.status().is_success() {
        bail!("promotion failed: HTTP {}", p.status());
    }
    first_token(c, &r.base)?;
    let total_s = t0.elapsed().as_secs_f64();
    let start = Start {
        total_s,
        promote_ms,
        phases: phases(c, &r.base),
        resident_at_start: 1.0,
        ..Start::default()
    };
    Ok((start, r))
}

/// One start of a model at zero from `source` (its snapshot at `snapshot`; `convert`
/// downloads `p`'s checkpoint from `http` into `dl` first, the download counted in
/// the start); the replica is returned serving.
fn start_from(
    c: &reqwest::blocking::Client,
    source: &str,
    snapshot: &Path,
    p: &prepare::Prepared,
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
        other => bail!("unknown source {other}"),
    }
}

/// Downloads every file of `files` from `base` into `dir`.
fn download(
    c: &reqwest::blocking::Client,
    base: &str,
    files: &[String],
    dir: &Path,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for f in files {
        let mut r = c
            .get(format!("{base}/{f}"))
            .timeout(Duration::from_secs(3600))
            .send()?
            .error_for_status()?;
        let mut out =
            std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(dir.join(f))?);
        std::io::copy(&mut r, &mut out)?;
        use std::io::Write;
        out.flush()?;
    }
    Ok(())
}

/// Reads the whole file with large reads; returns seconds.
fn read_all(path: &Path) -> anyhow::Result<f64> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 16 << 20];
    let t0 = Instant::now();
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    preheat_scaler::percentile::percentile(&mut v, 0.5).unwrap_or(0.0)
}

/// Bar segments of a start: (phase, seconds), consecutive.
fn segments(s: &Start, source: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    if source == "standby" {
        out.push(("promote".to_owned(), s.promote_ms / 1e3));
        out.push((
            "first_token".to_owned(),
            (s.total_s - s.promote_ms / 1e3).max(0.0),
        ));
        return out;
    }
    let mut prev = 0.0;
    if source == "convert" {
        out.push(("download".to_owned(), s.download_s));
    }
    let offset = s.download_s;
    for p in PHASES {
        let v = s
            .phases
            .iter()
            .find(|(k, _)| k.split('/').next() == Some(p))
            .map(|(_, v)| *v);
        let end = if p == "first_token" {
            Some(s.total_s - offset)
        } else {
            v
        };
        if let Some(end) = end {
            out.push((p.to_owned(), (end - prev).max(0.0)));
            prev = end.max(prev);
        }
    }
    out
}

pub(crate) fn run(a: &BenchColdstartArgs) -> anyhow::Result<ExitCode> {
    let mut errs = Vec::new();
    if a.runs == 0 {
        errs.push("--runs must be > 0".to_owned());
    }
    if !errs.is_empty() {
        bail!("invalid options:\n  {}", errs.join("\n  "));
    }
    let wanted: Vec<String> = a.sources.iter().map(|s| s.as_str().to_owned()).collect();
    let p = prepare(&a.model, &a.work_dir)?;
    let bytes = std::fs::metadata(&p.snapshot)?.len();
    let c = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()?;
    // The physical reference: the snapshot's bytes read from page cache.
    let _ = read_all(&p.snapshot)?;
    let read_s = median(
        (0..3)
            .map(|_| read_all(&p.snapshot))
            .collect::<anyhow::Result<Vec<_>>>()?,
    );
    residency::evict(&p.snapshot)?;
    let disk_s = read_all(&p.snapshot)?;
    let evicted_ok = {
        residency::evict(&p.snapshot)?;
        residency::of_file(&p.snapshot)?.fraction()
    };
    tracing::info!(
        read_s,
        disk_s,
        resident_after_evict = evicted_ok,
        "reference reads"
    );
    let http = if wanted.iter().any(|s| s == "convert") {
        Some(serve_dir(p.convert_dir.clone())?)
    } else {
        None
    };
    let mut results: BTreeMap<String, Vec<Start>> = BTreeMap::new();
    for run in 0..a.runs {
        for source in &wanted {
            let dl = a.work_dir.join(format!("download-{run}"));
            let (s, replica) = start_from(
                &c,
                source,
                &p.snapshot,
                &p,
                http.as_deref(),
                &dl,
                a.kv_cache_mib,
            )?;
            drop(replica);
            let _ = std::fs::remove_dir_all(&dl);
            tracing::info!(run, source = %source, total_s = s.total_s, "start measured");
            results.entry(source.clone()).or_default().push(s);
        }
    }
    let hot_target = 2.0 * read_s + 0.5;
    let mut sources = serde_json::Map::new();
    let mut bars = Vec::new();
    for source in &wanted {
        let runs = &results[source];
        let total = median(runs.iter().map(|s| s.total_s).collect());
        // The run closest to the median stands for the source in the chart.
        let rep = runs
            .iter()
            .min_by(|x, y| {
                (x.total_s - total)
                    .abs()
                    .total_cmp(&(y.total_s - total).abs())
            })
            .cloned()
            .unwrap_or_default();
        let segs = segments(&rep, source);
        bars.push((source.clone(), segs.clone()));
        let mut o = json!({
            "first_token_s": total,
            "runs_s": runs.iter().map(|s| s.total_s).collect::<Vec<_>>(),
            "vs_page_cache_read": total / read_s.max(1e-9),
            "resident_at_start": rep.resident_at_start,
            "phases_s": segs.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
        });
        if source == "standby" {
            o["promote_ms"] = json!(median(runs.iter().map(|s| s.promote_ms).collect()));
        }
        if source == "convert" {
            o["download_s"] = json!(median(runs.iter().map(|s| s.download_s).collect()));
        }
        sources.insert(source.clone(), o);
    }
    let fleet = if a.fleet {
        Some(fleet::measure(
            &c,
            &p,
            &a.work_dir,
            http.as_deref(),
            &wanted,
            a.runs,
            a.kv_cache_mib,
        )?)
    } else {
        None
    };
    let hot = sources.get("hot").and_then(|v| v["first_token_s"].as_f64());
    let promote = sources
        .get("standby")
        .and_then(|v| v["promote_ms"].as_f64());
    let report = json!({
        "model": p.name,
        "snapshot_bytes": bytes,
        "runs": a.runs,
        "threads": rayon::current_num_threads(),
        "page_cache_read_s": read_s,
        "page_cache_read_gbps": bytes as f64 / read_s / 1e9,
        "disk_read_s": disk_s,
        "resident_after_evict": evicted_ok,
        "sources": sources,
        "targets": {
            "hot_first_token_max_s": hot_target,
            "hot_met": hot.map(|h| h <= hot_target),
            "standby_promote_max_ms": 100.0,
            "standby_met": promote.map(|m| m < 100.0),
        },
        "fleet": fleet,
    });
    if let Some(path) = &a.plot {
        let svg = preheat_output::plot::stacked_bars(
            &format!(
                "Cold start to first token: {} ({}), {} runs, median",
                p.name,
                human_bytes(bytes),
                a.runs
            ),
            "seconds from start of the replica",
            &bars,
            Some((
                format!("2 × page-cache read + 0.5 s = {hot_target:.2} s"),
                hot_target,
            )),
        );
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    if a.out.json {
        preheat_output::print_json(&report)?;
    } else {
        outln!(
            "{} ({}): page-cache read {:.3} s ({:.2} GB/s), disk read {:.3} s",
            p.name,
            human_bytes(bytes),
            read_s,
            bytes as f64 / read_s / 1e9,
            disk_s
        );
        for source in &wanted {
            let v = &report["sources"][source];
            let ft = v["first_token_s"].as_f64().unwrap_or(0.0);
            let extra = match source.as_str() {
                "standby" => format!(
                    "  (promote {:.1} ms)",
                    v["promote_ms"].as_f64().unwrap_or(0.0)
                ),
                "convert" => format!(
                    "  (download {:.2} s)",
                    v["download_s"].as_f64().unwrap_or(0.0)
                ),
                _ => String::new(),
            };
            outln!(
                "  {source:>8}: first token {ft:>8.3} s = {:>7.2}x page-cache read{extra}",
                ft / read_s
            );
        }
        if let Some(f) = &fleet {
            fleet::print(f, &wanted, read_s)?;
        }
        outln!(
            "targets: hot <= {hot_target:.3} s: {}; standby promotion < 100 ms: {}",
            hot.map_or("not measured".into(), |h| if h <= hot_target {
                "met".to_owned()
            } else {
                "NOT met".to_owned()
            }),
            promote.map_or("not measured".into(), |m| if m < 100.0 {
                "met".to_owned()
            } else {
                "NOT met".to_owned()
            })
        );
    }
    Ok(ExitCode::SUCCESS)
}
