//! Independent simulations spread over every core: each is single-threaded, and the
//! results do not depend on how many run at once.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Threads for a batch of runs: what the machine offers.
fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// `job(i)` for every `i` in `0..n`, started in `order` (longest first, so no core is
/// left with one long run at the end) on up to every core; the results by `i`. A
/// panicking job panics the caller, as it would run alone.
///
/// # Panics
/// Where `order` is not a permutation of `0..n` (a caller's mistake).
pub(crate) fn run_ordered<R: Send>(
    n: usize,
    order: &[usize],
    job: impl Fn(usize) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..n).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads().min(n) {
            s.spawn(|| {
                while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let r = job(i);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.expect("every job was run"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_job_runs_once_and_its_result_lands_at_its_index() {
        let ran = AtomicUsize::new(0);
        let got = run_ordered(5, &[4, 2, 0, 1, 3], |i| {
            ran.fetch_add(1, Ordering::Relaxed);
            i * 10
        });
        assert_eq!(got, vec![0, 10, 20, 30, 40]);
        assert_eq!(ran.load(Ordering::Relaxed), 5);
        assert!(run_ordered(0, &[], |i| i).is_empty());
    }
}
