//! How a decision changes a pool: replicas added (each paying its start-up, or a
//! parked standby's promotion) and removed (starting ones first, then the least loaded
//! drain, as a Deployment scaled down with preheat's drain hook would).

use preheat_scaler::policy::Pool;

use crate::cluster::{DecodeReplica, PrefillReplica};
use crate::config::StartClass;
use crate::replay::Sim;

impl Sim<'_> {
    /// Applies a decision at once: new replicas serve after the start-up time (a
    /// parked standby's when one is left), removed ones go as the Deployment would.
    pub(crate) fn apply(&mut self, pool: Pool, desired: u32, current: u32) {
        let t = self.t;
        if desired == current {
            return;
        }
        let ctl = &mut self.ctl[pool];
        ctl.events += 1;
        if desired > current {
            let add = desired - current;
            let standby = self.cfg.start == StartClass::Standby && ctl.scaler.keeps_standbys();
            let hot = self.cfg.profile.startup_s.hot;
            ctl.parked += ctl.refilling.iter().filter(|&&r| r <= t).count() as u32;
            ctl.refilling.retain(|&r| r > t);
            for _ in 0..add {
                let (ready_at, node) = if let Some(place) = self.placement.as_mut() {
                    // No GPU in the fleet: the rest wait for the next decision.
                    let Some(s) = place.start(t) else {
                        break;
                    };
                    ctl.measured_startup = Some(s.ready_in);
                    (t + s.ready_in, s.node)
                } else if !standby {
                    (t + self.startup, 0)
                } else if ctl.parked > 0 {
                    ctl.parked -= 1;
                    ctl.refilling.push(t + hot);
                    (t + self.startup, 0)
                } else {
                    (t + hot, 0)
                };
                ctl.starts += 1;
                match pool {
                    Pool::Prefill => {
                        let mut r = PrefillReplica::new(ready_at, self.cache_blocks);
                        r.node = node;
                        self.prefill.push(r);
                    }
                    Pool::Decode => {
                        let mut r = DecodeReplica::new(ready_at).with_id(self.next_decode_id);
                        r.node = node;
                        self.decode.push(r);
                        self.next_decode_id += 1;
                    }
                }
            }
        } else {
            let mut remove = current - desired;
            // Replicas still starting go first (nothing to drain), newest first; then
            // the least loaded ready ones drain.
            match pool {
                Pool::Prefill => remove_replicas(
                    &mut self.prefill,
                    &mut remove,
                    |r| r.draining,
                    |r| r.is_ready(t),
                    |r| r.backlog_s(t),
                    |r| r.draining = true,
                    &mut ctl.retired_busy,
                    |r| r.busy_s,
                    |r| {
                        if let Some(p) = self.placement.as_mut() {
                            p.stop(r.node);
                        }
                    },
                ),
                Pool::Decode => remove_replicas(
                    &mut self.decode,
                    &mut remove,
                    |r| r.draining,
                    |r| r.is_ready(t),
                    |r| r.kv_held() + r.running() as f64,
                    |r| r.draining = true,
                    &mut ctl.retired_busy,
                    |r| r.busy_s,
                    |r| {
                        if let Some(p) = self.placement.as_mut() {
                            p.stop(r.node);
                        }
                    },
                ),
            }
        }
        let n = self.current(pool);
        let ctl = &mut self.ctl[pool];
        ctl.max_replicas = ctl.max_replicas.max(n);
        self.retire_drained();
    }
}

/// Removes `remove` replicas: starting ones outright (newest first), then marks the
/// least loaded ready ones draining.
#[allow(clippy::too_many_arguments)]
fn remove_replicas<R>(
    reps: &mut Vec<R>,
    remove: &mut u32,
    draining: impl Fn(&R) -> bool,
    ready: impl Fn(&R) -> bool,
    load: impl Fn(&R) -> f64,
    mut drain: impl FnMut(&mut R),
    retired_busy: &mut f64,
    busy: impl Fn(&R) -> f64,
    mut removed: impl FnMut(&R),
) {
    while *remove > 0 {
        // Never routed to, so holding no prefix-index slot.
        let Some(i) = reps.iter().rposition(|r| !draining(r) && !ready(r)) else {
            break;
        };
        *retired_busy += busy(&reps[i]);
        removed(&reps[i]);
        reps.remove(i);
        *remove -= 1;
    }
    while *remove > 0 {
        let Some(i) = reps
            .iter()
            .enumerate()
            .filter(|(_, r)| !draining(r))
            .min_by(|a, b| load(a.1).total_cmp(&load(b.1)))
            .map(|(i, _)| i)
        else {
            break;
        };
        drain(&mut reps[i]);
        *remove -= 1;
    }
}
