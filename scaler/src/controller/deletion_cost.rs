//! Which pods a scale-down removes. A ReplicaSet that has more pods than it wants
//! removes the not-ready ones first, then those with the lowest
//! `controller.kubernetes.io/pod-deletion-cost`, then the newest. Left alone it would
//! remove the newest replica even when it is the busiest: its streams would drain for
//! as long as they run, holding a GPU the budget has given to another model. So when a
//! pool is to lose ready pods, each ready pod is marked with its in-flight requests, and
//! the idlest goes first.
//!
//! Kubernetes asks not to update the annotation at every metric change (each one is a
//! pod update every watcher sees): pods are marked when a scale-down is decided, again
//! only if the target changes or [`REMARK_EVERY`] has passed while it is still pending
//! (KEDA's HPA removes one pod per 30 s), and only the pods whose mark changed. Not for
//! a pool going to zero (every pod goes) nor one losing only pods that are not ready
//! (the ReplicaSet takes those first).

use std::time::{Duration, Instant};

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
    /// The ready pods of `view`, their loads read from `ok` (metrics URL, reading).
    pub fn of(view: &PodView, ok: &[(String, Reading)]) -> Vec<PodLoad> {
        view.ready
            .iter()
            .map(|(name, url)| {
                // A pod whose scrape failed counts as the busiest: its load is
                // unknown, and a guess could send a busy pod first.
                let in_flight = ok
                    .iter()
                    .find(|(u, _)| u == url)
                    .map_or(f64::INFINITY, |(_, r)| {
                        r.running.unwrap_or(0.0) + r.waiting.unwrap_or(0.0)
                    });
                PodLoad {
                    name: name.clone(),
                    in_flight,
                    cost: view.deletion_cost.get(name).copied().flatten(),
                }
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

/// How often the marks of a pending scale-down are brought up to date.
pub(crate) const REMARK_EVERY: Duration = Duration::from_secs(30);

/// Whether a pool going to `replicas` with `ready` ready pods loses ready pods it should
/// choose among, and whether its marks are due given the last marking (target, when).
pub(crate) fn due(replicas: u32, ready: u32, last: Option<(u32, Instant)>, now: Instant) -> bool {
    let choosing = replicas > 0 && replicas < ready;
    choosing
        && last.is_none_or(|(target, at)| {
            target != replicas || now.saturating_duration_since(at) >= REMARK_EVERY
        })
}

/// Marks a pool's pods before it shrinks.
pub(super) struct DeletionCost {
    pub client: kube::Client,
    pub namespace: String,
    /// Bound on the patches of one tick, all sent at once.
    pub timeout: Duration,
    /// The target last marked for, and when.
    pub last: Option<(u32, Instant)>,
}

impl Actuator for DeletionCost {
    fn act<'a>(&'a mut self, t: &'a Target<'a>) -> Acting<'a> {
        Box::pin(async move {
            let now = Instant::now();
            if !due(t.replicas(), t.ready, self.last, now) {
                if t.replicas() >= t.ready {
                    self.last = None;
                }
                return;
            }
            self.last = Some((t.replicas(), now));
            let marks = changes(t.pods);
            if marks.is_empty() {
                return;
            }
            let (client, namespace, timeout) = (&self.client, &self.namespace, self.timeout);
            let patches = marks.iter().map(|&(pod, cost)| async move {
                let set = crate::kube::set_deletion_cost(client.clone(), namespace, pod, cost);
                (pod, tokio::time::timeout(timeout, set).await)
            });
            let mut marked = Vec::new();
            for ((pod, r), &(_, cost)) in join_all(patches).await.into_iter().zip(&marks) {
                match r {
                    Ok(Ok(())) => marked.push((pod, cost)),
                    Ok(Err(e)) => tracing::warn!(pod, error = %e, "deletion cost not set"),
                    Err(_) => tracing::warn!(pod, "setting the deletion cost timed out"),
                }
            }
            if !marked.is_empty() {
                tracing::info!(
                    model = t.model,
                    pool = t.pool.as_str(),
                    replicas = t.replicas(),
                    ready = t.ready,
                    ?marked,
                    "pods marked with their in-flight requests before a scale-down"
                );
            }
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
    fn marks_are_due_when_ready_pods_must_be_chosen_among_and_not_every_tick() {
        let t0 = Instant::now();
        let later = |s: u64| t0 + Duration::from_secs(s);
        // Losing ready pods: due at once.
        assert!(due(2, 3, None, t0));
        // Not when nothing shrinks, when every pod goes, or when only starting pods go.
        assert!(!due(3, 3, None, t0));
        assert!(!due(0, 3, None, t0));
        assert!(!due(3, 2, None, t0));
        // Marked for this target: not again until REMARK_EVERY, or the target changes.
        assert!(!due(2, 3, Some((2, t0)), later(5)));
        assert!(due(2, 3, Some((2, t0)), later(30)));
        assert!(due(1, 3, Some((2, t0)), later(5)));
    }

    #[test]
    fn a_pod_whose_scrape_failed_counts_as_the_busiest() {
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
        assert_eq!(
            loads,
            [pod("down", f64::INFINITY, Some(9)), pod("up", 3.0, Some(9))]
        );
        assert_eq!(changes(&loads), [("down", i32::MAX), ("up", 3)]);
    }
}
