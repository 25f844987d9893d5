//! The agent's configuration: a YAML file, read raw, then validated with every problem
//! reported at once.
//!
//! ```yaml
//! dir: /var/lib/preheat/snapshots     # node-local NVMe
//! disk_budget: 200GiB
//! memory_budget: 64GiB                # page cache held for the hot set
//! mlock: false                        # pin the hot set (needs CAP_IPC_LOCK)
//! listen: 127.0.0.1:9400             # default; in Kubernetes the pod IP (--listen)
//! refresh_secs: 10
//! kernel_cache_dir: /var/lib/preheat/kernels
//! kubernetes: { node_name: node-1, api_url: null }   # omit to run without kube
//! stage: { concurrency: 4, piece_mib: 8 }
//! models:
//!   - { name: llama-1b, source: "https://models.example/llama-1b.phpack", hot: true }
//! advertise_host: 10.0.3.7               # where peers reach this node's standbys
//! standby_budget: 2                   # parked at once on this node, every pool's (default: no cap)
//! standbys:
//!   - { pool: decode, model: llama-1b, count: 1, base_port: 18100,
//!       command: [preheat, engine, decode, --model, "{model_path}", --host, 0.0.0.0,
//!                 --port, "{port}", --advertise, "http://{host}:{port}", --standby] }
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::fetch::Source;
use crate::stage::{StageOptions, validate_name};
use crate::{Error, Result};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    dir: Option<PathBuf>,
    disk_budget: Option<String>,
    memory_budget: Option<String>,
    #[serde(default)]
    mlock: bool,
    listen: Option<String>,
    advertise_host: Option<String>,
    refresh_secs: Option<f64>,
    kernel_cache_dir: Option<PathBuf>,
    kubernetes: Option<RawKube>,
    stage: Option<RawStage>,
    #[serde(default)]
    models: Vec<RawModel>,
    #[serde(default)]
    standbys: Vec<RawStandby>,
    standby_budget: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKube {
    node_name: Option<String>,
    api_url: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    concurrency: Option<usize>,
    piece_mib: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: String,
    /// A path or URL; or, with `source_env`, read from that environment variable (a
    /// Secret's key: a URL with credentials stays out of the ConfigMap).
    #[serde(default)]
    source: String,
    #[serde(default)]
    source_env: Option<String>,
    #[serde(default)]
    hot: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStandby {
    pool: String,
    model: String,
    count: u32,
    base_port: u16,
    command: Vec<String>,
    /// Seconds a promoted (serving) standby gets to finish its requests when the
    /// agent stops.
    #[serde(default = "default_drain_grace_s")]
    drain_grace_s: f64,
    /// Seconds between taking a promoted standby off the agent's `/standbys` list and
    /// asking it to drain: gateways read that list every half second, and must have
    /// stopped sending it requests before it stops taking them.
    #[serde(default = "default_unlist_delay_s")]
    unlist_delay_s: f64,
}

fn default_unlist_delay_s() -> f64 {
    // As long as a worker pod's preStop pause: every gateway has re-read the list.
    5.0
}

fn default_drain_grace_s() -> f64 {
    60.0
}

/// A model the agent keeps staged (and hot when asked).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub name: String,
    pub source: Source,
    pub hot: bool,
}

/// Parked standby replicas of one pool.
#[derive(Clone, Debug, PartialEq)]
pub struct StandbySpec {
    pub pool: String,
    pub model: String,
    pub count: u32,
    /// Standby `i` listens on `base_port + 2*i` (a prefill worker's KV port is the
    /// next one).
    pub base_port: u16,
    /// Program and arguments; `{model_path}`, `{port}` and `{host}` (the agent's
    /// `advertise_host`) are substituted.
    pub command: Vec<String>,
    /// How long a promoted standby may drain (SIGTERM → exit) when it is retired or the
    /// agent stops, before it is killed.
    pub drain_grace: Duration,
    /// From leaving the agent's serving list to the drain (see `unlist_delay_s`).
    pub unlist_delay: Duration,
}

/// Where the node labels go.
#[derive(Clone, Debug, PartialEq)]
pub struct KubeSpec {
    pub node_name: String,
    pub api_url: Option<String>,
}

/// The validated configuration.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub dir: PathBuf,
    pub disk_budget: u64,
    pub memory_budget: u64,
    pub mlock: bool,
    pub listen: SocketAddr,
    /// The address peers reach this node's standbys at (`{host}` in their commands);
    /// in Kubernetes the agent pod's IP.
    pub advertise_host: String,
    pub refresh: Duration,
    pub kernel_cache_dir: Option<PathBuf>,
    pub kubernetes: Option<KubeSpec>,
    pub stage: StageOptions,
    pub models: Vec<ModelSpec>,
    pub standbys: Vec<StandbySpec>,
    /// Standbys parked at once on this node across every pool (each holds what a
    /// worker holds: on a GPU node, a GPU). Where the pools' counts add up to more,
    /// the pools of the most recently wanted models park first. `None`: no cap.
    pub standby_budget: Option<u32>,
    /// The deployment's cluster token and the file it came from (not in the YAML: the
    /// `--cluster-token-file` flag or `$PREHEAT_CLUSTER_TOKEN_FILE`). The API asks for
    /// it; standbys are started with the file named in their environment.
    pub cluster_token: Option<(std::sync::Arc<preheat_edge::ClusterToken>, PathBuf)>,
}

/// `"200GiB"`, `"512MiB"`, `"1.5TB"`, `"4096"` → bytes.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 200GiB)"))?;
    let mult: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KiB" | "Ki" => 1024.0,
        "MiB" | "Mi" => 1024.0 * 1024.0,
        "GiB" | "Gi" => 1024.0 * 1024.0 * 1024.0,
        "TiB" | "Ti" => 1024.0f64.powi(4),
        "KB" | "K" => 1e3,
        "MB" | "M" => 1e6,
        "GB" | "G" => 1e9,
        "TB" | "T" => 1e12,
        u => return Err(format!("{s:?}: unknown unit {u:?}")),
    };
    let v = n * mult;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(v as u64)
}

impl Default for AgentConfig {
    /// What an empty config file means: the defaults of every setting, no models.
    fn default() -> Self {
        Self::from_raw(Raw::default(), None, &|_| None)
            .expect("every default setting is valid (tested)")
    }
}

impl AgentConfig {
    /// Parses and validates YAML; `node_name_env` stands for `$NODE_NAME` (the
    /// downward API) when the file names no node.
    pub fn from_yaml(text: &str, node_name_env: Option<String>) -> Result<Self> {
        Self::from_yaml_env(text, node_name_env, &|k| std::env::var(k).ok())
    }

    /// [`AgentConfig::from_yaml`] reading `source_env` variables through `env`.
    pub fn from_yaml_env(
        text: &str,
        node_name_env: Option<String>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let raw: Raw =
            preheat_edge::config_file::parse_yaml(text).map_err(|e| Error::Config(vec![e]))?;
        Self::from_raw(raw, node_name_env, env)
    }

    /// Validates what the YAML said (every problem at once).
    fn from_raw(
        raw: Raw,
        node_name_env: Option<String>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let mut errs = Vec::new();
        let mut size = |what: &str, v: Option<&String>, default: u64| match v {
            None => default,
            Some(s) => parse_size(s).unwrap_or_else(|e| {
                errs.push(format!("{what}: {e}"));
                0
            }),
        };
        let disk_budget = size("disk_budget", raw.disk_budget.as_ref(), 100 << 30);
        let memory_budget = size("memory_budget", raw.memory_budget.as_ref(), 16 << 30);
        // Loopback unless told: the API starts and retires serving replicas, so it is
        // not offered to every network the node is on (in Kubernetes: the pod IP).
        let listen = raw.listen.as_deref().unwrap_or("127.0.0.1:9400");
        let listen = listen.parse().unwrap_or_else(|_| {
            errs.push(format!("listen: {listen:?} is not host:port"));
            SocketAddr::from(([127, 0, 0, 1], 9400))
        });
        let advertise_host = raw.advertise_host.unwrap_or_else(|| "127.0.0.1".to_owned());
        if advertise_host.is_empty() || advertise_host.contains(['/', ' ', '@']) {
            errs.push(format!("advertise_host: {advertise_host:?} is not a host"));
        }
        let refresh = raw.refresh_secs.unwrap_or(10.0);
        if !(refresh.is_finite() && refresh > 0.0) {
            errs.push(format!("refresh_secs: {refresh} must be > 0"));
        }
        let mut stage = StageOptions::default();
        if let Some(s) = &raw.stage {
            if let Some(c) = s.concurrency {
                if c == 0 || c > 256 {
                    errs.push(format!("stage.concurrency: {c} must be in 1..=256"));
                }
                stage.concurrency = c.max(1);
            }
            if let Some(p) = s.piece_mib {
                if p == 0 || p > 1024 {
                    errs.push(format!("stage.piece_mib: {p} must be in 1..=1024"));
                }
                stage.piece_bytes = p.max(1) << 20;
            }
        }
        let kubernetes = raw.kubernetes.map(|k| {
            let node_name = k.node_name.or(node_name_env).unwrap_or_else(|| {
                errs.push("kubernetes.node_name: not set and $NODE_NAME is empty".into());
                String::new()
            });
            KubeSpec {
                node_name,
                api_url: k.api_url,
            }
        });
        let mut models = Vec::new();
        for (i, m) in raw.models.into_iter().enumerate() {
            if let Err(e) = validate_name(&m.name) {
                errs.push(format!("models[{i}]: {e}"));
            }
            if models.iter().any(|o: &ModelSpec| o.name == m.name) {
                errs.push(format!("models[{i}]: {:?} appears twice", m.name));
            }
            let source = match (&m.source_env, m.source.trim().is_empty()) {
                (Some(var), true) => match env(var) {
                    Some(v) if !v.trim().is_empty() => v,
                    _ => {
                        errs.push(format!(
                            "models[{i}].source_env: ${var} is not set (or empty)"
                        ));
                        String::new()
                    }
                },
                (Some(_), false) => {
                    errs.push(format!("models[{i}]: give source or source_env, not both"));
                    String::new()
                }
                (None, true) => {
                    errs.push(format!("models[{i}].source is empty"));
                    String::new()
                }
                (None, false) => m.source.clone(),
            };
            models.push(ModelSpec {
                name: m.name,
                source: Source::parse(&source),
                hot: m.hot,
            });
        }
        let mut standbys = Vec::new();
        for (i, s) in raw.standbys.into_iter().enumerate() {
            if !models.iter().any(|m| m.name == s.model) {
                errs.push(format!(
                    "standbys[{i}].model {:?} is not among models",
                    s.model
                ));
            }
            if s.command.is_empty() {
                errs.push(format!("standbys[{i}].command is empty"));
            }
            if u32::from(s.base_port) + 2 * s.count > u32::from(u16::MAX) {
                errs.push(format!("standbys[{i}]: ports past 65535"));
            }
            if !(s.drain_grace_s.is_finite() && s.drain_grace_s >= 0.0) {
                errs.push(format!("standbys[{i}].drain_grace_s must be >= 0"));
            }
            if !(s.unlist_delay_s.is_finite() && (0.0..=600.0).contains(&s.unlist_delay_s)) {
                errs.push(format!("standbys[{i}].unlist_delay_s must be in 0..=600"));
            }
            if standbys.iter().any(|o: &StandbySpec| o.pool == s.pool) {
                errs.push(format!("standbys[{i}]: pool {:?} appears twice", s.pool));
            }
            standbys.push(StandbySpec {
                pool: s.pool,
                model: s.model,
                count: s.count,
                base_port: s.base_port,
                command: s.command,
                drain_grace: Duration::from_secs_f64(s.drain_grace_s.clamp(0.0, 86_400.0)),
                unlist_delay: Duration::from_secs_f64(s.unlist_delay_s.clamp(0.0, 600.0)),
            });
        }
        if !errs.is_empty() {
            return Err(Error::Config(errs));
        }
        Ok(AgentConfig {
            dir: raw
                .dir
                .unwrap_or_else(|| PathBuf::from("/var/lib/preheat/snapshots")),
            disk_budget,
            memory_budget,
            mlock: raw.mlock,
            listen,
            advertise_host,
            refresh: Duration::from_secs_f64(refresh),
            kernel_cache_dir: raw.kernel_cache_dir,
            kubernetes,
            stage,
            models,
            standbys,
            standby_budget: raw.standby_budget,
            cluster_token: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_empty_file() {
        let d = AgentConfig::default();
        let e = AgentConfig::from_yaml("{}", None).unwrap();
        assert_eq!(
            (d.disk_budget, d.memory_budget, d.listen),
            (e.disk_budget, e.memory_budget, e.listen)
        );
        assert!(d.models.is_empty() && d.standbys.is_empty());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("200GiB"), Ok(200 << 30));
        assert_eq!(parse_size("1.5 GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
    }

    #[test]
    fn every_error_at_once() {
        let y = r#"
disk_budget: huge
listen: nowhere
refresh_secs: 0
kubernetes: {}
stage: { concurrency: 0 }
models:
  - { name: "a/b", source: "" }
  - { name: ok, source: /x.preheat }
  - { name: ok, source: /y.preheat }
standbys:
  - { pool: p, model: missing, count: 1, base_port: 65535, command: [] }
"#;
        let Err(Error::Config(errs)) = AgentConfig::from_yaml(y, None) else {
            panic!("must fail")
        };
        for needle in [
            "disk_budget",
            "listen",
            "refresh_secs",
            "node_name",
            "concurrency",
            "models[0]",
            "source is empty",
            "appears twice",
            "not among models",
            "command is empty",
            "ports past",
        ] {
            assert!(
                errs.iter().any(|e| e.contains(needle)),
                "{needle} missing from {errs:#?}"
            );
        }
    }

    #[test]
    fn a_good_file() {
        let y = "dir: /d\nkubernetes: {}\nmodels:\n  - { name: m, source: 'http://h/m.phpack', hot: true }\n";
        let c = AgentConfig::from_yaml(y, Some("node-7".into())).unwrap();
        assert_eq!(c.kubernetes.unwrap().node_name, "node-7");
        assert_eq!(c.models[0].source, Source::Http("http://h/m.phpack".into()));
        assert!(c.models[0].hot);
        assert!(AgentConfig::from_yaml("bogus_key: 1", None).is_err());
    }

    #[test]
    fn a_source_from_the_environment_stays_out_of_the_file() {
        let var = "PREHEAT_TEST_SOURCE_FROM_A_SECRET";
        let y = format!("dir: /d\nmodels:\n  - {{ name: m, source_env: {var} }}\n");
        let Err(Error::Config(errs)) = AgentConfig::from_yaml_env(&y, None, &|_| None) else {
            panic!("an unset variable must fail")
        };
        assert!(errs.iter().any(|e| e.contains(var)), "{errs:?}");
        let env = |k: &str| (k == var).then(|| "https://user:secret@h/m.phpack".to_owned());
        let c = AgentConfig::from_yaml_env(&y, None, &env).unwrap();
        assert_eq!(
            c.models[0].source,
            Source::Http("https://user:secret@h/m.phpack".into())
        );
        assert!(!format!("{:?}", c.models[0].source).contains("secret"));
        let both = format!("dir: /d\nmodels:\n  - {{ name: m, source: /x, source_env: {var} }}\n");
        assert!(AgentConfig::from_yaml_env(&both, None, &env).is_err());
    }
}
