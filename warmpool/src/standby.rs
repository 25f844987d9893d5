//! Parked standby replicas: engine processes started with `--standby` (model mapped
//! and paged in, tokenizer loaded, warm-up done, not registered), promoted to serving
//! by one HTTP call. A pool keeps `count` parked; each promotion hands one over and a
//! replacement is started.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::process::{Child, Command};

use crate::config::StandbySpec;
use crate::{Error, Result};

#[derive(Debug)]
struct Parked {
    child: Child,
    port: u16,
    url: String,
    ready: bool,
}

/// A promoted standby.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Promoted {
    pub url: String,
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
    client: reqwest::Client,
}

impl StandbyPool {
    #[must_use]
    pub fn new(spec: StandbySpec, model_path: &Path) -> Self {
        StandbyPool {
            spec,
            model_path: model_path.to_path_buf(),
            parked: Vec::new(),
            promoted: Vec::new(),
            client: reqwest::Client::new(),
        }
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

    /// Reaps exited processes, checks readiness, starts or stops standbys to reach
    /// `count` parked.
    pub async fn reconcile(&mut self) -> Result<()> {
        self.promoted
            .retain_mut(|(_, c)| matches!(c.try_wait(), Ok(None)));
        let mut kept = Vec::new();
        for mut p in std::mem::take(&mut self.parked) {
            if let Ok(Some(status)) = p.child.try_wait() {
                tracing::warn!(pool = %self.spec.pool, port = p.port, %status, "standby exited; replacing it");
                continue;
            }
            if !p.ready {
                p.ready = state_of(&self.client, &p.url).await.as_deref() == Some("standby");
            }
            kept.push(p);
        }
        self.parked = kept;
        while self.parked.len() > self.spec.count as usize {
            if let Some(mut p) = self.parked.pop() {
                let _ = p.child.kill().await;
            }
        }
        while self.parked.len() < self.spec.count as usize {
            let port = self.free_port()?;
            let args: Vec<String> = self
                .spec
                .command
                .iter()
                .map(|a| {
                    a.replace("{model_path}", &self.model_path.to_string_lossy())
                        .replace("{port}", &port.to_string())
                })
                .collect();
            let (prog, rest) = args
                .split_first()
                .ok_or_else(|| Error::Invalid("empty standby command".into()))?;
            let child = Command::new(prog)
                .args(rest)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| Error::Invalid(format!("starting standby {prog}: {e}")))?;
            tracing::info!(pool = %self.spec.pool, port, pid = child.id(), "standby started");
            self.parked.push(Parked {
                child,
                port,
                url: format!("http://127.0.0.1:{port}"),
                ready: false,
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
            })
            .ok_or_else(|| Error::Invalid("no free standby port".into()))
    }

    /// Promotes one ready standby; `None` when none is ready.
    pub async fn promote(&mut self) -> Result<Option<Promoted>> {
        let Some(i) = self.parked.iter().position(|p| p.ready) else {
            return Ok(None);
        };
        let p = self.parked.remove(i);
        let t0 = Instant::now();
        let r = self
            .client
            .post(format!("{}/internal/promote", p.url))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        match r {
            Ok(r) if r.status().is_success() => {
                let out = Promoted {
                    url: p.url.clone(),
                    pid: p.child.id(),
                    promote_ms: t0.elapsed().as_secs_f64() * 1e3,
                };
                tracing::info!(pool = %self.spec.pool, url = %out.url, ms = out.promote_ms, "standby promoted");
                self.promoted.push((p.port, p.child));
                Ok(Some(out))
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

    /// Stops every process the pool started.
    pub async fn shutdown(&mut self) {
        for mut p in self.parked.drain(..) {
            let _ = p.child.kill().await;
        }
        for (_, mut c) in self.promoted.drain(..) {
            let _ = c.kill().await;
        }
    }
}

/// The worker's `/internal/state`: `loading`, `standby` or `serving`.
pub async fn state_of(client: &reqwest::Client, url: &str) -> Option<String> {
    let r = client
        .get(format!("{url}/internal/state"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    let v: serde_json::Value = r.json().await.ok()?;
    v.get("state")?.as_str().map(str::to_owned)
}
