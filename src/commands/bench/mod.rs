//! `preheat bench …`: long measurements kept out of the test suite. Each figure is
//! reported next to a baseline measured in the same run, since absolute times on a
//! shared machine are not stable.

pub mod coldstart;
pub mod engine;
pub mod gpu;
pub mod grammar;
pub mod host_share;
pub mod kv;
pub mod router;
pub mod scaler;
pub mod serve;
pub mod simreal;
pub mod snapshot;

use std::time::{Duration, Instant};

/// Runs `f` `reps` times and returns the fastest wall time.
pub fn best_of<T>(
    reps: usize,
    mut f: impl FnMut() -> anyhow::Result<T>,
) -> anyhow::Result<(Duration, T)> {
    let mut best: Option<(Duration, T)> = None;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let v = f()?;
        let d = t.elapsed();
        if best.as_ref().is_none_or(|(b, _)| d < *b) {
            best = Some((d, v));
        }
    }
    Ok(best.expect("at least one repetition"))
}

/// GB/s for `bytes` moved in `d`.
pub fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}
