//! `preheat bench simreal`: is the simulator right about the stack it models?
//!
//! It runs `preheat up` (as a child process, with the flags an operator would give)
//! under a trace slice sent as `bench serve` sends it, and records each pool's replicas
//! (the scaler's `/status`, twice a second) and every worker's start time (its
//! `preheat:startup_phase_seconds{phase="registered"}`). Then it runs the simulator on
//! what actually happened: the requests as sent (their times and token counts as the
//! server counted them), `up`'s measured profile, the start times just measured, and
//! the pools' policies worked out from the same `up` flags, actuated directly as `up`'s
//! driver does. (The simulator decides on whole seconds, `up` every half second; and it
//! counts a draining replica until it empties, where `up`'s scaler stops counting it
//! when told to stop, a difference of the drain's length.) It reports each pool's replica-seconds and the
//! SLO attainment, measured and predicted, and their errors against the tolerances
//! the simulator is held to.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use preheat_scaler::policy::PoolPolicy;
use preheat_scaler::profile::Profile;
use preheat_scaler::scrape::{MAX_BODY_BYTES, read_limited};
use preheat_scaler::status::StatusReport;
use preheat_sim::trace::TraceRequest;
use preheat_sim::{Actuation, SimConfig, StartClass};
use serde::{Deserialize, Serialize};

use super::host_share;
use super::serve::{self, Outcome, Planned};
use crate::cli::{BenchSimrealArgs, Cli, Command, UpArgs};
use crate::commands::up;
use crate::output::outln;
use crate::process::free_port;

/// This run's scaler state file, in its cache dir: deleted before each run.
const STATE_FILE: &str = "simreal-scaler-state.json";

/// Predicted replica-seconds may be off by this fraction of the measured …
const REPLICA_SECONDS_TOLERANCE: f64 = 0.20;
/// … and predicted attainment by this many percentage points. A miss means the model
/// needs fixing, not these.
const ATTAINMENT_TOLERANCE_POINTS: f64 = 5.0;

/// The host's capacity is known to a few percent only: this machine is shared, and
/// the measured profile moves by more than this between runs. Predicted attainment is
/// also given with this fraction fewer and more worker slots. Where those two differ
/// by more than the tolerance, the load sits at the host's capacity and a miss says
/// as much about that noise as about the model.
const HOST_SLOTS_SENSITIVITY: f64 = 0.05;

/// How long each count of workers computes together when the host's sharing is
/// measured: a few prefill passes each.
const HOST_SHARE_PERIOD: Duration = Duration::from_secs(5);

/// How long `up` may take to stage the model and open its gateway.
const UP_READY_TIMEOUT: Duration = Duration::from_secs(300);
/// How often the pools' replicas are read.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// One worker's measured start.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Start {
    pub role: String,
    /// `cold`, `staged`, `hot` or `standby` (a promotion), as the worker says.
    pub source: String,
    /// Seconds from its origin (process start, or promotion) to registering.
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PoolComparison {
    pub pool: &'static str,
    pub measured_replica_s: f64,
    pub predicted_replica_s: f64,
    /// (predicted − measured) / measured; `None` when it never ran for real.
    pub error: Option<f64>,
    /// Within the tolerance: a pool that never ran for real is only when the
    /// prediction did not run it either.
    pub within_tolerance: bool,
    pub measured_max: u32,
    pub predicted_max: u32,
}

/// A request that missed its SLO for real: where an attainment gap is.
#[derive(Debug, Serialize)]
pub struct Missed {
    pub sent_at: f64,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub ttft: Option<f64>,
    pub itl: Option<f64>,
    pub ok: bool,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub requests: usize,
    pub failed: usize,
    /// The first few distinct errors of failed requests.
    pub errors: Vec<String>,
    /// Both sides are compared over [0, this]: from the first request to the last
    /// answer.
    pub window_s: f64,
    pub profile_source: String,
    pub starts: Vec<Start>,
    /// The start times the simulation ran with (the medians of `starts`, or the
    /// profile's where none of that kind was seen).
    pub sim_start_s: f64,
    pub sim_promote_s: f64,
    pub sim_start_measured: bool,
    /// Cores the stack's own processes (gateway, scaler, agent, load generator) used
    /// on average over the window, and the worker slots left (the simulation's
    /// shared host).
    pub stack_cores: f64,
    pub host_slots: f64,
    /// How much slower than their share of the cores workers computed together on
    /// the measured machine, `(workers, slowdown)`, as the simulation ran them.
    pub host_slowdown: Vec<(u32, f64)>,
    /// Requests with prompts shorter than the gateway's `--disagg-min-tokens`, whose
    /// decode workers computed them (and so does the simulation).
    pub prefilled_on_decode: usize,
    pub disagg_min_tokens: u32,
    pub measured_attainment: f64,
    pub predicted_attainment: f64,
    /// Predicted attainment with `HOST_SLOTS_SENSITIVITY` fewer and more worker slots.
    pub predicted_attainment_band: (f64, f64),
    pub attainment_error_points: f64,
    /// TTFT and ITL (p50, p99), measured and predicted: where an attainment gap comes
    /// from.
    pub measured_ttft: (Option<f64>, Option<f64>),
    pub predicted_ttft: (f64, f64),
    pub measured_itl: (Option<f64>, Option<f64>),
    pub predicted_itl: (f64, f64),
    pub pools: Vec<PoolComparison>,
    /// The requests that missed their SLO for real, in the order sent.
    pub missed: Vec<Missed>,
    pub replica_s_tolerance: f64,
    pub attainment_tolerance_points: f64,
    pub within_tolerance: bool,
    /// (seconds, prefill, decode) replicas, as `up` ran them and as predicted.
    pub measured: Vec<(f64, u32, u32)>,
    pub predicted: Vec<(f64, u32, u32)>,
}

/// The `preheat up` command line for this run, on free loopback ports.
fn up_args(a: &BenchSimrealArgs) -> anyhow::Result<Vec<String>> {
    let addr = |p: u16| format!("127.0.0.1:{p}");
    let mut v: Vec<String> = vec![
        "up".into(),
        "--port".into(),
        free_port()?.to_string(),
        "--gateway-internal".into(),
        addr(free_port()?),
        "--scaler-listen".into(),
        addr(free_port()?),
        "--scaler-http".into(),
        addr(free_port()?),
        "--agent-listen".into(),
        addr(free_port()?),
        "--cache-dir".into(),
        a.cache_dir.to_string_lossy().into_owned(),
        "--state-file".into(),
        a.cache_dir.join(STATE_FILE).to_string_lossy().into_owned(),
        "--prefill-max".into(),
        a.prefill_max.to_string(),
        "--decode-max".into(),
        a.decode_max.to_string(),
        "--idle-grace".into(),
        format!("{}ms", a.idle_grace.as_millis()),
        "--standbys".into(),
        a.standbys.to_string(),
        "--kv-cache-mib".into(),
        a.kv_cache_mib.to_string(),
        "--slo-ttft".into(),
        a.slo_ttft.to_string(),
        "--slo-itl".into(),
        a.slo_itl.to_string(),
    ];
    if let Some(m) = &a.model {
        v.push("--model".into());
        v.push(m.to_string_lossy().into_owned());
    }
    Ok(v)
}

/// The same command line as `up` itself parses it.
fn parse_up(args: &[String]) -> anyhow::Result<UpArgs> {
    let cli =
        Cli::try_parse_from(std::iter::once("preheat").chain(args.iter().map(String::as_str)))
            .context("the `preheat up` flags this run would use")?;
    match cli.command {
        Command::Up(u) => Ok(u),
        _ => bail!("`up` parsed as another command"),
    }
}

/// `preheat up` in its own process group, so that its workers and parked standbys
/// can be signalled with it. `stop` lets it drain; dropped without `stop` (an error or
/// a panic on the way), the whole group gets SIGTERM.
struct UpProcess {
    child: tokio::process::Child,
    log: PathBuf,
    stopped: bool,
}

impl Drop for UpProcess {
    fn drop(&mut self) {
        if !self.stopped {
            self.signal_group(libc::SIGTERM);
        }
    }
}

impl UpProcess {
    fn start(args: &[String], log: &Path) -> anyhow::Result<Self> {
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = tokio::process::Command::new(std::env::current_exe()?)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .spawn()
            .context("starting `preheat up`")?;
        Ok(UpProcess {
            child,
            log: log.to_owned(),
            stopped: false,
        })
    }

    /// Sends `sig` to `up` and every process it started.
    fn signal_group(&self, sig: libc::c_int) {
        if let Some(pid) = self.child.id().and_then(|p| libc::pid_t::try_from(p).ok()) {
            // SAFETY: kill(2) on the process group this process created for its
            // unreaped child (`process_group(0)`: the group id is the child's pid, which
            // cannot be reused while unreaped); no memory is involved.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(-pid, sig);
            }
        }
    }

    /// Why it is not running, with the end of its log; `None` while it runs.
    fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok()??;
        Some(format!(
            "`preheat up` exited with {status}: {}",
            preheat_warmpool::restart_backoff::log_tail(&self.log, 5)
        ))
    }

    async fn stop(mut self) {
        preheat_warmpool::standby::terminate(&self.child);
        if tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .is_err()
        {
            tracing::warn!("`preheat up` did not stop within 60 s; killing it and its workers");
            self.signal_group(libc::SIGKILL);
            let _ = self.child.wait().await;
        }
        self.stopped = true;
    }
}

/// Where this run's `up` listens, read back from its own flags.
#[derive(Clone)]
struct Endpoints {
    gateway: String,
    gateway_internal: String,
    scaler_http: String,
    token_file: PathBuf,
}

impl Endpoints {
    fn of(u: &UpArgs) -> Self {
        Endpoints {
            gateway: format!("http://{}:{}", u.host, u.port),
            gateway_internal: format!("http://{}", u.gateway_internal),
            scaler_http: format!("http://{}", u.scaler_http),
            token_file: u.cache_dir.join("cluster-token"),
        }
    }
}

/// Waits until the gateway answers, the scaler reports both pools and (with
/// standbys) `up` has said each pool's standby is parked.
async fn wait_ready(
    c: &reqwest::Client,
    e: &Endpoints,
    up: &mut UpProcess,
    standbys: u32,
) -> anyhow::Result<String> {
    let deadline = Instant::now() + UP_READY_TIMEOUT;
    loop {
        if let Some(why) = up.exited() {
            bail!("{why}");
        }
        if Instant::now() > deadline {
            bail!(
                "`preheat up` was not ready within {} s (log: {})",
                UP_READY_TIMEOUT.as_secs(),
                up.log.display()
            );
        }
        let healthy = c
            .get(format!("{}/health", e.gateway))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        // The simulation opens with the standbys parked: so must the real run.
        let parked = standbys == 0 || {
            let log = std::fs::read_to_string(&up.log).unwrap_or_default();
            ["prefill", "decode"]
                .iter()
                .all(|role| log.contains(&format!("{role}: standby parked")))
        };
        if healthy
            && parked
            && let Ok(token) = std::fs::read_to_string(&e.token_file)
            && status(c, e, token.trim()).await.is_some()
        {
            return Ok(token.trim().to_owned());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A successful answer's body from one of this run's own processes, with this run's
/// token; bounded in time (2 s) and size as the scaler bounds its scrapes.
async fn get_body(c: &reqwest::Client, url: &str, token: &str) -> Option<Vec<u8>> {
    let r = c
        .get(url)
        .bearer_auth(token)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?
        .error_for_status()
        .ok()?;
    read_limited(r, MAX_BODY_BYTES).await.ok()
}

/// (prefill, decode) replicas the scaler sees: `up`'s started, unstopped workers.
async fn status(c: &reqwest::Client, e: &Endpoints, token: &str) -> Option<(u32, u32)> {
    let body = get_body(c, &format!("{}/status", e.scaler_http), token).await?;
    let r: StatusReport = serde_json::from_slice(&body).ok()?;
    let pools = &r.models.first()?.pools;
    let n = |name: &str| pools.iter().find(|p| p.pool == name).map(|p| p.current);
    Some((n("prefill")?, n("decode")?))
}

/// Registered workers not yet looked at: their measured start, once each.
async fn new_starts(
    c: &reqwest::Client,
    e: &Endpoints,
    token: &str,
    seen: &mut std::collections::HashSet<String>,
) -> Vec<Start> {
    let url = format!("{}/internal/workers", e.gateway_internal);
    let Some(v) = get_body(c, &url, token)
        .await
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for w in v["workers"].as_array().into_iter().flatten() {
        let (Some(url), Some(role)) = (w["url"].as_str(), w["role"].as_str()) else {
            continue;
        };
        if seen.contains(url) {
            continue;
        }
        let metrics = format!("{}/metrics", url.trim_end_matches('/'));
        let Some(text) = get_body(c, &metrics, token)
            .await
            .and_then(|b| String::from_utf8(b).ok())
        else {
            continue;
        };
        let Ok(reading) = preheat_scaler::signals::exposition::parse(&text, None) else {
            continue;
        };
        // The latest start's `registered` phase; a promoted standby reports its
        // promotion, not its parked load.
        let latest = reading
            .startup
            .iter()
            .filter(|((phase, _), _)| phase == "registered")
            .max_by(|a, b| a.1.total_cmp(b.1));
        if let Some(((_, source), &seconds)) = latest {
            seen.insert(url.to_owned());
            out.push(Start {
                role: role.to_owned(),
                source: source.clone(),
                seconds,
            });
        }
    }
    out
}

/// What the real run produced.
#[derive(Serialize, Deserialize)]
struct Measured {
    outcomes: Vec<Outcome>,
    replicas: Vec<(f64, u32, u32)>,
    starts: Vec<Start>,
    window_s: f64,
    /// CPU seconds the stack itself used over the window, besides its workers: `up`'s
    /// gateway, scaler and warm-pool agent, and this load generator. `None` where
    /// `/proc` cannot say.
    stack_cpu_s: Option<f64>,
    /// This machine's cores, and each worker's compute threads (`RAYON_NUM_THREADS`,
    /// inherited, else every core): with `stack_cpu_s`, the workers that fit side by
    /// side.
    host_cores: usize,
    worker_threads: usize,
    /// Why `up` was gone before the load ended.
    up_exited: Option<String>,
    /// `(workers computing at once, slowdown beyond their share of the cores)` on
    /// this machine, measured before the run ([`host_share::measure`]); empty in runs
    /// saved before it was.
    #[serde(default)]
    host_slowdown: Vec<(u32, f64)>,
}

/// CPU seconds (user + system) process `pid` has used itself (not its children).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces, hence the last ')'): state is
    // field 3 of proc(5), utime 14 and stime 15.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // In clock ticks of USER_HZ, which Linux fixes at 100 for user space.
    Some(ticks / 100.0)
}

/// CPU seconds used by this process and `up`'s.
fn stack_cpu(up_pid: Option<u32>) -> Option<f64> {
    Some(cpu_seconds(std::process::id())? + cpu_seconds(up_pid?)?)
}

async fn measure(
    a: &BenchSimrealArgs,
    planned: &[Planned],
    args: &[String],
    e: &Endpoints,
) -> anyhow::Result<Measured> {
    std::fs::create_dir_all(&a.cache_dir)?;
    // From idle with nothing learnt, as the simulation starts: an earlier run's season
    // would pre-warm this one. Its own file, never an operator's `up`'s.
    match std::fs::remove_file(a.cache_dir.join(STATE_FILE)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            anyhow::bail!("removing the last run's scaler state: {e}")
        }
        _ => {}
    }
    let mut up = UpProcess::start(args, &a.cache_dir.join("simreal-up.log"))?;
    let c = reqwest::Client::new();
    let token = match wait_ready(&c, e, &mut up, a.standbys).await {
        Ok(t) => t,
        Err(err) => {
            up.stop().await;
            return Err(err);
        }
    };
    let t0 = tokio::time::Instant::now();
    let up_pid = up.child.id();
    let cpu0 = stack_cpu(up_pid);
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let watcher = {
        let (c, e, token) = (c.clone(), e.clone(), token.clone());
        tokio::spawn(async move {
            let mut replicas = Vec::new();
            let mut starts = Vec::new();
            let mut seen = std::collections::HashSet::new();
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop_rx.changed() => break,
                }
                let t = t0.elapsed().as_secs_f64();
                if let Some((p, d)) = status(&c, &e, &token).await {
                    replicas.push((t, p, d));
                }
                starts.extend(new_starts(&c, &e, &token, &mut seen).await);
            }
            // Workers that registered since the last look.
            starts.extend(new_starts(&c, &e, &token, &mut seen).await);
            (replicas, starts)
        })
    };
    let bar = serve::request_bar(planned.len())?;
    let timeout = a.load.timeout.max(Duration::from_millis(1));
    let sent = serve::replay(&e.gateway, None, planned, timeout, t0, &bar).await;
    let window_s = t0.elapsed().as_secs_f64();
    let up_exited = up.exited();
    let stack_cpu_s = stack_cpu(up_pid).zip(cpu0).map(|(b, a)| (b - a).max(0.0));
    bar.finish_and_clear();
    let _ = stop_tx.send(true);
    let watched = watcher.await;
    up.stop().await;
    let (outcomes, _) = sent?;
    let (replicas, starts) = watched.context("the replica watcher")?;
    Ok(Measured {
        outcomes,
        replicas,
        starts,
        window_s,
        stack_cpu_s,
        host_cores: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        worker_threads: rayon::current_num_threads(),
        up_exited,
        host_slowdown: Vec::new(),
    })
}

/// How many workers run at full speed together on the measured machine: the cores the
/// stack's own processes left them on average (`stack_cores`), over each worker's
/// compute threads. At least a tenth of one.
fn host_slots(stack_cores: f64, host_cores: usize, worker_threads: usize) -> f64 {
    ((host_cores as f64 - stack_cores) / worker_threads.max(1) as f64).max(0.1)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    preheat_scaler::percentile::percentile(&mut v, 0.5)
}

/// A request's prompt and output tokens as the server counted them (its usage), else
/// as planned.
fn counted(p: &Planned, o: &Outcome) -> (u32, u32) {
    let n = |v: Option<u64>, planned: u32| v.and_then(|n| u32::try_from(n).ok()).unwrap_or(planned);
    (
        n(o.prompt_tokens, p.input_tokens),
        n(o.completion_tokens, p.output_tokens),
    )
}

/// The requests as they were sent: when, and how many tokens the server counted.
fn trace_of(planned: &[Planned], outcomes: &[Outcome]) -> Vec<TraceRequest> {
    let mut t: Vec<TraceRequest> = planned
        .iter()
        .zip(outcomes)
        .map(|(p, o)| {
            let (input_tokens, output_tokens) = counted(p, o);
            TraceRequest {
                t: o.sent_at,
                input_tokens,
                output_tokens,
                blocks: Vec::new(),
            }
        })
        .collect();
    t.sort_by(|a, b| a.t.total_cmp(&b.t));
    t
}

/// Whether a request was answered within the SLOs as the simulator counts them.
fn attained(o: &Outcome, input_tokens: u32, prefill: &PoolPolicy, decode: &PoolPolicy) -> bool {
    o.ok && o
        .ttft
        .is_some_and(|t| t <= prefill.ttft_slo_for(f64::from(input_tokens)) + 1e-9)
        && o.itl.is_none_or(|i| i <= decode.slo_itl_s + 1e-9)
}

/// ∫ replicas dt over [0, end] of a step function sampled at `samples` (each value
/// holds until the next sample; before the first, the pools are at their first value).
fn replica_seconds(
    samples: &[(f64, u32, u32)],
    end: f64,
    pick: fn(&(f64, u32, u32)) -> u32,
) -> f64 {
    let mut total = 0.0;
    for (i, s) in samples.iter().enumerate() {
        let from = if i == 0 { 0.0 } else { s.0.min(end) };
        let to = samples.get(i + 1).map_or(end, |n| n.0.min(end));
        total += f64::from(pick(s)) * (to - from).max(0.0);
    }
    total
}

fn compare(
    pool: &'static str,
    measured: &[(f64, u32, u32)],
    predicted: &[(f64, u32, u32)],
    end: f64,
    pick: fn(&(f64, u32, u32)) -> u32,
) -> PoolComparison {
    let m = replica_seconds(measured, end, pick);
    let p = replica_seconds(predicted, end, pick);
    let error = (m > 0.0).then(|| (p - m) / m);
    let max = |v: &[(f64, u32, u32)]| v.iter().filter(|s| s.0 <= end).map(pick).max().unwrap_or(0);
    PoolComparison {
        pool,
        measured_replica_s: m,
        predicted_replica_s: p,
        error,
        within_tolerance: error.map_or(p == 0.0, |e| e.abs() <= REPLICA_SECONDS_TOLERANCE),
        measured_max: max(measured),
        predicted_max: max(predicted),
    }
}

/// `--save-run`'s file: bumped when a field changes meaning.
const SAVED_RUN_FORMAT: u32 = 2;

/// A measured run and everything its prediction needs, as `--save-run` writes it.
#[derive(Serialize, Deserialize)]
struct SavedRun {
    format: u32,
    planned: Vec<Planned>,
    measured: Measured,
    profile: Profile,
    prefill: PoolPolicy,
    decode: PoolPolicy,
    standbys: u32,
    /// The stack's settings the run was measured under (`up`'s scaler tick and
    /// window, the engine's prefill token budget, the gateway's short-prompt rule), so
    /// a later build predicts it under them rather than its own.
    interval_s: f64,
    window_s: f64,
    prefill_batch_tokens: f64,
    disagg_min_tokens: u32,
}

impl SavedRun {
    fn read(path: &Path) -> anyhow::Result<Self> {
        let bytes =
            std::fs::read(path).with_context(|| format!("reading the run {}", path.display()))?;
        let run: SavedRun = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a run `--save-run` wrote", path.display()))?;
        if run.format != SAVED_RUN_FORMAT {
            bail!(
                "{} is a format-{} run; this build reads format {SAVED_RUN_FORMAT}",
                path.display(),
                run.format
            );
        }
        if run.planned.len() != run.measured.outcomes.len() {
            bail!(
                "{}: {} requests planned but {} outcomes",
                path.display(),
                run.planned.len(),
                run.measured.outcomes.len()
            );
        }
        run.profile
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: its profile: {}", path.display(), e.join("; ")))?;
        Ok(run)
    }

    /// Written whole or not at all, as every file of the project's that a reader may
    /// find half-done ([`preheat_snapshot::publish`]).
    fn write(&self, path: &Path) -> anyhow::Result<()> {
        use preheat_snapshot::publish::{publish_temp, temp_beside};
        let bytes = serde_json::to_vec(self)?;
        let (mut tmp, _) = temp_beside(path)?;
        std::io::Write::write_all(&mut tmp, &bytes)
            .with_context(|| format!("writing the run to {}", tmp.path().display()))?;
        publish_temp(tmp, path)?;
        Ok(())
    }
}

pub fn run(a: &BenchSimrealArgs) -> anyhow::Result<ExitCode> {
    let run = match &a.from_run {
        Some(path) => SavedRun::read(path)?,
        None => {
            let run = measure_run(a)?;
            // The measurement took minutes: its report comes whether or not it could
            // also be kept.
            if let Some(path) = &a.save_run
                && let Err(e) = run.write(path)
            {
                tracing::error!("the run is not saved: {e:#}");
            }
            run
        }
    };
    let report = predict(run)?;
    let svg = a.plot.as_deref().map(|p| (p, plot(&report)));
    serve::emit(&report, svg, a.out.json, print_text, report.failed)
}

/// Runs `up` under the load and records what happened.
fn measure_run(a: &BenchSimrealArgs) -> anyhow::Result<SavedRun> {
    let planned = serve::plan(&a.load)?;
    // Stages the model and measures its profile (once per model, KV budget and
    // threads) here, so `up` below finds both in its cache and starts as it would on a
    // second run; its ports are picked after that, so nothing takes them meanwhile.
    let setup = up::setup(&parse_up(&up_args(a)?)?)?;
    tracing::info!("measuring how workers slow each other on this machine");
    let host_slowdown = host_share::measure(
        &setup.snapshot,
        usize::try_from(a.prefill_max.saturating_add(a.decode_max)).unwrap_or(usize::MAX),
        rayon::current_num_threads(),
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        preheat_engine::scheduler::DEFAULT_MAX_BATCHED_TOKENS,
        HOST_SHARE_PERIOD,
    )?;
    let args = up_args(a)?;
    let up_flags = parse_up(&args)?;
    let e = Endpoints::of(&up_flags);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    tracing::info!(
        requests = planned.len(),
        "running `preheat up` under the load"
    );
    let mut m = rt.block_on(measure(a, &planned, &args, &e))?;
    m.host_slowdown = host_slowdown;
    if m.replicas.is_empty() {
        bail!(
            "the scaler's /status gave no replica counts during the run (log: {})",
            a.cache_dir.join("simreal-up.log").display()
        );
    }
    Ok(SavedRun {
        format: SAVED_RUN_FORMAT,
        planned,
        measured: m,
        profile: setup.profile,
        prefill: setup.prefill,
        decode: setup.decode,
        standbys: a.standbys,
        interval_s: up::INTERVAL_S,
        window_s: up::WINDOW_S,
        prefill_batch_tokens: preheat_engine::scheduler::DEFAULT_MAX_BATCHED_TOKENS as f64,
        disagg_min_tokens: u32::try_from(
            preheat_engine::disagg::gateway::DEFAULT_DISAGG_MIN_TOKENS,
        )
        .unwrap_or(u32::MAX),
    })
}

/// The simulator's prediction of a measured run, and how far off it is.
fn predict(run: SavedRun) -> anyhow::Result<Report> {
    let SavedRun {
        planned,
        measured: m,
        profile: measured_profile,
        prefill,
        decode,
        standbys,
        interval_s,
        window_s,
        prefill_batch_tokens,
        disagg_min_tokens,
        ..
    } = run;
    if m.replicas.is_empty() {
        bail!("the run has no replica counts to compare with");
    }
    let of = |standby: bool| {
        median(
            m.starts
                .iter()
                .filter(|s| (s.source == "standby") == standby)
                .map(|s| s.seconds)
                .collect(),
        )
    };
    let (start_s, promote_s) = (of(false), of(true));
    let mut profile = measured_profile;
    if let Some(s) = start_s {
        profile.startup_s.hot = s;
    }
    if let Some(s) = promote_s {
        profile.startup_s.standby = s;
    }
    let mut cfg = SimConfig::new(prefill.clone(), decode.clone(), profile.clone());
    cfg.start = if standbys > 0 {
        StartClass::Standby
    } else {
        StartClass::Hot
    };
    cfg.standbys = standbys;
    cfg.actuation = Actuation::Direct;
    cfg.interval_s = interval_s;
    cfg.window_s = window_s;
    cfg.sample_s = 1.0;
    // `up` starts idle, with every worker on this one machine. The profile was
    // measured with the threads each worker has, so that many fit side by side in the
    // cores the gateway, scaler and load generator leave.
    cfg.warm_start = false;
    let stack_cores = m.stack_cpu_s.map_or(0.0, |c| c / m.window_s.max(1e-9));
    let slots = host_slots(stack_cores, m.host_cores, m.worker_threads);
    cfg.shared_host = Some(slots);
    cfg.shared_host_slowdown = m
        .host_slowdown
        .iter()
        .map(|&(k, f)| (f64::from(k), f))
        .collect();
    // `up`'s workers batch queued prompts up to their default token budget.
    cfg.prefill_batch_tokens = Some(prefill_batch_tokens);
    // `up`'s gateway has decode workers compute prompts shorter than its default
    // `--disagg-min-tokens` themselves.
    cfg.local_prefill_below = Some(disagg_min_tokens);
    let trace = trace_of(&planned, &m.outcomes);
    let prefilled_on_decode = trace.iter().filter(|r| cfg.prefills_on_decode(r)).count();
    tracing::info!("simulating the same run");
    let predicted = preheat_sim::run_policy("preheat", &cfg, &trace)?;
    let attainment_with = |f: f64| -> anyhow::Result<f64> {
        let mut c = cfg.clone();
        c.shared_host = Some(slots * f);
        Ok(preheat_sim::run_policy("preheat", &c, &trace)?.slo_attainment)
    };
    let predicted_attainment_band = (
        attainment_with(1.0 - HOST_SLOTS_SENSITIVITY)?,
        attainment_with(1.0 + HOST_SLOTS_SENSITIVITY)?,
    );

    let missed: Vec<Missed> = m
        .outcomes
        .iter()
        .zip(&planned)
        .filter_map(|(o, p)| {
            let (prompt_tokens, completion_tokens) = counted(p, o);
            (!attained(o, prompt_tokens, &prefill, &decode)).then_some(Missed {
                sent_at: o.sent_at,
                prompt_tokens,
                completion_tokens,
                ttft: o.ttft,
                itl: o.itl,
                ok: o.ok,
            })
        })
        .collect();
    let ok = m.outcomes.len() - missed.len();
    let n = m.outcomes.len().max(1);
    let measured_attainment = ok as f64 / n as f64;
    let pools = vec![
        compare(
            "prefill",
            &m.replicas,
            &predicted.timeline,
            m.window_s,
            |s| s.1,
        ),
        compare(
            "decode",
            &m.replicas,
            &predicted.timeline,
            m.window_s,
            |s| s.2,
        ),
    ];
    let attainment_error_points = (predicted.slo_attainment - measured_attainment) * 100.0;
    let within_tolerance = attainment_error_points.abs() <= ATTAINMENT_TOLERANCE_POINTS
        && pools.iter().all(|p| p.within_tolerance);
    let pcts = |v: &mut Vec<f64>| {
        (
            preheat_scaler::percentile::percentile(v, 0.5),
            preheat_scaler::percentile::percentile(v, 0.99),
        )
    };
    let answered = || m.outcomes.iter().filter(|o| o.ok);
    let measured_ttft = pcts(&mut answered().filter_map(|o| o.ttft).collect());
    let measured_itl = pcts(&mut answered().filter_map(|o| o.itl).collect());
    let report = Report {
        requests: m.outcomes.len(),
        failed: m.outcomes.iter().filter(|o| !o.ok).count(),
        errors: m
            .up_exited
            .iter()
            .cloned()
            .chain(serve::first_errors(&m.outcomes))
            .collect(),
        window_s: m.window_s,
        profile_source: profile.source.clone(),
        starts: m.starts,
        sim_start_s: profile.startup_s.hot,
        sim_promote_s: profile.startup_s.standby,
        sim_start_measured: start_s.is_some(),
        stack_cores,
        host_slots: slots,
        host_slowdown: m.host_slowdown.clone(),
        prefilled_on_decode,
        disagg_min_tokens,
        measured_attainment,
        predicted_attainment: predicted.slo_attainment,
        predicted_attainment_band,
        attainment_error_points,
        measured_ttft,
        predicted_ttft: (predicted.ttft_p50, predicted.ttft_p99),
        measured_itl,
        predicted_itl: (predicted.itl_p50, predicted.itl_p99),
        pools,
        missed,
        replica_s_tolerance: REPLICA_SECONDS_TOLERANCE,
        attainment_tolerance_points: ATTAINMENT_TOLERANCE_POINTS,
        within_tolerance,
        measured: m.replicas,
        predicted: predicted
            .timeline
            .iter()
            .copied()
            .filter(|s| s.0 <= m.window_s)
            .collect(),
    };
    Ok(report)
}

fn print_text(r: &Report) -> anyhow::Result<()> {
    outln!(
        "{} requests ({} failed) over {:.1} s; profile: {}",
        r.requests,
        r.failed,
        r.window_s,
        r.profile_source
    );
    for e in &r.errors {
        outln!("error: {e}");
    }
    outln!(
        "host: the stack besides its workers used {:.2} cores; {:.2} worker slots left",
        r.stack_cores,
        r.host_slots
    );
    if r.host_slowdown.is_empty() {
        outln!("host sharing: not measured (workers slow each other by cores only)");
    } else {
        let each: Vec<String> = r
            .host_slowdown
            .iter()
            .map(|(k, f)| format!("{k} workers ×{f:.3}"))
            .collect();
        outln!(
            "host sharing beyond the cores: {} (simulated as measured)",
            each.join(", ")
        );
    }
    outln!(
        "prompts computed on decode workers (shorter than {} tokens): {}",
        r.disagg_min_tokens,
        r.prefilled_on_decode
    );
    outln!(
        "starts measured: {} (simulated with {:.2} s to start{}, {:.3} s to promote)",
        r.starts.len(),
        r.sim_start_s,
        if r.sim_start_measured {
            ""
        } else {
            " (the profile's: none measured)"
        },
        r.sim_promote_s
    );
    outln!(
        "{:<8} {:>12} {:>12} {:>8} {:>6} {:>6}",
        "pool",
        "measured r-s",
        "predicted",
        "error",
        "max m",
        "max p"
    );
    for p in &r.pools {
        outln!(
            "{:<8} {:>12.1} {:>12.1} {:>8} {:>6} {:>6}",
            p.pool,
            p.measured_replica_s,
            p.predicted_replica_s,
            p.error
                .map_or("-".to_owned(), |e| format!("{:+.1}%", e * 100.0)),
            p.measured_max,
            p.predicted_max
        );
    }
    outln!(
        "SLO attainment: measured {:.2}%, predicted {:.2}% ({:+.2} points)",
        r.measured_attainment * 100.0,
        r.predicted_attainment * 100.0,
        r.attainment_error_points
    );
    outln!(
        "  predicted with {:.0}% fewer / more worker slots: {:.2}% / {:.2}%",
        HOST_SLOTS_SENSITIVITY * 100.0,
        r.predicted_attainment_band.0 * 100.0,
        r.predicted_attainment_band.1 * 100.0
    );
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |x| format!("{:.0} ms", x * 1e3));
    outln!(
        "TTFT p50/p99: measured {} / {}, predicted {} / {}; ITL p50/p99: measured {} / {}, predicted {} / {}",
        ms(r.measured_ttft.0),
        ms(r.measured_ttft.1),
        ms(Some(r.predicted_ttft.0)),
        ms(Some(r.predicted_ttft.1)),
        ms(r.measured_itl.0),
        ms(r.measured_itl.1),
        ms(Some(r.predicted_itl.0)),
        ms(Some(r.predicted_itl.1))
    );
    outln!(
        "within tolerance (replica-seconds ±{:.0}%, attainment ±{} points): {}",
        r.replica_s_tolerance * 100.0,
        r.attainment_tolerance_points,
        if r.within_tolerance { "yes" } else { "no" }
    );
    Ok(())
}

fn plot(r: &Report) -> String {
    use crate::plot::{Panel, Series, svg};
    let pool = |label: &str, pick: fn(&(f64, u32, u32)) -> u32| Panel {
        y_label: label.into(),
        series: [("measured", &r.measured), ("predicted", &r.predicted)]
            .into_iter()
            .map(|(name, v)| Series {
                name: name.into(),
                points: v.iter().map(|s| (s.0, f64::from(pick(s)))).collect(),
                step: true,
            })
            .collect(),
    };
    svg(
        &format!(
            "sim-to-real: {} requests; attainment measured {:.1}%, predicted {:.1}%",
            r.requests,
            r.measured_attainment * 100.0,
            r.predicted_attainment * 100.0
        ),
        "seconds",
        &[
            pool("prefill replicas", |s| s.1),
            pool("decode replicas", |s| s.2),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_seconds_integrate_a_step_function_over_the_window() {
        let s = [(0.5, 0, 1), (10.0, 2, 1), (20.0, 1, 0)];
        // prefill: 0 until 10, 2 until 20, 1 until 25.
        assert_eq!(replica_seconds(&s, 25.0, |x| x.1), 25.0);
        // decode: 1 until 20 (the first sample holds from 0), 0 after.
        assert_eq!(replica_seconds(&s, 25.0, |x| x.2), 20.0);
        // Samples after the window do not count.
        assert_eq!(replica_seconds(&s, 15.0, |x| x.1), 10.0);
        assert_eq!(replica_seconds(&[], 15.0, |x| x.1), 0.0);
    }

    #[test]
    fn errors_are_relative_to_the_measured_side() {
        let m = [(0.0, 2, 0)];
        let p = [(0.0, 1, 0), (5.0, 3, 0)];
        let c = compare("prefill", &m, &p, 10.0, |x| x.1);
        assert_eq!((c.measured_replica_s, c.predicted_replica_s), (20.0, 20.0));
        assert_eq!(c.error, Some(0.0));
        assert_eq!((c.measured_max, c.predicted_max), (2, 3));
        let idle = compare("decode", &m, &p, 10.0, |x| x.2);
        assert_eq!(idle.error, None);
        // A pool only the prediction ran is a miss, not a pass.
        let phantom = compare("decode", &[(0.0, 0, 0)], &[(0.0, 0, 1)], 10.0, |x| x.2);
        assert_eq!(phantom.error, None);
        assert!(!phantom.within_tolerance);
        assert!(idle.within_tolerance && c.within_tolerance);
    }

    #[test]
    fn attainment_counts_like_the_simulator() {
        let policy = PoolPolicy {
            slo_ttft_s: 1.0,
            slo_ttft_ref_tokens: 100.0,
            slo_itl_s: 0.05,
            ..PoolPolicy::default()
        };
        let o = |ttft: f64, itl: Option<f64>| Outcome {
            ok: true,
            ttft: Some(ttft),
            itl,
            ..Outcome::default()
        };
        // A 300-token prompt has three times the TTFT target.
        assert!(attained(&o(2.5, Some(0.01)), 300, &policy, &policy));
        assert!(!attained(&o(2.5, Some(0.01)), 100, &policy, &policy));
        assert!(!attained(&o(0.5, Some(0.06)), 100, &policy, &policy));
        assert!(attained(&o(0.5, None), 100, &policy, &policy));
        let failed = Outcome {
            ok: false,
            ..o(0.1, None)
        };
        assert!(!attained(&failed, 100, &policy, &policy));
    }

    #[test]
    fn cpu_seconds_come_from_proc_and_grow_with_work() {
        let before = cpu_seconds(std::process::id()).expect("this process's /proc stat");
        // Work until the count moves (a busy machine may give this thread little time),
        // for at most 20 s.
        let t = Instant::now();
        let mut x = 0u64;
        let mut after = before;
        while after - before < 0.05 && t.elapsed() < Duration::from_secs(20) {
            for _ in 0..1_000_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            after = cpu_seconds(std::process::id()).unwrap();
        }
        assert!(after - before >= 0.05, "{before} → {after}");
        assert_eq!(cpu_seconds(u32::MAX), None);
    }

    fn small_run() -> SavedRun {
        let planned: Vec<Planned> = (0..6)
            .map(|i| Planned {
                at: f64::from(i) * 0.5,
                input_tokens: 200,
                output_tokens: 20,
            })
            .collect();
        let outcomes = planned
            .iter()
            .map(|p| Outcome {
                sent_at: p.at,
                ok: true,
                ttft: Some(0.3),
                itl: Some(0.02),
                e2e: 0.7,
                output_chunks: 20,
                prompt_tokens: Some(200),
                completion_tokens: Some(20),
                ..Outcome::default()
            })
            .collect();
        SavedRun {
            format: SAVED_RUN_FORMAT,
            planned,
            measured: Measured {
                outcomes,
                replicas: vec![(0.0, 0, 0), (1.0, 1, 1)],
                starts: Vec::new(),
                window_s: 4.0,
                stack_cpu_s: Some(0.4),
                host_cores: 4,
                worker_threads: 1,
                up_exited: None,
                host_slowdown: vec![(2, 1.1), (4, 1.2)],
            },
            profile: Profile::default(),
            prefill: PoolPolicy::default(),
            decode: PoolPolicy::default(),
            standbys: 1,
            interval_s: 0.5,
            window_s: 60.0,
            prefill_batch_tokens: 256.0,
            disagg_min_tokens: 32,
        }
    }

    #[test]
    fn a_saved_run_predicts_as_the_measured_one_did() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        small_run().write(&path).unwrap();
        let direct = predict(small_run()).unwrap();
        let read = predict(SavedRun::read(&path).unwrap()).unwrap();
        assert_eq!(direct.predicted, read.predicted);
        assert_eq!(direct.predicted_attainment, read.predicted_attainment);
        assert_eq!(read.requests, 6);
        // The machine it was measured on, not this one: 4 cores less 0.1 used.
        assert!((read.host_slots - 3.9).abs() < 1e-9, "{}", read.host_slots);
        assert_eq!(read.host_slowdown, vec![(2, 1.1), (4, 1.2)]);
        // Nothing beside it: the temporary file became the run.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_run_file_that_is_cut_short_or_from_another_format_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        small_run().write(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let e = format!("{:#}", SavedRun::read(&path).err().unwrap());
        assert!(e.contains("not a run `--save-run` wrote"), "{e}");
        let mut old = small_run();
        old.format = 0;
        old.write(&path).unwrap();
        let e = format!("{:#}", SavedRun::read(&path).err().unwrap());
        assert!(e.contains("format-0 run"), "{e}");
        let mut torn = small_run();
        torn.planned.pop();
        torn.write(&path).unwrap();
        let e = format!("{:#}", SavedRun::read(&path).err().unwrap());
        assert!(e.contains("5 requests planned but 6 outcomes"), "{e}");
    }

    #[test]
    fn from_run_refuses_the_flags_that_would_shape_a_new_run() {
        for flag in [["--rate", "3"], ["--slo-itl", "1s"], ["--prefill-max", "4"]] {
            let r = Cli::try_parse_from(
                ["preheat", "bench", "simreal", "--from-run", "x.json"]
                    .into_iter()
                    .chain(flag),
            );
            assert!(r.is_err(), "{flag:?} was taken beside --from-run");
        }
        assert!(
            Cli::try_parse_from([
                "preheat",
                "bench",
                "simreal",
                "--from-run",
                "x.json",
                "--json"
            ])
            .is_ok()
        );
    }

    #[test]
    fn the_simulated_itl_histogram_has_the_engines_buckets() {
        assert_eq!(
            preheat_sim::ITL_BUCKETS.as_slice(),
            preheat_engine::metrics::ITL_BUCKETS
        );
    }

    /// The simulator's decode KV is the running sequences' own; the real scaler sees
    /// it as usage less the engine's reservations, read by the name the engine writes.
    #[test]
    fn the_scaler_reads_the_engines_reserved_kv_by_name() {
        use preheat_engine::metrics::{EngineMetrics, Role};
        let m = EngineMetrics::new("m", Role::Decode);
        m.kv_usage.set(0.5);
        m.kv_reserved.set(0.375);
        let r = preheat_scaler::signals::exposition::parse(&m.render(), Some("m")).unwrap();
        assert_eq!((r.kv_usage, r.kv_reserved), (Some(0.5), Some(0.375)));
    }

    #[test]
    fn the_up_flags_parse_as_up_parses_them() {
        let a = Cli::try_parse_from([
            "preheat",
            "bench",
            "simreal",
            "--prefill-max",
            "3",
            "--idle-grace",
            "45s",
            "--slo-ttft",
            "1.5",
        ])
        .unwrap();
        let Command::Bench(crate::cli::BenchCmd::Simreal(a)) = a.command else {
            panic!("not simreal")
        };
        let u = parse_up(&up_args(&a).unwrap()).unwrap();
        assert_eq!((u.prefill_max, u.decode_max), (3, 2));
        assert_eq!(u.idle_grace, Duration::from_secs(45));
        assert_eq!((u.slo_ttft, u.slo_itl), (1.5, 0.05));
        assert_eq!(u.cache_dir, a.cache_dir);
    }
}
