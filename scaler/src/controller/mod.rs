//! The control loop: every interval, read each pool's signals (scraping its endpoints
//! — static or discovered through Kubernetes — or querying Prometheus), run the
//! policy, publish decisions for KEDA and, in direct mode, set Deployment replicas.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Config, MetricsSource, Mode, ModelConfig, PoolConfig};
use crate::grpc::{DecisionStore, PoolDecision, PoolStatus, SloView};
use crate::kube::PodSet;
use crate::policy::{Observation, Pool, PreheatPolicy};
use crate::profile::Profile;
use crate::prom::PromSource;
use crate::scrape::{FailureLog, scrape_all};
use crate::signals::exposition::Reading;
use crate::signals::{PoolSignals, PoolWindows};
use crate::standbys;

mod state_keeper;
use state_keeper::StateKeeper;

/// Endpoint URLs someone else keeps current (the local mode's replica driver).
pub type SharedEndpoints = Arc<std::sync::RwLock<Vec<String>>>;

/// Where a pool's signals come from.
#[derive(Debug)]
enum Source {
    Static(Vec<String>),
    Shared(SharedEndpoints),
    Pods(PodSet),
    Prometheus(String),
}

struct PoolLoop {
    pool: Pool,
    windows: PoolWindows,
    policy: PreheatPolicy,
    source: Source,
    deployment: Option<String>,
    /// Replicas last set in direct mode.
    applied: Option<u32>,
    /// Replicas last known, for ticks where the source cannot say; `None` until
    /// known (a starting scaler decides nothing before it knows what a pool has).
    last_current: Option<u32>,
    /// Whether the "replicas unknown" warning was logged since the count was last known.
    unknown_logged: bool,
    failures: FailureLog,
    /// Since when the pool has had more than it wants with standbys serving.
    surplus_since: Option<Instant>,
    /// Path of a replica's (and a standby's) metrics.
    metrics_path: String,
    /// Whether the policy's hindsight window was read back from Prometheus (or there
    /// was nothing to read it from): once, at the first tick that sees the pool.
    seeded: bool,
}

struct ModelLoop {
    cfg: ModelConfig,
    pools: Vec<PoolLoop>,
    /// Gateway pods found by `gateway_selector`, scraped besides `gateway` URLs.
    gateway_pods: Option<PodSet>,
    gateway_failures: FailureLog,
    /// Warm-pool agents whose parked standbys bridge the pools' start-ups.
    agents: Option<(PodSet, crate::standbys::StandbyConfig)>,
}

/// Runs the scrape-and-decide loop over `cfg`'s models until the task is dropped.
pub struct Controller {
    store: Arc<DecisionStore>,
    cfg: Config,
    profile: Profile,
    kube: Option<kube::Client>,
    shared: std::collections::HashMap<(String, Pool), SharedEndpoints>,
    /// The cluster token the warm-pool agents' API asks for.
    agent_token: Option<Arc<preheat_edge::ClusterToken>>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("models", &self.cfg.models.len())
            .field("kube", &self.kube.is_some())
            .finish()
    }
}

impl Controller {
    /// `kube` is required when a pool has a `selector` or the mode is direct.
    #[must_use]
    pub fn new(
        cfg: Config,
        profile: Profile,
        store: Arc<DecisionStore>,
        kube: Option<kube::Client>,
    ) -> Self {
        Controller {
            store,
            cfg,
            profile,
            kube,
            shared: std::collections::HashMap::new(),
            agent_token: None,
        }
    }

    /// Calls the warm-pool agents with the cluster token.
    #[must_use]
    pub fn with_agent_token(mut self, token: Option<Arc<preheat_edge::ClusterToken>>) -> Self {
        self.agent_token = token;
        self
    }

    /// Reads `model`'s `pool` endpoints from `list` (kept current by the caller)
    /// instead of the config.
    #[must_use]
    pub fn with_shared(mut self, model: &str, pool: Pool, list: SharedEndpoints) -> Self {
        self.shared.insert((model.to_owned(), pool), list);
        self
    }

    /// Whether `cfg` needs a Kubernetes client: pods to watch, or Deployments whose
    /// replicas are read (both modes) or set (direct mode).
    #[must_use]
    pub fn needs_kube(cfg: &Config) -> bool {
        cfg.mode == Mode::Direct
            || cfg.models.iter().any(|m| {
                m.gateway_selector.is_some()
                    || m.standbys.is_some()
                    || [&m.prefill, &m.decode].iter().any(|p| {
                        matches!(p.source, MetricsSource::Pods { .. }) || p.deployment.is_some()
                    })
            })
    }

    fn source(&self, model: &str, pool: Pool, p: &PoolConfig) -> Source {
        if let Some(list) = self.shared.get(&(model.to_owned(), pool)) {
            return Source::Shared(Arc::clone(list));
        }
        match (&p.source, &self.kube) {
            (MetricsSource::Pods { selector }, Some(client)) => Source::Pods(PodSet::watch(
                client.clone(),
                &self.cfg.kubernetes.namespace,
                selector,
                p.metrics_port,
                &p.metrics_path,
            )),
            (MetricsSource::Prometheus { selector }, _) => Source::Prometheus(selector.clone()),
            (MetricsSource::Endpoints(urls), _) => Source::Static(urls.clone()),
            // Unset, or pods without a Kubernetes client (refused at start): no replicas.
            _ => Source::Static(Vec::new()),
        }
    }

    /// Ticks until `stop` turns true, then saves the state file a last time.
    pub async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let client = reqwest::Client::new();
        // The token goes to the agents alone, never to scrape targets or Prometheus.
        let agents_client = preheat_edge::client::internal_with_token(self.agent_token.as_deref());
        let prom = self.cfg.prometheus_url.as_deref().map(|u| {
            PromSource::new(client.clone(), u, self.cfg.window_s, self.cfg.interval_s)
                .with_scrape_interval(self.cfg.prometheus_scrape_interval_s)
        });
        let start = Instant::now();
        let mut models: Vec<ModelLoop> = self
            .cfg
            .models
            .iter()
            .map(|m| ModelLoop {
                cfg: m.clone(),
                pools: [(Pool::Prefill, &m.prefill), (Pool::Decode, &m.decode)]
                    .into_iter()
                    .map(|(pool, p)| PoolLoop {
                        pool,
                        windows: PoolWindows::new(self.cfg.window_s),
                        policy: PreheatPolicy::new(pool, p.policy.clone(), self.profile.clone()),
                        source: self.source(&m.name, pool, p),
                        deployment: p.deployment.clone(),
                        applied: None,
                        last_current: None,
                        unknown_logged: false,
                        failures: FailureLog::default(),
                        surplus_since: None,
                        metrics_path: p.metrics_path.clone(),
                        seeded: false,
                    })
                    .collect(),
                gateway_pods: match (&m.gateway_selector, &self.kube) {
                    (Some(sel), Some(client)) => Some(PodSet::watch(
                        client.clone(),
                        &self.cfg.kubernetes.namespace,
                        sel,
                        m.gateway_port,
                        "/metrics",
                    )),
                    _ => None,
                },
                gateway_failures: FailureLog::default(),
                agents: match (&m.standbys, &self.kube) {
                    (Some(sb), Some(client)) => Some((
                        PodSet::watch(
                            client.clone(),
                            &self.cfg.kubernetes.namespace,
                            &sb.agent_selector,
                            sb.agent_port,
                            "",
                        ),
                        sb.clone(),
                    )),
                    _ => None,
                },
            })
            .collect();
        let mut keeper = match &self.cfg.state_file {
            Some(path) => {
                Some(StateKeeper::resume(path, &mut models, Arc::clone(&self.store)).await)
            }
            None => None,
        };
        let mut tick = tokio::time::interval(Duration::from_secs_f64(self.cfg.interval_s));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let ctx = Tick {
            client: &client,
            agents_client: &agents_client,
            prom: prom.as_ref(),
            timeout: Duration::from_secs_f64(self.cfg.scrape_timeout_s),
            store: &self.store,
            kube: self.kube.as_ref(),
            direct: self.cfg.mode == Mode::Direct,
            namespace: &self.cfg.kubernetes.namespace,
        };
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|v| *v) => break,
            }
            let t = start.elapsed().as_secs_f64();
            for m in &mut models {
                ctx.decide_model(m, t).await;
            }
            if let Some(k) = &mut keeper {
                k.save_if_due(&models);
            }
        }
        // A graceful stop (a rollout, `up` ending) loses nothing learnt since the last save.
        if let Some(k) = keeper {
            k.last_save(&models).await;
        }
    }
}

/// What one tick needs besides the pools.
struct Tick<'a> {
    client: &'a reqwest::Client,
    /// Carries the cluster token: for the warm-pool agents only.
    agents_client: &'a reqwest::Client,
    prom: Option<&'a PromSource>,
    timeout: Duration,
    store: &'a DecisionStore,
    kube: Option<&'a kube::Client>,
    /// Direct mode: the scaler sets the Deployments' replicas itself.
    direct: bool,
    namespace: &'a str,
}

/// Slowest measured start among readings: seconds from the start of a replica to
/// serving (`registered` for workers, `ready` for colocated servers), or to its first
/// token when an engine reports only that.
fn startup_of<'a>(
    readings: impl Iterator<Item = &'a crate::signals::exposition::Reading>,
) -> Option<f64> {
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

impl Tick<'_> {
    /// Signals, current replicas and measured start-up of one pool. `standbys` (the
    /// metrics URLs of its serving standbys) are scraped with the pool's replicas: the
    /// load they carry is the pool's, though they are not among its replicas and their
    /// starts are not its start-up.
    async fn observe(
        &self,
        p: &mut PoolLoop,
        t: f64,
        filter: Option<&str>,
        standbys: &[String],
    ) -> (PoolSignals, Option<u32>, Option<f64>) {
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
                (p.windows.tick(t, ok, &failed), Some(current), startup)
            }
            Source::Pods(set) => {
                if !set.synced() {
                    let current = self.real_replicas(p).await;
                    return (blind("pod watch has not listed yet"), current, None);
                }
                let view = set.view();
                let urls: Vec<String> = view.ready.values().cloned().collect();
                let (ok, failed) = self.scrape_with(p, urls, standbys, filter).await;
                let startup = startup_of(own(&ok, standbys));
                (p.windows.tick(t, ok, &failed), Some(view.current), startup)
            }
            Source::Prometheus(sel) => {
                let Some(prom) = self.prom else {
                    let current = self.real_replicas(p).await;
                    return (blind("no prometheus_url"), current, None);
                };
                match prom.pool_signals(sel, self.timeout).await {
                    Ok((s, pods, startup)) => (s, Some(pods), startup),
                    Err(e) => {
                        let current = self.real_replicas(p).await;
                        (blind(&e.to_string()), current, None)
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

    /// [`Tick::scrape`] of `urls` and `standbys` together.
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

    async fn decide_model(&self, m: &mut ModelLoop, t: f64) {
        let filter = m.cfg.metrics_model_name.as_deref();
        let mut gateways = m.cfg.gateway.clone();
        if let Some(set) = &m.gateway_pods {
            gateways.extend(set.view().ready.into_values());
        }
        let (gw, gw_failed) = scrape_all(self.client, &gateways, filter, self.timeout).await;
        m.gateway_failures
            .note("gateway", gw.iter().map(|(u, _)| u.as_str()), &gw_failed);
        let held: f64 = gw.iter().filter_map(|(_, r)| r.gateway_pending).sum();
        let agents = match &m.agents {
            Some((set, _)) => {
                let bases: Vec<String> = set.view().ready.into_values().collect();
                standbys::read_agents(self.agents_client, &bases, self.timeout).await
            }
            None => Vec::new(),
        };
        for p in &mut m.pools {
            let pool = p.pool.as_str();
            let agent_pool = m
                .agents
                .as_ref()
                .map_or(pool, |(_, sb)| sb.agent_pool(p.pool));
            let path = match &p.source {
                Source::Pods(_) | Source::Static(_) | Source::Shared(_) => p.metrics_path.as_str(),
                // Prometheus does not scrape the standbys: their load is not added.
                Source::Prometheus(_) => "",
            };
            let serving_urls = if path.is_empty() {
                Vec::new()
            } else {
                standbys::serving_urls(&agents, agent_pool, path)
            };
            let (signals, current, startup) = self.observe(p, t, filter, &serving_urls).await;
            let Some(current) = current else {
                // Acting on a guess could shrink a serving pool: decide nothing, and
                // KEDA is told the pool is not decided yet (HPA then keeps its size).
                if !p.unknown_logged {
                    tracing::warn!(model = %m.cfg.name, pool = p.pool.as_str(), "the pool's replica count is unknown (no signals, no readable Deployment): not deciding");
                    p.unknown_logged = true;
                }
                self.store.set_status(
                    &m.cfg.name,
                    p.pool,
                    PoolStatus {
                        endpoints_failed: signals.endpoints_failed,
                        blind: true,
                        reason: "replicas unknown: not deciding",
                        failing: failing_urls(&p.failures),
                        slo: SloView::of(&signals, p.policy.cfg.slo_ttft_s, p.policy.cfg.slo_itl_s),
                        ..PoolStatus::default()
                    },
                );
                continue;
            };
            p.last_current = Some(current);
            p.unknown_logged = false;
            let (endpoints_ok, endpoints_failed, blind) = (
                signals.endpoints_ok,
                signals.endpoints_failed,
                signals.is_blind(),
            );
            let slo = SloView::of(&signals, p.policy.cfg.slo_ttft_s, p.policy.cfg.slo_itl_s);
            if !p.seeded && !blind {
                self.seed_from_prometheus(&m.cfg.name, p, t, signals.prefix_hit_rate)
                    .await;
            }
            let obs = Observation {
                current,
                held_requests: held,
                measured_startup_s: startup,
                mean_prompt_len: signals.mean_prompt_len(),
                signals,
                unix_time: unix_now(),
                ..Observation::default()
            };
            let d = p.policy.decide(t, &obs);
            tracing::debug!(model = %m.cfg.name, pool = p.pool.as_str(), current, desired = d.desired, active = d.active, reason = d.reason, "decision");
            self.store.set(
                &m.cfg.name,
                p.pool,
                PoolDecision {
                    desired: d.desired,
                    active: d.active,
                },
            );
            let ready = match &p.source {
                Source::Pods(set) => u32::try_from(set.view().ready.len()).unwrap_or(u32::MAX),
                _ => current,
            };
            self.store.set_status(
                &m.cfg.name,
                p.pool,
                PoolStatus {
                    current,
                    // Without pods to ask, serving is what answered (standbys included).
                    ready: match &p.source {
                        Source::Pods(_) => ready,
                        _ => u32::try_from(endpoints_ok).unwrap_or(u32::MAX),
                    },
                    endpoints_ok,
                    endpoints_failed,
                    blind,
                    reason: d.reason,
                    failing: failing_urls(&p.failures),
                    slo,
                    load: p.policy.last_load(),
                },
            );
            let replicas = if d.active { d.desired } else { 0 };
            if let Some((_, sb)) = &m.agents {
                let mine: Vec<(String, standbys::AgentPool)> = agents
                    .iter()
                    .map(|(a, pools)| {
                        (
                            a.clone(),
                            pools.get(agent_pool).cloned().unwrap_or_default(),
                        )
                    })
                    .collect();
                let serving = mine.iter().map(|(_, a)| a.serving.len()).sum::<usize>();
                // Load not fully known (the pool blind, a standby not answering —
                // perhaps overloaded): no surplus, whatever the counts say.
                let unsure = blind
                    || serving_urls
                        .iter()
                        .any(|u| p.failures.failing().contains_key(u));
                let surplus =
                    !unsure && serving > 0 && ready as usize + serving > replicas as usize;
                let due = standbys::retire_due(
                    surplus,
                    &mut p.surplus_since,
                    Duration::from_secs_f64(sb.retire_after_s),
                );
                let steps = standbys::plan(replicas, ready, &mine, due);
                if !steps.is_empty() {
                    tracing::info!(model = %m.cfg.name, pool, replicas, ready, serving, ?steps, "standbys");
                    standbys::apply(self.agents_client, agent_pool, &steps, self.timeout).await;
                }
            }
            if let (true, Some(client), Some(deploy)) = (self.direct, self.kube, &p.deployment)
                && p.applied != Some(replicas)
            {
                match crate::kube::scale_deployment(
                    client.clone(),
                    self.namespace,
                    deploy,
                    replicas,
                )
                .await
                {
                    Ok(_) => {
                        tracing::info!(model = %m.cfg.name, pool = p.pool.as_str(), deployment = %deploy, replicas, reason = d.reason, "scaled");
                        p.applied = Some(replicas);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "direct scaling failed; retrying next tick")
                    }
                }
            }
        }
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

/// The wall clock, Unix seconds (UTC): what scheduled floors and the season read;
/// `None` on a clock set before 1970.
fn unix_now() -> Option<f64> {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs_f64())
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
