//! The control loop. Every interval, for each model and each of its pools, a tick runs
//! four stages:
//!
//! 1. **observe** ([`observe`]): the pool's signals (scraping its endpoints, static or
//!    discovered through Kubernetes, or querying Prometheus), its replicas and measured
//!    start-up, what the model's gateways hold and its agents park;
//! 2. **decide** ([`decide`], no I/O): the pool's policy, and the status it explains;
//!    then, once every model's pools have decided, the fleet's GPU budget ([`budget`],
//!    no I/O) grants each pool its replicas when they want more than the fleet has;
//! 3. **publish**: the status, into the [`DecisionStore`];
//! 4. **act** ([`actuate`]): every [`actuate::Actuator`] the pool has: KEDA's (the
//!    decision its gRPC service answers), the Deployment's replicas in direct mode, the
//!    agents' standbys.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Config, MetricsSource, Mode, ModelConfig, PoolConfig};
use crate::decisions::DecisionStore;
use crate::kube::PodSet;
use crate::policy::{Pool, PreheatPolicy};
use crate::profile::Profile;
use crate::prom::PromSource;
use crate::scrape::FailureLog;
use crate::signals::PoolWindows;

mod actuate;
mod budget;
mod decide;
mod deletion_cost;
mod observe;
mod state_keeper;

use actuate::{Actuator, Target};
use observe::{Observer, Source};
use state_keeper::StateKeeper;

/// The attainment a pool's SLO deficit is measured from, for the fleet's budget.
const SLO_TARGET: f64 = 0.99;

/// What one pool's tick decided, waiting for the fleet's budget before it acts.
struct Decided {
    outcome: decide::Outcome,
    agents: Vec<(String, crate::standbys::AgentPool)>,
    ready_pods: Option<u32>,
    unsure: bool,
    /// Requests the model's gateways hold for this pool.
    held: f64,
    /// Its ready pods' loads (a pool watched through its pods).
    pods: Vec<deletion_cost::PodLoad>,
}

/// Endpoint URLs someone else keeps current (the local mode's replica driver).
pub type SharedEndpoints = Arc<std::sync::RwLock<Vec<String>>>;

struct PoolLoop {
    pool: Pool,
    windows: PoolWindows,
    policy: PreheatPolicy,
    source: Source,
    /// Read for the replicas when the source cannot say.
    deployment: Option<String>,
    /// Replicas last known, for ticks where the source cannot say; `None` until
    /// known (a starting scaler decides nothing before it knows what a pool has).
    last_current: Option<u32>,
    /// Whether the "replicas unknown" warning was logged since the count was last known.
    unknown_logged: bool,
    failures: FailureLog,
    /// Path of a replica's (and a standby's) metrics.
    metrics_path: String,
    /// Whether the policy's hindsight window was read back from Prometheus (or there
    /// was nothing to read it from): once, at the first tick that sees the pool.
    seeded: bool,
    /// What brings the pool to its decision, in order.
    actuators: Vec<Box<dyn Actuator>>,
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
    /// Profiles of the models that have their own (`models[].profile`).
    model_profiles: std::collections::HashMap<String, Profile>,
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
            model_profiles: std::collections::HashMap::new(),
            kube,
            shared: std::collections::HashMap::new(),
            agent_token: None,
        }
    }

    /// Sizes `model`'s replicas by `profile` instead of the shared one.
    #[must_use]
    pub fn with_model_profile(mut self, model: &str, profile: Profile) -> Self {
        self.model_profiles.insert(model.to_owned(), profile);
        self
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

    /// The actuators `p` of model `m` is configured for: KEDA's always (its decision
    /// is also what `/status` shows), the agents' standbys, direct scaling.
    fn actuators(
        &self,
        m: &ModelConfig,
        p: &PoolConfig,
        agents_client: &reqwest::Client,
    ) -> Vec<Box<dyn Actuator>> {
        let mut out: Vec<Box<dyn Actuator>> = Vec::new();
        // Before anything scales: the pods are marked before the ReplicaSet picks.
        if let (true, Some(client), MetricsSource::Pods { .. }) =
            (self.cfg.kubernetes.pod_deletion_cost, &self.kube, &p.source)
        {
            out.push(Box::new(deletion_cost::DeletionCost {
                client: client.clone(),
                namespace: self.cfg.kubernetes.namespace.clone(),
                timeout: Duration::from_secs_f64(self.cfg.scrape_timeout_s),
                last: None,
            }));
        }
        out.push(Box::new(actuate::Keda {
            store: Arc::clone(&self.store),
        }));
        if let (Some(sb), Some(_)) = (&m.standbys, &self.kube) {
            out.push(Box::new(actuate::Standbys {
                client: agents_client.clone(),
                cfg: sb.clone(),
                timeout: Duration::from_secs_f64(self.cfg.scrape_timeout_s),
                surplus_since: None,
            }));
        }
        if let (Mode::Direct, Some(client), Some(deploy)) =
            (self.cfg.mode, &self.kube, &p.deployment)
        {
            out.push(Box::new(actuate::Direct {
                client: client.clone(),
                namespace: self.cfg.kubernetes.namespace.clone(),
                deployment: deploy.clone(),
                applied: None,
            }));
        }
        out
    }

    /// The first stages of one model's tick: observe, then each pool's decision.
    async fn decide_model(
        &self,
        observer: &Observer<'_>,
        m: &mut ModelLoop,
        t: f64,
    ) -> Vec<Decided> {
        let seen = observer.model(m).await;
        let name = m.cfg.name.as_str();
        let filter = m.cfg.metrics_model_name.as_deref();
        let mut out = Vec::new();
        for p in &mut m.pools {
            let agent_pool = m.agents.as_ref().map(|(_, sb)| sb.agent_pool(p.pool));
            let mut pool_seen = observer.pool(name, filter, agent_pool, p, &seen, t).await;
            let pods = std::mem::take(&mut pool_seen.pods);
            let agents = pool_seen.agents.clone();
            let ready_pods = pool_seen.ready_pods;
            let unsure = pool_seen.signals.is_blind() || pool_seen.standby_failing;
            let held = seen.held.for_pool(p.pool);
            let outcome = decide::decide(name, p, pool_seen, held, t);
            out.push(Decided {
                outcome,
                agents,
                ready_pods,
                unsure,
                held,
                pods,
            });
        }
        out
    }

    /// Grants each decided pool its replicas within the fleet's GPU budget, where the
    /// models want more than it holds; records what each wanted and was granted.
    fn apply_budget(&self, models: &[ModelLoop], decided: &mut [Vec<Decided>]) {
        if self.cfg.fleet.max_gpus == 0 {
            // No budget: every pool has what it decided (and `wanted` says so).
            return;
        }
        // Parked standbys hold their GPUs whatever the pools want.
        let parked: u32 = decided
            .iter()
            .flatten()
            .flat_map(|d| d.agents.iter())
            .map(|(_, a)| a.parked)
            .sum();
        let max = budget::for_pools(self.cfg.fleet.max_gpus, parked, self.cfg.fleet.standby_gpus);
        let mut claims = Vec::new();
        let mut at = Vec::new();
        // A pool that decides nothing has replicas nobody knows (a scaler just
        // started, a watch not yet listed): what is left of the budget is not known
        // either, so no pool grows past what it has, but a pool with requests held and
        // nothing serving still gets its first replica.
        let mut unknown = false;
        for (mi, (m, ds)) in models.iter().zip(decided.iter()).enumerate() {
            for (pi, (p, d)) in m.pools.iter().zip(ds).enumerate() {
                let current = d.outcome.status.current;
                let Some(decision) = &d.outcome.decision else {
                    unknown = true;
                    continue;
                };
                let attainment = match p.pool {
                    Pool::Prefill => d.outcome.status.slo.ttft_attainment,
                    Pool::Decode => d.outcome.status.slo.itl_attainment,
                };
                claims.push(budget::Claim {
                    desired: decision.desired,
                    min: p.policy.cfg.min_replicas,
                    current,
                    // Starting replicas do not serve yet: a pool waking from zero
                    // stays first until one does.
                    held_at_zero: d.held > 0.0 && d.outcome.status.ready == 0,
                    slo_deficit: attainment.map_or(0.0, |a| (SLO_TARGET - a).max(0.0)),
                    priority: m.cfg.priority,
                });
                at.push((mi, pi));
            }
        }
        let granted: Vec<u32> = if unknown {
            claims
                .iter()
                .map(|c| {
                    let floor = if c.held_at_zero {
                        c.current.max(1)
                    } else {
                        c.current
                    };
                    c.desired.min(floor)
                })
                .collect()
        } else {
            budget::grant(&claims, max)
        };
        let mut cut = vec![false; models.len()];
        for ((mi, pi), (claim, g)) in at.into_iter().zip(claims.iter().zip(granted)) {
            // (Held back while a size is unknown is not a wait on the budget.)
            cut[mi] |= g < claim.desired && !unknown;
            let d = &mut decided[mi][pi];
            if let Some(decision) = &mut d.outcome.decision
                && g < decision.desired
            {
                decision.desired = g;
                decision.active = g > 0;
                decision.reason = if unknown {
                    "fleet GPU budget: a pool's replicas are unknown, nothing grows"
                } else {
                    "fleet GPU budget: granted fewer replicas than wanted"
                };
                d.outcome.status.reason = decision.reason;
            }
        }
        for (m, cut) in models.iter().zip(cut) {
            self.store.set_budget_cut(&m.cfg.name, cut);
        }
    }

    /// The last stages of one model's tick: publish each pool's status, and act.
    async fn act_model(&self, m: &mut ModelLoop, decided: Vec<Decided>, dt: f64) {
        let name = m.cfg.name.as_str();
        for (p, d) in m.pools.iter_mut().zip(decided) {
            let Decided {
                outcome,
                agents,
                ready_pods,
                unsure,
                pods,
                ..
            } = d;
            // What the pool holds now (serving or starting) is what it costs, over the
            // time since the last tick.
            // (A pool that decided nothing has no known size: not counted.)
            let replicas = if outcome.decision.is_some() {
                outcome.status.current
            } else {
                0
            };
            let gpus = f64::from(replicas) * f64::from(budget::GPUS_PER_REPLICA);
            self.store.add_gpu_seconds(name, gpus * dt);
            self.store.set_status(name, p.pool, outcome.status);
            let (Some(decision), Some(current)) = (outcome.decision, p.last_current) else {
                continue;
            };
            let target = Target {
                model: name,
                pool: p.pool,
                decision: &decision,
                ready: ready_pods.unwrap_or(current),
                agents: &agents,
                unsure,
                pods: &pods,
            };
            for a in &mut p.actuators {
                a.act(&target).await;
            }
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
                        policy: PreheatPolicy::new(
                            pool,
                            p.policy.clone(),
                            self.model_profiles
                                .get(&m.name)
                                .unwrap_or(&self.profile)
                                .clone(),
                        ),
                        source: self.source(&m.name, pool, p),
                        deployment: p.deployment.clone(),
                        last_current: None,
                        unknown_logged: false,
                        failures: FailureLog::default(),
                        metrics_path: p.metrics_path.clone(),
                        seeded: false,
                        actuators: self.actuators(m, p, &agents_client),
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
        // The first tick fires at once: it counts no time yet.
        let mut last_t = 0.0;
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let observer = Observer {
            client: &client,
            agents_client: &agents_client,
            prom: prom.as_ref(),
            timeout: Duration::from_secs_f64(self.cfg.scrape_timeout_s),
            kube: self.kube.as_ref(),
            namespace: &self.cfg.kubernetes.namespace,
        };
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|v| *v) => break,
            }
            let t = start.elapsed().as_secs_f64();
            let dt = t - last_t;
            last_t = t;
            let mut decided = Vec::with_capacity(models.len());
            for m in &mut models {
                decided.push(self.decide_model(&observer, m, t).await);
            }
            self.apply_budget(&models, &mut decided);
            for (m, d) in models.iter_mut().zip(decided) {
                self.act_model(m, d, dt).await;
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

/// The wall clock, Unix seconds (UTC): what scheduled floors and the season read;
/// `None` on a clock set before 1970.
fn unix_now() -> Option<f64> {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs_f64())
}
