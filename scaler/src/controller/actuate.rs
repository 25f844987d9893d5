//! The last stage of a tick: whatever brings a pool to its decision. Each pool holds
//! the actuators its configuration asks for, all behind one [`Actuator`] trait:
//! KEDA's (the decision published for its gRPC service), direct scaling of a
//! Deployment, and the warm-pool agents' parked standbys.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::decisions::{DecisionStore, PoolDecision};
use crate::policy::{Decision, Pool};
use crate::standbys::{self, AgentPool, StandbyConfig};

/// What one tick decided for one pool, and what the actuators need to know of it.
#[derive(Debug)]
pub(super) struct Target<'a> {
    pub model: &'a str,
    pub pool: Pool,
    pub decision: &'a Decision,
    /// Serving replicas of the pool itself (standbys not counted).
    pub ready: u32,
    /// This pool's standbys at each agent that answered, by agent base URL.
    pub agents: &'a [(String, AgentPool)],
    /// The pool's load is not fully known (blind, or a serving standby not answering):
    /// no standby is surplus, whatever the counts say.
    pub unsure: bool,
    /// Its ready pods' loads (a pool watched through its pods; empty otherwise).
    pub pods: &'a [super::deletion_cost::PodLoad],
}

impl Target<'_> {
    /// The replicas the pool should run: zero when the decision lets it go.
    pub fn replicas(&self) -> u32 {
        if self.decision.active {
            self.decision.desired
        } else {
            0
        }
    }
}

pub(super) type Acting<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Brings a pool toward a [`Target`]. A failure is logged and left for the next tick,
/// which decides again: an actuator never stalls the loop past its own timeout.
pub(super) trait Actuator: Send + Sync {
    fn act<'a>(&'a mut self, target: &'a Target<'a>) -> Acting<'a>;
}

/// KEDA's: the decision its gRPC service answers with (and `/status` shows).
#[derive(Debug)]
pub(super) struct Keda {
    pub store: Arc<DecisionStore>,
}

impl Actuator for Keda {
    fn act<'a>(&'a mut self, t: &'a Target<'a>) -> Acting<'a> {
        self.store.set(
            t.model,
            t.pool,
            PoolDecision {
                desired: t.decision.desired,
                active: t.decision.active,
            },
        );
        Box::pin(std::future::ready(()))
    }
}

/// Direct mode: the scaler sets the Deployment's replicas itself (scale subresource).
pub(super) struct Direct {
    pub client: kube::Client,
    pub namespace: String,
    pub deployment: String,
    /// Replicas last set: the API is called again only for a change (or after a failure).
    pub applied: Option<u32>,
}

impl Actuator for Direct {
    fn act<'a>(&'a mut self, t: &'a Target<'a>) -> Acting<'a> {
        Box::pin(async move {
            let replicas = t.replicas();
            if self.applied == Some(replicas) {
                return;
            }
            let scaled = crate::kube::scale_deployment(
                self.client.clone(),
                &self.namespace,
                &self.deployment,
                replicas,
            )
            .await;
            match scaled {
                Ok(_) => {
                    tracing::info!(model = t.model, pool = t.pool.as_str(), deployment = %self.deployment, replicas, reason = t.decision.reason, "scaled");
                    self.applied = Some(replicas);
                }
                Err(e) => tracing::warn!(error = %e, "direct scaling failed; retrying next tick"),
            }
        })
    }
}

/// The warm-pool agents' standbys: promoted to bridge a shortfall while replicas
/// start, retired once the pool has had more than it wants for `retire_after_s`.
#[derive(Debug)]
pub(super) struct Standbys {
    /// Carries the cluster token: for the agents only.
    pub client: reqwest::Client,
    pub cfg: StandbyConfig,
    pub timeout: Duration,
    /// Since when the pool has had more than it wants with standbys serving.
    pub surplus_since: Option<Instant>,
}

impl Actuator for Standbys {
    fn act<'a>(&'a mut self, t: &'a Target<'a>) -> Acting<'a> {
        Box::pin(async move {
            let (replicas, ready) = (t.replicas(), t.ready);
            let serving = t.agents.iter().map(|(_, a)| a.serving.len()).sum::<usize>();
            let surplus = !t.unsure && serving > 0 && ready as usize + serving > replicas as usize;
            let due = standbys::retire_due(
                surplus,
                &mut self.surplus_since,
                Duration::from_secs_f64(self.cfg.retire_after_s),
            );
            let steps = standbys::plan(replicas, ready, t.agents, due);
            if !steps.is_empty() {
                tracing::info!(
                    model = t.model,
                    pool = t.pool.as_str(),
                    replicas,
                    ready,
                    serving,
                    ?steps,
                    "standbys"
                );
                let agent_pool = self.cfg.agent_pool(t.pool);
                standbys::apply(&self.client, agent_pool, &steps, self.timeout).await;
            }
        })
    }
}
