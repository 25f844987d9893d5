//! The `preheat up` a run measures: its command line, its process (group), and what
//! its gateway and scaler say while it runs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use preheat_local::UpArgs;
use preheat_local::ports::free_port;
use preheat_scaler::scrape::{MAX_BODY_BYTES, read_limited};
use preheat_scaler::status::StatusReport;
use serde::{Deserialize, Serialize};

use crate::args::BenchSimrealArgs;

/// This run's scaler state file, in its cache dir: deleted before each run.
pub(super) const STATE_FILE: &str = "simreal-scaler-state.json";

/// How long `up` may take to stage the model and open its gateway.
const UP_READY_TIMEOUT: Duration = Duration::from_secs(300);

/// One worker's measured start.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Start {
    pub role: String,
    /// `cold`, `staged`, `hot` or `standby` (a promotion), as the worker says.
    pub source: String,
    /// Seconds from its origin (process start, or promotion) to registering.
    pub seconds: f64,
}

/// The `preheat up` command line for this run, on free loopback ports.
pub(super) fn up_args(a: &BenchSimrealArgs) -> anyhow::Result<Vec<String>> {
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

/// `preheat up` as the CLI parses it (the CLI's `up` subcommand takes [`UpArgs`] as
/// they are), so this run's flags are read back as its `up` reads them.
#[derive(Parser)]
#[command(name = "preheat")]
enum UpCommandLine {
    Up(UpArgs),
}

/// The same command line as `up` itself parses it.
pub(super) fn parse_up(args: &[String]) -> anyhow::Result<UpArgs> {
    let UpCommandLine::Up(u) = UpCommandLine::try_parse_from(
        std::iter::once("preheat").chain(args.iter().map(String::as_str)),
    )
    .context("the `preheat up` flags this run would use")?;
    Ok(u)
}

/// `preheat up` in its own process group, so that its workers and parked standbys
/// can be signalled with it. `stop` lets it drain; dropped without `stop` (an error or
/// a panic on the way), the whole group gets SIGTERM.
pub(super) struct UpProcess {
    pub(super) child: tokio::process::Child,
    pub(super) log: PathBuf,
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
    pub(super) fn start(args: &[String], log: &Path) -> anyhow::Result<Self> {
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
    pub(super) fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok()??;
        Some(format!(
            "`preheat up` exited with {status}: {}",
            preheat_warmpool::restart_backoff::log_tail(&self.log, 5)
        ))
    }

    pub(super) async fn stop(mut self) {
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
pub(super) struct Endpoints {
    pub(super) gateway: String,
    gateway_internal: String,
    scaler_http: String,
    token_file: PathBuf,
}

impl Endpoints {
    pub(super) fn of(u: &UpArgs) -> Self {
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
pub(super) async fn wait_ready(
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
pub(super) async fn status(c: &reqwest::Client, e: &Endpoints, token: &str) -> Option<(u32, u32)> {
    let body = get_body(c, &format!("{}/status", e.scaler_http), token).await?;
    let r: StatusReport = serde_json::from_slice(&body).ok()?;
    let pools = &r.models.first()?.pools;
    let n = |name: &str| pools.iter().find(|p| p.pool == name).map(|p| p.current);
    Some((n("prefill")?, n("decode")?))
}

/// Registered workers not yet looked at: their measured start, once each.
pub(super) async fn new_starts(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{BenchCmd, try_parse_bench};

    #[test]
    fn the_up_flags_parse_as_up_parses_them() {
        let a = try_parse_bench(&[
            "simreal",
            "--prefill-max",
            "3",
            "--idle-grace",
            "45s",
            "--slo-ttft",
            "1.5",
        ])
        .unwrap();
        let BenchCmd::Simreal(a) = a else {
            panic!("not simreal")
        };
        let u = parse_up(&up_args(&a).unwrap()).unwrap();
        assert_eq!((u.prefill_max, u.decode_max), (3, 2));
        assert_eq!(u.idle_grace, Duration::from_secs(45));
        assert_eq!((u.slo_ttft, u.slo_itl), (1.5, 0.05));
        assert_eq!(u.cache_dir, a.cache_dir);
    }
}
