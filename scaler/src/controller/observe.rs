//! The first stage of a tick: what a model's gateways hold, what its warm-pool agents
//! park and serve, and each pool's signals, replicas and measured start-up. All the
//! reading a tick does happens here (scrapes, Prometheus, the Kubernetes API, the
//! agents), each call bounded by the scrape timeout.

use std::collections::BTreeMap;
use std::time::Duration;

use super::deletion_cost::PodLoad;
use super::{ModelLoop, PoolLoop, SharedEndpoints, unix_now};
use crate::kube::PodSet;
use crate::policy::Pool;
use crate::prom::PromSource;
use crate::scrape::scrape_all;
use crate::signals::PoolSignals;
use crate::signals::exposition::Reading;
use crate::standbys::{self, AgentPool};

/// Where a pool's signals come from.
#[derive(Debug)]
pub(super) enum Source {
    Static(Vec<String>),
    Shared(SharedEndpoints),
    Pods(PodSet),
    Prometheus(String),
}

/// What one tick reads once per model.
#[derive(Debug, Default)]
pub(super) struct ModelSeen {
    /// Requests the model's gateways hold (its pools at zero, or busy), by the pool
    /// they wait for.
    pub held: HeldByPool,
    /// Each agent that answered, by base URL: its standbys per agent pool.
    pub agents: Vec<(String, BTreeMap<String, AgentPool>)>,
}

/// Requests a model's gateways hold, by the pool they wait for.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct HeldByPool(BTreeMap<String, f64>);

impl HeldByPool {
    /// Summed over the gateways' readings.
    fn of<'a>(readings: impl Iterator<Item = &'a Reading>) -> HeldByPool {
        let mut by_pool = BTreeMap::new();
        for r in readings {
            for (pool, n) in &r.gateway_pending_by_pool {
                *by_pool.entry(pool.clone()).or_default() += n;
            }
        }
        HeldByPool(by_pool)
    }

    /// Those that `pool` would serve: the ones that wait for it, and those of a
    /// gateway that does not say which pool its requests wait for.
    pub fn for_pool(&self, pool: Pool) -> f64 {
        self.0.get(pool.as_str()).copied().unwrap_or(0.0) + self.0.get("").copied().unwrap_or(0.0)
    }
}

/// What one tick saw of one pool.
#[derive(Debug)]
pub(super) struct PoolSeen {
    pub signals: PoolSignals,
    /// Replicas the pool has (ready or starting); `None`: nothing could say.
    pub current: Option<u32>,
    /// The slowest start-up measured among the pool's own replicas.
    pub startup: Option<f64>,
    /// Ready pods, for a pool whose source is a pod watch.
    pub ready_pods: Option<u32>,
    /// This pool's standbys at each agent that answered.
    pub agents: Vec<(String, AgentPool)>,
    /// Whether a standby serving for the pool did not answer its scrape.
    pub standby_failing: bool,
    /// Each ready pod's load, for a pool whose source is a pod watch.
    pub pods: Vec<PodLoad>,
}

/// The reading side of a tick: clients, Prometheus and the Kubernetes API.
pub(super) struct Observer<'a> {
    pub client: &'a reqwest::Client,
    /// Carries the cluster token: for the warm-pool agents only.
    pub agents_client: &'a reqwest::Client,
    pub prom: Option<&'a PromSource>,
    pub timeout: Duration,
    pub kube: Option<&'a kube::Client>,
    pub namespace: &'a str,
}

/// Slowest measured start among readings: seconds from the start of a replica to
/// serving (`registered` for workers, `ready` for colocated servers), or to its first
/// token when an engine reports only that.
fn startup_of<'a>(readings: impl Iterator<Item = &'a Reading>) -> Option<f64> {
    readings
        .filter_map(|r| {
            ["registered", "ready", "first_token"]
                .iter()
                .find_map(|want| {
                    r.startup
                        .iter()
                        .filter(|((phase, _), _)| phase == want)
                        .map(|(_, v)| *v)
                        .reduce(f64::max)
                })
        })
        .fold(None, |acc: Option<f64>, v| {
            Some(acc.map_or(v, |a| a.max(v)))
        })
}

/// The readings of a pool's own replicas (not its standbys').
fn own<'a>(
    ok: &'a [(String, Reading)],
    standbys: &'a [String],
) -> impl Iterator<Item = &'a Reading> {
    ok.iter()
        .filter(|(u, _)| !standbys.contains(u))
        .map(|(_, r)| r)
}

impl Observer<'_> {
    /// The model's gateways (what they hold) and agents (their standbys).
    pub async fn model(&self, m: &mut ModelLoop) -> ModelSeen {
        let filter = m.cfg.metrics_model_name.as_deref();
        let mut gateways = m.cfg.gateway.clone();
        if let Some(set) = &m.gateway_pods {
            gateways.extend(set.view().ready.into_values());
        }
        let (gw, gw_failed) = scrape_all(self.client, &gateways, filter, self.timeout).await;
        m.gateway_failures
            .note("gateway", gw.iter().map(|(u, _)| u.as_str()), &gw_failed);
        let held = HeldByPool::of(gw.iter().map(|(_, r)| r));
        let agents = match &m.agents {
            Some((set, _)) => {
                let bases: Vec<String> = set.view().ready.into_values().collect();
                standbys::read_agents(self.agents_client, &bases, self.timeout).await
            }
            None => Vec::new(),
        };
        ModelSeen { held, agents }
    }

    /// One pool: its signals (its serving standbys scraped with it: the load they
    /// carry is the pool's, though they are not its replicas and their starts are not
    /// its start-up), replicas and start-up. The first time the pool is seen with
    /// signals, what its policy learns from is read back from Prometheus.
    pub async fn pool(
        &self,
        model: &str,
        filter: Option<&str>,
        agent_pool: Option<&str>,
        p: &mut PoolLoop,
        seen: &ModelSeen,
        t: f64,
    ) -> PoolSeen {
        let path = match &p.source {
            Source::Pods(_) | Source::Static(_) | Source::Shared(_) => p.metrics_path.as_str(),
            // Prometheus does not scrape the standbys: their load is not added.
            Source::Prometheus(_) => "",
        };
        let agent_pool = agent_pool.unwrap_or(p.pool.as_str());
        let serving_urls = if path.is_empty() {
            Vec::new()
        } else {
            standbys::serving_urls(&seen.agents, agent_pool, path)
        };
        let (signals, current, startup, pods) = self.signals(p, t, filter, &serving_urls).await;
        let ready_pods = match &p.source {
            Source::Pods(set) => Some(u32::try_from(set.view().ready.len()).unwrap_or(u32::MAX)),
            _ => None,
        };
        if current.is_some() && !p.seeded && !signals.is_blind() {
            self.seed_from_prometheus(model, p, t, signals.prefix_hit_rate)
                .await;
        }
        let standby_failing = serving_urls
            .iter()
            .any(|u| p.failures.failing().contains_key(u));
        PoolSeen {
            signals,
            current,
            startup,
            ready_pods,
            agents: seen
                .agents
                .iter()
                .map(|(a, pools)| {
                    (
                        a.clone(),
                        pools.get(agent_pool).cloned().unwrap_or_default(),
                    )
                })
                .collect(),
            standby_failing,
            pods,
        }
    }

    /// Signals, current replicas and measured start-up of one pool, its serving
    /// `standbys` (metrics URLs) scraped with it.
    async fn signals(
        &self,
        p: &mut PoolLoop,
        t: f64,
        filter: Option<&str>,
        standbys: &[String],
    ) -> (PoolSignals, Option<u32>, Option<f64>, Vec<PodLoad>) {
        let blind = |why: &str| {
            let s = PoolSignals {
                endpoints_failed: 1,
                ..PoolSignals::default()
            };
            tracing::warn!(
                pool = p.pool.as_str(),
                reason = why,
                "pool signals unavailable"
            );
            s
        };
        match &p.source {
            Source::Static(_) | Source::Shared(_) => {
                let urls = match &p.source {
                    Source::Shared(list) => list
                        .read()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .clone(),
                    Source::Static(urls) => urls.clone(),
                    _ => Vec::new(),
                };
                // Static endpoints all exist, answering or not.
                let current = u32::try_from(urls.len()).unwrap_or(u32::MAX);
                let (ok, failed) = self.scrape_with(p, urls, standbys, filter).await;
                let startup = startup_of(own(&ok, standbys));
                (
                    p.windows.tick(t, ok, &failed),
                    Some(current),
                    startup,
                    Vec::new(),
                )
            }
            Source::Pods(set) => {
                if !set.synced() {
                    let current = self.real_replicas(p).await;
                    return (
                        blind("pod watch has not listed yet"),
                        current,
                        None,
                        Vec::new(),
                    );
                }
                let view = set.view();
                let urls: Vec<String> = view.ready.values().cloned().collect();
                let (ok, failed) = self.scrape_with(p, urls, standbys, filter).await;
                let startup = startup_of(own(&ok, standbys));
                let pods = PodLoad::of(&view, &ok);
                (
                    p.windows.tick(t, ok, &failed),
                    Some(view.current),
                    startup,
                    pods,
                )
            }
            Source::Prometheus(sel) => {
                let Some(prom) = self.prom else {
                    let current = self.real_replicas(p).await;
                    return (blind("no prometheus_url"), current, None, Vec::new());
                };
                match prom.pool_signals(sel, self.timeout).await {
                    Ok((s, pods, startup)) => (s, Some(pods), startup, Vec::new()),
                    Err(e) => {
                        let current = self.real_replicas(p).await;
                        (blind(&e.to_string()), current, None, Vec::new())
                    }
                }
            }
        }
    }

    /// What a pool has when its source cannot say: the Deployment's replicas (read
    /// through the scale subresource), else the last count seen, else unknown.
    async fn real_replicas(&self, p: &PoolLoop) -> Option<u32> {
        if let (Some(client), Some(deploy)) = (self.kube, &p.deployment) {
            // Bounded like a scrape: a stalled API server must not stall every pool.
            let read = crate::kube::deployment_replicas(client.clone(), self.namespace, deploy);
            match tokio::time::timeout(self.timeout, read).await {
                Ok(Ok(n)) => return Some(n),
                Ok(Err(e)) => {
                    tracing::warn!(pool = p.pool.as_str(), error = %e, "reading the pool's replicas");
                }
                Err(_) => {
                    tracing::warn!(
                        pool = p.pool.as_str(),
                        "reading the pool's replicas timed out"
                    );
                }
            }
        }
        p.last_current
    }

    /// [`Observer::scrape`] of `urls` and `standbys` together.
    async fn scrape_with(
        &self,
        p: &mut PoolLoop,
        mut urls: Vec<String>,
        standbys: &[String],
        filter: Option<&str>,
    ) -> (Vec<(String, Reading)>, Vec<String>) {
        urls.extend(standbys.iter().cloned());
        self.scrape(p, &urls, filter).await
    }

    /// Scrapes a pool's endpoints; failures are logged when they change and returned
    /// as the URLs that did not answer.
    async fn scrape(
        &self,
        p: &mut PoolLoop,
        urls: &[String],
        filter: Option<&str>,
    ) -> (Vec<(String, Reading)>, Vec<String>) {
        let (ok, failed) = scrape_all(self.client, urls, filter, self.timeout).await;
        p.failures
            .note(p.pool.as_str(), ok.iter().map(|(u, _)| u.as_str()), &failed);
        (ok, failed.into_iter().map(|f| f.url).collect())
    }

    /// A restarted scaler reads what its policy learns from back from Prometheus, so
    /// it does not spend a window relearning a load it had seen: the prefill pool's
    /// hindsight window, and each pool's season (the load by time of day). The two
    /// queries run together: the first decision waits for one round trip, not two.
    async fn seed_from_prometheus(&self, model: &str, p: &mut PoolLoop, t: f64, hit_rate: f64) {
        p.seeded = true;
        let (Source::Prometheus(sel), Some(prom)) = (&p.source, self.prom) else {
            return;
        };
        let span = p.policy.cfg.burst_memory_s;
        let recent = async {
            if p.pool == Pool::Prefill {
                Some(prom.recent_prompt_rates(sel, span, self.timeout).await)
            } else {
                None
            }
        };
        let season = async {
            match p.policy.season_buckets() {
                Some((bucket, period)) => Some(
                    prom.seasonal_rates(sel, p.pool, period, bucket, self.timeout)
                        .await,
                ),
                None => None,
            }
        };
        let (recent, season) = tokio::join!(recent, season);
        let pool = p.pool.as_str();
        let log = |what: &str, taken: crate::Result<usize>| match taken {
            Ok(n) => tracing::info!(model, pool, points = n, "{what} read back from Prometheus"),
            Err(e) => {
                tracing::warn!(model, pool, error = %e, "reading the {what} back from Prometheus: learning it from what is seen from now on")
            }
        };
        if let Some(r) = recent {
            let taken = r.map(|points| {
                p.policy
                    .seed_arrivals(t, prom.step_s(), &points, 1.0 - hit_rate)
            });
            log("hindsight window", taken);
        }
        if let Some(r) = season {
            let taken = r.map(|points| {
                p.policy
                    .seed_season(unix_now().unwrap_or(0.0), &points, 1.0 - hit_rate)
            });
            log("season", taken);
        }
    }
}
