//! Scaler configuration: a YAML file, every value of which can be overridden from the
//! command line with `--set path=value` (e.g. `--set models.0.decode.max_replicas=8`).
//! Parsing and validation report every problem at once.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_yaml::Value;

use crate::policy::PoolPolicy;
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
    pub models: Vec<ModelConfig>,
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
    pub prefill: PoolConfig,
    pub decode: PoolConfig,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Static `/metrics` URLs of this pool's replicas.
    #[serde(default)]
    pub endpoints: Vec<String>,
    #[serde(flatten)]
    pub policy: PoolPolicy,
}

/// Applies one `path=value` override to a YAML tree; `path` is dot-separated, with
/// numbers indexing lists. The value is parsed as YAML (`8`, `true`, `[a, b]`).
fn apply_override(root: &mut Value, spec: &str) -> std::result::Result<(), String> {
    let (path, raw) = spec
        .split_once('=')
        .ok_or_else(|| format!("--set {spec:?}: expected path=value"))?;
    let value: Value = serde_yaml::from_str(raw).map_err(|e| format!("--set {path}: {e}"))?;
    let mut cur = root;
    let parts: Vec<&str> = path.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        if cur.is_null() {
            *cur = Value::Mapping(Default::default());
        }
        cur = match cur {
            Value::Sequence(seq) => {
                let idx: usize = part
                    .parse()
                    .map_err(|_| format!("--set {path}: {part:?} is not a list index"))?;
                seq.get_mut(idx)
                    .ok_or_else(|| format!("--set {path}: index {idx} out of range"))?
            }
            Value::Mapping(map) => {
                let key = Value::String((*part).to_owned());
                if !map.contains_key(&key) {
                    map.insert(key.clone(), Value::Null);
                }
                map.get_mut(&key).expect("inserted above")
            }
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
        let mut errs = Vec::new();
        let mut tree: Value = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| ScalerError::Config(vec![format!("{}: {e}", p.display())]))?;
                serde_yaml::from_str(&text)
                    .map_err(|e| ScalerError::Config(vec![format!("{}: {e}", p.display())]))?
            }
            None => Value::Mapping(Default::default()),
        };
        if tree.is_null() {
            tree = Value::Mapping(Default::default());
        }
        for o in overrides {
            if let Err(e) = apply_override(&mut tree, o) {
                errs.push(e);
            }
        }
        let cfg: Config = match serde_yaml::from_value(tree) {
            Ok(c) => c,
            Err(e) => {
                errs.push(e.to_string());
                return Err(ScalerError::Config(errs));
            }
        };
        errs.extend(cfg.problems());
        if errs.is_empty() {
            Ok(cfg)
        } else {
            Err(ScalerError::Config(errs))
        }
    }

    /// Every semantic problem of a parsed config.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut e = Vec::new();
        if self.models.is_empty() {
            e.push("models: at least one model is required".into());
        }
        for (n, v) in [
            ("interval_s", self.interval_s),
            ("window_s", self.window_s),
            ("scrape_timeout_s", self.scrape_timeout_s),
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
        let mut names = std::collections::HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                e.push(format!("models.{i}.name is empty"));
            }
            if !names.insert(&m.name) {
                e.push(format!("models.{i}.name {:?} appears twice", m.name));
            }
            for (pool, p) in [("prefill", &m.prefill), ("decode", &m.decode)] {
                e.extend(p.policy.validate(&format!("models.{i}.{pool}")));
                for url in &p.endpoints {
                    if !(url.starts_with("http://") || url.starts_with("https://")) {
                        e.push(format!(
                            "models.{i}.{pool}.endpoints: {url:?} is not an http(s) URL"
                        ));
                    }
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
mod tests {
    use super::*;

    const YAML: &str = r#"
interval_s: 2
models:
  - name: llama
    gateway: [http://gw:8000/metrics]
    prefill:
      endpoints: [http://p0:8000/metrics]
      slo_ttft_s: 1.5
    decode:
      endpoints: [http://d0:8000/metrics, http://d1:8000/metrics]
      max_replicas: 16
"#;

    fn load(yaml: &str, sets: &[&str]) -> Result<Config> {
        let dir = std::env::temp_dir().join(format!(
            "preheat-cfg-{}-{}",
            std::process::id(),
            yaml.len() + sets.len()
        ));
        std::fs::write(&dir, yaml).unwrap();
        let r = Config::load(
            Some(&dir),
            &sets.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
        );
        let _ = std::fs::remove_file(&dir);
        r
    }

    #[test]
    fn file_and_overrides() {
        let c = load(
            YAML,
            &[
                "models.0.decode.max_replicas=8",
                "window_s=90",
                "grpc_listen=127.0.0.1:7000",
            ],
        )
        .unwrap();
        assert_eq!(c.interval_s, 2.0);
        assert_eq!(c.window_s, 90.0);
        assert_eq!(c.models[0].decode.policy.max_replicas, 8);
        assert_eq!(c.models[0].prefill.policy.slo_ttft_s, 1.5);
        assert_eq!(c.models[0].decode.endpoints.len(), 2);
        assert_eq!(c.grpc_listen.port(), 7000);
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let bad = load(
            YAML,
            &[
                "models.0.decode.min_replicas=20",
                "models.0.prefill.slo_ttft_s=-1",
                "models.0.prefill.endpoints=[p0:8000]",
                "models.5.x=1",
                "interval_s=0",
            ],
        )
        .unwrap_err();
        let ScalerError::Config(errs) = bad else {
            panic!()
        };
        let all = errs.join("\n");
        for needle in [
            "min_replicas 20 > max_replicas 16",
            "slo_ttft_s",
            "not an http",
            "index 5",
            "interval_s",
        ] {
            assert!(all.contains(needle), "{needle} missing from:\n{all}");
        }
    }

    #[test]
    fn unknown_keys_are_errors() {
        let e = load("models: []\nintreval_s: 3\n", &[]).unwrap_err();
        assert!(e.to_string().contains("intreval_s"), "{e}");
    }
}
