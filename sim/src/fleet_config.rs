//! A fleet file (`FLEET.yaml`): the models a fleet serves, its nodes and what preheat
//! may use on each, and the hardware each step of a replica's start is timed on. The
//! key names are a contract with operators' files; every problem is reported at once,
//! naming its key.
//!
//! ```yaml
//! nodes: 8
//! gpus_per_node: 8
//! nvme_gb: 800          # per node, for staged snapshots
//! host_ram_gb: 512      # per node, for hot snapshots and host-parked standbys
//! max_gpus: 48          # the fleet's GPU budget (default: every GPU)
//! models:
//!   - {name: m00, params_b: 8, gpus_per_replica: 1}
//!   - {name: m05, params_b: 32, gpus_per_replica: 2, bytes_per_param: 1, priority: 1}
//! hardware: {object_store_gbps: 1.25}   # any of [`Hardware`]'s keys
//! ```

use std::path::Path;

use serde::Deserialize;

/// The speeds and fixed times a start is made of. Defaults: a 10 Gb/s link to the
/// object store, a datacenter NVMe drive, pinned PCIe 4 copies, and the start-up of
/// an engine with its kernel and graph caches restored or not.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Hardware {
    /// Object store → node, GB/s (10 Gb/s).
    pub object_store_gbps: f64,
    pub nvme_read_gbps: f64,
    /// Writing a fetched snapshot to NVMe, GB/s.
    pub nvme_write_gbps: f64,
    /// Host → GPU, pinned, GB/s per GPU (a replica on g GPUs uploads g shares at once).
    pub host_to_gpu_gbps: f64,
    /// A pod's start before the engine runs (scheduling, image present, container).
    pub pod_start_s: f64,
    /// The engine from weights on the GPU to serving, kernel and graph caches restored.
    pub engine_start_s: f64,
    /// The same without the caches (kernels compiled, graphs captured).
    pub engine_start_uncached_s: f64,
    /// Promotion of a standby parked on a GPU.
    pub gpu_standby_promote_s: f64,
    /// Promotion of a standby parked in host memory, besides its weights' upload.
    pub host_standby_promote_s: f64,
}

impl Default for Hardware {
    fn default() -> Self {
        Hardware {
            object_store_gbps: 1.25,
            nvme_read_gbps: 6.5,
            nvme_write_gbps: 3.0,
            host_to_gpu_gbps: 25.0,
            pod_start_s: 5.0,
            engine_start_s: 2.0,
            engine_start_uncached_s: 30.0,
            gpu_standby_promote_s: 0.2,
            host_standby_promote_s: 0.5,
        }
    }
}

/// One model of the fleet.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetModel {
    pub name: String,
    /// Billions of parameters.
    pub params_b: f64,
    pub gpus_per_replica: u32,
    /// Bytes per parameter of its weights (2: bf16).
    #[serde(default = "two")]
    pub bytes_per_param: f64,
    /// Ranks it under the GPU budget (higher first), as the scaler's `priority`.
    #[serde(default)]
    pub priority: i32,
    /// Its own time-to-first-token target, seconds (the run's otherwise).
    #[serde(default)]
    pub slo_ttft_s: Option<f64>,
    /// Its own inter-token target, seconds (the run's otherwise).
    #[serde(default)]
    pub slo_itl_s: Option<f64>,
}

fn two() -> f64 {
    2.0
}

impl FleetModel {
    /// Size of its weights, bytes.
    #[must_use]
    pub fn weight_bytes(&self) -> f64 {
        self.params_b * 1e9 * self.bytes_per_param
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFleet {
    models: Vec<FleetModel>,
    nodes: u32,
    gpus_per_node: u32,
    nvme_gb: f64,
    host_ram_gb: f64,
    #[serde(default)]
    max_gpus: Option<u32>,
    #[serde(default)]
    hardware: Hardware,
}

/// The most nodes a fleet file may name (node ids are 16-bit in the simulator).
pub const MAX_NODES: u32 = 10_000;

/// A fleet, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Fleet {
    pub models: Vec<FleetModel>,
    pub nodes: u32,
    pub gpus_per_node: u32,
    /// Per node, what preheat may use: NVMe for staged snapshots, bytes.
    pub nvme_bytes: f64,
    /// Per node, host RAM for hot snapshots and host-parked standbys, bytes.
    pub host_ram_bytes: f64,
    /// The fleet's GPU budget.
    pub max_gpus: u32,
    pub hardware: Hardware,
}

/// Where a replica starts from, warmest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// A standby parked on a GPU: promoted.
    GpuStandby,
    /// A standby parked in host memory (weights pinned, no GPU): uploaded, promoted.
    HostStandby,
    /// The snapshot in the node's page cache.
    Hot,
    /// The snapshot on the node's NVMe.
    Staged,
    /// Nothing on the node: fetched from the object store.
    Remote,
}

impl Tier {
    pub const ALL: [Tier; 5] = [
        Tier::GpuStandby,
        Tier::HostStandby,
        Tier::Hot,
        Tier::Staged,
        Tier::Remote,
    ];

    /// Its name in reports (`starts` keys).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::GpuStandby => "gpu_standby",
            Tier::HostStandby => "host_standby",
            Tier::Hot => "hot",
            Tier::Staged => "staged",
            Tier::Remote => "remote",
        }
    }
}

/// Seconds each move of a model's weights takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Steps {
    /// Object store → the node's NVMe (fetched and written).
    pub fetch_s: f64,
    /// NVMe → page cache.
    pub read_s: f64,
    /// Host memory → its GPUs.
    pub upload_s: f64,
}

/// A fleet file that cannot be used: every problem, each naming its key.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {}", problems.join("; "))]
pub struct FleetError {
    pub path: String,
    pub problems: Vec<String>,
}

impl Fleet {
    /// Reads and checks a fleet file.
    pub fn load(path: &Path) -> Result<Fleet, FleetError> {
        let text = std::fs::read_to_string(path).map_err(|e| FleetError {
            path: path.display().to_string(),
            problems: vec![e.to_string()],
        })?;
        Fleet::parse(&text, &path.display().to_string())
    }

    /// Parses and checks fleet YAML; `name` labels errors.
    pub fn parse(text: &str, name: &str) -> Result<Fleet, FleetError> {
        let fail = |problems: Vec<String>| FleetError {
            path: name.to_owned(),
            problems,
        };
        let raw: RawFleet =
            preheat_edge::config_file::parse_yaml(text).map_err(|e| fail(vec![e]))?;
        let mut e = Vec::new();
        let positive = |e: &mut Vec<String>, key: &str, v: f64| {
            if !(v.is_finite() && v > 0.0) {
                e.push(format!("{key}: {v} must be above 0"));
            }
        };
        let not_negative = |e: &mut Vec<String>, key: &str, v: f64| {
            if !(v.is_finite() && v >= 0.0) {
                e.push(format!("{key}: {v} must be 0 or more"));
            }
        };
        if raw.models.is_empty() {
            e.push("models: the fleet has no model".into());
        } else if raw.models.len() > crate::fleet_trace::MAX_MODELS {
            e.push(format!(
                "models: {} is more than the {} a fleet may hold",
                raw.models.len(),
                crate::fleet_trace::MAX_MODELS
            ));
        }
        if raw.nodes == 0 || raw.nodes > MAX_NODES {
            e.push(format!(
                "nodes: {} must be between 1 and {MAX_NODES}",
                raw.nodes
            ));
        }
        if raw.gpus_per_node == 0 {
            e.push("gpus_per_node: must be at least 1".into());
        }
        not_negative(&mut e, "nvme_gb", raw.nvme_gb);
        not_negative(&mut e, "host_ram_gb", raw.host_ram_gb);
        let all = raw.nodes.saturating_mul(raw.gpus_per_node);
        if let Some(m) = raw.max_gpus
            && (m == 0 || m > all)
        {
            e.push(format!(
                "max_gpus: {m} must be between 1 and the fleet's {all} GPUs"
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, m) in raw.models.iter().enumerate() {
            let key = |k: &str| format!("models[{i}].{k}");
            if m.name.is_empty() {
                e.push(format!("{}: empty", key("name")));
            } else if !seen.insert(m.name.as_str()) {
                e.push(format!("{}: {:?} is named twice", key("name"), m.name));
            }
            positive(&mut e, &key("params_b"), m.params_b);
            positive(&mut e, &key("bytes_per_param"), m.bytes_per_param);
            if m.gpus_per_replica == 0 || m.gpus_per_replica > raw.gpus_per_node {
                e.push(format!(
                    "{}: {} must be between 1 and gpus_per_node ({})",
                    key("gpus_per_replica"),
                    m.gpus_per_replica,
                    raw.gpus_per_node
                ));
            }
            for (k, v) in [("slo_ttft_s", m.slo_ttft_s), ("slo_itl_s", m.slo_itl_s)] {
                if let Some(v) = v {
                    positive(&mut e, &key(k), v);
                }
            }
        }
        let h = &raw.hardware;
        for (k, v) in [
            ("object_store_gbps", h.object_store_gbps),
            ("nvme_read_gbps", h.nvme_read_gbps),
            ("nvme_write_gbps", h.nvme_write_gbps),
            ("host_to_gpu_gbps", h.host_to_gpu_gbps),
        ] {
            positive(&mut e, &format!("hardware.{k}"), v);
        }
        for (k, v) in [
            ("pod_start_s", h.pod_start_s),
            ("engine_start_s", h.engine_start_s),
            ("engine_start_uncached_s", h.engine_start_uncached_s),
            ("gpu_standby_promote_s", h.gpu_standby_promote_s),
            ("host_standby_promote_s", h.host_standby_promote_s),
        ] {
            not_negative(&mut e, &format!("hardware.{k}"), v);
        }
        if !e.is_empty() {
            return Err(fail(e));
        }
        Ok(Fleet {
            max_gpus: raw.max_gpus.unwrap_or(all),
            models: raw.models,
            nodes: raw.nodes,
            gpus_per_node: raw.gpus_per_node,
            nvme_bytes: raw.nvme_gb * 1e9,
            host_ram_bytes: raw.host_ram_gb * 1e9,
            hardware: raw.hardware,
        })
    }

    /// The model named `name`, by index.
    #[must_use]
    pub fn model_index(&self, name: &str) -> Option<usize> {
        self.models.iter().position(|m| m.name == name)
    }

    /// The steps of moving `m`'s weights between tiers, on this fleet's hardware.
    #[must_use]
    pub fn steps(&self, m: &FleetModel) -> Steps {
        let h = &self.hardware;
        let gb = m.weight_bytes() / 1e9;
        Steps {
            fetch_s: gb / h.object_store_gbps + gb / h.nvme_write_gbps,
            read_s: gb / h.nvme_read_gbps,
            upload_s: gb / (h.host_to_gpu_gbps * f64::from(m.gpus_per_replica)),
        }
    }

    /// Seconds from deciding to start a replica of `m` to its serving, from `tier`: the
    /// sum of the tier's steps on this fleet's hardware. `caches`: kernel and graph
    /// caches restored.
    #[must_use]
    pub fn start_s(&self, m: &FleetModel, tier: Tier, caches: bool) -> f64 {
        let h = &self.hardware;
        let Steps {
            fetch_s: fetch,
            read_s: read,
            upload_s: upload,
        } = self.steps(m);
        let engine = if caches {
            h.engine_start_s
        } else {
            h.engine_start_uncached_s
        };
        let pod = h.pod_start_s;
        match tier {
            Tier::GpuStandby => h.gpu_standby_promote_s,
            Tier::HostStandby => upload + h.host_standby_promote_s,
            Tier::Hot => upload + pod + engine,
            Tier::Staged => read + upload + pod + engine,
            Tier::Remote => fetch + read + upload + pod + engine,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = "nodes: 2\ngpus_per_node: 4\nnvme_gb: 100\nhost_ram_gb: 64\n\
                         models:\n  - {name: a, params_b: 8, gpus_per_replica: 1}\n";

    #[test]
    fn the_shipped_example_reads() {
        let f = Fleet::load(&preheat_testkit_path("fleets/example.yaml")).unwrap();
        assert_eq!((f.models.len(), f.nodes, f.gpus_per_node), (12, 8, 8));
        assert_eq!(f.max_gpus, 64, "every GPU by default");
        assert_eq!(f.models[5].gpus_per_replica, 2);
        assert_eq!(f.hardware, Hardware::default());
    }

    /// `testdata/` from this crate (the testkit is a dev-dependency of the root only).
    fn preheat_testkit_path(rel: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata")
            .join(rel)
    }

    #[test]
    fn a_start_is_the_sum_of_its_tiers_steps() {
        let f = Fleet::parse(SMALL, "f").unwrap();
        // 8B at bf16: 16 GB.
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let upload = 16.0 / 25.0;
        let read = 16.0 / 6.5;
        let fetch = 16.0 / 1.25 + 16.0 / 3.0;
        assert!(close(f.start_s(&f.models[0], Tier::GpuStandby, true), 0.2));
        assert!(close(
            f.start_s(&f.models[0], Tier::HostStandby, true),
            upload + 0.5
        ));
        assert!(close(
            f.start_s(&f.models[0], Tier::Hot, true),
            upload + 5.0 + 2.0
        ));
        assert!(close(
            f.start_s(&f.models[0], Tier::Staged, true),
            read + upload + 7.0
        ));
        assert!(close(
            f.start_s(&f.models[0], Tier::Remote, false),
            fetch + read + upload + 5.0 + 30.0
        ));
        // Warmer is never slower.
        for w in Tier::ALL.windows(2) {
            assert!(
                f.start_s(&f.models[0], w[0], true) <= f.start_s(&f.models[0], w[1], true),
                "{w:?}"
            );
        }
    }

    #[test]
    fn a_replica_on_two_gpus_uploads_its_halves_at_once() {
        let text = SMALL.replace(
            "params_b: 8, gpus_per_replica: 1",
            "params_b: 32, gpus_per_replica: 2",
        );
        let f = Fleet::parse(&text, "f").unwrap();
        let upload = 64.0 / (25.0 * 2.0);
        assert!((f.start_s(&f.models[0], Tier::HostStandby, true) - (upload + 0.5)).abs() < 1e-9);
    }

    #[test]
    fn an_unknown_key_is_refused_naming_it() {
        let e = Fleet::parse(&SMALL.replace("params_b", "param_b"), "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("f.yaml: ") && e.contains("param_b"), "{e}");
        let e = Fleet::parse(&format!("{SMALL}hardware: {{nvme_gbps: 3}}\n"), "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("nvme_gbps"), "{e}");
    }

    #[test]
    fn every_bad_value_is_named_at_once() {
        let text = "nodes: 0\ngpus_per_node: 4\nnvme_gb: -1\nhost_ram_gb: 64\nmax_gpus: 99\n\
                    hardware: {host_to_gpu_gbps: 0}\n\
                    models:\n  - {name: a, params_b: 0, gpus_per_replica: 5}\n  - {name: a, params_b: 1, gpus_per_replica: 1}\n";
        let e = Fleet::parse(text, "f").unwrap_err();
        let all = e.problems.join("\n");
        for key in [
            "nodes",
            "nvme_gb",
            "max_gpus",
            "hardware.host_to_gpu_gbps",
            "models[0].params_b",
            "models[0].gpus_per_replica",
            "models[1].name",
        ] {
            assert!(
                e.problems.iter().any(|p| p.starts_with(&format!("{key}:"))),
                "{key} in {all}"
            );
        }
    }

    #[test]
    fn a_fleet_past_the_bounds_is_refused_naming_the_key() {
        let list: String = (0..=crate::fleet_trace::MAX_MODELS)
            .map(|i| format!("  - {{name: m{i}, params_b: 8, gpus_per_replica: 1}}\n"))
            .collect();
        let text =
            format!("nodes: 20000\ngpus_per_node: 4\nnvme_gb: 1\nhost_ram_gb: 1\nmodels:\n{list}");
        let e = Fleet::parse(&text, "f").unwrap_err();
        for key in ["nodes:", "models:"] {
            assert!(
                e.problems.iter().any(|p| p.starts_with(key)),
                "{key} in {:?}",
                e.problems
            );
        }
    }
}
