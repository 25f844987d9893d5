//! `clairvoyant`: a reference, not a policy anyone can run. It knows the whole trace
//! and gives every minute the fewest prefill replicas under which that minute's
//! requests met their SLOs in fixed-size runs, starting them one start-up ahead; decode
//! stays at `static-peak`'s size. It bounds what scaling can save on a trace: a
//! policy that reacts to load cannot do better than knowing it in advance, minute by
//! minute, so when even this schedule is close to `static-peak`, no causal policy can
//! be clearly below it.

use super::autoscalers::{Autoscaler, PoolView, Static};
use super::config::SimConfig;
use super::replay::Sim;
use super::trace::TraceRequest;

const MINUTE: f64 = 60.0;

/// Prefill replicas per minute of the trace, applied one start-up ahead.
#[derive(Clone, Debug)]
pub struct Plan {
    per_minute: Vec<u32>,
    lead_s: f64,
}

impl Plan {
    fn at(&self, t: f64) -> u32 {
        let minute = |t: f64| (t.max(0.0) / MINUTE) as usize;
        let get = |i: usize| self.per_minute.get(i).copied().unwrap_or(0);
        // Replicas for the next minute start a start-up before it begins; the current
        // minute's stay until it ends (removed ones drain what they hold).
        get(minute(t)).max(get(minute(t + self.lead_s)))
    }
}

impl Autoscaler for Plan {
    fn period_s(&self) -> f64 {
        1.0
    }
    fn wakes_on_arrival(&self) -> bool {
        false
    }
    fn decide(&mut self, v: &PoolView) -> u32 {
        self.at(v.t).max(1)
    }
    fn initial(&self) -> Option<u32> {
        Some(self.at(0.0).max(1))
    }
    /// It knows the load: it starts replicas ahead instead of parking standbys.
    fn keeps_standbys(&self) -> bool {
        false
    }
}

/// Plans prefill replicas from fixed-size runs of 1..=`peak` replicas (decode fixed at
/// `decode`): each request needs the smallest size it attained under (`peak` if none),
/// each minute the most any of its requests needed.
#[must_use]
pub fn prefill_plan(cfg: &SimConfig, trace: &[TraceRequest], peak: u32, decode: u32) -> Plan {
    let mut need = vec![peak; trace.len()];
    for n in (1..peak).rev() {
        let (_, attained) =
            Sim::new(cfg, trace, Box::new(Static(n)), Box::new(Static(decode))).run_detailed();
        let mut any = false;
        for (need, ok) in need.iter_mut().zip(attained) {
            if ok && *need == n + 1 {
                *need = n;
                any = true;
            }
        }
        // A request met at n+1 but not at n needs n+1; smaller sizes cannot lower it.
        if !any {
            break;
        }
    }
    let minutes = trace.last().map_or(0.0, |r| r.t / MINUTE) as usize + 1;
    let mut per_minute = vec![1; minutes];
    for (r, n) in trace.iter().zip(need) {
        let m = &mut per_minute[(r.t / MINUTE) as usize];
        *m = (*m).max(n);
    }
    // Without standbys of its own, every start it makes takes the full (hot) time.
    let lead_s = if cfg.start == super::StartClass::Standby {
        cfg.profile.startup_s.hot
    } else {
        cfg.startup_s()
    };
    Plan { per_minute, lead_s }
}
