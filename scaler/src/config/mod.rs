//! Scaler configuration: a YAML file, every value of which can be overridden from the
//! command line with `--set path=value` (e.g. `--set models.0.decode.max_replicas=8`).
//! Parsing and validation report every problem at once.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::policy::{Pool, PoolPolicy};
use crate::{Result, ScalerError};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// KEDA external-scaler gRPC address.
    pub grpc_listen: SocketAddr,
    /// Health (`/healthz`) and the scaler's own `/metrics`.
    pub http_listen: SocketAddr,
    /// Seconds between scrape-and-decide ticks.
    pub interval_s: f64,
    /// Seconds of history for rates and latency quantiles.
    pub window_s: f64,
    /// Per-request scrape timeout in seconds.
    pub scrape_timeout_s: f64,
    /// Capacity profile JSON (`preheat engine profile` output); the documented
    /// default GPU-class profile when absent.
    pub profile: Option<PathBuf>,
    /// `keda`: publish decisions for KEDA over gRPC. `direct`: also set each pool's
    /// Deployment replicas through the scale subresource (clusters without KEDA).
    pub mode: Mode,
    /// Kubernetes API access for pod discovery and direct mode.
    pub kubernetes: KubeSettings,
    /// Prometheus server root URL, for pools with a `prometheus_selector`.
    pub prometheus_url: Option<String>,
    /// How often that Prometheus scrapes the pools (its `scrape_interval`, or the
    /// ServiceMonitor's): a `rate()` needs two samples in its range, so short-term peak
    /// rates are taken over max(interval + this, 4 × this), as Grafana's
    /// `$__rate_interval` does.
    pub prometheus_scrape_interval_s: f64,
    /// TLS on the gRPC endpoint (KEDA's `tlsCertFile`/`caCert` trigger settings).
    pub tls: Option<TlsSettings>,
    /// File holding the deployment's cluster token, which the warm-pool agents' API
    /// asks for (`--cluster-token-file` / `$PREHEAT_CLUSTER_TOKEN_FILE` override it).
    pub cluster_token_file: Option<PathBuf>,
    /// File the scaler keeps what it learnt in (each pool's season), read at start and
    /// rewritten every 30 s, so a restart resumes it; without it (or Prometheus to read
    /// it back from) a restarted scaler relearns its season over a whole period.
    pub state_file: Option<PathBuf>,
    /// What the models share: the fleet's GPU budget.
    pub fleet: FleetConfig,
    pub models: Vec<ModelConfig>,
}

/// Limits shared by every model of the config.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// GPUs every model's replicas may hold together (0: no limit). The bundled engine
    /// runs one GPU per replica (it has no tensor parallelism). When the models want
    /// more, the scaler grants them in order: a model with requests held at zero, then
    /// the largest SLO deficit, then `priority`.
    pub max_gpus: u32,
    /// GPUs each parked standby holds (0, the default: standbys park off the GPUs the
    /// budget counts, e.g. on CPU nodes). Parked standbys hold them whether or not a
    /// pool wants them, so they come off `max_gpus` before any pool is granted.
    pub standby_gpus: u32,
}

/// PEM files for the gRPC endpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA (mutual TLS,
    /// as KEDA does with a client certificate).
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Keda,
    Direct,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubeSettings {
    /// Namespace of the engine pods and Deployments.
    pub namespace: String,
    /// API server URL; default: in-cluster service account, else the kubeconfig.
    pub api_url: Option<String>,
    /// Before a pool watched through its pods scales down, mark each ready pod with
    /// its in-flight requests as `controller.kubernetes.io/pod-deletion-cost`, so the
    /// ReplicaSet removes the idlest first. Needs `patch` on pods.
    pub pod_deletion_cost: bool,
}

impl Default for KubeSettings {
    fn default() -> Self {
        KubeSettings {
            namespace: "default".into(),
            api_url: None,
            pod_deletion_cost: false,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            grpc_listen: ([0, 0, 0, 0], 9090).into(),
            http_listen: ([0, 0, 0, 0], 9091).into(),
            interval_s: 5.0,
            window_s: 60.0,
            scrape_timeout_s: 2.0,
            profile: None,
            mode: Mode::Keda,
            kubernetes: KubeSettings::default(),
            prometheus_url: None,
            prometheus_scrape_interval_s: 15.0,
            tls: None,
            cluster_token_file: None,
            state_file: None,
            fleet: FleetConfig::default(),
            models: Vec::new(),
        }
    }
}

/// One served model and its two pools.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    /// `model_name` label value to filter on when endpoints serve several models.
    #[serde(default)]
    pub metrics_model_name: Option<String>,
    /// Gateway `/metrics` URLs (held requests come from here).
    #[serde(default)]
    pub gateway: Vec<String>,
    /// Label selector of the gateway pods, each scraped (with several replicas behind
    /// one Service, a request held at any of them must be seen).
    #[serde(default)]
    pub gateway_selector: Option<String>,
    /// Port of a discovered gateway pod's `/metrics`.
    #[serde(default = "default_metrics_port")]
    pub gateway_port: u16,
    /// Parked standbys on the warm-pool agents, promoted while a pool has fewer Ready
    /// replicas than it wants (see [`crate::standbys`]).
    #[serde(default)]
    pub standbys: Option<crate::standbys::StandbyConfig>,
    /// This model's capacity profile (`preheat engine profile` output), where its
    /// replicas differ from the others'; the top-level `profile` otherwise.
    #[serde(default)]
    pub profile: Option<PathBuf>,
    /// What the model is (e.g. its name and manifest digest), where the name alone
    /// could be reused for another: a season saved under the same name for another
    /// identity is not resumed (it stays in the state file for a rollback).
    #[serde(default)]
    pub identity: Option<String>,
    /// Its rank for the fleet's GPU budget among models equally held and equally
    /// short of their SLOs (higher first; default 0).
    #[serde(default)]
    pub priority: i32,
    pub prefill: PoolConfig,
    pub decode: PoolConfig,
}

/// One pool: where its metrics come from, what it scales, and its policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "PoolFile", into = "PoolFile")]
pub struct PoolConfig {
    pub source: MetricsSource,
    /// Port and path of a discovered pod's metrics.
    pub metrics_port: u16,
    pub metrics_path: String,
    /// The pool's Deployment. Its replicas are read whenever the metrics cannot say
    /// how many the pool has (a restart, a watch not yet listed, a Prometheus
    /// outage), so a pool is held at its real size; in direct mode the scaler also
    /// sets them.
    pub deployment: Option<String>,
    pub policy: PoolPolicy,
}

/// Where a pool's metrics come from.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum MetricsSource {
    /// None named: a pool with no replicas of its own (local mode supplies its
    /// endpoints at run time; the gateway's held requests still wake it).
    #[default]
    Unset,
    /// Static `/metrics` URLs of the pool's replicas (`endpoints`).
    Endpoints(Vec<String>),
    /// The pool's pods, watched through the Kubernetes API (`selector`).
    Pods { selector: String },
    /// PromQL label matchers of the pool's series, read from `prometheus_url` instead
    /// of scraping (`prometheus_selector`).
    Prometheus { selector: String },
    /// The file named several of the keys above, which are alternatives: refused by
    /// [`Config::problems`] (with every other problem, those of each key given
    /// included), never used.
    Conflicting {
        endpoints: Vec<String>,
        selector: Option<String>,
        prometheus_selector: Option<String>,
    },
}

/// A pool as the config file spells it: the source's three keys side by side.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolFile {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    endpoints: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    selector: Option<String>,
    #[serde(default = "default_metrics_port")]
    metrics_port: u16,
    #[serde(default = "default_metrics_path")]
    metrics_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prometheus_selector: Option<String>,
    #[serde(default)]
    deployment: Option<String>,
    #[serde(flatten)]
    policy: PoolPolicy,
}

impl From<PoolFile> for PoolConfig {
    fn from(f: PoolFile) -> Self {
        let source = match (f.endpoints.is_empty(), f.selector, f.prometheus_selector) {
            (true, None, None) => MetricsSource::Unset,
            (false, None, None) => MetricsSource::Endpoints(f.endpoints),
            (true, Some(selector), None) => MetricsSource::Pods { selector },
            (true, None, Some(selector)) => MetricsSource::Prometheus { selector },
            (_, selector, prometheus_selector) => MetricsSource::Conflicting {
                endpoints: f.endpoints,
                selector,
                prometheus_selector,
            },
        };
        PoolConfig {
            source,
            metrics_port: f.metrics_port,
            metrics_path: f.metrics_path,
            deployment: f.deployment,
            policy: f.policy,
        }
    }
}

impl From<PoolConfig> for PoolFile {
    fn from(p: PoolConfig) -> Self {
        let (mut endpoints, mut selector, mut prometheus_selector) = (Vec::new(), None, None);
        match p.source {
            MetricsSource::Unset => {}
            MetricsSource::Endpoints(e) => endpoints = e,
            MetricsSource::Pods { selector: s } => selector = Some(s),
            MetricsSource::Prometheus { selector: s } => prometheus_selector = Some(s),
            MetricsSource::Conflicting {
                endpoints: e,
                selector: s,
                prometheus_selector: ps,
            } => (endpoints, selector, prometheus_selector) = (e, s, ps),
        }
        PoolFile {
            endpoints,
            selector,
            metrics_port: p.metrics_port,
            metrics_path: p.metrics_path,
            prometheus_selector,
            deployment: p.deployment,
            policy: p.policy,
        }
    }
}

fn default_metrics_port() -> u16 {
    8000
}

impl Default for PoolConfig {
    /// A pool with no metrics source of its own (one supplied at run time, as local
    /// mode does) and the default policy.
    fn default() -> Self {
        PoolConfig {
            source: MetricsSource::Unset,
            metrics_port: default_metrics_port(),
            metrics_path: default_metrics_path(),
            deployment: None,
            policy: PoolPolicy::default(),
        }
    }
}

fn default_metrics_path() -> String {
    "/metrics".into()
}

/// Parses YAML text into a tree, to be overridden before it becomes a [`Config`].
fn parse_yaml(text: &str) -> std::result::Result<Value, String> {
    preheat_edge::config_file::parse_yaml(text)
}

/// Applies one `path=value` override to a YAML tree; `path` is dot-separated, with
/// numbers indexing lists. The value is parsed as YAML (`8`, `true`, `[a, b]`).
fn apply_override(root: &mut Value, spec: &str) -> std::result::Result<(), String> {
    let (path, raw) = spec
        .split_once('=')
        .ok_or_else(|| format!("--set {spec:?}: expected path=value"))?;
    // `--set a=` clears `a` (null), as YAML's empty value does.
    let value = if raw.trim().is_empty() {
        Value::Null
    } else {
        parse_yaml(raw).map_err(|e| format!("--set {path}: {e}"))?
    };
    let mut cur = root;
    let parts: Vec<&str> = path.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        if cur.is_null() {
            // No map in the config has numeric keys: an index into a list that is not
            // there would otherwise become a map, which serde refuses without naming
            // the flag or the list.
            if part.parse::<usize>().is_ok() {
                return Err(format!(
                    "--set {path}: there is no list at `{}` to take entry {part} from \
                     (give the list in the config file, or set `{}=[...]`)",
                    parts[..i].join("."),
                    parts[..i].join(".")
                ));
            }
            *cur = Value::Object(serde_json::Map::new());
        }
        cur = match cur {
            Value::Array(seq) => {
                let idx: usize = part
                    .parse()
                    .map_err(|_| format!("--set {path}: {part:?} is not a list index"))?;
                seq.get_mut(idx)
                    .ok_or_else(|| format!("--set {path}: index {idx} out of range"))?
            }
            Value::Object(map) => map.entry(*part).or_insert(Value::Null),
            _ => return Err(format!("--set {path}: {part:?} is inside a scalar")),
        };
        if last {
            *cur = value.clone();
        }
    }
    Ok(())
}

impl Config {
    /// Loads `path` (if any), applies `overrides`, and validates; all errors together.
    pub fn load(path: Option<&std::path::Path>, overrides: &[String]) -> Result<Self> {
        Self::load_checked(path, overrides, true)
    }

    /// As [`Config::load`], without requiring metrics sources and deployments: for the
    /// simulator, which reads only the pools' policies.
    pub fn load_policies(path: Option<&std::path::Path>, overrides: &[String]) -> Result<Self> {
        Self::load_checked(path, overrides, false)
    }

    /// A config built in code (local mode's) with `--set` overrides applied, validated
    /// as [`Config::load`] validates a file (`sources`: its metrics sources and files
    /// too, or only the pools' policies as [`Config::load_policies`] does); every
    /// problem at once.
    pub fn with_overrides(self, overrides: &[String], sources: bool) -> Result<Self> {
        // Nothing to apply: checked as built (JSON holds neither a non-finite number
        // nor a path that is not UTF-8, which the checks name better than serde).
        if overrides.is_empty() {
            return self.validated(Vec::new(), sources);
        }
        let tree = serde_json::to_value(&self)
            .map_err(|e| ScalerError::Config(vec![format!("config: {e}")]))?;
        Self::from_tree(tree, overrides, sources)
    }

    fn load_checked(
        path: Option<&std::path::Path>,
        overrides: &[String],
        sources: bool,
    ) -> Result<Self> {
        let tree: Value = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| ScalerError::Config(vec![format!("{}: {e}", p.display())]))?;
                parse_yaml(&text)
                    .map_err(|e| ScalerError::Config(vec![format!("{}: {e}", p.display())]))?
            }
            None => Value::Object(serde_json::Map::new()),
        };
        Self::from_tree(tree, overrides, sources)
    }

    /// `tree` with `overrides` applied, parsed and validated.
    fn from_tree(mut tree: Value, overrides: &[String], sources: bool) -> Result<Self> {
        let mut errs = Vec::new();
        if tree.is_null() {
            tree = Value::Object(serde_json::Map::new());
        }
        for o in overrides {
            // A refused override leaves no trace (the nodes it made on its way).
            let mut next = tree.clone();
            match apply_override(&mut next, o) {
                Ok(()) => tree = next,
                Err(e) => errs.push(e),
            }
        }
        let cfg: Config = match serde_json::from_value(tree) {
            Ok(c) => c,
            Err(e) => {
                errs.push(e.to_string());
                return Err(ScalerError::Config(errs));
            }
        };
        cfg.validated(errs, sources)
    }

    /// `self` unless it or the steps before (`errs`) found problems: all of them.
    fn validated(self, mut errs: Vec<String>, sources: bool) -> Result<Self> {
        errs.extend(self.problems(sources));
        if errs.is_empty() {
            Ok(self)
        } else {
            Err(ScalerError::Config(errs))
        }
    }

    /// The pool and policy key a `--set` path names (`models.0.prefill.headroom`,
    /// `models.0.decode.schedule.0.cron`), if it names one of the first model's pool
    /// policy keys: what local mode and the simulator take of a scaler config.
    #[must_use]
    pub fn first_model_policy_key(path: &str) -> Option<(Pool, &str)> {
        let mut parts = path.split('.');
        let (Some("models"), Some("0"), Some(pool), Some(key)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        let pool = Pool::parse(pool)?;
        PoolPolicy::has_key(key).then_some((pool, key))
    }

    /// Every semantic problem of a parsed config (`sources`: also where each pool's
    /// metrics come from, in direct mode what it scales, and the files this host must
    /// hold: TLS PEMs, the state file's directory).
    #[must_use]
    pub fn problems(&self, sources: bool) -> Vec<String> {
        let mut e = Vec::new();
        if self.models.is_empty() {
            e.push("models: at least one model is required".into());
        }
        for (n, v) in [
            ("interval_s", self.interval_s),
            ("window_s", self.window_s),
            ("scrape_timeout_s", self.scrape_timeout_s),
            (
                "prometheus_scrape_interval_s",
                self.prometheus_scrape_interval_s,
            ),
        ] {
            if !(v.is_finite() && v > 0.0) {
                e.push(format!("{n} must be > 0"));
            }
        }
        if self.window_s < self.interval_s * 2.0 {
            e.push(format!(
                "window_s {} must cover at least two intervals ({})",
                self.window_s,
                self.interval_s * 2.0
            ));
        }
        if let Some(u) = &self.prometheus_url
            && !(u.starts_with("http://") || u.starts_with("https://"))
        {
            e.push(format!("prometheus_url {u:?} is not an http(s) URL"));
        }
        if self.prometheus_url.is_some() && self.window_s < self.prometheus_scrape_interval_s * 2.0
        {
            e.push(format!(
                "window_s {} must cover at least two Prometheus scrapes ({})",
                self.window_s,
                self.prometheus_scrape_interval_s * 2.0
            ));
        }
        // A simulation of a deployed config (`load_policies`) runs where its TLS files
        // are not.
        if sources && let Some(t) = &self.tls {
            for (n, p) in [
                ("tls.cert", Some(&t.cert)),
                ("tls.key", Some(&t.key)),
                ("tls.client_ca", t.client_ca.as_ref()),
            ] {
                if let Some(p) = p
                    && !p.is_file()
                {
                    e.push(format!("{n}: {} is not a readable file", p.display()));
                }
            }
        }
        if sources && let Some(p) = &self.state_file {
            let dir = match p.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => std::path::Path::new("."),
            };
            if p.file_name().is_none() || p.is_dir() {
                e.push(format!("state_file: {} is not a file name", p.display()));
            } else if !dir.is_dir() {
                e.push(format!(
                    "state_file: its directory {} does not exist",
                    dir.display()
                ));
            }
        }
        if self.kubernetes.namespace.is_empty() {
            e.push("kubernetes.namespace is empty".into());
        }
        let mut names = std::collections::HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                e.push(format!("models.{i}.name is empty"));
            }
            if !names.insert(&m.name) {
                e.push(format!("models.{i}.name {:?} appears twice", m.name));
            }
            if let Some(sb) = &m.standbys {
                if sb.agent_selector.trim().is_empty() {
                    e.push(format!("models.{i}.standbys.agent_selector is empty"));
                }
                if !(sb.retire_after_s.is_finite() && sb.retire_after_s >= 0.0) {
                    e.push(format!("models.{i}.standbys.retire_after_s must be >= 0"));
                }
            }
            for (pool, p) in [("prefill", &m.prefill), ("decode", &m.decode)] {
                let at = format!("models.{i}.{pool}");
                e.extend(p.policy.validate(&at));
                if !sources {
                    continue;
                }
                let (urls, prometheus): (&[String], bool) = match &p.source {
                    MetricsSource::Unset | MetricsSource::Pods { .. } => (&[], false),
                    MetricsSource::Endpoints(urls) => (urls, false),
                    MetricsSource::Prometheus { .. } => (&[], true),
                    MetricsSource::Conflicting {
                        endpoints,
                        selector,
                        prometheus_selector,
                    } => {
                        let named: Vec<&str> = [
                            (!endpoints.is_empty()).then_some("endpoints"),
                            selector.as_ref().map(|_| "selector"),
                            prometheus_selector.as_ref().map(|_| "prometheus_selector"),
                        ]
                        .into_iter()
                        .flatten()
                        .collect();
                        e.push(format!(
                            "{at}: endpoints, selector and prometheus_selector are alternatives; give one (it names {})",
                            named.join(", ")
                        ));
                        (endpoints, prometheus_selector.is_some())
                    }
                };
                if prometheus && self.prometheus_url.is_none() {
                    e.push(format!("{at}.prometheus_selector needs prometheus_url"));
                }
                for url in urls {
                    if !(url.starts_with("http://") || url.starts_with("https://")) {
                        e.push(format!(
                            "models.{i}.{pool}.endpoints: {url:?} is not an http(s) URL"
                        ));
                    }
                }
                if self.mode == Mode::Direct && p.deployment.is_none() {
                    e.push(format!("{at}.deployment is required in direct mode"));
                }
                if !p.metrics_path.starts_with('/') {
                    e.push(format!("{at}.metrics_path must start with /"));
                }
            }
            for url in &m.gateway {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    e.push(format!("models.{i}.gateway: {url:?} is not an http(s) URL"));
                }
            }
        }
        e
    }
}

#[cfg(test)]
mod tests;
