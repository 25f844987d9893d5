//! What the season expects of a pool's load up to when new replicas would serve, and
//! whether that alone should keep (or wake) the pool.

use super::season::Season;

/// Most today's load may stand above the season's before the season's outlook is
/// scaled by it: a spike must not multiply a whole ramp.
const MAX_SEASON_LEVEL: f64 = 1.5;
/// Share of one replica's load the season must expect before it wakes a pool at zero.
const WAKE_SHARE: f64 = 0.25;

/// A pool's season (`None`: off) and what its last outlook expected.
#[derive(Clone, Debug)]
pub(super) struct SeasonOutlook {
    pub(super) season: Option<Season>,
    /// The last outlook expected at least a replica's load before new replicas would
    /// serve: the pool is not idle (a pool at zero is woken for it).
    pub(super) expects: bool,
}

impl SeasonOutlook {
    pub(super) fn new(season: Option<Season>) -> Self {
        SeasonOutlook {
            season,
            expects: false,
        }
    }

    /// Records the pool's load (`rate` over the source's latest `span`) into the
    /// season and returns the most it expects within `horizon_s`, scaled by how
    /// today's load (`now_rate`) compares with the season's at this time; 0 while it
    /// knows nothing. `unit` is the load one replica carries at the planning rate.
    /// A pool at zero (`at_zero`) is woken only for a rise out of a quiet time (the
    /// season below one unit now) to at least a quarter of one.
    pub(super) fn expected(
        &mut self,
        unix: Option<f64>,
        reading: (f64, f64),
        now_rate: f64,
        horizon_s: f64,
        unit: f64,
        at_zero: bool,
    ) -> f64 {
        self.expects = false;
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
        self.expects = unit > 0.0 && quiet_now && expected >= WAKE_SHARE * unit;
        if at_zero && !self.expects {
            return 0.0;
        }
        expected
    }
}
