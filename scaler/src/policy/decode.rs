//! Sizes the decode pool: concurrent sequences and KV tokens expected one lead ahead,
//! over one replica's batch at the ITL SLO and its KV capacity.

use super::forecast::Holt;
use super::{ACTUATION_S, KV_TARGET, LoadView, Observation, Sizing};

/// The decode pool's load memory: its generation-rate forecast.
#[derive(Clone, Debug, Default)]
pub(super) struct DecodeSizer {
    demand: Holt,
}

impl DecodeSizer {
    /// Replicas the load model says are needed, and what it saw.
    pub(super) fn need(&mut self, ctx: &mut Sizing<'_>, o: &Observation) -> LoadView {
        let (t, lead) = (ctx.t, ctx.lead);
        let s = &o.signals;
        let seqs = s.running + s.waiting + o.held_requests;
        // Sequence growth tracks the generation rate forecast.
        if !s.rates_unmeasured() {
            self.demand.observe(t, s.generation_rate);
        }
        let now_rate = s.generation_rate.max(1e-9);
        let itl = ctx.cfg.slo_itl_s * 0.9;
        let batch = ctx.profile.max_batch_at(itl);
        // The season's generation rate up to when new replicas would serve.
        let seasonal = ctx.season.expected(
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
        let reported = own * serving * ctx.profile.kv_tokens;
        let kv_now = match o.mean_seq_tokens {
            Some(per_seq) => reported.max(s.running * per_seq),
            None if s.kv_usage <= 0.0 => s.running * ctx.cfg.default_prompt_len,
            None => reported,
        };
        let by_kv = kv_now * growth / (KV_TARGET * ctx.profile.kv_tokens);
        let mut n = by_batch.max(by_kv);
        if let Some(p90) = s.itl_p90
            && p90 > ctx.cfg.slo_itl_s
            && s.running > 0.0
        {
            n *= (p90 / ctx.cfg.slo_itl_s).min(1.5);
        }
        let view = LoadView {
            observed: s.generation_rate,
            forecast: self.demand.forecast(lead).max(seasonal),
            lead_s: lead,
            needed: n,
        };
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
        view
    }
}
