//! Parked standbys bridge a pool's start-up. A new pod of a large model takes minutes;
//! the warm-pool agents keep standby replicas parked (loaded, not serving) that serve
//! within a second of a promote call. When a pool wants more replicas than it has
//! Ready, the scaler promotes parked standbys for the difference; once the pool's own
//! Ready replicas have covered what it wants for `retire_after_s`, it retires them
//! (each is unlisted, then drains). While they serve, their metrics count with the
//! pool's, so the load they carry keeps the pool awake and sized.
//!
//! The agents are found by a pod selector and read over their API (`GET /standbys`,
//! `POST /standbys/{pool}/promote|retire`); [`plan`] is the whole decision, pure.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where the agents are and how long the pool's own replicas must have caught up
/// before standbys are retired.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandbyConfig {
    /// Label selector of the warm-pool agent pods.
    pub agent_selector: String,
    /// Port of an agent's API.
    #[serde(default = "default_agent_port")]
    pub agent_port: u16,
    /// Seconds the pool's Ready replicas (with the standbys) must exceed what it wants
    /// before a standby is retired: a pod that just turned Ready may still be warming,
    /// and load may come back.
    #[serde(default = "default_retire_after_s")]
    pub retire_after_s: f64,
    /// The agents' names of this model's pools (their `standbys[].pool`).
    #[serde(default = "default_prefill_pool")]
    pub prefill_pool: String,
    #[serde(default = "default_decode_pool")]
    pub decode_pool: String,
}

fn default_prefill_pool() -> String {
    "prefill".into()
}

fn default_decode_pool() -> String {
    "decode".into()
}

impl StandbyConfig {
    /// The agents' name of `pool`.
    #[must_use]
    pub fn agent_pool(&self, pool: crate::policy::Pool) -> &str {
        match pool {
            crate::policy::Pool::Prefill => &self.prefill_pool,
            crate::policy::Pool::Decode => &self.decode_pool,
        }
    }
}

fn default_agent_port() -> u16 {
    9400
}

fn default_retire_after_s() -> f64 {
    30.0
}

/// One agent's standbys of one pool, as its `GET /standbys` lists them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct AgentPool {
    /// Parked and ready to promote.
    #[serde(default)]
    pub parked: u32,
    /// Ports of the promoted standbys serving now.
    #[serde(default)]
    pub serving: Vec<u16>,
}

/// What to do at one agent (by its base URL).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Promote(String),
    Retire(String),
}

/// The steps that bring `ready` pool replicas plus serving standbys to `want`:
/// promotions for a shortfall (spread over the agents with the most parked), and, when
/// `retire_due` (the surplus has lasted), retirements of standbys the pool no longer
/// needs (from the agents with the most serving).
#[must_use]
pub fn plan(want: u32, ready: u32, agents: &[(String, AgentPool)], retire_due: bool) -> Vec<Step> {
    let serving: u32 = agents
        .iter()
        .map(|(_, a)| u32::try_from(a.serving.len()).unwrap_or(u32::MAX))
        .sum();
    let have = ready.saturating_add(serving);
    if want > have {
        let parked = agents.iter().map(|(u, a)| (u.as_str(), a.parked as usize));
        spread(parked, (want - have) as usize)
            .into_iter()
            .map(Step::Promote)
            .collect()
    } else if retire_due && have > want && serving > 0 {
        let serving_at = agents.iter().map(|(u, a)| (u.as_str(), a.serving.len()));
        spread(serving_at, (have - want).min(serving) as usize)
            .into_iter()
            .map(Step::Retire)
            .collect()
    } else {
        Vec::new()
    }
}

/// Up to `n` agents, one at a time from the one with the most left (`counts`), ties to
/// the first: steps spread over agents instead of piling onto one.
fn spread<'a>(counts: impl Iterator<Item = (&'a str, usize)>, n: usize) -> Vec<String> {
    let mut left: Vec<(&str, usize)> = counts.collect();
    let mut out = Vec::new();
    for _ in 0..n {
        let Some(best) = left
            .iter_mut()
            .filter(|(_, k)| *k > 0)
            .min_by_key(|(_, k)| std::cmp::Reverse(*k))
        else {
            break;
        };
        best.1 -= 1;
        out.push(best.0.to_owned());
    }
    out
}

/// Whether standbys may be retired now: the pool has had more than it wants, with
/// standbys serving, for `after`. `since` is when that started (kept by the caller).
pub fn retire_due(surplus: bool, since: &mut Option<std::time::Instant>, after: Duration) -> bool {
    if !surplus {
        *since = None;
        return false;
    }
    since.get_or_insert_with(std::time::Instant::now).elapsed() >= after
}

/// Most serving standbys taken from one agent's list for one pool.
const MAX_SERVING_PER_AGENT: usize = 64;

/// Most bytes read from an agent's `/standbys`.
const MAX_AGENT_BYTES: usize = 64 << 10;

/// Reads each agent's standbys, by agent base URL; agents that do not answer are
/// left out (nothing is promoted on or retired from an agent that cannot be read).
pub async fn read_agents(
    client: &reqwest::Client,
    agents: &[String],
    timeout: Duration,
) -> Vec<(String, BTreeMap<String, AgentPool>)> {
    let reads = agents.iter().map(|base| async move {
        let r = client
            .get(format!("{base}/standbys"))
            .timeout(timeout)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| e.to_string());
        let pools = match r {
            Ok(r) => crate::scrape::read_limited(r, MAX_AGENT_BYTES)
                .await
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string())),
            Err(e) => Err(e),
        };
        match pools {
            Ok(p) => Some((base.clone(), p)),
            Err(e) => {
                tracing::debug!(agent = %base, error = %e, "agent standbys unread");
                None
            }
        }
    });
    futures_util::future::join_all(reads)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Carries out `steps` for `pool`; failures are logged (the next tick plans again).
pub async fn apply(client: &reqwest::Client, pool: &str, steps: &[Step], timeout: Duration) {
    for step in steps {
        let (agent, verb) = match step {
            Step::Promote(a) => (a, "promote"),
            Step::Retire(a) => (a, "retire"),
        };
        let r = client
            .post(format!("{agent}/standbys/{pool}/{verb}"))
            .timeout(timeout)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status);
        match r {
            Ok(_) => tracing::info!(pool, agent = %agent, verb, "standby"),
            Err(e) => tracing::warn!(pool, agent = %agent, verb, error = %e, "standby step failed"),
        }
    }
}

/// `http://host:port<path>` of each serving standby of `pool`, at its agent's host
/// (an agent names ports of its own pod, nothing else; at most 64 per pool).
#[must_use]
pub fn serving_urls(
    agents: &[(String, BTreeMap<String, AgentPool>)],
    pool: &str,
    path: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    for (base, pools) in agents {
        let Some(host) = base
            .strip_prefix("http://")
            .and_then(|h| h.rsplit_once(':'))
            .map(|(h, _)| h)
        else {
            continue;
        };
        let mut ports: Vec<u16> = pools
            .get(pool)
            .map(|p| p.serving.clone())
            .unwrap_or_default();
        ports.sort_unstable();
        ports.dedup();
        for port in ports.iter().take(MAX_SERVING_PER_AGENT) {
            out.push(format!("http://{host}:{port}{path}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(url: &str, parked: u32, serving: &[u16]) -> (String, AgentPool) {
        (
            url.to_owned(),
            AgentPool {
                parked,
                serving: serving.to_vec(),
            },
        )
    }

    #[test]
    fn a_shortfall_is_promoted_across_agents_with_parked_standbys() {
        let agents = [agent("a", 1, &[]), agent("b", 2, &[]), agent("c", 0, &[])];
        assert_eq!(
            plan(3, 0, &agents, false),
            [
                Step::Promote("b".into()),
                Step::Promote("a".into()),
                Step::Promote("b".into())
            ]
        );
        // No more than are parked.
        assert_eq!(plan(9, 0, &agents, false).len(), 3);
        // Standbys already serving count.
        let agents = [agent("a", 1, &[18000]), agent("b", 1, &[])];
        assert_eq!(plan(2, 1, &agents, false), []);
        assert_eq!(plan(3, 1, &agents, false).len(), 1);
    }

    #[test]
    fn standbys_retire_only_once_the_surplus_has_lasted() {
        let agents = [agent("a", 1, &[18000]), agent("b", 1, &[18000, 18002])];
        // Pods caught up: 2 Ready + 3 standbys for 2 wanted.
        assert_eq!(plan(2, 2, &agents, false), []);
        assert_eq!(
            plan(2, 2, &agents, true),
            [
                Step::Retire("b".into()),
                Step::Retire("a".into()),
                Step::Retire("b".into())
            ]
        );
        // Partly caught up: only the surplus goes.
        assert_eq!(plan(3, 1, &agents, true), [Step::Retire("b".into())]);
        // To zero: every standby goes, pods are the Deployment's business.
        assert_eq!(plan(0, 0, &agents, true).len(), 3);
    }

    #[test]
    fn retire_due_needs_a_continuous_surplus() {
        let mut since = None;
        assert!(!retire_due(true, &mut since, Duration::from_millis(50)));
        std::thread::sleep(Duration::from_millis(60));
        assert!(retire_due(true, &mut since, Duration::from_millis(50)));
        assert!(!retire_due(false, &mut since, Duration::from_millis(50)));
        assert!(since.is_none());
        assert!(!retire_due(true, &mut since, Duration::from_millis(50)));
    }

    #[test]
    fn serving_urls_are_at_the_agents_host() {
        let mut pools = BTreeMap::new();
        pools.insert(
            "decode".to_owned(),
            AgentPool {
                parked: 0,
                serving: vec![18000],
            },
        );
        let agents = vec![("http://10.0.0.5:9400".to_owned(), pools)];
        assert_eq!(
            serving_urls(&agents, "decode", "/metrics"),
            ["http://10.0.0.5:18000/metrics"]
        );
        assert!(serving_urls(&agents, "prefill", "/metrics").is_empty());
        let v6 = vec![("http://[fd00::7]:9400".to_owned(), agents[0].1.clone())];
        let mut flood = BTreeMap::new();
        flood.insert(
            "decode".to_owned(),
            AgentPool {
                parked: 0,
                serving: (1..=5000).chain([7, 7]).collect(),
            },
        );
        let flood = vec![("http://10.0.0.6:9400".to_owned(), flood)];
        assert_eq!(
            serving_urls(&flood, "decode", "").len(),
            64,
            "capped and deduplicated"
        );
        assert_eq!(serving_urls(&v6, "decode", ""), ["http://[fd00::7]:18000"]);
    }
}
