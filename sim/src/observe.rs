//! What an autoscaler sees of a pool at a decision: the signals the real scaler scrapes
//! (queues, rates, KV usage, latency quantiles over the window) and what the baselines
//! read instead (utilisation, held requests).

use std::collections::VecDeque;

use preheat_scaler::policy::Pool;
use preheat_scaler::signals::PoolSignals;

use crate::autoscalers::PoolView;
use crate::cluster::{DecodeReplica, PrefillReplica};
use crate::replay::{Counters, Sim};

/// The part of a view that differs between the pools.
struct PoolSide {
    ready: usize,
    signals: PoolSignals,
    held: f64,
    mean_seq_tokens: Option<f64>,
}

impl Sim<'_> {
    /// Replicas not draining (starting ones included): what a Deployment's spec says.
    pub(crate) fn current(&self, pool: Pool) -> u32 {
        let n = match pool {
            Pool::Prefill => self.prefill.iter().filter(|r| !r.draining).count(),
            Pool::Decode => self.decode.iter().filter(|r| !r.draining).count(),
        };
        n as u32
    }

    /// Busy seconds of the pool's replicas so far, gone ones included.
    pub(crate) fn busy_s(&self, pool: Pool) -> f64 {
        let live: f64 = match pool {
            Pool::Prefill => self.prefill.iter().map(|r| r.busy_s).sum(),
            Pool::Decode => self.decode.iter().map(|r| r.busy_s).sum(),
        };
        self.ctl[pool].retired_busy + live
    }

    pub(crate) fn view(&self, pool: Pool) -> PoolView {
        let t = self.t;
        let oldest = self.history.front().copied().unwrap_or_default();
        // The prefill pool's prompts (the only pool whose policy reads the length).
        let arrived = self.now.prefill_arrived - oldest.prefill_arrived;
        let mean_prompt_len = (arrived > 0.0)
            .then(|| (self.now.prefill_prompt_tokens - oldest.prefill_prompt_tokens) / arrived);
        let current = self.current(pool);
        let side = match pool {
            Pool::Prefill => self.prefill_side(&oldest),
            Pool::Decode => self.decode_side(&oldest),
        };
        let ready = side.ready;
        let busy = self.busy_s(pool);
        let (t0, b0) = self.ctl[pool].last_busy;
        let utilization = if ready > 0 && t > t0 {
            ((busy - b0) / (ready as f64 * (t - t0))).clamp(0.0, 1.0)
        } else {
            0.0
        };
        PoolView {
            t,
            current,
            ready: ready as u32,
            held: side.held,
            waiting: side.signals.waiting,
            running: side.signals.running,
            utilization,
            signals: side.signals,
            mean_prompt_len,
            mean_seq_tokens: side.mean_seq_tokens,
            measured_startup_s: self.ctl[pool].measured_startup,
            arrived_requests: self.now.arrived,
            arrived_input_tokens: self.now.prompt_tokens,
            arrived_output_tokens: self.now.output_tokens,
        }
    }

    /// Seconds the latest rate was measured over: none before a second reading, as a
    /// scrape source reports its first.
    fn recent_span(&self, oldest: &Counters) -> f64 {
        if self.t > oldest.t {
            self.cfg.interval_s.max(1.0)
        } else {
            0.0
        }
    }

    /// Per-second rate of a counter over the window.
    fn window_rate(&self, oldest: &Counters, f: fn(&Counters) -> f64) -> f64 {
        let span = (self.t - oldest.t).max(1.0);
        (f(&self.now) - f(oldest)) / span
    }

    fn prefill_side(&self, oldest: &Counters) -> PoolSide {
        let t = self.t;
        let reps: Vec<&PrefillReplica> = self.prefill.iter().filter(|r| r.is_ready(t)).collect();
        let ready = reps.len();
        let queries = self.now.prefix_queries - oldest.prefix_queries;
        let signals = PoolSignals {
            endpoints_ok: ready,
            waiting: reps.iter().map(|r| r.waiting() as f64).sum(),
            running: reps.iter().map(|r| r.running_prompts() as f64).sum(),
            queued_prompt_tokens: reps.iter().map(|r| r.queued_tokens()).sum(),
            prompt_rate: self.window_rate(oldest, |c| c.prefill_prompt_tokens),
            prompt_rate_peak: self.peak_prompt_rate(),
            peak_span_s: self.cfg.interval_s.max(1.0),
            prompt_rate_recent: self.recent_prompt_rate(),
            recent_span_s: self.recent_span(oldest),
            prefix_hit_rate: if queries > 0.0 {
                (self.now.prefix_hits - oldest.prefix_hits) / queries
            } else {
                0.0
            },
            ttft_p50: quantile(&self.recent_ttft, 0.5),
            ttft_p90: quantile(&self.recent_ttft, 0.9),
            ..PoolSignals::default()
        };
        PoolSide {
            ready,
            signals,
            held: self.held.len() as f64,
            mean_seq_tokens: None,
        }
    }

    fn decode_side(&self, oldest: &Counters) -> PoolSide {
        let t = self.t;
        let reps: Vec<&DecodeReplica> = self.decode.iter().filter(|r| r.is_ready(t)).collect();
        let ready = reps.len();
        let running: f64 = reps.iter().map(|r| r.running() as f64).sum();
        let kv: f64 = reps.iter().map(|r| r.kv_used).sum();
        let reserved: f64 = reps.iter().map(|r| r.kv_reserved()).sum();
        // As the engines report them: usage counts the blocks reserved for prompts
        // still in prefill, and the reserved share on its own.
        let share = |tokens: f64| {
            if ready > 0 {
                tokens / (ready as f64 * self.cfg.profile.kv_tokens)
            } else {
                0.0
            }
        };
        let mut signals = PoolSignals {
            endpoints_ok: ready,
            running,
            kv_usage: share(kv + reserved),
            kv_reserved: share(reserved),
            generation_rate: self.window_rate(oldest, |c| c.generated),
            recent_span_s: self.recent_span(oldest),
            itl_p50: self.now.itl.quantile_since(&oldest.itl, 0.5),
            itl_p90: self.now.itl.quantile_since(&oldest.itl, 0.9),
            ..PoolSignals::default()
        };
        // With decode replicas up, prefilled requests queue in the pool; at zero,
        // everything in the system is held at the gateway for it.
        let held = if ready > 0 {
            signals.waiting = self.decode_wait.len() as f64;
            0.0
        } else {
            (self.trace.len().min(self.next_arrival) - self.finished) as f64
        };
        PoolSide {
            ready,
            signals,
            held,
            mean_seq_tokens: (running > 0.0).then(|| kv / running),
        }
    }

    /// The prefill pool's prompt-token rate over the last scrape interval
    /// (`interval_s`).
    fn recent_prompt_rate(&self) -> f64 {
        let step = self.cfg.interval_s.max(1.0);
        self.history
            .iter()
            .rev()
            .find(|c| self.t - c.t >= step - 1e-9)
            .map_or(0.0, |c| {
                (self.now.prefill_prompt_tokens - c.prefill_prompt_tokens) / (self.t - c.t)
            })
    }

    /// The prefill pool's highest prompt-token rate between the scaler's scrapes (every `interval_s`)
    /// within the window, as the real scaler sees it.
    fn peak_prompt_rate(&self) -> f64 {
        let step = self.cfg.interval_s.max(1.0);
        let mut peak = 0.0f64;
        let mut prev: Option<&Counters> = None;
        for c in &self.history {
            match prev {
                None => prev = Some(c),
                Some(p) if c.t - p.t >= step - 1e-9 => {
                    peak =
                        peak.max((c.prefill_prompt_tokens - p.prefill_prompt_tokens) / (c.t - p.t));
                    prev = Some(c);
                }
                Some(_) => {}
            }
        }
        peak
    }
}

/// A latency quantile over the window's (time, value) samples: the nearest rank of
/// [`preheat_scaler::percentile`], found by selection instead of a sort (twice a second
/// per pool over thousands of samples at fleet scale).
fn quantile(xs: &VecDeque<(f64, f64)>, q: f64) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().map(|x| x.1).collect();
    let last = v.len().checked_sub(1)?;
    let i = ((last as f64 * q.clamp(0.0, 1.0)).round() as usize).min(last);
    Some(*v.select_nth_unstable_by(i, f64::total_cmp).1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_gives_the_sorted_nearest_rank() {
        let xs: VecDeque<(f64, f64)> = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 0.5]
            .iter()
            .map(|&v| (0.0, v))
            .collect();
        for q in [0.0, 0.5, 0.9, 0.99, 1.0] {
            let mut v: Vec<f64> = xs.iter().map(|x| x.1).collect();
            assert_eq!(
                quantile(&xs, q),
                preheat_scaler::percentile::percentile(&mut v, q)
            );
        }
        assert_eq!(quantile(&VecDeque::new(), 0.5), None);
    }
}
