//! The scaling policy: desired replicas per pool from signals, SLOs and the capacity
//! profile. Pure and clocked by the caller, so the KEDA scaler, local mode and the
//! simulator run exactly the same code.
//!
//! - **Prefill**: the larger of two sizes, then a backlog's share. *Hindsight*: the
//!   fewest fixed replicas that would have served the last `burst_memory_s` of uncached
//!   prompt arrivals within the TTFT SLO ([`hindsight`]; bursts that come faster than a
//!   replica starts are met only by replicas kept for them). *Forecast*: prompt tokens/s
//!   expected one start-up ahead (Holt; the lead is the measured start time of a
//!   replica) at a planning utilisation. A queued backlog adds replicas only for what
//!   the pool's spare capacity cannot clear before they would serve. Raised when
//!   observed TTFT exceeds the SLO while a queue persists.
//! - **Decode**: concurrent sequences and KV tokens expected ahead, over one replica's
//!   batch size at the ITL SLO and its KV capacity; raised when observed ITL exceeds
//!   the SLO or KV pressure is high.
//! - **Season** (`season_period_s`, daily by default): each pool's load by time of
//!   day (or week), learnt per bucket over earlier periods ([`season`]); the most it
//!   expects up to when new replicas would serve, scaled by today's level against the
//!   season's now, sizes the pool like a forecast, so a ramp that recurs is met one
//!   lead before it shows. A restarted scaler reads it back from Prometheus.
//! - **Scheduled floors** (`schedule`): an operator's known peaks, as cron starts with a
//!   duration; each floor holds from one lead before its start (the longest start-up
//!   measured, at least the default, plus actuation), so the replicas are serving when
//!   the peak begins.
//! - Scale-up is immediate (a burst is answered in the tick it is seen); scale-down waits
//!   a stabilisation window and then steps down gradually; a pool with work in flight
//!   or queued never goes to zero; a pool goes to zero after an idle grace period, and
//!   comes back at once when the gateway holds requests for it.

pub mod cron;
mod decode;
pub mod forecast;
pub mod hindsight;
mod pool_policy;
mod prefill;
pub mod season;
mod season_outlook;

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use self::cron::Cron;
use self::decode::DecodeSizer;
pub use self::pool_policy::{PoolPolicy, ScheduledFloor};
use self::prefill::PrefillSizer;
use self::season::Season;
use self::season_outlook::SeasonOutlook;
use crate::profile::Profile;
use crate::signals::PoolSignals;

/// Which pool a decision is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    Prefill,
    Decode,
}

impl Pool {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }

    /// Parses `prefill` / `decode`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "prefill" => Some(Pool::Prefill),
            "decode" => Some(Pool::Decode),
            _ => None,
        }
    }
}

/// Share of the recent window's prompt tokens the hindsight size must serve in time.
const HINDSIGHT_TARGET: f64 = 0.995;
/// Utilisation the forecast load is planned at once the window knows the load.
const FORECAST_UTIL: f64 = 0.85;

/// The share of a decode replica's KV cache the pool is sized to fill.
const KV_TARGET: f64 = 0.85;
/// Share of a replica's profiled prefill rate the hindsight replay counts on. The
/// replay pools every replica's capacity into one fluid queue and spreads a scrape
/// interval's arrivals evenly; real prompts are served whole by one replica each, land
/// where the KV-aware router sends them and arrive in clumps. Set where the shipped
/// policy holds 99% on the steady shared trace and the 30x day (`simulate`; 0.85 gave
/// 98.8% and 97.4%): BENCHMARKS.md, issue #15. The simulator counts prompt tokens as
/// they arrive; engines count them as they are prefilled, so a burst that queues
/// reaches the scaler flattened to the pool's rate (its queue is counted as backlog),
/// and one wait limit (the mean prompt's) is applied to every prompt in the window.
const HINDSIGHT_UTIL: f64 = 0.65;
/// Seconds of arrivals the hindsight size needs before it is trusted.
const HINDSIGHT_MIN_S: f64 = 60.0;
/// Longest floor: the policy scans its minutes each tick.
const MAX_FLOOR_S: f64 = 7.0 * 86_400.0;
/// What new replicas need beyond their own start-up before they serve: a scaler tick,
/// HPA's 15 s sync and its scale-up pacing, pod scheduling.
const ACTUATION_S: f64 = 30.0;
/// Longest lead a floor is raised ahead by (a bogus start-up reading must not keep
/// it up for ever).
const MAX_FLOOR_LEAD_S: f64 = 3600.0;

/// What the policy sees at a tick.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observation {
    pub signals: PoolSignals,
    /// Replicas that exist now (ready or starting).
    pub current: u32,
    /// Requests the gateway holds for this pool (pool at zero).
    pub held_requests: f64,
    /// Measured start-up time of a replica of this pool, if known.
    pub measured_startup_s: Option<f64>,
    /// Mean prompt length over the window, if known.
    pub mean_prompt_len: Option<f64>,
    /// Decode only: mean tokens held per running sequence (prompt + generated so far).
    pub mean_seq_tokens: Option<f64>,
    /// Wall-clock time (Unix seconds, UTC) for scheduled floors; `None`: none apply.
    pub unix_time: Option<f64>,
}

/// A decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub desired: u32,
    /// KEDA activation: false lets the pool go to zero.
    pub active: bool,
    /// Why, for logs and the simulator's report.
    pub reason: &'static str,
}

/// What the last decision saw of the pool's load and what it made of it, for the
/// scaler's metrics and `preheat status` (the policy decides without it).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoadView {
    /// The load now, in the pool's unit: uncached prompt tokens/s (prefill) or
    /// generated tokens/s (decode).
    pub observed: f64,
    /// The forecast of that load one lead time ahead.
    pub forecast: f64,
    /// The lead time: a replica's measured start-up, or the configured default.
    pub lead_s: f64,
    /// Replicas the load needs, with the configured headroom, before limits, rounding
    /// and damping.
    pub needed: f64,
}

/// The `preheat` policy for one pool, with its memory (forecast, stabilisation).
#[derive(Clone, Debug)]
pub struct PreheatPolicy {
    pub pool: Pool,
    pub cfg: PoolPolicy,
    pub profile: Profile,
    /// The pool's own load model.
    sizer: Sizer,
    /// (time, raw desired) over the stabilisation window.
    recent: VecDeque<(f64, u32)>,
    idle_since: Option<f64>,
    last_scale_down: f64,
    /// The last scale-down step's target and the replicas it stepped from, answered
    /// until the pool gets there or the load needs more: HPA reads the answer on its own
    /// sync period, and a step said for one tick is missed by every sync that falls
    /// between. A pool raised above where it stepped from (a floor, a person) drops it.
    step_target: Option<(u32, u32)>,
    /// When this policy first decided: it removes nothing before it has watched the
    /// load for a stabilisation window (a restarted scaler knows no history).
    first_seen: Option<f64>,
    last_load: Option<LoadView>,
    /// `cfg.schedule`, parsed (entries that do not parse were refused by validation).
    schedule: Vec<(Cron, f64, u32)>,
    /// The longest start-up measured so far: a floor wakes a pool at zero, where no
    /// start-up is measured, and its lead must not shrink when replicas come up (the
    /// window would close before its start and reopen at zero).
    longest_startup_s: f64,
    /// The load by time of day (or week) learnt over earlier periods.
    season: SeasonOutlook,
}

/// One load model per pool: what each pool's replicas are sized by.
#[derive(Clone, Debug)]
enum Sizer {
    Prefill(PrefillSizer),
    Decode(DecodeSizer),
}

/// What a sizer reads besides the observation: the tick, the lead, the pool's
/// settings and capacity, and the season it records its load into.
struct Sizing<'a> {
    t: f64,
    /// Seconds before a replica asked for now would serve.
    lead: f64,
    cfg: &'a PoolPolicy,
    profile: &'a Profile,
    season: &'a mut SeasonOutlook,
}

impl PreheatPolicy {
    #[must_use]
    pub fn new(pool: Pool, cfg: PoolPolicy, profile: Profile) -> Self {
        let schedule = cfg
            .schedule
            .iter()
            .filter_map(|f| {
                Some((
                    Cron::parse(&f.cron).ok()?,
                    f.duration_s.clamp(0.0, MAX_FLOOR_S),
                    f.min_replicas,
                ))
            })
            .collect();
        let season = Season::new(cfg.season_period_s, cfg.season_bucket_s);
        PreheatPolicy {
            pool,
            cfg,
            profile,
            sizer: match pool {
                Pool::Prefill => Sizer::Prefill(PrefillSizer::default()),
                Pool::Decode => Sizer::Decode(DecodeSizer::default()),
            },
            recent: VecDeque::new(),
            idle_since: None,
            last_scale_down: f64::NEG_INFINITY,
            step_target: None,
            first_seen: None,
            last_load: None,
            schedule,
            longest_startup_s: 0.0,
            season: SeasonOutlook::new(season),
        }
    }

    /// Fills the season's unlearnt buckets with rates read before this policy started
    /// (a restarted scaler reads them back from Prometheus): (Unix time, mean rate over
    /// the bucket before it), in the pool's unit before prefix caching (`uncached` of
    /// prompt tokens are not served from caches). Returns the points taken.
    pub fn seed_season(&mut self, now_unix: f64, points: &[(f64, f64)], uncached: f64) -> usize {
        let Some(season) = &mut self.season.season else {
            return 0;
        };
        let share = match self.pool {
            Pool::Prefill if uncached.is_finite() => uncached.clamp(0.0, 1.0),
            Pool::Prefill | Pool::Decode => 1.0,
        };
        let points: Vec<(f64, f64)> = points.iter().map(|&(t, r)| (t, r * share)).collect();
        season.seed(now_unix, &points)
    }

    /// What the season has learnt, for the state file; `None`: off.
    #[must_use]
    pub fn season_state(&self) -> Option<season::SeasonState> {
        self.season.season.as_ref().map(Season::state)
    }

    /// Takes back a season saved by an earlier run (see [`Season::restore`]): what it
    /// took, or why it was refused (this pool's season is off, too).
    pub fn restore_season(
        &mut self,
        st: &season::SeasonState,
        now_unix: f64,
    ) -> Result<season::Restored, String> {
        match &mut self.season.season {
            Some(season) => season.restore(st, now_unix),
            None => Err("seasonality is off for this pool (season_period_s: 0)".into()),
        }
    }

    /// The season's bucket and period, for reading it back; `None`: off.
    #[must_use]
    pub fn season_buckets(&self) -> Option<(f64, f64)> {
        self.season
            .season
            .as_ref()
            .map(|s| (s.bucket_s(), s.period_s()))
    }

    /// The scheduled floor at Unix time `now` for replicas that take `lead` seconds
    /// to serve: an entry counts from `lead` before a start until `duration_s` after.
    #[must_use]
    pub fn scheduled_floor(&self, now: f64, lead: f64) -> u32 {
        let mut floor = 0;
        for (cron, duration, min) in &self.schedule {
            if *min <= floor {
                continue;
            }
            // Starts F (minute marks) with now - duration < F <= now + lead.
            let first = ((now - duration) / 60.0).floor() as i64 + 1;
            let last = ((now + lead.max(0.0)) / 60.0).floor() as i64;
            if (first..=last).any(|m| cron.fires(m)) {
                floor = *min;
            }
        }
        floor
    }

    /// Fills an empty hindsight window with arrivals seen before this policy started
    /// (a restarted scaler reads them back from Prometheus): `points` are (seconds
    /// before `t`, prompt tokens/s), each the rate over the `step_s` before it, of
    /// which `uncached` is not served from prefix caches. Returns the points taken;
    /// none once the window holds arrivals of its own.
    pub fn seed_arrivals(
        &mut self,
        t: f64,
        step_s: f64,
        points: &[(f64, f64)],
        uncached: f64,
    ) -> usize {
        if self.pool != Pool::Prefill {
            return 0;
        }
        let uncached = if uncached.is_finite() {
            uncached.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let points: Vec<(f64, f64)> = points.iter().map(|&(age, r)| (age, r * uncached)).collect();
        match &mut self.sizer {
            Sizer::Prefill(sizer) => {
                sizer.seed_arrivals(t, step_s, &points, self.cfg.burst_memory_s)
            }
            Sizer::Decode(_) => 0,
        }
    }

    /// The load the last decision sized for; `None` before one, and while blind.
    #[must_use]
    pub fn last_load(&self) -> Option<LoadView> {
        self.last_load
    }

    /// Replicas needed for the observed and forecast load, with the configured
    /// headroom, before limits and damping.
    fn raw_desired(&mut self, t: f64, o: &Observation) -> f64 {
        let n = self.needed(t, o) * self.cfg.headroom;
        // What status and explain show is what the decision used.
        if let Some(load) = &mut self.last_load {
            load.needed = n;
        }
        n
    }

    /// Replicas the load model says are needed.
    fn needed(&mut self, t: f64, o: &Observation) -> f64 {
        // A pool at zero has nothing to measure: its next start takes as long as the
        // longest seen (at least the default), as for scheduled floors.
        let lead = o
            .measured_startup_s
            .filter(|l| l.is_finite() && *l >= 0.0)
            .unwrap_or(self.longest_startup_s.max(self.cfg.default_lead_s))
            .min(MAX_FLOOR_LEAD_S);
        let mut ctx = Sizing {
            t,
            lead,
            cfg: &self.cfg,
            profile: &self.profile,
            season: &mut self.season,
        };
        let view = match &mut self.sizer {
            Sizer::Prefill(sizer) => sizer.need(&mut ctx, o),
            Sizer::Decode(sizer) => sizer.need(&mut ctx, o),
        };
        self.last_load = Some(view);
        view.needed
    }

    /// Decides desired replicas at time `t` (seconds, monotonic).
    pub fn decide(&mut self, t: f64, o: &Observation) -> Decision {
        self.first_seen.get_or_insert(t);
        let s = &o.signals;
        if let Some(s) = o.measured_startup_s.filter(|s| s.is_finite()) {
            self.longest_startup_s = self.longest_startup_s.max(s);
        }
        let lead = (self.longest_startup_s.max(self.cfg.default_lead_s) + ACTUATION_S)
            .min(MAX_FLOOR_LEAD_S);
        let scheduled = o
            .unix_time
            .filter(|t| t.is_finite())
            .map_or(0, |now| self.scheduled_floor(now, lead))
            .min(self.cfg.max_replicas);
        // The floor this tick: the configured one, or a scheduled one above it.
        let min = self.cfg.min_replicas.max(scheduled);
        // Work in flight or queued: never zero. Traffic of any kind: not idle.
        let work = s.running + s.waiting + s.queued_prompt_tokens + o.held_requests > 0.0;
        let traffic = work || s.prompt_rate > 0.0 || s.generation_rate > 0.0;
        self.last_load = None;
        if s.is_blind() {
            // Nothing known: hold (a dead endpoint is not an idle one), but answer
            // requests the gateway holds.
            self.idle_since = None;
            let desired = o
                .current
                .max(u32::from(o.held_requests > 0.0))
                .clamp(min, self.cfg.max_replicas);
            return Decision {
                desired,
                // Holding means holding: a pool at zero stays inactive (KEDA would
                // otherwise start a replica nobody asked for).
                active: desired > 0,
                reason: "metrics unavailable: holding",
            };
        }
        let raw = self.raw_desired(t, o);
        // Traffic, or the season expecting a replica's load before new ones would serve
        // (a recurring ramp wakes a pool at zero one lead ahead of it).
        let busy = traffic || self.season.expects;
        let mut desired = raw.ceil().clamp(0.0, self.cfg.max_replicas as f64) as u32;
        if work {
            desired = desired.max(1);
        }
        let by_schedule = desired < scheduled && scheduled > self.cfg.min_replicas;
        desired = desired.clamp(min, self.cfg.max_replicas);
        // Idle tracking for scale to zero.
        if busy {
            self.idle_since = None;
        } else if self.idle_since.is_none() {
            self.idle_since = Some(t);
        }
        let idle_long = self
            .idle_since
            .is_some_and(|i| t - i >= self.cfg.idle_grace_s);
        self.recent.push_back((t, desired));
        while self
            .recent
            .front()
            .is_some_and(|(ts, _)| *ts < t - self.cfg.scale_down_stabilization_s)
        {
            self.recent.pop_front();
        }
        if o.held_requests > 0.0 && o.current == 0 {
            return Decision {
                desired: desired.max(1),
                active: true,
                reason: "requests held at zero: activate",
            };
        }
        if desired >= o.current {
            self.step_target = None;
            let reason = if desired > o.current && by_schedule {
                "scheduled floor"
            } else if desired > o.current {
                "scale up"
            } else {
                "steady"
            };
            // A pool at zero with nothing to do stays there: waking it costs a start.
            let idle_at_zero = o.current == 0 && desired == 0 && !busy;
            let active = !(idle_at_zero || idle_long && min == 0 && !busy);
            if !active {
                return Decision {
                    desired: 0,
                    active: false,
                    reason: if idle_at_zero {
                        "idle at zero"
                    } else {
                        "idle past grace: scale to zero"
                    },
                };
            }
            return Decision {
                desired,
                active: true,
                reason,
            };
        }
        // Scale down: only to the highest desired seen over the stabilisation window,
        // one step at a time.
        let window_max = self.recent.iter().map(|(_, d)| *d).max().unwrap_or(desired);
        if idle_long && min == 0 && !busy {
            return Decision {
                desired: 0,
                active: false,
                reason: "idle past grace: scale to zero",
            };
        }
        // Zero is reached only through the idle grace above.
        let floor = window_max.max(desired).max(1);
        let watched = t - self.first_seen.unwrap_or(t);
        if floor >= o.current || self.step_target.is_some_and(|s| o.current > s.1) {
            self.step_target = None;
        }
        if floor >= o.current
            || watched < self.cfg.scale_down_stabilization_s
            || t - self.last_scale_down < self.cfg.scale_down_stabilization_s / 4.0
        {
            // Between steps, the step taken stands until the pool is there.
            if let Some((step, _)) = self.step_target.filter(|s| s.0 < o.current) {
                return Decision {
                    desired: step.max(floor).max(min),
                    active: true,
                    reason: "scale down",
                };
            }
            return Decision {
                desired: o.current,
                active: true,
                reason: "scale down deferred (stabilisation)",
            };
        }
        let step = ((o.current as f64 * self.cfg.scale_down_step).ceil() as u32).max(1);
        self.last_scale_down = t;
        let mut target = floor.max(o.current.saturating_sub(step)).max(min);
        if let Some((prev, _)) = self.step_target {
            target = target.min(prev.max(floor).max(min));
        }
        self.step_target = Some((target, o.current));
        Decision {
            desired: target,
            active: true,
            reason: "scale down",
        }
    }
}

#[cfg(test)]
mod tests;
