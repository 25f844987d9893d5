//! What an end-to-end test runs against, started the one way: a gateway and its prefill
//! and decode workers ([`stack`], or [`gateway`] and [`worker`] one by one), a colocated
//! `engine serve` ([`serve`]) or `preheat up` (`super::up`, in its own module). Every
//! process is the real binary with this run's cluster token, on free loopback ports,
//! and is killed when the test lets go of it; every wait goes through
//! `preheat_testkit::wait_for`.
//!
//! (Here and not in `preheat-testkit`: it starts the `preheat` binary, which only the
//! root package's tests can name.)

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use preheat_testkit::{KillOnDrop, Wait, free_port, model_fixture, wait_for};
use serde_json::Value;

use super::{bearer, token_file};

/// Where a started process's stderr goes.
#[derive(Clone, Debug)]
pub enum Log {
    /// The test's own stderr (the default).
    Inherit,
    Null,
    /// A pipe the test reads (a stack that never gets ready shows it in its failure).
    /// Nobody else reads it: a process that logs much blocks once it fills.
    Piped,
    /// A file, created afresh (one process per file).
    File(PathBuf),
}

impl Log {
    pub(super) fn stdio(&self) -> Stdio {
        match self {
            Log::Inherit => Stdio::inherit(),
            Log::Null => Stdio::null(),
            Log::Piped => Stdio::piped(),
            Log::File(p) => Stdio::from(std::fs::File::create(p).expect("a log file")),
        }
    }
}

/// Starts `preheat ARGS…` in the background (stdout discarded, quiet logs on
/// `stderr`), with this run's cluster token; killed when dropped.
pub fn spawn(args: &[&str], stderr: Stdio) -> KillOnDrop {
    spawn_with_env(args, stderr, &[])
}

/// [`spawn`], with `env` set for it.
pub fn spawn_with_env(args: &[&str], stderr: Stdio, env: &[(String, String)]) -> KillOnDrop {
    KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_preheat"))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "warn")
            .env("PREHEAT_CLUSTER_TOKEN_FILE", token_file())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn preheat"),
    )
}

/// `GET url` over a plain HTTP/1.0 connection, with `authorization` when given: its
/// status and body, or `None` when nothing answers. Blocking, but no runtime of its
/// own, so it serves sync tests and async ones alike.
pub fn http_get(url: &str, authorization: Option<&str>) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_owned()), |(h, p)| (h, format!("/{p}")));
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let auth = authorization.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n{auth}\r\n").ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Waits until `GET /health` on `port` answers 200 (a server answers 503 while its
/// model loads), up to `secs`.
pub fn wait_healthy(port: u16, secs: u64) {
    let url = format!("http://127.0.0.1:{port}/health");
    wait_for(
        format!("port {port} to be healthy"),
        Duration::from_secs(secs),
        || match http_get(&url, None) {
            Some((200, _)) => Ok(()),
            Some((status, body)) => Err(format!("{status} {body}")),
            None => Err("no answer".to_owned()),
        },
    );
}

/// The value of the first sample of `name` (any labels) on a Prometheus text page.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The sum of `name`'s samples (every label set) on a Prometheus text page; `None`
/// when it has none.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

/// A gateway to start: see [`gateway`].
#[derive(Debug)]
#[must_use = "nothing starts until `start`"]
pub struct GatewayBuilder {
    args: Vec<String>,
    env: Vec<(String, String)>,
    internal: bool,
    log: Log,
}

/// A gateway with an internal port of its own where workers register; it learns its
/// model from the first worker unless given [`GatewayBuilder::model`].
pub fn gateway() -> GatewayBuilder {
    GatewayBuilder {
        args: Vec::new(),
        env: Vec::new(),
        internal: true,
        log: Log::Inherit,
    }
}

impl GatewayBuilder {
    /// `--model`: the gateway knows its model (read for its manifest only) before any
    /// worker registers.
    pub fn model(self, model: &str) -> Self {
        self.args(&["--model", model])
    }

    /// Every prompt goes through a prefill worker (`--disagg-min-tokens 1`).
    pub fn through_prefill(self) -> Self {
        self.args(&["--disagg-min-tokens", "1"])
    }

    /// No internal port: its workers are discovered (flags in [`GatewayBuilder::args`]).
    pub fn discovering(mut self) -> Self {
        self.internal = false;
        self
    }

    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    pub fn log(mut self, log: Log) -> Self {
        self.log = log;
        self
    }

    /// `$key` set to `value` in its environment.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    pub fn start(self) -> Gateway {
        let (port, internal) = (free_port(), free_port());
        let (port_s, internal_s) = (port.to_string(), internal.to_string());
        let mut args = vec!["engine", "gateway", "--port", &port_s];
        if self.internal {
            args.extend(["--internal-port", &internal_s]);
        }
        args.extend(self.args.iter().map(String::as_str));
        Gateway {
            proc: spawn_with_env(&args, self.log.stdio(), &self.env),
            port,
            url: format!("http://127.0.0.1:{port}"),
            internal: if self.internal {
                format!("http://127.0.0.1:{internal}")
            } else {
                String::new()
            },
        }
    }
}

/// A running gateway.
#[derive(Debug)]
pub struct Gateway {
    pub proc: KillOnDrop,
    pub port: u16,
    /// Its public base URL.
    pub url: String,
    /// Its internal base URL, where workers register (empty where it discovers them).
    pub internal: String,
}

impl Gateway {
    /// A worker of `model` that registers here.
    pub fn worker(&self, role: &str, model: &Path) -> WorkerBuilder {
        worker(role, model).gateway(&self.internal)
    }

    /// The workers registered here (`GET /internal/workers`); `None` unless the gateway
    /// answers 200 with a worker list (a gateway that died or refused the token is not
    /// one without workers).
    pub fn try_workers(&self) -> Option<Vec<Value>> {
        let (status, body) = http_get(
            &format!("{}/internal/workers", self.internal),
            Some(&bearer()),
        )?;
        if status != 200 {
            return None;
        }
        serde_json::from_str::<Value>(&body).ok()?["workers"]
            .as_array()
            .cloned()
    }

    /// [`Gateway::try_workers`] of a gateway that must be answering.
    pub fn workers(&self) -> Vec<Value> {
        self.try_workers()
            .expect("the gateway answers GET /internal/workers with 200 and a worker list")
    }

    /// Its `/metrics` page (empty when it does not answer).
    pub fn metrics(&self) -> String {
        http_get(&format!("{}/metrics", self.url), None).map_or(String::new(), |(_, t)| t)
    }

    pub fn wait_healthy(&self, secs: u64) {
        wait_healthy(self.port, secs);
    }
}

/// A worker to start: see [`worker`].
#[derive(Debug)]
#[must_use = "nothing starts until `start`"]
pub struct WorkerBuilder {
    role: String,
    model: PathBuf,
    gateway: Option<String>,
    kv_mib: Option<u32>,
    args: Vec<String>,
    log: Log,
}

/// An `engine prefill` or `engine decode` worker (`role`) of `model` that registers
/// nowhere (to be discovered) unless given [`WorkerBuilder::gateway`]. A prefill
/// worker's KV port is a free port of its own: the default (`--port` + 1) can be the
/// port another test's process was just given (the cause of "timed out waiting for
/// three workers" in a CI run).
pub fn worker(role: &str, model: &Path) -> WorkerBuilder {
    WorkerBuilder {
        role: role.to_owned(),
        model: model.to_path_buf(),
        gateway: None,
        kv_mib: None,
        args: Vec::new(),
        log: Log::Inherit,
    }
}

impl WorkerBuilder {
    /// Registers at `gateway` (a gateway's internal URL).
    pub fn gateway(mut self, gateway: &str) -> Self {
        self.gateway = Some(gateway.to_owned());
        self
    }

    /// `--kv-cache-mib` (else the engine's default).
    pub fn kv_mib(mut self, mib: u32) -> Self {
        self.kv_mib = Some(mib);
        self
    }

    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    pub fn log(mut self, log: Log) -> Self {
        self.log = log;
        self
    }

    pub fn start(self) -> Worker {
        let port = free_port();
        let (port_s, kv_port) = (port.to_string(), free_port().to_string());
        let kv_mib = self.kv_mib.map(|m| m.to_string());
        let model = self.model.to_str().expect("utf-8 path");
        let mut args = vec!["engine", self.role.as_str(), "--model", model];
        args.extend(["--port", &port_s]);
        if let Some(mib) = &kv_mib {
            args.extend(["--kv-cache-mib", mib]);
        }
        if let Some(g) = &self.gateway {
            args.extend(["--gateway", g]);
        }
        if self.role == "prefill" {
            args.extend(["--kv-port", &kv_port]);
        }
        args.extend(self.args.iter().map(String::as_str));
        Worker {
            proc: spawn(&args, self.log.stdio()),
            port,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

/// A running worker (or `engine serve`).
#[derive(Debug)]
pub struct Worker {
    pub proc: KillOnDrop,
    pub port: u16,
    pub url: String,
}

impl Worker {
    /// Its `/metrics` page (empty when it does not answer).
    pub fn metrics(&self) -> String {
        http_get(&format!("{}/metrics", self.url), None).map_or(String::new(), |(_, t)| t)
    }

    pub fn wait_healthy(&self, secs: u64) {
        wait_healthy(self.port, secs);
    }
}

/// A disaggregated deployment to start: see [`stack`].
#[derive(Debug)]
#[must_use = "nothing starts until `start`"]
pub struct StackBuilder {
    gateway: GatewayBuilder,
    model: PathBuf,
    prefill: usize,
    decode: usize,
    kv_mib: Option<u32>,
    log: Log,
    ready_secs: u64,
}

/// A gateway (as [`gateway`] starts it, or [`StackBuilder::gateway`]) and workers of the
/// tiny fixture (or [`StackBuilder::model`]) registering there, started together;
/// [`StackBuilder::start`] returns once the deployment is ready (see
/// [`Stack::wait_ready`]).
pub fn stack() -> StackBuilder {
    StackBuilder {
        gateway: gateway(),
        model: model_fixture("llama-tiny"),
        prefill: 0,
        decode: 0,
        kv_mib: None,
        log: Log::Inherit,
        ready_secs: 60,
    }
}

impl StackBuilder {
    /// The gateway as `g` starts it (its log is the stack's).
    pub fn gateway(mut self, g: GatewayBuilder) -> Self {
        self.gateway = g;
        self
    }

    /// The workers' model.
    pub fn model(mut self, model: &Path) -> Self {
        self.model = model.to_path_buf();
        self
    }

    pub fn prefill(mut self, n: usize) -> Self {
        self.prefill = n;
        self
    }

    pub fn decode(mut self, n: usize) -> Self {
        self.decode = n;
        self
    }

    /// Every worker's `--kv-cache-mib` (else the engine's default).
    pub fn kv_mib(mut self, mib: u32) -> Self {
        self.kv_mib = Some(mib);
        self
    }

    /// Where every process's stderr goes (not [`Log::File`]).
    pub fn log(mut self, log: Log) -> Self {
        self.log = log;
        self
    }

    /// How long the deployment may take to get ready (60 s unless told).
    pub fn ready_within(mut self, secs: u64) -> Self {
        self.ready_secs = secs;
        self
    }

    pub fn start(self) -> Stack {
        let gateway = self.gateway.log(self.log.clone()).start();
        let mut s = Stack {
            gateway,
            prefill: Vec::new(),
            decode: Vec::new(),
            model: self.model,
            kv_mib: self.kv_mib,
            log: self.log,
        };
        for _ in 0..self.prefill {
            s.add("prefill");
        }
        for _ in 0..self.decode {
            s.add("decode");
        }
        s.wait_ready(self.ready_secs);
        s
    }
}

/// A running gateway and its workers.
#[derive(Debug)]
pub struct Stack {
    pub gateway: Gateway,
    pub prefill: Vec<Worker>,
    pub decode: Vec<Worker>,
    model: PathBuf,
    kv_mib: Option<u32>,
    log: Log,
}

impl Stack {
    /// Its public base URL.
    pub fn url(&self) -> &str {
        &self.gateway.url
    }

    /// Its internal base URL (registration).
    pub fn internal(&self) -> &str {
        &self.gateway.internal
    }

    /// The workers registered at the gateway.
    pub fn workers(&self) -> Vec<Value> {
        self.gateway.workers()
    }

    /// Starts one more worker of `role` like the others (not waited for: see
    /// [`Stack::wait_ready`]).
    pub fn add(&mut self, role: &str) -> &mut Worker {
        let mut w = self.gateway.worker(role, &self.model).log(self.log.clone());
        if let Some(mib) = self.kv_mib {
            w = w.kv_mib(mib);
        }
        let pool = if role == "prefill" {
            &mut self.prefill
        } else {
            &mut self.decode
        };
        pool.push(w.start());
        pool.last_mut().expect("just pushed")
    }

    /// Whether the gateway lists exactly this stack's workers, and has told every decode
    /// worker of every prefill worker.
    fn is_ready(&self, listed: &[Value]) -> bool {
        listed.len() == self.prefill.len() + self.decode.len()
            && listed
                .iter()
                .filter(|w| w["role"] == "decode")
                .all(|w| w["prefill_peers"] == self.prefill.len())
    }

    /// Waits up to `secs` until the gateway lists exactly this stack's workers (one
    /// that died is gone from its list) and has told every decode worker of every
    /// prefill worker. Otherwise every process is stopped and the failure shows how
    /// each ended and, where piped, what it said.
    pub fn wait_ready(&mut self, secs: u64) {
        let waited = Wait::new(
            format!(
                "{} prefill and {} decode workers registered and announced",
                self.prefill.len(),
                self.decode.len()
            ),
            Duration::from_secs(secs),
        )
        .poll(|| {
            let listed = self.gateway.try_workers().unwrap_or_default();
            if self.is_ready(&listed) {
                Ok(())
            } else {
                Err(format!("{listed:?}"))
            }
        });
        if let Err(timed_out) = waited {
            panic!("{timed_out}\n{}", self.stop_and_tell());
        }
    }

    /// Stops every process; how each ended and its piped stderr.
    fn stop_and_tell(&mut self) -> String {
        let mut why = String::new();
        let procs = std::iter::once(("gateway".to_owned(), &mut self.gateway.proc))
            .chain(
                self.prefill
                    .iter_mut()
                    .enumerate()
                    .map(|(i, w)| (format!("prefill {i}"), &mut w.proc)),
            )
            .chain(
                self.decode
                    .iter_mut()
                    .enumerate()
                    .map(|(i, w)| (format!("decode {i}"), &mut w.proc)),
            );
        for (name, p) in procs {
            let status = p.0.try_wait();
            let _ = p.0.kill();
            let _ = p.0.wait();
            let mut err = String::new();
            if let Some(mut e) = p.0.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            why.push_str(&format!("--- {name} ({status:?}):\n{err}\n"));
        }
        why
    }
}

/// A colocated `engine serve` to start: see [`serve`].
#[derive(Debug)]
#[must_use = "nothing starts until `start`"]
pub struct ServeBuilder {
    model: PathBuf,
    kv_mib: Option<u32>,
    args: Vec<String>,
    log: Log,
}

/// `engine serve` of `model`.
pub fn serve(model: &Path) -> ServeBuilder {
    ServeBuilder {
        model: model.to_path_buf(),
        kv_mib: None,
        args: Vec::new(),
        log: Log::Inherit,
    }
}

impl ServeBuilder {
    pub fn kv_mib(mut self, mib: u32) -> Self {
        self.kv_mib = Some(mib);
        self
    }

    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    pub fn log(mut self, log: Log) -> Self {
        self.log = log;
        self
    }

    /// Starts it (not waited for: see [`Worker::wait_healthy`]).
    pub fn start(self) -> Worker {
        let port = free_port();
        let port_s = port.to_string();
        let kv_mib = self.kv_mib.map(|m| m.to_string());
        let model = self.model.to_str().expect("utf-8 path");
        let mut args = vec!["engine", "serve", "--model", model, "--port", &port_s];
        if let Some(mib) = &kv_mib {
            args.extend(["--kv-cache-mib", mib]);
        }
        args.extend(self.args.iter().map(String::as_str));
        Worker {
            proc: spawn(&args, self.log.stdio()),
            port,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}
