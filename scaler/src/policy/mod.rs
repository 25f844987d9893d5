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
pub mod forecast;
pub mod hindsight;
pub mod season;

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use self::cron::Cron;
use self::forecast::Holt;
use self::hindsight::{ArrivalHistory, ServiceModel};
use self::season::Season;
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

/// Targets and limits of one pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolPolicy {
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// Time to first token target (seconds) for prompts up to `slo_ttft_ref_tokens`.
    pub slo_ttft_s: f64,
    /// Longer prompts get a proportionally longer TTFT target: prefill time grows with
    /// the prompt, so a fixed target would be unreachable for long-context requests
    /// however many replicas run.
    pub slo_ttft_ref_tokens: f64,
    /// Inter-token latency target (seconds).
    pub slo_itl_s: f64,
    /// Seconds desired must stay below current before replicas are removed.
    pub scale_down_stabilization_s: f64,
    /// Fraction of current replicas removed per scale-down step (at least one).
    pub scale_down_step: f64,
    /// Seconds with nothing running, queued or held before the pool goes to zero
    /// (only when `min_replicas` is 0).
    pub idle_grace_s: f64,
    /// Seconds of prompt arrivals the prefill pool is sized in hindsight over (the
    /// fewest fixed replicas that would have served them): bursts recur, and one
    /// shorter than a start-up can only be met by replicas already running. 0 keeps
    /// only the latest interval.
    pub burst_memory_s: f64,
    /// Start-up lead time used for the forecast when no start has been measured.
    pub default_lead_s: f64,
    /// Mean prompt length assumed before any traffic is seen.
    pub default_prompt_len: f64,
    /// Factor on the replicas the load model says are needed: above 1 buys SLO margin
    /// with GPUs, below 1 saves GPUs at the SLO's expense. The one knob that moves
    /// this policy along its cost/attainment frontier (`simulate --frontier`).
    pub headroom: f64,
    /// Floors for peaks the operator knows (`[{cron: "0 8 * * 1-5", duration_s:
    /// 36000, min_replicas: 4}]`).
    pub schedule: Vec<ScheduledFloor>,
    /// The period the load repeats over, seconds (86400: daily; 604800: weekly; 0:
    /// off). The pool is sized ahead, by one lead, for the load seen at that time of
    /// the period before (blended over periods, scaled by today's level).
    pub season_period_s: f64,
    /// The period's buckets, seconds: the load is learnt as a mean per bucket.
    pub season_bucket_s: f64,
}

/// At least `min_replicas` from each time `cron` fires (UTC) for `duration_s`; ready
/// by then: the floor is raised one start-up lead earlier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduledFloor {
    /// Five-field cron expression (minute hour day-of-month month day-of-week), UTC.
    pub cron: String,
    /// How long the floor holds after each start, seconds (at most a week).
    pub duration_s: f64,
    pub min_replicas: u32,
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

impl Default for PoolPolicy {
    fn default() -> Self {
        PoolPolicy {
            min_replicas: 0,
            max_replicas: 64,
            slo_ttft_s: 2.0,
            slo_ttft_ref_tokens: 8192.0,
            slo_itl_s: 0.05,
            scale_down_stabilization_s: 300.0,
            scale_down_step: 0.25,
            idle_grace_s: 300.0,
            burst_memory_s: 600.0,
            default_lead_s: 60.0,
            default_prompt_len: 2048.0,
            headroom: 1.0,
            schedule: Vec::new(),
            season_period_s: 86_400.0,
            season_bucket_s: 300.0,
        }
    }
}

impl PoolPolicy {
    /// Whether `key` names one of these settings as a config file spells it (a pool's
    /// other keys say where its metrics come from: a deployment's, not a policy's).
    #[must_use]
    pub fn has_key(key: &str) -> bool {
        serde_json::to_value(PoolPolicy::default()).is_ok_and(|v| v.get(key).is_some())
    }

    /// The TTFT target of a prompt of `len` tokens.
    #[must_use]
    pub fn ttft_slo_for(&self, len: f64) -> f64 {
        self.slo_ttft_s * (len / self.slo_ttft_ref_tokens).max(1.0)
    }

    /// Every problem with the values at once.
    pub fn validate(&self, what: &str) -> Vec<String> {
        let mut e = Vec::new();
        if self.min_replicas > self.max_replicas {
            e.push(format!(
                "{what}: min_replicas {} > max_replicas {}",
                self.min_replicas, self.max_replicas
            ));
        }
        if self.max_replicas == 0 {
            e.push(format!("{what}: max_replicas must be > 0"));
        }
        for (n, v) in [
            ("slo_ttft_s", self.slo_ttft_s),
            ("slo_itl_s", self.slo_itl_s),
            ("slo_ttft_ref_tokens", self.slo_ttft_ref_tokens),
            ("default_prompt_len", self.default_prompt_len),
            ("headroom", self.headroom),
        ] {
            if !(v.is_finite() && v > 0.0) {
                e.push(format!("{what}: {n} must be > 0"));
            }
        }
        for (n, v) in [
            (
                "scale_down_stabilization_s",
                self.scale_down_stabilization_s,
            ),
            ("idle_grace_s", self.idle_grace_s),
            ("burst_memory_s", self.burst_memory_s),
            ("default_lead_s", self.default_lead_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                e.push(format!("{what}: {n} must be >= 0"));
            }
        }
        if !(self.scale_down_step > 0.0 && self.scale_down_step <= 1.0) {
            e.push(format!("{what}: scale_down_step must be in (0, 1]"));
        }
        e.extend(
            season::problems(self.season_period_s, self.season_bucket_s)
                .into_iter()
                .map(|p| format!("{what}: {p}")),
        );
        for (i, f) in self.schedule.iter().enumerate() {
            let at = format!("{what}: schedule[{i}]");
            if let Err(err) = Cron::parse(&f.cron) {
                e.push(format!("{at}.cron: {err}"));
            }
            if !(f.duration_s > 0.0 && f.duration_s <= MAX_FLOOR_S) {
                e.push(format!(
                    "{at}.duration_s must be in (0, {MAX_FLOOR_S}], got {}",
                    f.duration_s
                ));
            }
            if f.min_replicas > self.max_replicas {
                e.push(format!(
                    "{at}.min_replicas {} > max_replicas {}",
                    f.min_replicas, self.max_replicas
                ));
            }
        }
        e
    }
}

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
    demand: Holt,
    /// (time, raw desired) over the stabilisation window.
    recent: VecDeque<(f64, u32)>,
    idle_since: Option<f64>,
    last_scale_down: f64,
    /// Prefill: uncached prompt tokens per policy tick over the burst memory.
    arrivals: ArrivalHistory,
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
    /// The load by time of day (or week) learnt over earlier periods; `None`: off.
    season: Option<Season>,
    /// The last decision's season expected at least a replica's load before new
    /// replicas would serve: the pool is not idle (a pool at zero is woken for it).
    season_expects: bool,
}

/// Most today's load may stand above the season's before the season's outlook is
/// scaled by it: a spike must not multiply a whole ramp.
const MAX_SEASON_LEVEL: f64 = 1.5;
/// Share of one replica's load the season must expect before it wakes a pool at zero.
const WAKE_SHARE: f64 = 0.25;

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
            demand: Holt::default(),
            recent: VecDeque::new(),
            idle_since: None,
            last_scale_down: f64::NEG_INFINITY,
            arrivals: ArrivalHistory::default(),
            step_target: None,
            first_seen: None,
            last_load: None,
            schedule,
            longest_startup_s: 0.0,
            season,
            season_expects: false,
        }
    }

    /// Fills the season's unlearnt buckets with rates read before this policy started
    /// (a restarted scaler reads them back from Prometheus): (Unix time, mean rate over
    /// the bucket before it), in the pool's unit before prefix caching (`uncached` of
    /// prompt tokens are not served from caches). Returns the points taken.
    pub fn seed_season(&mut self, now_unix: f64, points: &[(f64, f64)], uncached: f64) -> usize {
        let Some(season) = &mut self.season else {
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
        self.season.as_ref().map(Season::state)
    }

    /// Takes back a season saved by an earlier run (see [`Season::restore`]): what it
    /// took, or why it was refused (this pool's season is off, too).
    pub fn restore_season(
        &mut self,
        st: &season::SeasonState,
        now_unix: f64,
    ) -> Result<season::Restored, String> {
        match &mut self.season {
            Some(season) => season.restore(st, now_unix),
            None => Err("seasonality is off for this pool (season_period_s: 0)".into()),
        }
    }

    /// The season's bucket and period, for reading it back; `None`: off.
    #[must_use]
    pub fn season_buckets(&self) -> Option<(f64, f64)> {
        self.season.as_ref().map(|s| (s.bucket_s(), s.period_s()))
    }

    /// Records the pool's load (`rate` over the source's latest `span`) into the
    /// season and returns the most it expects within `horizon_s`, scaled by how
    /// today's load (`now_rate`) compares with the season's at this time; 0 while it
    /// knows nothing. `unit` is the load one replica carries at the planning rate.
    /// A pool at zero (`at_zero`) is woken only for a rise out of a quiet time (the
    /// season below one unit now) to at least a quarter of one.
    fn seasonal(
        &mut self,
        unix: Option<f64>,
        reading: (f64, f64),
        now_rate: f64,
        horizon_s: f64,
        unit: f64,
        at_zero: bool,
    ) -> f64 {
        self.season_expects = false;
        let (Some(season), Some(unix)) = (&mut self.season, unix.filter(|u| u.is_finite())) else {
            return 0.0;
        };
        season.record(unix, reading.0, reading.1);
        let horizon = if horizon_s.is_finite() {
            horizon_s
        } else {
            0.0
        };
        let Some(o) = season.outlook(unix, horizon) else {
            return 0.0;
        };
        // Today's level against the season's: a quieter day (a holiday) pre-warms less,
        // and hardly any once its ramp should have shown and has not. Both sides carry
        // half a replica's load, so the noise of a trickle (a night's one request, or
        // none) does not scale a whole ramp by 0 or by the cap.
        let eps = 0.5 * unit.max(0.0);
        let level = match o.now {
            Some(then) if now_rate.is_finite() && then + eps > 0.0 => {
                ((now_rate.max(0.0) + eps) / (then + eps)).min(MAX_SEASON_LEVEL)
            }
            _ => 1.0,
        };
        let expected = o.ahead * level;
        // A pool at zero wakes ahead of a ramp out of a quiet time. When the season says
        // the load should be here already and none is (a holiday, a job that stopped),
        // what today's level leaves over must not wake it, nor a trickle.
        let quiet_now = o.now.is_none_or(|then| then < unit);
        self.season_expects = unit > 0.0 && quiet_now && expected >= WAKE_SHARE * unit;
        if at_zero && !self.season_expects {
            return 0.0;
        }
        expected
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
        self.arrivals
            .seed(t, step_s, &points, self.cfg.burst_memory_s)
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
        let s = &o.signals;
        // A pool at zero has nothing to measure: its next start takes as long as the
        // longest seen (at least the default), as for scheduled floors.
        let lead = o
            .measured_startup_s
            .filter(|l| l.is_finite() && *l >= 0.0)
            .unwrap_or(self.longest_startup_s.max(self.cfg.default_lead_s))
            .min(MAX_FLOOR_LEAD_S);
        match self.pool {
            Pool::Prefill => {
                let uncached = 1.0 - s.prefix_hit_rate;
                let rate = s.prompt_rate * uncached;
                // A first reading carries no rate: as a zero it made a steady load look
                // like a ramp from nothing, forecast a lead ahead.
                if !s.rates_unmeasured() {
                    self.demand.observe(t, rate);
                }
                let ahead = self.demand.forecast(lead).max(rate);
                let len = o.mean_prompt_len.unwrap_or(self.cfg.default_prompt_len);
                let per_replica = self.profile.prefill_rate(len);
                let slo = self.cfg.ttft_slo_for(len);
                // Leave the SLO room for queueing: at service time x, waiting must stay
                // under SLO − x; M/D/1-style utilisation cap, kept within [0.3, 0.85].
                let service = len / per_replica;
                let util = (1.0 - service / slo).clamp(0.3, 0.85);
                // Engines that report queued prompt tokens count them exactly; others
                // only report waiting requests.
                let queued = if s.queued_prompt_tokens > 0.0 {
                    s.queued_prompt_tokens
                } else {
                    s.waiting * len
                };
                let backlog = queued + o.held_requests * len;
                // What the recent past needed: the fewest fixed replicas that would have
                // served the last `burst_memory_s` of arrivals within the SLO. Bursts
                // recur, and one that comes faster than a replica starts can only be met
                // by replicas already up: the window keeps what a burst needed for as
                // long as it remembers the burst.
                self.arrivals.record(
                    t,
                    s.prompt_rate_recent * uncached,
                    s.recent_span_s,
                    self.cfg.burst_memory_s,
                );
                let model = ServiceModel {
                    rate_per_replica: per_replica * HINDSIGHT_UTIL,
                    max_wait_s: (slo - service).max(0.1 * slo),
                    target: HINDSIGHT_TARGET,
                };
                let past = f64::from(self.arrivals.fewest_replicas(&model, self.cfg.max_replicas));
                // ...or, where the forecast expects more one lead ahead, that: at the
                // planning utilisation once the window knows the load, at the SLO's
                // queueing cap before.
                let known =
                    self.arrivals.covered_s() >= HINDSIGHT_MIN_S.min(self.cfg.burst_memory_s);
                let fore_util = if known { FORECAST_UTIL } else { util };
                // ...or what the same time of earlier periods saw up to the time new
                // replicas would serve: a recurring ramp is met before it shows.
                let seasonal = self.seasonal(
                    o.unix_time,
                    (s.prompt_rate_recent * uncached, s.recent_span_s),
                    rate,
                    lead + ACTUATION_S,
                    per_replica * FORECAST_UTIL,
                    o.current == 0,
                );
                let size = past
                    .max(ahead / (per_replica * fore_util))
                    .max(seasonal / (per_replica * FORECAST_UTIL));
                // A backlog the pool's spare capacity clears before new replicas would
                // serve needs none: a short start-up must not turn every passing queue
                // into replicas held for a stabilisation window. Only what is left
                // then is theirs, drained over their start-up and half the SLO, the
                // start-up counted as at least half the actuation: replicas asked for
                // come no sooner than HPA's sync brings them, and a shorter drain
                // bought more of them the shorter the start-up (with a 2 s SLO, a 1 s
                // start drained with 8× the replicas of a 15 s one, for no more
                // requests served).
                // Spare at the planning utilisation, against the most load seen or expected.
                let load = rate.max(s.prompt_rate_recent * uncached).max(ahead);
                let spare = (s.endpoints_ok as f64 * per_replica * FORECAST_UTIL - load).max(0.0);
                // New replicas serve after their start-up and the actuation before it.
                let serve_in = lead + ACTUATION_S;
                let left = (backlog - spare * (serve_in + 0.5 * slo)).max(0.0);
                let mut n = size + left / (per_replica * (0.5 * slo + lead.max(0.5 * ACTUATION_S)));
                // Observed latency corrects the model while a real queue persists: a factor
                // on the modelled need, not on current replicas, so replicas still
                // starting do not compound it; an emptied queue means it is history.
                let queue_wait = backlog / (s.endpoints_ok.max(1) as f64 * per_replica);
                if let Some(p90) = s.ttft_p90
                    && p90 > slo
                    && queue_wait > 0.25 * slo
                {
                    n *= (p90 / slo).min(1.5);
                }
                self.last_load = Some(LoadView {
                    observed: rate,
                    forecast: self.demand.forecast(lead).max(seasonal),
                    lead_s: lead,
                    needed: n,
                });
                tracing::trace!(
                    t,
                    rate,
                    recent = s.prompt_rate_recent,
                    past,
                    ahead,
                    seasonal,
                    backlog,
                    len,
                    per_replica,
                    util,
                    n,
                    "prefill need"
                );
                n
            }
            Pool::Decode => {
                let seqs = s.running + s.waiting + o.held_requests;
                // Sequence growth tracks the generation rate forecast.
                if !s.rates_unmeasured() {
                    self.demand.observe(t, s.generation_rate);
                }
                let now_rate = s.generation_rate.max(1e-9);
                let itl = self.cfg.slo_itl_s * 0.9;
                let batch = self.profile.max_batch_at(itl);
                // The season's generation rate up to when new replicas would serve.
                let seasonal = self.seasonal(
                    o.unix_time,
                    (s.generation_rate, s.recent_span_s),
                    s.generation_rate,
                    lead + ACTUATION_S,
                    batch / itl,
                    o.current == 0,
                );
                let growth = if s.generation_rate > 0.0 {
                    (self.demand.forecast(lead).max(seasonal) / now_rate).clamp(1.0, 4.0)
                } else {
                    1.0
                };
                // Sequences each generating at most one token per ITL: a replica serves
                // `batch / itl` tokens/s, which also sizes a pool the season wakes at zero.
                let by_batch = (seqs * growth).max(seasonal * itl) / batch;
                // The usage is a mean over the endpoints that answered, which include
                // promoted standbys beside the pool's own replicas.
                let serving = (s.endpoints_ok as f64).max(o.current as f64);
                // KV in use as the engines report it, at least the running sequences at
                // their measured length (the simulator knows it). The default length
                // stands in only where no engine reports KV usage: counted for every
                // running sequence, it made a 240-token sequence a third of a small
                // replica's cache.
                // Blocks reserved for K/V still being prefilled are prefill's backlog,
                // not decode's load: more decode replicas would only reserve more. Past
                // the target they count all the same: a full cache refuses the next
                // reservation, and the client gets a 429.
                let own = if s.kv_usage > KV_TARGET {
                    s.kv_usage
                } else {
                    (s.kv_usage - s.kv_reserved).max(0.0)
                };
                let reported = own * serving * self.profile.kv_tokens;
                let kv_now = match o.mean_seq_tokens {
                    Some(per_seq) => reported.max(s.running * per_seq),
                    None if s.kv_usage <= 0.0 => s.running * self.cfg.default_prompt_len,
                    None => reported,
                };
                let by_kv = kv_now * growth / (KV_TARGET * self.profile.kv_tokens);
                let mut n = by_batch.max(by_kv);
                if let Some(p90) = s.itl_p90
                    && p90 > self.cfg.slo_itl_s
                    && s.running > 0.0
                {
                    n *= (p90 / self.cfg.slo_itl_s).min(1.5);
                }
                self.last_load = Some(LoadView {
                    observed: s.generation_rate,
                    forecast: self.demand.forecast(lead).max(seasonal),
                    lead_s: lead,
                    needed: n,
                });
                tracing::trace!(
                    t,
                    seqs,
                    rate = s.generation_rate,
                    seasonal,
                    growth,
                    batch,
                    by_batch,
                    by_kv,
                    itl_p90 = s.itl_p90,
                    n,
                    "decode need"
                );
                n
            }
        }
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
        let busy = traffic || self.season_expects;
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
