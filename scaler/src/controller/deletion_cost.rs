//! Which pods a scale-down removes. A ReplicaSet that has more pods than it wants
//! removes the not-ready ones first, then those with the lowest
//! `controller.kubernetes.io/pod-deletion-cost`, then the newest. Left alone it would
//! remove the newest replica even when it is the busiest: its streams would drain for
//! as long as they run, holding a GPU the budget has given to another model. So just
//! before a pool shrinks, each ready pod is marked with its in-flight requests, and
//! the idlest goes first.
//!
//! Marked only when a scale-down is decided (Kubernetes asks not to update the
//! annotation at every metric change: each one is a pod update every watcher sees),
//! and only the pods whose mark changed.

use std::time::Duration;

use futures_util::future::join_all;

use super::actuate::{Acting, Actuator, Target};
use crate::kube::PodView;
use crate::signals::exposition::Reading;

/// One ready pod of a pool, as one tick saw it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PodLoad {
    pub name: String,
    /// Requests running and waiting on it.
    pub in_flight: f64,
    /// The deletion cost it carries now.
    pub cost: Option<i32>,
}

impl PodLoad {
    /// The ready pods of `view` whose scrape answered in `ok` (metrics URL, reading).
    /// A pod that did not answer is left out: its load is unknown, and a guess could
    /// send a busy pod first.
    pub fn of(view: &PodView, ok: &[(String, Reading)]) -> Vec<PodLoad> {
        view.ready
            .iter()
            .filter_map(|(name, url)| {
                let (_, r) = ok.iter().find(|(u, _)| u == url)?;
                Some(PodLoad {
                    name: name.clone(),
                    in_flight: r.running.unwrap_or(0.0) + r.waiting.unwrap_or(0.0),
                    cost: view.deletion_cost.get(name).copied().flatten(),
                })
            })
            .collect()
    }

    /// The cost this pod should carry: its in-flight requests.
    fn wanted(&self) -> i32 {
        // Saturating: a NaN or negative reading counts as idle, an absurd one as busiest.
        let n = self.in_flight.round();
        if n.is_nan() || n <= 0.0 {
            0
        } else if n >= f64::from(i32::MAX) {
            i32::MAX
        } else {
            n as i32
        }
    }
}

/// The pods whose mark must change, with the cost each should carry.
pub(crate) fn changes(pods: &[PodLoad]) -> Vec<(&str, i32)> {
    pods.iter()
        .filter(|p| p.cost != Some(p.wanted()))
        .map(|p| (p.name.as_str(), p.wanted()))
        .collect()
}

/// Marks a pool's pods before it shrinks.
pub(super) struct DeletionCost {
    pub client: kube::Client,
    pub namespace: String,
    /// Bound on the patches of one tick, all sent at once.
    pub timeout: Duration,
}

impl Actuator for DeletionCost {
    fn act<'a>(&'a mut self, t: &'a Target<'a>) -> Acting<'a> {
        Box::pin(async move {
            if t.replicas() >= t.current {
                return;
            }
            let marks = changes(t.pods);
            if marks.is_empty() {
                return;
            }
            let (client, namespace, timeout) = (&self.client, &self.namespace, self.timeout);
            let patches = marks.iter().map(|&(pod, cost)| async move {
                let set = crate::kube::set_deletion_cost(client.clone(), namespace, pod, cost);
                (pod, tokio::time::timeout(timeout, set).await)
            });
            for (pod, r) in join_all(patches).await {
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(pod, error = %e, "deletion cost not set"),
                    Err(_) => tracing::warn!(pod, "setting the deletion cost timed out"),
                }
            }
            tracing::info!(
                model = t.model,
                pool = t.pool.as_str(),
                replicas = t.replicas(),
                current = t.current,
                ?marks,
                "pods marked with their in-flight requests before a scale-down"
            );
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, in_flight: f64, cost: Option<i32>) -> PodLoad {
        PodLoad {
            name: name.into(),
            in_flight,
            cost,
        }
    }

    #[test]
    fn the_idlest_pod_gets_the_lowest_cost() {
        let pods = [
            pod("busy", 7.0, None),
            pod("idle", 0.0, None),
            pod("some", 2.4, None),
        ];
        let mut marks = changes(&pods);
        marks.sort_by_key(|&(_, c)| c);
        assert_eq!(marks, [("idle", 0), ("some", 2), ("busy", 7)]);
    }

    #[test]
    fn a_pod_already_marked_with_its_load_is_not_patched_again() {
        let pods = [pod("a", 3.0, Some(3)), pod("b", 1.0, Some(4))];
        assert_eq!(changes(&pods), [("b", 1)]);
    }

    #[test]
    fn odd_readings_saturate() {
        let pods = [
            pod("nan", f64::NAN, None),
            pod("neg", -2.0, None),
            pod("huge", 1e12, None),
        ];
        assert_eq!(changes(&pods), [("nan", 0), ("neg", 0), ("huge", i32::MAX)]);
    }

    #[test]
    fn a_pod_whose_scrape_failed_is_not_marked() {
        let mut view = PodView::default();
        for (name, url) in [("up", "http://a/metrics"), ("down", "http://b/metrics")] {
            view.ready.insert(name.into(), url.into());
            view.deletion_cost.insert(name.into(), Some(9));
        }
        let reading = Reading {
            running: Some(2.0),
            waiting: Some(1.0),
            ..Reading::default()
        };
        let loads = PodLoad::of(&view, &[("http://a/metrics".into(), reading)]);
        assert_eq!(loads, [pod("up", 3.0, Some(9))]);
    }
}
