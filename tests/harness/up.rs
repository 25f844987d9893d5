//! `preheat up` as a test starts it: the stack builder's (see `stack`) last kind, a
//! single process that runs gateway, workers, scaler and agent itself.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use preheat_testkit::{Wait, free_port};
use serde_json::Value;

use super::stack::{Log, http_get};

/// The loopback ports of one `preheat up`.
#[derive(Debug, Clone, Copy)]
pub struct UpPorts {
    pub gateway: u16,
    pub gateway_internal: u16,
    pub scaler: u16,
    pub scaler_http: u16,
    pub agent: u16,
}

/// `preheat up` to start: see [`up`].
#[derive(Debug)]
#[must_use = "nothing starts until `start`"]
pub struct UpBuilder {
    cache: PathBuf,
    args: Vec<String>,
    log: Log,
}

/// `preheat up` with `cache` as its cache dir (its stdout goes to `cache/up.stdout`),
/// on free loopback ports.
pub fn up(cache: &Path) -> UpBuilder {
    UpBuilder {
        cache: cache.to_path_buf(),
        args: Vec::new(),
        log: Log::Null,
    }
}

impl UpBuilder {
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    /// Where its stderr goes ([`Log::Null`] unless told).
    pub fn log(mut self, log: Log) -> Self {
        self.log = log;
        self
    }

    pub fn start(self) -> Up {
        let ports = UpPorts {
            gateway: free_port(),
            gateway_internal: free_port(),
            scaler: free_port(),
            scaler_http: free_port(),
            agent: free_port(),
        };
        let at = |p: u16| format!("127.0.0.1:{p}");
        let child = Command::new(env!("CARGO_BIN_EXE_preheat"))
            .args(["up", "--port", &ports.gateway.to_string()])
            .args(["--gateway-internal", &at(ports.gateway_internal)])
            .args(["--scaler-listen", &at(ports.scaler)])
            .args(["--scaler-http", &at(ports.scaler_http)])
            .args(["--agent-listen", &at(ports.agent)])
            .args(&self.args)
            .arg("--cache-dir")
            .arg(&self.cache)
            .env("RUST_LOG", "warn")
            .stdout(std::fs::File::create(self.cache.join("up.stdout")).expect("up.stdout"))
            .stderr(self.log.stdio())
            .spawn()
            .expect("spawn preheat up");
        Up {
            child,
            url: format!("http://127.0.0.1:{}", ports.gateway),
            internal: format!("http://127.0.0.1:{}", ports.gateway_internal),
            ports,
            cache: self.cache,
        }
    }
}

/// A running `preheat up`: stopped as an operator stops it (SIGINT, 20 s to wind
/// down, then killed) when the test lets go of it.
#[derive(Debug)]
pub struct Up {
    pub child: std::process::Child,
    pub ports: UpPorts,
    /// Its gateway's public base URL.
    pub url: String,
    /// Its gateway's internal base URL.
    pub internal: String,
    cache: PathBuf,
}

impl Up {
    /// The cluster token `up` writes for its run.
    pub fn token_file(&self) -> PathBuf {
        self.cache.join("cluster-token")
    }

    /// What `up` printed so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self.cache.join("up.stdout")).unwrap_or_default()
    }

    /// Registered (prefill, decode) workers; `None` before the gateway and its token
    /// are there.
    pub fn workers(&self) -> Option<(usize, usize)> {
        self.workers_of(None)
    }

    /// Registered (prefill, decode) workers of `model` (every model's with `None`).
    pub fn workers_of(&self, model: Option<&str>) -> Option<(usize, usize)> {
        let token = std::fs::read_to_string(self.token_file()).ok()?;
        let (_, body) = http_get(
            &format!("{}/internal/workers", self.internal),
            Some(&format!("Bearer {}", token.trim())),
        )?;
        let v: Value = serde_json::from_str(&body).ok()?;
        let w = v["workers"].as_array()?;
        let n = |role: &str| {
            w.iter()
                .filter(|x| x["role"] == role && model.is_none_or(|m| x["model"] == m))
                .count()
        };
        Some((n("prefill"), n("decode")))
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let exited = Wait::new("up to stop after SIGINT", Duration::from_secs(20))
            .poll(|| matches!(self.child.try_wait(), Ok(Some(_))));
        if exited.is_err() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
