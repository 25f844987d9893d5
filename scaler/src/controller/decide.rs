//! The middle stage of a tick, with no I/O: what a pool's policy decides from what was
//! seen, and the status published for it (`/status`, the scaler's `/metrics`).

use super::PoolLoop;
use super::observe::PoolSeen;
use crate::decisions::{PoolStatus, SloView};
use crate::policy::{Decision, Observation};
use crate::scrape::FailureLog;

/// What a pool's tick decided and what it publishes.
#[derive(Debug)]
pub(super) struct Outcome {
    /// `None`: the pool's replicas are unknown, so nothing is decided (KEDA is told the
    /// pool is not decided yet, and HPA keeps its size).
    pub decision: Option<Decision>,
    pub status: PoolStatus,
}

/// Runs `p`'s policy on what the tick saw (`held`: requests the gateways hold).
pub(super) fn decide(model: &str, p: &mut PoolLoop, seen: PoolSeen, held: f64, t: f64) -> Outcome {
    let PoolSeen {
        signals,
        current,
        startup,
        ready_pods,
        ..
    } = seen;
    let slo = SloView::of(&signals, p.policy.cfg.slo_ttft_s, p.policy.cfg.slo_itl_s);
    let Some(current) = current else {
        // Acting on a guess could shrink a serving pool.
        if !p.unknown_logged {
            tracing::warn!(
                model,
                pool = p.pool.as_str(),
                "the pool's replica count is unknown (no signals, no readable Deployment): not deciding"
            );
            p.unknown_logged = true;
        }
        return Outcome {
            decision: None,
            status: PoolStatus {
                endpoints_failed: signals.endpoints_failed,
                blind: true,
                reason: "replicas unknown: not deciding",
                failing: failing_urls(&p.failures),
                slo,
                ..PoolStatus::default()
            },
        };
    };
    p.last_current = Some(current);
    p.unknown_logged = false;
    let (endpoints_ok, endpoints_failed, blind) = (
        signals.endpoints_ok,
        signals.endpoints_failed,
        signals.is_blind(),
    );
    let obs = Observation {
        current,
        held_requests: held,
        measured_startup_s: startup,
        mean_prompt_len: signals.mean_prompt_len(),
        signals,
        unix_time: super::unix_now(),
        ..Observation::default()
    };
    let d = p.policy.decide(t, &obs);
    tracing::debug!(
        model,
        pool = p.pool.as_str(),
        current,
        desired = d.desired,
        active = d.active,
        reason = d.reason,
        "decision"
    );
    let status = PoolStatus {
        current,
        // Without pods to ask, serving is what answered (standbys included).
        ready: ready_pods.unwrap_or(u32::try_from(endpoints_ok).unwrap_or(u32::MAX)),
        endpoints_ok,
        endpoints_failed,
        blind,
        reason: d.reason,
        failing: failing_urls(&p.failures),
        slo,
        load: p.policy.last_load(),
        // What the policy wants; the fleet's budget may grant less.
        wanted: Some(d.desired),
    };
    Outcome {
        decision: Some(d),
        status,
    }
}

/// The URLs of the endpoints failing now, sorted, without any user:password part.
fn failing_urls(f: &FailureLog) -> Vec<String> {
    let mut v: Vec<String> = f.failing().keys().map(|u| without_userinfo(u)).collect();
    v.sort();
    v
}

/// `scheme://user:pass@host/…` → `scheme://host/…`: credentials never leave in a status.
fn without_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let host_end = rest.find('/').unwrap_or(rest.len());
    match rest[..host_end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_endpoints_are_shown_without_credentials() {
        assert_eq!(
            without_userinfo("http://user:secret@10.0.0.7:8000/metrics"),
            "http://10.0.0.7:8000/metrics"
        );
        assert_eq!(
            without_userinfo("http://10.0.0.7:8000/a@b"),
            "http://10.0.0.7:8000/a@b"
        );
        assert_eq!(without_userinfo("10.0.0.7:8000"), "10.0.0.7:8000");
    }
}
