//! Parked standby replicas: engine processes started with `--standby` (model mapped
//! and paged in, tokenizer loaded, warm-up done, not registered), promoted to serving
//! by one HTTP call. A pool keeps `count` parked; each promotion hands one over and a
//! replacement is started. A promoted standby serves until it is retired (the scaler,
//! once the pool's own replicas have caught up) or the agent stops: it leaves the
//! serving list first, then drains, so no gateway sends it a request it would refuse.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use preheat_edge::{ClusterToken, WithClusterToken};

use serde::Serialize;
use tokio::process::{Child, Command};

use crate::config::StandbySpec;
use crate::restart_backoff::{RestartBackoff, log_tail};
use crate::worker_process::{reported_state, worker_command};
use crate::{Error, Result};

#[derive(Debug)]
struct Parked {
    child: Child,
    port: u16,
    url: String,
    ready: bool,
    /// Where its stderr goes, for its last words when it dies.
    log: Option<PathBuf>,
}

/// A promoted standby.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Promoted {
    /// Where the agent reaches it (loopback).
    pub url: String,
    pub port: u16,
    pub pid: Option<u32>,
    /// From the promote call to the worker answering that it serves.
    pub promote_ms: f64,
}

/// The standbys of one pool.
#[derive(Debug)]
pub struct StandbyPool {
    spec: StandbySpec,
    model_path: PathBuf,
    parked: Vec<Parked>,
    /// Handed over; kept to reap them and stop them with the agent.
    promoted: Vec<(u16, Child)>,
    /// Retired: off the serving list, draining (their ports stay taken until done).
    draining: Vec<(u16, tokio::task::JoinHandle<()>)>,
    /// `{host}` in the command: where peers reach the standbys.
    host: String,
    client: reqwest::Client,
    /// The cluster token standbys ask for (and its file, named in their environment).
    token: Option<(Arc<ClusterToken>, PathBuf)>,
    /// Where each standby's stderr goes (`<pool>-standby-<port>.log`); inherited when
    /// unset.
    log_dir: Option<PathBuf>,
    /// Standbys that die before parking are replaced with growing pauses.
    backoff: RestartBackoff,
    /// The node's standby budget's share for this pool: at most this many parked,
    /// whatever `count` says.
    cap: u32,
}

impl StandbyPool {
    #[must_use]
    pub fn new(spec: StandbySpec, model_path: &Path) -> Self {
        StandbyPool {
            spec,
            model_path: model_path.to_path_buf(),
            parked: Vec::new(),
            promoted: Vec::new(),
            draining: Vec::new(),
            host: "127.0.0.1".to_owned(),
            client: preheat_edge::client::internal().build().unwrap_or_default(),
            token: None,
            log_dir: None,
            backoff: RestartBackoff::default(),
            cap: u32::MAX,
        }
    }

    /// After several standbys in a row died before parking: why the last one did.
    #[must_use]
    pub fn failing(&self) -> Option<&str> {
        self.backoff.gave_up()
    }

    /// Where peers reach the standbys (`{host}` in their command; default loopback).
    #[must_use]
    pub fn with_host(mut self, host: &str) -> Self {
        host.clone_into(&mut self.host);
        self
    }

    /// Ports of the promoted standbys that serve now (not retired, not exited).
    #[must_use]
    pub fn serving_ports(&mut self) -> Vec<u16> {
        self.reap_promoted();
        self.promoted.iter().map(|(p, _)| *p).collect()
    }

    fn reap_promoted(&mut self) {
        self.promoted
            .retain_mut(|(_, c)| matches!(c.try_wait(), Ok(None)));
    }

    /// Retires the newest promoted standby: off the serving list now, asked to drain
    /// after the spec's `unlist_delay` (gateways have stopped sending it requests by
    /// then), killed if it outlives `drain_grace`. Its port, or `None` when none serves.
    pub fn retire(&mut self) -> Option<u16> {
        self.reap_promoted();
        let (port, child) = self.promoted.pop()?;
        let (delay, grace, pool) = (
            self.spec.unlist_delay,
            self.spec.drain_grace,
            self.spec.pool.clone(),
        );
        tracing::info!(pool = %pool, port, "promoted standby retired: unlisted, draining");
        let task = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            drain_children(&mut [child], grace, &pool).await;
        });
        self.draining.push((port, task));
        Some(port)
    }

    /// The cluster token the standbys ask for, and the file they are told to read it
    /// from.
    #[must_use]
    pub fn with_token(mut self, token: Option<(Arc<ClusterToken>, PathBuf)>) -> Self {
        self.token = token;
        self
    }

    /// Sends each standby's stderr to a file in `dir`.
    #[must_use]
    pub fn with_log_dir(mut self, dir: &Path) -> Self {
        self.log_dir = Some(dir.to_path_buf());
        self
    }

    #[must_use]
    pub fn spec(&self) -> &StandbySpec {
        &self.spec
    }

    /// Parked and ready to promote.
    #[must_use]
    pub fn ready(&self) -> usize {
        self.parked.iter().filter(|p| p.ready).count()
    }

    pub fn set_count(&mut self, count: u32) {
        self.spec.count = count;
    }

    /// Parks at most `cap` (the node's standby budget's share), `count` still the
    /// wish.
    pub fn set_cap(&mut self, cap: u32) {
        self.cap = cap;
    }

    /// How many it keeps parked: `count` within the cap.
    #[must_use]
    pub fn target(&self) -> u32 {
        self.spec.count.min(self.cap)
    }

    /// Reaps exited processes, checks readiness, starts or stops standbys to reach
    /// `count` parked.
    pub async fn reconcile(&mut self) -> Result<()> {
        self.reap_promoted();
        self.draining.retain(|(_, t)| !t.is_finished());
        let mut kept = Vec::new();
        for mut p in std::mem::take(&mut self.parked) {
            if let Ok(Some(status)) = p.child.try_wait() {
                let words = p.log.as_deref().map(|l| log_tail(l, 3)).unwrap_or_default();
                let reason = if words.is_empty() {
                    format!("standby exited with {status}")
                } else {
                    format!("standby exited with {status}: {words}")
                };
                self.backoff.died_at_start(Instant::now(), reason.clone());
                tracing::warn!(pool = %self.spec.pool, port = p.port, quick_deaths = self.backoff.quick_deaths(), %reason, "standby died; replacing it after a pause");
                continue;
            }
            if !p.ready {
                let token = self.token.as_ref().map(|(t, _)| &**t);
                p.ready =
                    reported_state(&self.client, &p.url, token).await.as_deref() == Some("standby");
                if p.ready {
                    self.backoff.started_ok();
                }
            }
            kept.push(p);
        }
        self.parked = kept;
        while self.parked.len() > self.target() as usize {
            if let Some(mut p) = self.parked.pop() {
                let _ = p.child.kill().await;
            }
        }
        while self.parked.len() < self.target() as usize && self.backoff.may_start(Instant::now()) {
            let port = self.free_port()?;
            let args: Vec<String> = self
                .spec
                .command
                .iter()
                .map(|a| {
                    a.replace("{model_path}", &self.model_path.to_string_lossy())
                        .replace("{port}", &port.to_string())
                        .replace("{host}", &self.host)
                })
                .collect();
            let (prog, rest) = args
                .split_first()
                .ok_or_else(|| Error::Invalid("empty standby command".into()))?;
            let log = self
                .log_dir
                .as_ref()
                .map(|dir| dir.join(format!("{}-standby-{port}.log", self.spec.pool)));
            let token = self.token.as_ref().map(|(_, file)| file.as_path());
            let std_cmd = worker_command(prog, rest, token, log.as_deref())
                .map_err(|e| Error::io(log.as_deref().unwrap_or(Path::new(prog.as_str())), e))?;
            let child = Command::from(std_cmd)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| Error::Invalid(format!("starting standby {prog}: {e}")))?;
            tracing::info!(pool = %self.spec.pool, port, pid = child.id(), "standby started");
            self.parked.push(Parked {
                child,
                port,
                url: format!("http://127.0.0.1:{port}"),
                ready: false,
                log,
            });
        }
        Ok(())
    }

    fn free_port(&self) -> Result<u16> {
        (0..u32::from(u16::MAX))
            .map(|i| u32::from(self.spec.base_port) + 2 * i)
            .take_while(|&p| p < u32::from(u16::MAX))
            .map(|p| p as u16)
            .find(|p| {
                !self.parked.iter().any(|x| x.port == *p)
                    && !self.promoted.iter().any(|(q, _)| q == p)
                    && !self.draining.iter().any(|(q, _)| q == p)
                    && bindable(*p)
                    && p.checked_add(1).is_some_and(bindable)
            })
            .ok_or_else(|| Error::Invalid("no free standby port".into()))
    }

    /// Promotes one ready standby; `None` when none is ready. The pool keeps the
    /// process (stopped with the pool).
    pub async fn promote(&mut self) -> Result<Option<Promoted>> {
        Ok(self.promote_take().await?.map(|(p, port, child)| {
            self.promoted.push((port, child));
            p
        }))
    }

    /// Like [`StandbyPool::promote`], handing the process (and its port) to the caller,
    /// which then owns stopping it.
    pub async fn promote_take(&mut self) -> Result<Option<(Promoted, u16, Child)>> {
        let Some(i) = self.parked.iter().position(|p| p.ready) else {
            return Ok(None);
        };
        let p = self.parked.remove(i);
        let t0 = Instant::now();
        let r = self
            .client
            .post(format!("{}/internal/promote", p.url))
            .cluster_token(self.token.as_ref().map(|(t, _)| &**t))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        match r {
            Ok(r) if r.status().is_success() => {
                let out = Promoted {
                    url: p.url.clone(),
                    port: p.port,
                    pid: p.child.id(),
                    promote_ms: t0.elapsed().as_secs_f64() * 1e3,
                };
                tracing::info!(pool = %self.spec.pool, url = %out.url, ms = out.promote_ms, "standby promoted");
                Ok(Some((out, p.port, p.child)))
            }
            other => {
                let why = match other {
                    Ok(r) => format!("HTTP {}", r.status()),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(pool = %self.spec.pool, url = %p.url, reason = %why, "promotion failed; standby dropped");
                let mut c = p.child;
                let _ = c.kill().await;
                Err(Error::Invalid(format!("promoting {}: {why}", p.url)))
            }
        }
    }

    /// Stops every process the pool started: parked ones at once (they serve
    /// nobody); promoted ones, once off the list for `unlist_delay` (the agent's API
    /// is already closed, so gateways drop them), drain — SIGTERM, on which a worker
    /// deregisters and finishes what it holds — and are killed only if they outlive
    /// the spec's `drain_grace`. Standbys retired earlier finish their drains too.
    pub async fn shutdown(&mut self) {
        for mut p in self.parked.drain(..) {
            let _ = p.child.kill().await;
        }
        let mut promoted: Vec<Child> = self.promoted.drain(..).map(|(_, c)| c).collect();
        if !promoted.is_empty() {
            tokio::time::sleep(self.spec.unlist_delay).await;
        }
        drain_children(&mut promoted, self.spec.drain_grace, &self.spec.pool).await;
        for (_, t) in self.draining.drain(..) {
            let _ = t.await;
        }
    }
}

/// Asks a replica to drain: SIGTERM (a worker deregisters, finishes what it holds
/// within its grace, and exits). A child already reaped is left alone.
pub fn terminate(child: &Child) {
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        // SAFETY: kill(2) on a pid this process spawned and has not reaped (an
        // unreaped child's pid cannot be reused); no memory is involved.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
}

/// Asks each child to drain (SIGTERM) and waits up to `grace` for all of them to
/// exit; those still running then are killed. Serving replicas finish their requests
/// instead of dropping them.
pub async fn drain_children(children: &mut [Child], grace: Duration, what: &str) {
    for c in children.iter() {
        terminate(c);
    }
    let deadline = Instant::now() + grace;
    for c in children.iter_mut() {
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, c.wait()).await.is_err() {
            tracing::warn!(pool = %what, pid = c.id(), grace_s = grace.as_secs_f64(), "replica did not drain in time; killed");
            let _ = c.kill().await;
        }
    }
}

/// Whether `port` can be bound on loopback now (another process may hold it).
fn bindable(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}
