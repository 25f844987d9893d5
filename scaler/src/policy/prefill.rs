//! Sizes the prefill pool: uncached prompt tokens/s against what one replica prefills
//! within the TTFT SLO, from the recent past (hindsight), the forecast one lead ahead
//! and the season, plus a queued backlog's share.

use super::forecast::Holt;
use super::hindsight::{ArrivalHistory, ServiceModel};
use super::{
    ACTUATION_S, FORECAST_UTIL, HINDSIGHT_MIN_S, HINDSIGHT_TARGET, HINDSIGHT_UTIL, LoadView,
    Observation, Sizing,
};

/// The prefill pool's load memory: its demand forecast and the hindsight window.
#[derive(Clone, Debug, Default)]
pub(super) struct PrefillSizer {
    demand: Holt,
    /// Uncached prompt tokens per policy tick over the burst memory.
    arrivals: ArrivalHistory,
}

impl PrefillSizer {
    /// See [`super::PreheatPolicy::seed_arrivals`]; `points` already uncached.
    pub(super) fn seed_arrivals(
        &mut self,
        t: f64,
        step_s: f64,
        points: &[(f64, f64)],
        burst_memory_s: f64,
    ) -> usize {
        self.arrivals.seed(t, step_s, points, burst_memory_s)
    }

    /// Replicas the load model says are needed, and what it saw.
    pub(super) fn need(&mut self, ctx: &mut Sizing<'_>, o: &Observation) -> LoadView {
        let (t, lead) = (ctx.t, ctx.lead);
        let s = &o.signals;
        let uncached = 1.0 - s.prefix_hit_rate;
        let rate = s.prompt_rate * uncached;
        // A first reading carries no rate: as a zero it made a steady load look
        // like a ramp from nothing, forecast a lead ahead.
        if !s.rates_unmeasured() {
            self.demand.observe(t, rate);
        }
        let ahead = self.demand.forecast(lead).max(rate);
        let len = o.mean_prompt_len.unwrap_or(ctx.cfg.default_prompt_len);
        let per_replica = ctx.profile.prefill_rate(len);
        let slo = ctx.cfg.ttft_slo_for(len);
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
            ctx.cfg.burst_memory_s,
        );
        let model = ServiceModel {
            rate_per_replica: per_replica * HINDSIGHT_UTIL,
            max_wait_s: (slo - service).max(0.1 * slo),
            target: HINDSIGHT_TARGET,
        };
        let past = f64::from(self.arrivals.fewest_replicas(&model, ctx.cfg.max_replicas));
        // ...or, where the forecast expects more one lead ahead, that: at the
        // planning utilisation once the window knows the load, at the SLO's
        // queueing cap before.
        let known = self.arrivals.covered_s() >= HINDSIGHT_MIN_S.min(ctx.cfg.burst_memory_s);
        let fore_util = if known { FORECAST_UTIL } else { util };
        // ...or what the same time of earlier periods saw up to the time new
        // replicas would serve: a recurring ramp is met before it shows.
        let seasonal = ctx.season.expected(
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
        let view = LoadView {
            observed: rate,
            forecast: self.demand.forecast(lead).max(seasonal),
            lead_s: lead,
            needed: n,
        };
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
        view
    }
}
