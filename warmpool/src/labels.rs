//! Node labels `preheat.dev/<model>=staged|hot`, so engine pods can prefer nodes where
//! their snapshot is already on disk or in memory (node affinity). Only labels under
//! `preheat.dev/` are touched; stale ones are removed.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};

use crate::{Error, Result};

pub const PREFIX: &str = "preheat.dev/";

/// Where a model stands on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ModelState {
    Staged,
    Hot,
}

impl ModelState {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ModelState::Staged => "staged",
            ModelState::Hot => "hot",
        }
    }
}

/// The labels `models` call for.
#[must_use]
pub fn desired(models: &BTreeMap<String, ModelState>) -> BTreeMap<String, String> {
    models
        .iter()
        .map(|(m, s)| (format!("{PREFIX}{m}"), s.as_str().to_owned()))
        .collect()
}

/// The JSON merge patch that turns the node's `current` labels into `want` for keys
/// under [`PREFIX`]; `None` when nothing changes.
#[must_use]
pub fn patch(
    current: &BTreeMap<String, String>,
    want: &BTreeMap<String, String>,
) -> Option<serde_json::Value> {
    let mut labels = serde_json::Map::new();
    for (k, v) in want {
        if current.get(k) != Some(v) {
            labels.insert(k.clone(), serde_json::Value::String(v.clone()));
        }
    }
    for k in current.keys() {
        if k.starts_with(PREFIX) && !want.contains_key(k) {
            labels.insert(k.clone(), serde_json::Value::Null);
        }
    }
    (!labels.is_empty()).then(|| serde_json::json!({"metadata": {"labels": labels}}))
}

/// Labels one node. Needs `get` and `patch` on `nodes` (cluster-scoped).
#[derive(Clone)]
pub struct NodeLabeler {
    api: Api<Node>,
    node: String,
}

impl std::fmt::Debug for NodeLabeler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeLabeler")
            .field("node", &self.node)
            .finish()
    }
}

impl NodeLabeler {
    /// A labeler for `node`, talking to `api_url` or, without one, the in-cluster /
    /// kubeconfig API server.
    pub async fn new(node: String, api_url: Option<&str>) -> Result<Self> {
        let client = match api_url {
            Some(u) => {
                let url = u
                    .parse()
                    .map_err(|e| Error::Kube(format!("api_url {u:?}: {e}")))?;
                kube::Client::try_from(kube::Config::new(url))
            }
            None => {
                let c = kube::Config::infer()
                    .await
                    .map_err(|e| Error::Kube(e.to_string()))?;
                kube::Client::try_from(c)
            }
        }
        .map_err(|e| Error::Kube(e.to_string()))?;
        Ok(NodeLabeler {
            api: Api::all(client),
            node,
        })
    }

    /// Brings the node's `preheat.dev/*` labels to `models`. Returns whether a patch
    /// was sent.
    pub async fn apply(&self, models: &BTreeMap<String, ModelState>) -> Result<bool> {
        let node = self
            .api
            .get(&self.node)
            .await
            .map_err(|e| Error::Kube(format!("get node {}: {e}", self.node)))?;
        let current = node.metadata.labels.unwrap_or_default();
        let Some(p) = patch(&current, &desired(models)) else {
            return Ok(false);
        };
        self.api
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&p))
            .await
            .map_err(|e| Error::Kube(format!("patch node {}: {e}", self.node)))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_adds_changes_and_removes_only_ours() {
        let current: BTreeMap<String, String> = [
            ("kubernetes.io/hostname", "n1"),
            ("preheat.dev/old", "hot"),
            ("preheat.dev/a", "staged"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let models: BTreeMap<String, ModelState> = [
            ("a".to_owned(), ModelState::Hot),
            ("b".to_owned(), ModelState::Staged),
        ]
        .into();
        let p = patch(&current, &desired(&models)).unwrap();
        assert_eq!(
            p,
            serde_json::json!({"metadata": {"labels": {
                "preheat.dev/a": "hot", "preheat.dev/b": "staged", "preheat.dev/old": null
            }}})
        );
        let after: BTreeMap<String, String> = [
            ("kubernetes.io/hostname", "n1"),
            ("preheat.dev/a", "hot"),
            ("preheat.dev/b", "staged"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(patch(&after, &desired(&models)), None);
    }
}
