//! The fleet simulator: many models sharing nodes and GPUs, each scaled on its own,
//! each start timed by the tier its model finds on the node it lands on (a standby
//! parked in host memory, the snapshot hot in page cache, staged on NVMe, or fetched
//! from the object store), under one policy at a time on the same trace and budgets.
//!
//! Each model runs the single-model simulation ([`crate::replay`]) with its capacity
//! scaled from the profile (an 8B model on one GPU) by `8 / params_b ×
//! gpus_per_replica`; the runs step together in time order, so every start sees the
//! fleet as the others left it. Every serving policy sizes each model's pools with
//! `preheat`'s single-model policy, so they differ in what their starts find:
//!
//! | policy | pools | starts find |
//! |---|---|---|
//! | `always-on` | one replica per pool at least, `preheat`'s policy above | what earlier starts left (least recently used out) |
//! | `zero-cold` | to zero | nothing: fetched from the object store, caches not restored |
//! | `serverlessllm` | to zero | staged and hot where the model last ran, least recently used out; placed where most local |
//! | `preheat` | to zero (`preheat`'s policy) | the fleet cache's plan ([`preheat_scaler::cache_plan`], carried out by `planner`) |
//! | `clairvoyant` | sized per minute in hindsight, each start one start-up ahead, none in a minute without requests | staged (its start-up), nothing parked |

mod nodes;
mod planner;
mod report;
mod run;

pub use report::{FleetPolicyReport, FleetReport, ModelReport, TierStarts};
pub use run::simulate;

/// The fleet policies, in report order.
pub const FLEET_POLICIES: [&str; 5] = [
    "always-on",
    "zero-cold",
    "serverlessllm",
    "preheat",
    "clairvoyant",
];

/// A fleet policy's name that is not one.
#[derive(Debug, thiserror::Error)]
#[error("unknown fleet policy {0:?} (expected one of: {list}, or all)", list = FLEET_POLICIES.join(", "))]
pub struct UnknownFleetPolicy(pub String);

/// The named fleet policies, `all` expanded, in report order.
pub fn fleet_policy_list(names: &[String]) -> Result<Vec<&'static str>, UnknownFleetPolicy> {
    if let Some(bad) = names
        .iter()
        .find(|n| *n != "all" && !FLEET_POLICIES.contains(&n.as_str()))
    {
        return Err(UnknownFleetPolicy(bad.clone()));
    }
    let all = names.iter().any(|n| n == "all");
    Ok(FLEET_POLICIES
        .into_iter()
        .filter(|p| all || names.iter().any(|n| n == p))
        .collect())
}

#[cfg(test)]
mod tests;
