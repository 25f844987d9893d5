//! Fixed sizes found from the whole trace: `static-peak`'s hindsight search, and the
//! replicas a deployment already serving the trace's opening load would have.

use std::cell::RefCell;
use std::collections::HashMap;

use crate::autoscalers::Static;
use crate::config::SimConfig;
use crate::replay::Sim;
use crate::report::PolicyReport;
use crate::trace::TraceRequest;

/// The fewest fixed (prefill, decode) replicas meeting 99% SLO attainment on the whole
/// trace: prefill sized with decode plentiful, then decode with that prefill, then both
/// raised together if the pair falls short; the maxima when nothing reaches 99%. With
/// the report of the run at those sizes (the search ran it already).
pub(crate) fn static_peak(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32, PolicyReport) {
    const TARGET: f64 = 0.99;
    let runs: RefCell<HashMap<(u32, u32), PolicyReport>> = RefCell::default();
    let run = |p: u32, d: u32| {
        if let Some(r) = runs.borrow().get(&(p, d)) {
            return r.slo_attainment;
        }
        let r = Sim::new(cfg, trace, Box::new(Static(p)), Box::new(Static(d))).run();
        let a = r.slo_attainment;
        runs.borrow_mut().insert((p, d), r);
        a
    };
    let (mp, md) = (cfg.prefill.max_replicas, cfg.decode.max_replicas);
    let (gp, gd) = busiest_minute_need(cfg, trace);
    let plenty_d = md.min(16).max(gd);
    let p = smallest_from(gp, mp, &|p| run(p, plenty_d) >= TARGET);
    let d = smallest_from(gd, md, &|d| run(p, d) >= TARGET);
    let (mut p, mut d) = (p, d);
    while run(p, d) < TARGET && (p < mp || d < md) {
        p = (p + 1).min(mp);
        d = (d + 1).min(md);
    }
    run(p, d);
    let report = runs
        .borrow_mut()
        .remove(&(p, d))
        .expect("the sizes found were run");
    (p, d, report)
}

/// The smallest `n` in `1..=max` with `ok(n)` (`max` if none), for `ok` monotone in
/// `n`, searched outwards from `guess` by doubling steps and then bisected: a good
/// guess costs two or three replays where bisecting `1..=max` costs `log2(max) + 1`.
fn smallest_from(guess: u32, max: u32, ok: &dyn Fn(u32) -> bool) -> u32 {
    let max = max.max(1);
    let guess = guess.clamp(1, max);
    // Invariant once bracketed: ok(hi), and lo == 1 or !ok(lo - 1).
    let (mut lo, mut hi);
    if ok(guess) {
        hi = guess;
        let mut step = 1;
        loop {
            if hi == 1 {
                return 1;
            }
            let probe = hi.saturating_sub(step).max(1);
            if ok(probe) {
                hi = probe;
                step *= 2;
            } else {
                lo = probe + 1;
                break;
            }
        }
    } else {
        lo = guess + 1;
        let mut step = 1;
        loop {
            if lo > max {
                return max;
            }
            let probe = (guess + step).min(max);
            if ok(probe) {
                hi = probe;
                break;
            }
            if probe == max {
                return max;
            }
            lo = probe + 1;
            step *= 2;
        }
    }
    while lo < hi {
        let mid = (lo + hi) / 2;
        if ok(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// What the trace's busiest minute would need by [`minute_need`]: the fixed-size
/// search's first guess.
fn busiest_minute_need(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32) {
    let mut need = (1, 1);
    let mut start = 0;
    while start < trace.len() {
        let minute = (trace[start].t / 60.0).floor();
        let end = start
            + trace[start..]
                .iter()
                .take_while(|r| (r.t / 60.0).floor() == minute)
                .count();
        let (p, d) = minute_need(cfg, &trace[start..end]);
        need = (need.0.max(p), need.1.max(d));
        start = end.max(start + 1);
    }
    need
}

/// Replicas a deployment already serving the trace's opening load would have: the
/// first minute's prompt tokens/s over one replica's rate at 70%, and its concurrent
/// sequences (Little's law) over one replica's batch at the ITL SLO. Every dynamic
/// policy starts from here, so none pays for a trace that opens at full load.
pub(crate) fn warm_start(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32) {
    let first = trace.iter().take_while(|r| r.t < 60.0).count();
    minute_need(cfg, &trace[..first])
}

/// Replicas a minute of requests needs: its prompt tokens/s over one replica's rate at
/// 70%, and its concurrent sequences (Little's law) over one replica's batch at the
/// ITL SLO; (1, 1) for an empty minute.
fn minute_need(cfg: &SimConfig, minute: &[TraceRequest]) -> (u32, u32) {
    if minute.is_empty() {
        return (1, 1);
    }
    // The prefill pool's prompts: those computed on decode never reach it.
    let (n, tokens) = minute
        .iter()
        .filter(|r| !cfg.prefills_on_decode(r))
        .fold((0.0f64, 0.0f64), |(n, t), r| {
            (n + 1.0, t + f64::from(r.input_tokens))
        });
    let out: f64 = minute.iter().map(|r| f64::from(r.output_tokens)).sum();
    let p = cfg.profile.prefill_rate(tokens / n.max(1.0));
    let prefill = (tokens / 60.0 / (0.7 * p)).ceil().max(1.0);
    let batch = cfg.profile.max_batch_at(cfg.decode.slo_itl_s);
    let seqs = out / 60.0 * cfg.profile.itl(batch);
    let decode = (seqs / batch).ceil().max(1.0);
    let cap = |x: f64, max: u32| (x as u32).clamp(1, max.max(1));
    (
        cap(prefill, cfg.prefill.max_replicas),
        cap(decode, cfg.decode.max_replicas),
    )
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::smallest_from;

    #[test]
    fn the_search_from_a_guess_finds_the_smallest_size_whatever_the_guess() {
        for need in 1..=21 {
            for guess in 0..=22 {
                let calls = Cell::new(0);
                let ok = |n: u32| {
                    calls.set(calls.get() + 1);
                    n >= need
                };
                let want = need.min(20);
                assert_eq!(
                    smallest_from(guess, 20, &ok),
                    want,
                    "need {need}, guess {guess}"
                );
                if guess == need {
                    assert!(calls.get() <= 2, "an exact guess costs two probes");
                }
            }
        }
    }
}
