//! `static-peak`'s hindsight search: the fewest fixed replicas that serve the whole
//! trace, found by replaying it.

use std::cell::RefCell;
use std::collections::HashMap;

use crate::autoscalers::Static;
use crate::config::SimConfig;
use crate::replay::Sim;
use crate::report::PolicyReport;
use crate::rule_of_thumb::busiest_minute_need;
use crate::trace::TraceRequest;

/// The fewest fixed (prefill, decode) replicas meeting 99% SLO attainment on the whole
/// trace: prefill sized with decode plentiful, then decode with that prefill, then both
/// raised together if the pair falls short; the maxima when nothing reaches 99%. With
/// the report of the run at those sizes (the search's own, or where the maxima fall
/// short and their run stopped early, one more run).
pub(crate) fn static_peak(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32, PolicyReport) {
    const TARGET: f64 = 0.99;
    // A size's report, or `None` where its run stopped once it could not reach the
    // target (most candidates fail, and fail early: the search asks only pass or fail).
    let runs: RefCell<HashMap<(u32, u32), Option<PolicyReport>>> = RefCell::default();
    let sim = |p: u32, d: u32| Sim::new(cfg, trace, Box::new(Static(p)), Box::new(Static(d)));
    let passes = |p: u32, d: u32| {
        let pass =
            |r: &Option<PolicyReport>| r.as_ref().is_some_and(|r| r.slo_attainment >= TARGET);
        if let Some(r) = runs.borrow().get(&(p, d)) {
            return pass(r);
        }
        let r = sim(p, d).run_unless_below(TARGET);
        let ok = pass(&r);
        runs.borrow_mut().insert((p, d), r);
        ok
    };
    let (mp, md) = (cfg.prefill.max_replicas, cfg.decode.max_replicas);
    let (gp, gd) = busiest_minute_need(cfg, trace);
    let plenty_d = md.min(16).max(gd);
    let p = smallest_from(gp, mp, &|p| passes(p, plenty_d));
    let d = smallest_from(gd, md, &|d| passes(p, d));
    let (mut p, mut d) = (p, d);
    while !passes(p, d) && (p < mp || d < md) {
        p = (p + 1).min(mp);
        d = (d + 1).min(md);
    }
    // At the maxima without reaching the target, the last run stopped early: the
    // report is of a full run.
    let report = runs
        .borrow_mut()
        .remove(&(p, d))
        .flatten()
        .unwrap_or_else(|| sim(p, d).run());
    (p, d, report)
}

/// The smallest `n` in `1..=max` with `ok(n)` (`max` if none), for `ok` monotone in
/// `n`. A guess that holds is checked one below (a good guess costs two probes) and
/// otherwise bisected down from; one that fails is searched upwards by doubling steps
/// and then bisected; one at `max`, capped there, is no guess: `1..=max` is bisected.
/// A passing probe is a whole replay and a failing one stops early
/// ([`Sim::run_unless_below`]), so a far too high guess is halved, not walked down.
fn smallest_from(guess: u32, max: u32, ok: &dyn Fn(u32) -> bool) -> u32 {
    let max = max.max(1);
    let guess = guess.clamp(1, max);
    // Invariant once bracketed: ok(hi) (or hi == max, unprobed: `max` if none passes),
    // and lo == 1 or !ok(lo - 1).
    let (mut lo, mut hi);
    if guess == max {
        // A guess at the cap says only "at least this many": nothing to start from.
        (lo, hi) = (1, max);
    } else if ok(guess) {
        if guess == 1 || !ok(guess - 1) {
            return guess;
        }
        (lo, hi) = (1, guess - 1);
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
                if guess == need && need < 20 {
                    assert!(calls.get() <= 2, "an exact guess costs two probes");
                }
            }
        }
    }

    #[test]
    fn regression_a_far_too_high_guess_was_walked_down_through_passing_replays() {
        // The 30x day's busiest minute guessed 64 prefill replicas for a need of 28:
        // stepping down from the guess passed six whole replays before bisecting.
        for need in 1..=64 {
            for guess in need..=64 {
                let calls = Cell::new(0);
                let ok = |n: u32| {
                    calls.set(calls.get() + 1);
                    n >= need
                };
                assert_eq!(
                    smallest_from(guess, 64, &ok),
                    need,
                    "need {need}, guess {guess}"
                );
                // The guess, the one below it, then a bisection of 1..guess (it took
                // 12 probes at need 28).
                assert!(
                    calls.get() <= 8,
                    "need {need}, guess {guess}: {} probes",
                    calls.get()
                );
            }
        }
    }
}
