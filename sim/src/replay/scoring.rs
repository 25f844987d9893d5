//! How a run scores its requests against the SLOs: as they come (so a run that can no
//! longer reach its target stops), per request for `clairvoyant`, and in the report.

use preheat_scaler::percentile::percentile;

use crate::per_pool::PerPool;
use crate::report::PolicyReport;
use crate::trace::TraceRequest;

use super::{Outcome, Sim};

/// A request's mean inter-token latency; `None` with a single output token.
fn itl_of(r: &TraceRequest, first_token: f64, done: f64) -> Option<f64> {
    (r.output_tokens > 1).then(|| (done - first_token) / f64::from(r.output_tokens - 1))
}

/// How one request fared.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RequestScore {
    /// Seconds to its first token (NaN when none came).
    pub(crate) ttft: f64,
    /// Its first token came within its TTFT target.
    pub(crate) ttft_met: bool,
    /// That, and it decoded within the ITL target.
    pub(crate) slo_met: bool,
    /// It arrived with no replica serving in a pool it needs.
    pub(crate) cold: bool,
    /// What its prompt takes on an idle replica: the part of its time to first token
    /// no start or scaling can remove.
    pub(crate) compute_s: f64,
}

impl Sim<'_> {
    /// Counts a request that missed its SLO, and stops a run that can no longer reach
    /// its `fail_below` target (as the report computes attainment: met over all).
    fn count_miss(&mut self) {
        self.missed += 1;
        if let Some(target) = self.fail_below {
            let n = self.trace.len().max(1);
            let best = n.saturating_sub(self.missed) as f64 / n as f64;
            self.hopeless |= best < target;
        }
    }

    pub(super) fn record_first_token(&mut self, req: usize, t: f64) {
        let r = &self.trace[req];
        self.reqs[req].first_token = t;
        self.now.generated += 1.0;
        if self.fail_below.is_some() && !self.cfg.ttft_met(r, t - r.t) {
            self.count_miss();
        }
    }

    pub(super) fn finish(&mut self, req: usize, at: f64) {
        let r = &self.trace[req];
        let st = &mut self.reqs[req];
        st.done = at;
        self.finished += 1;
        // A late first token was counted when it came.
        if self.fail_below.is_some()
            && self.cfg.ttft_met(r, st.first_token - r.t)
            && !self.cfg.itl_met(itl_of(r, st.first_token, at))
        {
            self.count_miss();
        }
    }

    /// Runs to the end; per request, whether its prompt was done and its first token
    /// came within the TTFT SLO, and whether it then decoded within the ITL SLO.
    pub(crate) fn run_outcomes(mut self) -> Vec<Outcome> {
        self.run_to_end();
        self.trace
            .iter()
            .zip(&self.reqs)
            .map(|(r, st)| {
                let in_time = |at: f64| !at.is_nan() && self.cfg.ttft_met(r, at - r.t);
                let first = in_time(st.first_token);
                Outcome {
                    // A prompt computed on decode is done when its first token comes.
                    prompt: if st.prompt_done.is_nan() {
                        first
                    } else {
                        in_time(st.prompt_done)
                    },
                    first,
                    decoded: !st.done.is_nan()
                        && self.cfg.itl_met(itl_of(r, st.first_token, st.done)),
                }
            })
            .collect()
    }

    /// How each request fared, with the report: for a fleet, which scores requests
    /// across its models.
    pub(crate) fn scored_report(self) -> (PolicyReport, Vec<RequestScore>) {
        let scores = self
            .trace
            .iter()
            .zip(&self.reqs)
            .map(|(r, st)| {
                let ttft = st.first_token - r.t;
                let ttft_met = !ttft.is_nan() && self.cfg.ttft_met(r, ttft);
                RequestScore {
                    ttft,
                    ttft_met,
                    slo_met: ttft_met
                        && !st.done.is_nan()
                        && self.cfg.itl_met(itl_of(r, st.first_token, st.done)),
                    cold: st.cold,
                    compute_s: f64::from(r.input_tokens)
                        / self
                            .cfg
                            .profile
                            .prefill_rate(f64::from(r.input_tokens))
                            .max(1e-9),
                }
            })
            .collect();
        (self.report(), scores)
    }

    /// The report of a run that has ended.
    pub(crate) fn report(self) -> PolicyReport {
        let mut ttft = Vec::new();
        let mut itl = Vec::new();
        let mut ok = 0usize;
        let mut unfinished = 0usize;
        for (r, st) in self.trace.iter().zip(&self.reqs) {
            if st.done.is_nan() {
                unfinished += 1;
                continue;
            }
            let tt = st.first_token - r.t;
            let it = itl_of(r, st.first_token, st.done);
            ttft.push(tt);
            if let Some(i) = it {
                itl.push(i);
            }
            if self.cfg.ttft_met(r, tt) && self.cfg.itl_met(it) {
                ok += 1;
            }
        }
        let pct = |v: &mut Vec<f64>, q: f64| percentile(v, q).unwrap_or(f64::NAN);
        let n = self.trace.len().max(1);
        let PerPool {
            prefill: p,
            decode: d,
        } = &self.ctl;
        PolicyReport {
            name: String::new(),
            knob: None,
            slo_attainment: ok as f64 / n as f64,
            gpu_seconds: p.gpu_s + d.gpu_s,
            standby_gpu_seconds: p.standby_gpu_s + d.standby_gpu_s,
            prefill_gpu_seconds: p.gpu_s,
            decode_gpu_seconds: d.gpu_s,
            cold_starts: p.starts + d.starts,
            scale_events: p.events + d.events,
            ttft_p50: pct(&mut ttft, 0.5),
            ttft_p99: pct(&mut ttft, 0.99),
            itl_p50: pct(&mut itl, 0.5),
            itl_p99: pct(&mut itl, 0.99),
            requests: self.trace.len(),
            unfinished,
            prefix_hit_rate: if self.now.prefix_queries > 0.0 {
                self.now.prefix_hits / self.now.prefix_queries
            } else {
                0.0
            },
            max_prefill_replicas: p.max_replicas,
            max_decode_replicas: d.max_replicas,
            fixed_replicas: None,
            timeline: self.timeline,
        }
    }
}
