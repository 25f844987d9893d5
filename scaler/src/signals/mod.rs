//! From scraped metrics to the per-pool signals the policy reads.

pub mod exposition;
pub mod names;
pub mod text_format;
pub mod window;

use std::collections::{BTreeMap, BTreeSet};

use self::exposition::Reading;
use self::window::{Window, merge, window_quantile};

/// What the policy knows about one pool at one instant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolSignals {
    /// Endpoints scraped successfully in this tick.
    pub endpoints_ok: usize,
    /// Endpoints that should have answered but did not (timeouts, errors, garbage).
    pub endpoints_failed: usize,
    pub waiting: f64,
    pub running: f64,
    /// Mean KV-cache usage over endpoints (0–1).
    pub kv_usage: f64,
    /// The part of `kv_usage` reserved for K/V still being prefilled elsewhere
    /// (preheat decode workers; 0 elsewhere), over the same endpoints.
    pub kv_reserved: f64,
    /// Prompt tokens queued and not yet prefilled (preheat engines; 0 elsewhere).
    pub queued_prompt_tokens: f64,
    /// Prompt tokens per second arriving at the pool (window rate).
    pub prompt_rate: f64,
    /// Highest prompt-token rate between two consecutive scrapes in the window.
    pub prompt_rate_peak: f64,
    /// Seconds between the scrapes that peak was measured over.
    pub peak_span_s: f64,
    /// Prompt-token rate between the last two readings (scrape source: the last two
    /// scrapes; Prometheus: `irate` over the peak's range): the policy keeps these as
    /// its record of recent arrivals.
    pub prompt_rate_recent: f64,
    /// Seconds `prompt_rate_recent` was measured over (a scrape interval).
    pub recent_span_s: f64,
    pub generation_rate: f64,
    /// First tokens per second (TTFT observations; one per prefilled request), over
    /// the same window as `prompt_rate`.
    pub first_token_rate: f64,
    /// Fraction of prompt tokens served from the prefix cache over the window.
    pub prefix_hit_rate: f64,
    pub ttft_p50: Option<f64>,
    pub ttft_p90: Option<f64>,
    pub itl_p50: Option<f64>,
    pub itl_p90: Option<f64>,
    /// The window's TTFT histogram (cumulative bucket deltas, all endpoints), for the
    /// share of requests within a target; `None` where only quantiles are known.
    pub ttft_hist: Option<exposition::Buckets>,
    /// The same for inter-token latency (per token).
    pub itl_hist: Option<exposition::Buckets>,
}

impl PoolSignals {
    /// No endpoint answered although some were expected: the data says nothing, and
    /// must never be read as "idle".
    #[must_use]
    pub fn is_blind(&self) -> bool {
        self.endpoints_ok == 0 && self.endpoints_failed > 0
    }

    /// Endpoints answered, but none has been read twice yet (a scrape source's first
    /// tick; a pool whose every replica is new): every rate reads 0 for want of an
    /// interval, not for want of load. A pool at zero has nothing to read, and its zero
    /// is a reading. (A replica that joins others is read over their span, in
    /// [`PoolWindows::tick`].)
    #[must_use]
    pub fn rates_unmeasured(&self) -> bool {
        self.endpoints_ok > 0 && self.recent_span_s <= 0.0
    }

    /// Mean prompt length over the window: prompt tokens per first token. `None`
    /// without a whole request in the window.
    #[must_use]
    pub fn mean_prompt_len(&self) -> Option<f64> {
        let len = self.prompt_rate / self.first_token_rate;
        (self.first_token_rate > 0.0 && len.is_finite() && len >= 1.0).then_some(len)
    }
}

/// Sliding windows of every endpoint of one pool.
#[derive(Clone, Debug)]
pub struct PoolWindows {
    span: f64,
    endpoints: BTreeMap<String, Window>,
    /// Windows of endpoints scaled away, kept until their last reading leaves the
    /// window: apart from the names, which a new pod or standby may reuse.
    gone: Vec<Window>,
}

impl PoolWindows {
    #[must_use]
    pub fn new(span_secs: f64) -> Self {
        PoolWindows {
            span: span_secs,
            endpoints: BTreeMap::new(),
            gone: Vec::new(),
        }
    }

    /// Records one tick: `readings` of endpoints that answered, and the names of
    /// those that failed. Endpoints absent from both (scaled away) are forgotten once
    /// their last reading leaves the window; until then what they served in it still
    /// counts in the pool's rates.
    pub fn tick(
        &mut self,
        t: f64,
        readings: Vec<(String, Reading)>,
        failed: &[String],
    ) -> PoolSignals {
        let answered: BTreeSet<String> = readings.iter().map(|(n, _)| n.clone()).collect();
        let failed: BTreeSet<&String> = failed.iter().collect();
        // (`BTreeMap::extract_if` is newer than the crate's MSRV.)
        let departed: Vec<String> = self
            .endpoints
            .keys()
            .filter(|n| !answered.contains(*n) && !failed.contains(n))
            .cloned()
            .collect();
        for name in departed {
            self.gone.extend(self.endpoints.remove(&name));
        }
        let span = self.span;
        self.gone
            .retain(|w| w.latest().is_some_and(|(last, _)| t - last < span));
        for (name, r) in readings {
            let w = self
                .endpoints
                .entry(name)
                .or_insert_with(|| Window::new(self.span));
            // Back after failing for longer than the window: what it served meanwhile
            // is not known, and its last reading from before would average it over
            // the outage. It starts again, as a replica just up.
            if w.latest().is_some_and(|(last, _)| t - last > self.span) {
                *w = Window::new(self.span);
            }
            w.push(t, r);
        }
        let mut s = PoolSignals {
            endpoints_ok: answered.len(),
            endpoints_failed: failed.len(),
            ..PoolSignals::default()
        };
        let (mut ttft, mut itl) = (None, None);
        let (mut queries, mut hits) = (0.0, 0.0);
        let mut kv_n = 0;
        // A replica that joined mid-window has served only part of it: its increase
        // counts over the pool's span (the window, or the longest any endpoint has
        // been read for, if shorter), not over its own short life. Each over its own
        // span, the newcomer counted at full rate beside its elders' window, which
        // still holds the load they carried alone: one replica becoming two read 46%
        // over the load 5 s after the join. An endpoint read for longer (its kept
        // reading from before the window, a scrape gap) keeps its own span.
        let pool_span = self
            .endpoints
            .iter()
            .filter(|(n, _)| answered.contains(*n))
            .map(|(_, w)| w.covered_s().min(self.span))
            .fold(0.0, f64::max);
        // Scaled away within the window: the load it served there moved to the
        // endpoints that remain, whose windows still hold their smaller share.
        // Without it one replica of two leaving read 22k for a 40k load 5 s later.
        // (A failing endpoint's load while it fails is not known.)
        if pool_span > 0.0 {
            let since = t - pool_span;
            for w in &self.gone {
                s.prompt_rate += w.increase_since(|r| r.prompt_tokens, since) / pool_span;
                s.generation_rate += w.increase_since(|r| r.generation_tokens, since) / pool_span;
                s.first_token_rate += w.increase_since(first_tokens, since) / pool_span;
            }
        }
        for (name, w) in &self.endpoints {
            if !answered.contains(name) {
                continue;
            }
            let Some((_, r)) = w.latest() else { continue };
            let over = w.covered_s().max(pool_span);
            let rate = |f: &dyn Fn(&Reading) -> Option<f64>| {
                if over > 0.0 {
                    w.increase(f) / over
                } else {
                    0.0
                }
            };
            s.waiting += r.waiting.unwrap_or(0.0) + r.gateway_pending.unwrap_or(0.0);
            s.running += r.running.unwrap_or(0.0);
            if let Some(k) = r.kv_usage {
                s.kv_usage += k;
                s.kv_reserved += r.kv_reserved.unwrap_or(0.0).clamp(0.0, k);
                kv_n += 1;
            }
            s.queued_prompt_tokens += r.prefill_queue_tokens.unwrap_or(0.0);
            s.prompt_rate += rate(&|r| r.prompt_tokens);
            s.prompt_rate_peak += w.peak_rate(|r| r.prompt_tokens).unwrap_or(0.0);
            s.peak_span_s = s.peak_span_s.max(w.mean_spacing().unwrap_or(0.0));
            s.prompt_rate_recent += w.last_rate(|r| r.prompt_tokens).unwrap_or(0.0);
            s.recent_span_s = s.recent_span_s.max(w.mean_spacing().unwrap_or(0.0));
            s.generation_rate += rate(&|r| r.generation_tokens);
            s.first_token_rate += rate(&first_tokens);
            queries += w.increase(|r| r.prefix_queries);
            hits += w.increase(|r| r.prefix_hits);
            ttft = merge(ttft, w.delta_buckets(|r| r.ttft.as_ref()));
            itl = merge(itl, w.delta_buckets(|r| r.itl.as_ref()));
        }
        if kv_n > 0 {
            s.kv_usage /= kv_n as f64;
            s.kv_reserved /= kv_n as f64;
        }
        if queries > 0.0 {
            s.prefix_hit_rate = (hits / queries).clamp(0.0, 1.0);
        }
        s.ttft_p50 = window_quantile(&ttft, 0.5);
        s.ttft_p90 = window_quantile(&ttft, 0.9);
        s.itl_p50 = window_quantile(&itl, 0.5);
        s.itl_p90 = window_quantile(&itl, 0.9);
        s.ttft_hist = ttft;
        s.itl_hist = itl;
        s
    }
}

/// TTFT observations so far (the histogram's `+Inf` bucket).
fn first_tokens(r: &Reading) -> Option<f64> {
    r.ttft
        .as_ref()?
        .last()
        .filter(|b| b.0 == f64::INFINITY)
        .map(|b| b.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_endpoint_is_not_idle() {
        let mut w = PoolWindows::new(30.0);
        let s = w.tick(0.0, vec![], &["10.0.0.1:8000".into()]);
        assert!(s.is_blind());
        let ok = Reading {
            waiting: Some(2.0),
            running: Some(1.0),
            kv_usage: Some(0.5),
            ..Reading::default()
        };
        let s = w.tick(1.0, vec![("a".into(), ok.clone()), ("b".into(), ok)], &[]);
        assert!(!s.is_blind());
        assert_eq!((s.waiting, s.running, s.kv_usage), (4.0, 2.0, 0.5));
        // No endpoints at all (pool at zero) is not blind: it is genuinely empty.
        assert!(!w.tick(2.0, vec![], &[]).is_blind());
    }

    #[test]
    fn a_first_scrape_has_no_rates_and_a_pool_at_zero_reads_as_idle() {
        let mut w = PoolWindows::new(30.0);
        let s = w.tick(0.0, vec![("a".into(), prompts(1_000.0))], &[]);
        assert_eq!(s.prompt_rate, 0.0);
        assert!(s.rates_unmeasured(), "{s:?}");
        let s = w.tick(5.0, vec![("a".into(), prompts(6_000.0))], &[]);
        assert_eq!((s.prompt_rate, s.recent_span_s), (1_000.0, 5.0));
        assert!(!s.rates_unmeasured(), "{s:?}");
        assert!(
            !PoolWindows::new(30.0)
                .tick(0.0, vec![], &[])
                .rates_unmeasured()
        );
    }

    /// An endpoint's reading of `prompt` prompt tokens served so far.
    fn prompts(prompt: f64) -> Reading {
        Reading {
            prompt_tokens: Some(prompt),
            ..Reading::default()
        }
    }

    /// `ticks` 5 s apart with the readings `serve` gives (it advances its counters
    /// after each), checking the pool's prompt rate within 0.5% of what `expect` says
    /// for (tick, time), where it says anything.
    fn check_reads(
        w: &mut PoolWindows,
        ticks: std::ops::RangeInclusive<u32>,
        mut serve: impl FnMut() -> Vec<(String, Reading)>,
        expect: impl Fn(u32, f64) -> Option<f64>,
    ) {
        for i in ticks {
            let t = f64::from(i) * 5.0;
            let s = w.tick(t, serve(), &[]);
            if let Some(want) = expect(i, t) {
                assert!(
                    (s.prompt_rate / want - 1.0).abs() < 0.005,
                    "{} tokens/s at {t} s, {want} expected",
                    s.prompt_rate
                );
            }
        }
    }

    /// `ticks` with a and b taking 20k prompt tokens/s each (their counters `a` and
    /// `b`): the pool reads their 40k from its second tick (its first has no rate).
    fn both_take_half_of_40k(
        w: &mut PoolWindows,
        ticks: std::ops::RangeInclusive<u32>,
        a: &mut f64,
        b: &mut f64,
    ) {
        let serve = || {
            let r = vec![("a".into(), prompts(*a)), ("b".into(), prompts(*b))];
            *a += 20_000.0 * 5.0;
            *b += 20_000.0 * 5.0;
            r
        };
        check_reads(w, ticks, serve, |i, _| (i > 0).then_some(40_000.0));
    }

    /// `ticks` 5 s apart with a alone answering and taking 40k prompt tokens/s (its
    /// counter `a`), `failed` failing; the reads are not checked.
    fn a_alone_takes_40k(
        w: &mut PoolWindows,
        ticks: std::ops::Range<u32>,
        a: &mut f64,
        failed: &[String],
    ) {
        for i in ticks {
            w.tick(f64::from(i) * 5.0, vec![("a".into(), prompts(*a))], failed);
            *a += 40_000.0 * 5.0;
        }
    }

    #[test]
    fn regression_a_replica_that_joined_read_as_more_load() {
        // One replica takes 40k prompt tokens/s for a minute (read every 5 s, a 60 s
        // window); a second joins at 60 s and each then takes half. Each endpoint's
        // rate over its own span summed the newcomer's 20k with its elder's window,
        // still mostly the 40k it took alone: 58k 5 s after the join, back to 40k a
        // window later.
        let mut w = PoolWindows::new(60.0);
        let (mut a, mut b) = (0.0, 0.0);
        a_alone_takes_40k(&mut w, 0..12, &mut a, &[]);
        both_take_half_of_40k(&mut w, 12..=30, &mut a, &mut b);
    }

    #[test]
    fn an_endpoint_back_from_a_long_outage_is_read_as_new() {
        // Two replicas take 20k prompt tokens/s each; b stops answering for ten minutes
        // while a takes all 40k, then from 660 s both take 20k again. Its reading from
        // before the outage averaged b's rate over it (a tenth of its share for a
        // minute), and read as the pool's span it made the whole pool read a tenth of
        // the load.
        let mut w = PoolWindows::new(60.0);
        let (mut a, mut b) = (0.0, 0.0);
        both_take_half_of_40k(&mut w, 0..=11, &mut a, &mut b);
        a_alone_takes_40k(&mut w, 12..132, &mut a, &["b".into()]);
        both_take_half_of_40k(&mut w, 132..=150, &mut a, &mut b);
    }

    /// The 40k two replicas served, as read at `t` after b's last scrape at 55 s: what
    /// b served from then until it left at 60 s is never seen (5 s of its 20k over the
    /// 60 s window), until b's readings leave the window.
    fn read_with_b_unseen(t: f64) -> f64 {
        if t < 120.0 {
            40_000.0 - 20_000.0 * 5.0 / 60.0
        } else {
            40_000.0
        }
    }

    /// `ticks` with the readings `serve` gives, read as [`read_with_b_unseen`].
    fn reads_40k_but_b_unseen(
        w: &mut PoolWindows,
        ticks: std::ops::RangeInclusive<u32>,
        serve: impl FnMut() -> Vec<(String, Reading)>,
    ) {
        check_reads(w, ticks, serve, |_, t| Some(read_with_b_unseen(t)));
    }

    #[test]
    fn a_name_reused_within_the_window_is_a_new_endpoint() {
        // b leaves at 60 s and, 10 s later, a new process answers at b's address
        // with its counter at 0 (a pod IP reused). It starts a window of its own; the
        // old b's readings count as a departed endpoint's until they leave the window,
        // so the load is read once, and as a whole but for b's unseen last interval.
        let mut w = PoolWindows::new(60.0);
        let (mut a, mut b) = (0.0, 0.0);
        both_take_half_of_40k(&mut w, 0..=11, &mut a, &mut b);
        a_alone_takes_40k(&mut w, 12..14, &mut a, &[]);
        let mut b2 = 0.0;
        reads_40k_but_b_unseen(&mut w, 14..=40, || {
            let r = vec![("a".into(), prompts(a)), ("b".into(), prompts(b2))];
            a += 20_000.0 * 5.0;
            b2 += 20_000.0 * 5.0;
            r
        });
        assert_eq!(
            w.gone.len(),
            0,
            "the old b is forgotten a window after its last reading"
        );
    }

    #[test]
    fn regression_a_replica_scaled_away_took_its_load_with_it() {
        // Two replicas take 20k prompt tokens/s each for a minute; at 60 s b is scaled
        // away and a takes all 40k. b's window left the sum at once while a's still
        // held mostly its 20k: 22k 5 s later, back to 40k a window later.
        let mut w = PoolWindows::new(60.0);
        let (mut a, mut b) = (0.0, 0.0);
        both_take_half_of_40k(&mut w, 0..=11, &mut a, &mut b);
        reads_40k_but_b_unseen(&mut w, 12..=30, || {
            let r = vec![("a".into(), prompts(a))];
            a += 40_000.0 * 5.0;
            r
        });
        assert!(w.gone.is_empty(), "b is forgotten once out of the window");
    }

    #[test]
    fn a_rollout_that_replaces_a_replica_reads_the_same_load() {
        // b is replaced by c at 60 s (a new pod, a new address); the load stays at 20k
        // prompt tokens/s on each of two replicas.
        let mut w = PoolWindows::new(60.0);
        let (mut a, mut b) = (0.0, 0.0);
        both_take_half_of_40k(&mut w, 0..=11, &mut a, &mut b);
        let mut c = 0.0;
        reads_40k_but_b_unseen(&mut w, 12..=30, || {
            let r = vec![("a".into(), prompts(a)), ("c".into(), prompts(c))];
            a += 20_000.0 * 5.0;
            c += 20_000.0 * 5.0;
            r
        });
    }

    #[test]
    fn reserved_kv_is_averaged_over_the_endpoints_that_report_usage() {
        let mut w = PoolWindows::new(30.0);
        let at = |usage: Option<f64>, reserved: Option<f64>| Reading {
            kv_usage: usage,
            kv_reserved: reserved,
            ..Reading::default()
        };
        let s = w.tick(
            0.0,
            vec![
                // A preheat decode worker, a vLLM one (no reservations reported), one
                // reporting more reserved than used (read as all of it), and one
                // reporting nothing.
                ("a".into(), at(Some(0.5), Some(0.4))),
                ("b".into(), at(Some(0.3), None)),
                ("c".into(), at(Some(0.1), Some(0.9))),
                ("d".into(), at(None, Some(0.7))),
            ],
            &[],
        );
        assert!((s.kv_usage - 0.3).abs() < 1e-12, "{s:?}");
        assert!((s.kv_reserved - 0.5 / 3.0).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn the_mean_prompt_length_is_prompt_tokens_per_first_token() {
        let at = |prompt: f64, firsts: f64| Reading {
            prompt_tokens: Some(prompt),
            ttft: Some(vec![(1.0, firsts), (f64::INFINITY, firsts)]),
            ..Reading::default()
        };
        let mut w = PoolWindows::new(3.0);
        let s = w.tick(
            0.0,
            vec![("a".into(), at(0.0, 0.0)), ("b".into(), at(0.0, 0.0))],
            &[],
        );
        assert_eq!(s.mean_prompt_len(), None);
        // 3 prompts of 500 and 1 of 2,500 tokens over two endpoints in 2 s.
        let s = w.tick(
            2.0,
            vec![
                ("a".into(), at(1_500.0, 3.0)),
                ("b".into(), at(2_500.0, 1.0)),
            ],
            &[],
        );
        assert_eq!(s.first_token_rate, 2.0);
        assert_eq!(s.mean_prompt_len(), Some(1_000.0));
        // No request in the (3 s) window: unknown, not zero.
        let s = w.tick(6.0, vec![("a".into(), at(1_500.0, 3.0))], &[]);
        assert_eq!(s.mean_prompt_len(), None);
    }
}
