//! The control loop: every interval, scrape each pool's endpoints (and the gateway's),
//! turn them into signals, run the policy, and publish decisions for KEDA.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Config, ModelConfig};
use crate::grpc::{DecisionStore, PoolDecision};
use crate::policy::{Observation, Pool, PreheatPolicy};
use crate::profile::Profile;
use crate::scrape::scrape_all;
use crate::signals::PoolWindows;

struct PoolLoop {
    pool: Pool,
    windows: PoolWindows,
    policy: PreheatPolicy,
    endpoints: Vec<String>,
}

struct ModelLoop {
    cfg: ModelConfig,
    pools: Vec<PoolLoop>,
}

/// Runs the scrape-and-decide loop over `cfg`'s models until the task is dropped.
#[derive(Debug)]
pub struct Controller {
    store: Arc<DecisionStore>,
    cfg: Config,
    profile: Profile,
}

impl Controller {
    #[must_use]
    pub fn new(cfg: Config, profile: Profile, store: Arc<DecisionStore>) -> Self {
        Controller {
            store,
            cfg,
            profile,
        }
    }

    pub async fn run(self) {
        let client = reqwest::Client::new();
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
                        endpoints: p.endpoints.clone(),
                    })
                    .collect(),
            })
            .collect();
        let mut tick = tokio::time::interval(Duration::from_secs_f64(self.cfg.interval_s));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let timeout = Duration::from_secs_f64(self.cfg.scrape_timeout_s);
        loop {
            tick.tick().await;
            let t = start.elapsed().as_secs_f64();
            for m in &mut models {
                decide_model(&client, m, t, timeout, &self.store).await;
            }
        }
    }
}

async fn decide_model(
    client: &reqwest::Client,
    m: &mut ModelLoop,
    t: f64,
    timeout: Duration,
    store: &DecisionStore,
) {
    let filter = m.cfg.metrics_model_name.as_deref();
    let (gw, _) = scrape_all(client, &m.cfg.gateway, filter, timeout).await;
    let held: f64 = gw.iter().filter_map(|(_, r)| r.gateway_pending).sum();
    for p in &mut m.pools {
        let (ok, failed) = scrape_all(client, &p.endpoints, filter, timeout).await;
        let startup = ok
            .iter()
            .filter_map(|(_, r)| {
                r.startup
                    .iter()
                    .find(|((phase, _), _)| phase == "first_token")
                    .map(|(_, v)| *v)
            })
            .fold(None, |acc: Option<f64>, v| {
                Some(acc.map_or(v, |a| a.max(v)))
            });
        // Static endpoints all exist, answering or not.
        let current = u32::try_from(ok.len() + failed.len()).unwrap_or(u32::MAX);
        let signals = p.windows.tick(t, ok, &failed);
        let obs = Observation {
            current,
            held_requests: held,
            measured_startup_s: startup,
            signals,
            ..Observation::default()
        };
        let d = p.policy.decide(t, &obs);
        tracing::debug!(model = %m.cfg.name, pool = p.pool.as_str(), desired = d.desired, active = d.active, reason = d.reason, "decision");
        store.set(
            &m.cfg.name,
            p.pool,
            PoolDecision {
                desired: d.desired,
                active: d.active,
            },
        );
    }
}
