//! Load by time of day (or of week): what the pool saw at this time in earlier
//! periods, so a ramp that recurs is met by replicas started one lead before it
//! rather than after it shows in the rate. Holt's trend only extrapolates a ramp
//! already under way; the morning's first rise, and every step a day repeats, are
//! known only from the days before.
//!
//! The period is cut into buckets on the wall clock (UTC, counted from the Unix epoch:
//! a weekly period starts on Thursday 00:00 UTC), so a restarted scaler's buckets line
//! up with what it read back. Each bucket keeps the mean rate it saw, blended over
//! periods so a changed day takes over within a few periods (a daylight-saving shift
//! of local office hours, too).

use serde::{Deserialize, Serialize};

use super::hindsight::covered_since;

/// How many buckets a period may hold: a restart reads them back in one Prometheus
/// range query, and the scaler reads at most 2,000 points from one.
pub const MAX_BUCKETS: f64 = 2000.0;

/// Weight of the newest period's mean in a bucket's learnt rate.
const BLEND: f64 = 0.5;

/// A bucket filled for less than this share of its length says too little (the
/// scaler started or was blind part-way through it).
const MIN_FILL: f64 = 0.5;

/// What a season has learnt, as the scaler's state file keeps it across restarts
/// ([`Season::state`], [`Season::restore`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeasonState {
    pub period_s: f64,
    pub bucket_s: f64,
    /// Learnt mean rate per bucket, from the one holding the epoch on (`null`: not
    /// seen yet).
    pub learnt: Vec<Option<f64>>,
    /// The bucket being filled when saved, resumed or folded after a restart.
    pub filling: Option<Filling>,
    /// Unix time of the last reading.
    pub last_unix: Option<f64>,
}

/// A bucket part-way through its readings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Filling {
    /// Bucket number since the Unix epoch.
    pub bucket: i64,
    /// Rate × seconds read in it.
    pub sum: f64,
    /// Seconds read in it.
    pub secs: f64,
}

/// The learnt rate now and the most expected before the horizon.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outlook {
    /// The learnt mean of the bucket `now` falls in (`None`: not seen yet).
    pub now: Option<f64>,
    /// The highest learnt mean from `now`'s bucket to the horizon's.
    pub ahead: f64,
}

/// A rate learnt per bucket of a repeating period.
#[derive(Clone, Debug)]
pub struct Season {
    period_s: f64,
    bucket_s: f64,
    /// Learnt mean rate per bucket; `None` until a bucket has been seen.
    learnt: Vec<Option<f64>>,
    /// The bucket being filled: (bucket number since the epoch, rate × seconds, seconds).
    filling: Option<(i64, f64, f64)>,
    /// Unix time of the last reading.
    last_unix: Option<f64>,
    /// Until when an earlier run's state was resumed ([`Season::restore`]): readings
    /// seeded from after it are newer than what it learnt.
    resumed_until: Option<f64>,
}

/// What [`Season::restore`] took back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Restored {
    /// Buckets learnt.
    pub buckets: usize,
    /// Seconds of readings in the bucket that goes on filling (0: none).
    pub filling_s: f64,
}

impl Season {
    /// A season of `period_s` cut into `bucket_s` buckets; `None` when the period is
    /// 0 (seasonality off) or the pair is not usable (validation reports why).
    #[must_use]
    pub fn new(period_s: f64, bucket_s: f64) -> Option<Self> {
        if !valid(period_s, bucket_s) || period_s == 0.0 {
            return None;
        }
        // Validated: whole seconds, the bucket divides the period, at most 2,000 of them.
        let n = (period_s / bucket_s).round().max(1.0) as usize;
        Some(Season {
            period_s,
            bucket_s,
            learnt: vec![None; n],
            filling: None,
            last_unix: None,
            resumed_until: None,
        })
    }

    /// Seconds per bucket.
    #[must_use]
    pub fn bucket_s(&self) -> f64 {
        self.bucket_s
    }

    /// The period's length, seconds.
    #[must_use]
    pub fn period_s(&self) -> f64 {
        self.period_s
    }

    fn slot(&self, abs: i64) -> usize {
        abs.rem_euclid(self.learnt.len() as i64) as usize
    }

    fn abs_bucket(&self, unix: f64) -> i64 {
        (unix / self.bucket_s).floor() as i64
    }

    /// Records a reading at Unix time `unix`: `rate`, the source's latest over `span`
    /// seconds, taken to hold since the last reading (the first: one span; a gap
    /// counts for at most a minute). A pool at zero reads 0 with no span: that counts
    /// from the last reading on, so the quiet hours before a ramp are learnt too. A
    /// bucket is learnt when the clock leaves it.
    pub fn record(&mut self, unix: f64, rate: f64, span: f64) {
        if !(rate.is_finite() && rate >= 0.0) {
            return;
        }
        let Some(dt) = covered_since(&mut self.last_unix, unix, span).filter(|dt| *dt > 0.0) else {
            return;
        };
        let abs = self.abs_bucket(unix);
        match &mut self.filling {
            Some((b, sum, secs)) if *b == abs => {
                *sum += rate * dt;
                *secs += dt;
            }
            prev => {
                if let Some((b, sum, secs)) = prev.take() {
                    self.fold(b, sum, secs);
                }
                self.filling = Some((abs, rate * dt, dt));
            }
        }
    }

    fn fold(&mut self, abs: i64, sum: f64, secs: f64) {
        if secs < MIN_FILL * self.bucket_s {
            return;
        }
        let slot = self.slot(abs);
        let mean = sum / secs;
        self.learnt[slot] = Some(match self.learnt[slot] {
            Some(old) => BLEND * mean + (1.0 - BLEND) * old,
            None => mean,
        });
    }

    /// Fills buckets not yet learnt from readings taken earlier (a restarted scaler
    /// reads them back from Prometheus): (Unix time, mean rate over the bucket before
    /// it); a bucket resumed from the state file takes in a reading from after its
    /// save as one more period. Readings older than a period, in the future or not
    /// numbers are dropped. Returns how many were taken.
    pub fn seed(&mut self, now_unix: f64, points: &[(f64, f64)]) -> usize {
        let mut taken = 0;
        for &(at, rate) in points {
            let age = now_unix - at;
            let usable = at.is_finite()
                && rate.is_finite()
                && rate >= 0.0
                && (0.0..=self.period_s).contains(&age);
            if !usable {
                continue;
            }
            // The bucket that ends at `at` (a reading covers the bucket before it).
            let mid = at - 0.5 * self.bucket_s;
            let abs = self.abs_bucket(mid);
            // The resumed bucket under way learns from its own readings when it ends.
            if self.filling.is_some_and(|f| f.0 == abs) {
                continue;
            }
            let slot = self.slot(abs);
            match self.learnt[slot] {
                None => self.learnt[slot] = Some(rate),
                // Seen after the resumed state was saved (while this scaler was
                // down): a newer period of that bucket, blended in as one learnt live.
                Some(old) if self.resumed_until.is_some_and(|r| mid > r) => {
                    self.learnt[slot] = Some(BLEND * rate + (1.0 - BLEND) * old);
                }
                Some(_) => continue,
            }
            taken += 1;
        }
        taken
    }

    /// What this season has learnt, for the state file.
    #[must_use]
    pub fn state(&self) -> SeasonState {
        SeasonState {
            period_s: self.period_s,
            bucket_s: self.bucket_s,
            learnt: self.learnt.clone(),
            filling: self
                .filling
                .map(|(bucket, sum, secs)| Filling { bucket, sum, secs }),
            last_unix: self.last_unix,
        }
    }

    /// Takes back what an earlier run learnt (read from the state file at Unix time
    /// `now_unix`), before any reading of this run. A state from another period or
    /// bucket, with a wrong length or a learnt value that is not a rate, is refused
    /// whole, with the reason. The bucket being filled is resumed when it is readings
    /// (its seconds may run past a bucket: each reading covers the time since the last
    /// one, across the bucket's start) and not dated in the future; so is the time of
    /// the last reading. Otherwise they are dropped and the learnt buckets kept.
    pub fn restore(&mut self, st: &SeasonState, now_unix: f64) -> Result<Restored, String> {
        if st.period_s != self.period_s || st.bucket_s != self.bucket_s {
            return Err(format!(
                "saved for a {} s period of {} s buckets, configured {} s of {} s",
                st.period_s, st.bucket_s, self.period_s, self.bucket_s
            ));
        }
        if st.learnt.len() != self.learnt.len() {
            return Err(format!(
                "{} buckets saved where the period holds {}",
                st.learnt.len(),
                self.learnt.len()
            ));
        }
        let rate = |v: f64| v.is_finite() && v >= 0.0;
        if let Some(i) = st.learnt.iter().position(|v| v.is_some_and(|v| !rate(v))) {
            return Err(format!("bucket {i} holds {:?}, not a rate", st.learnt[i]));
        }
        if !now_unix.is_finite() {
            return Err("no wall clock to date it by".into());
        }
        self.learnt.clone_from(&st.learnt);
        let now_bucket = self.abs_bucket(now_unix);
        // A clock set back since the save would hold this run's readings off until it
        // passed the saved ones.
        self.last_unix = st.last_unix.filter(|t| t.is_finite() && *t <= now_unix);
        // Readings cover at most a minute past the bucket's length (a gap's cap).
        let n = self.learnt.len() as i64;
        self.filling = st
            .filling
            .filter(|f| rate(f.sum) && rate(f.secs) && f.secs <= 2.0 * self.bucket_s)
            .filter(|f| f.bucket <= now_bucket && f.bucket > now_bucket.saturating_sub(n))
            .filter(|_| self.last_unix.is_some())
            .map(|f| (f.bucket, f.sum, f.secs));
        self.resumed_until = self.last_unix;
        Ok(Restored {
            buckets: self.learnt.iter().filter(|v| v.is_some()).count(),
            filling_s: self.filling.map_or(0.0, |f| f.2),
        })
    }

    /// What the season expects from Unix time `unix` to `horizon_s` later; `None`
    /// while none of those buckets has been learnt.
    #[must_use]
    pub fn outlook(&self, unix: f64, horizon_s: f64) -> Option<Outlook> {
        if !unix.is_finite() {
            return None;
        }
        let horizon = if horizon_s.is_finite() {
            horizon_s.clamp(0.0, self.period_s)
        } else {
            0.0
        };
        let first = self.abs_bucket(unix);
        let last = self.abs_bucket(unix + horizon);
        let ahead = (first..=last)
            .filter_map(|b| self.learnt[self.slot(b)])
            .reduce(f64::max)?;
        Some(Outlook {
            now: self.learnt[self.slot(first)],
            ahead,
        })
    }
}

/// Whether `period_s` / `bucket_s` make a season (0 period: none, which is valid).
fn valid(period_s: f64, bucket_s: f64) -> bool {
    problems(period_s, bucket_s).is_empty()
}

/// Every problem with a season's period and bucket.
#[must_use]
pub fn problems(period_s: f64, bucket_s: f64) -> Vec<String> {
    let mut e = Vec::new();
    if !(period_s.is_finite() && (0.0..=28.0 * 86_400.0).contains(&period_s)) {
        e.push(format!(
            "season_period_s must be in [0, 28 days] (0: off), got {period_s}"
        ));
        return e;
    }
    if period_s == 0.0 {
        return e;
    }
    if !(bucket_s.is_finite() && bucket_s >= 60.0 && bucket_s <= period_s / 2.0) {
        e.push(format!(
            "season_bucket_s must be in [60, season_period_s / 2], got {bucket_s}"
        ));
    } else if period_s.fract() != 0.0 || bucket_s.fract() != 0.0 || period_s % bucket_s != 0.0 {
        // Prometheus reads back one point per whole-second step, on the bucket grid.
        e.push(format!(
            "season_bucket_s must be whole seconds dividing season_period_s ({period_s}), \
             got {bucket_s}"
        ));
    } else if period_s / bucket_s > MAX_BUCKETS {
        e.push(format!(
            "season_period_s / season_bucket_s must be at most {MAX_BUCKETS} (one \
             Prometheus range query reads a period back), got {}",
            (period_s / bucket_s).round()
        ));
    }
    e
}

#[cfg(test)]
mod tests;
