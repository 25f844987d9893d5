//! `clairvoyant`: a reference, not a policy anyone can run. It knows the whole trace
//! and gives every minute the fewest prefill and decode replicas under which that
//! minute's requests meet their SLOs, starting them one start-up ahead. It bounds what
//! scaling can save on a trace: a policy that reacts to load cannot do better than
//! knowing it in advance, minute by minute, so when even this schedule is close to
//! `static-peak`, no causal policy can be clearly below it.
//!
//! The sizes are found by bisecting every minute at once: each round replays one
//! schedule (every minute at the middle of its bracket, replicas ready the moment
//! they are planned), and a minute where 99% of the requests met their SLOs keeps the
//! lower half of its bracket, the others the upper half (a request whose prompt is done
//! late counts against its minute's prefill, one slow to decode, or late on its first
//! token only for the wait for its K/V to land, against its decode).
//! Requests no size meets, not even the pools' maxima, count against no one. A minute
//! left short leaves a backlog for the next, which then looks short too: the plan errs
//! towards more replicas, never fewer. Prefill is bisected first, its pool simulated
//! alone (prompts are done without waiting on decode), then decode under the prefill
//! plan, which answers for first tokens late only for the wait for K/V to land:
//! 2 × ⌈log2(max replicas)⌉ + 1 replays in all, where a fixed-size run per candidate
//! size took one replay per size.

use super::autoscalers::{Autoscaler, PoolView};
use super::config::{SimConfig, StartClass};
use super::replay::{Outcome, Sim};
use super::trace::TraceRequest;

/// Seconds of a planned minute.
pub(crate) const MINUTE: f64 = 60.0;

/// Replicas per minute of the trace, applied one start-up ahead.
#[derive(Clone, Debug)]
pub struct Plan {
    per_minute: Vec<u32>,
    lead_s: f64,
    /// The fewest replicas it ever holds: 1 as a single-model reference (a pool
    /// always ready), 0 in a fleet, whose models idle for hours.
    floor: u32,
}

impl Plan {
    /// A schedule of replicas per minute, ready the moment they are planned (the
    /// bisection's own kind).
    pub(crate) fn per_minute(per_minute: Vec<u32>) -> Self {
        Plan {
            per_minute,
            lead_s: 0.0,
            floor: 1,
        }
    }

    fn at(&self, t: f64) -> u32 {
        let minute = |t: f64| (t.max(0.0) / MINUTE) as usize;
        // Replicas for a minute start a start-up before it begins and stay until it
        // ends (removed ones drain what they hold): every minute from now to one
        // start-up ahead counts, not just the two ends (a lead over a minute spans
        // minutes in between).
        let (from, to) = (minute(t), minute(t + self.lead_s));
        self.per_minute
            .get(from..=to.min(self.per_minute.len().saturating_sub(1)))
            .and_then(|m| m.iter().max().copied())
            .unwrap_or(0)
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
        self.at(v.t).max(self.floor)
    }
    fn observes(&self) -> bool {
        false
    }
    fn initial(&self) -> Option<u32> {
        Some(self.at(0.0).max(self.floor))
    }
    /// It knows the load: it starts replicas ahead instead of parking standbys.
    fn keeps_standbys(&self) -> bool {
        false
    }
}

/// Replicas of each pool per minute of the trace, each planned minute's replicas
/// started one start-up ahead (both pools' plans).
#[must_use]
pub fn plan(cfg: &SimConfig, trace: &[TraceRequest]) -> (Plan, Plan) {
    let minutes = trace.last().map_or(0.0, |r| r.t / MINUTE) as usize + 1;
    let minute_of = |r: &TraceRequest| ((r.t / MINUTE) as usize).min(minutes - 1);
    // The schedules are what each minute needs, not when to start it: replicas in them
    // are ready at once.
    let instant = {
        let mut c = cfg.clone();
        c.start = StartClass::Hot;
        c.with_startup_s(0.0)
    };
    let (mp, md) = (
        cfg.prefill.max_replicas.max(1),
        cfg.decode.max_replicas.max(1),
    );
    let sched = |per_minute: &[u32]| {
        Box::new(Plan {
            per_minute: per_minute.to_vec(),
            lead_s: 0.0,
            floor: 1,
        })
    };
    let replay = |prefill: &[u32], decode: &[u32]| -> Vec<Outcome> {
        Sim::new(&instant, trace, sched(prefill), sched(decode)).run_outcomes()
    };
    // Prompts done with decode plentiful. Without a shared host they do not depend on
    // decode at all: the prefill pool alone gives them (one decode replica, idle), at a
    // fraction of the cost. On one, busy decode replicas slow prefill. (The wait for
    // the K/V to land on decode is decode's to answer for.)
    let replay_prefill = |prefill: &[u32]| -> Vec<Outcome> {
        if instant.shared_host.is_some() {
            replay(prefill, &vec![md; minutes])
        } else {
            Sim::new(&instant, trace, sched(prefill), sched(&vec![1; minutes]))
                .prefill_only()
                .run_outcomes()
        }
    };
    let reachable = replay(&vec![mp; minutes], &vec![md; minutes]);
    // One pool's minutes bisected; decode's with prefill's schedule fixed at `other`.
    let bisect = |pool: usize, other: &[u32], max: u32| -> Vec<u32> {
        let (mut lo, mut hi) = (vec![1; minutes], vec![max; minutes]);
        while lo != hi {
            let tried: Vec<u32> = lo.iter().zip(&hi).map(|(l, h)| (l + h) / 2).collect();
            let outcomes = if pool == 0 {
                replay_prefill(&tried)
            } else {
                replay(other, &tried)
            };
            // Per minute: requests the maxima serve in time, and of those, missed.
            let mut tally = vec![(0u32, 0u32); minutes];
            for ((r, met), can) in trace.iter().zip(outcomes).zip(&reachable) {
                // A prompt computed on decode is the decode pool's to serve, first token
                // included.
                // A prompt done in time whose first token is late waited for its K/V to
                // land on decode: decode's miss.
                let landed = |o: &Outcome| o.decoded && (o.first || !o.prompt);
                let on_decode = cfg.prefills_on_decode(r);
                let (can, met) = match (pool, on_decode) {
                    (0, true) => continue,
                    (0, false) => (can.prompt, met.prompt),
                    (_, true) => (can.first && can.decoded, met.first && met.decoded),
                    (_, false) => (landed(can), landed(&met)),
                };
                if can {
                    let t = &mut tally[minute_of(r)];
                    t.0 += 1;
                    t.1 += u32::from(!met);
                }
            }
            for (m, &(n, missed)) in tally.iter().enumerate() {
                if lo[m] == hi[m] {
                    continue;
                }
                // Short when more than 1% of what could be served was missed: the
                // same 99% `static-peak` is held to, so one outlier in a busy minute
                // does not buy a replica for the whole minute.
                if missed > n / 100 {
                    lo[m] = tried[m] + 1;
                } else {
                    hi[m] = tried[m];
                }
            }
        }
        hi
    };
    // Prefill first, alone (first tokens do not wait on decode); then
    // decode under that prefill plan (what reaches decode, and when, depends on it).
    // Bisected together, a minute's decode looked short whenever a too-small prefill
    // guess released a backlog into it, and kept the replicas it never needed.
    let prefill = bisect(0, &[], mp);
    let decode = bisect(1, &prefill, md);
    // Without standbys of its own, every start it makes takes the full (hot) time.
    let lead_s = if cfg.start == StartClass::Standby {
        cfg.profile.startup_s.hot
    } else {
        cfg.startup_s()
    };
    (
        Plan {
            per_minute: prefill,
            lead_s,
            floor: 1,
        },
        Plan {
            per_minute: decode,
            lead_s,
            floor: 1,
        },
    )
}

impl Plan {
    /// The same schedule for a model of a fleet: no replica in a minute in which none
    /// of its requests arrives nor did in the minute before (what arrived then may
    /// still be decoding; replicas removed drain what they hold), each later minute's
    /// replicas still started a start-up ahead.
    #[must_use]
    pub(crate) fn at_zero_when_idle(mut self, trace: &[TraceRequest]) -> Self {
        let mut busy = vec![false; self.per_minute.len()];
        for r in trace {
            let m = (r.t / MINUTE) as usize;
            for k in [m, m + 1] {
                if let Some(b) = busy.get_mut(k) {
                    *b = true;
                }
            }
        }
        for (n, b) in self.per_minute.iter_mut().zip(&busy) {
            if !b {
                *n = 0;
            }
        }
        // The minute after the last arrival is held as every other such minute is.
        if let Some(&last) = self.per_minute.last()
            && busy.last() == Some(&true)
        {
            self.per_minute.push(last);
        }
        self.floor = 0;
        self
    }
}

#[cfg(test)]
mod fleet_tests {
    use super::*;

    fn at(t: f64) -> TraceRequest {
        TraceRequest {
            t,
            input_tokens: 100,
            output_tokens: 10,
            blocks: Vec::new(),
        }
    }

    /// In a fleet a model idles for hours: its schedule holds nothing in a minute with
    /// no arrival nor one the minute before, and still starts ahead of the next.
    #[test]
    fn a_fleet_schedule_goes_to_zero_between_its_models_stretches() {
        let trace = [at(10.0), at(310.0)];
        let mut plan = Plan::per_minute(vec![2; 6]).at_zero_when_idle(&trace);
        assert_eq!(plan.per_minute, [2, 2, 0, 0, 0, 2, 2]);
        assert_eq!(plan.at(150.0), 0);
        plan.lead_s = 70.0;
        assert_eq!(plan.at(235.0), 2, "minute 5's replicas start a lead ahead");
        assert_eq!(plan.floor, 0);
    }
}
