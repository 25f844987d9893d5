//! How much slower than its share of the cores each worker computes when several
//! compute at once on one machine. Cores are not all they share: caches, memory
//! bandwidth and the scheduler's switches cost too, and more so the more workers there
//! are. `bench simreal` measures it before its run, so that the simulator's shared host
//! slows its replicas as this machine does rather than by the core count alone.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::Context;
use preheat_engine::backend::cpu::{CpuBackend, compute_pool};
use preheat_engine::profile::{
    BLOCK, DECODE_PROMPT, decode_blocks_at, decode_steps_at, prefill_passes,
};

/// Decode steps per timed call: short enough that a worker checks the clock often.
const DECODE_STEPS: usize = 16;
/// Sequences in each decode step: a decode worker under load runs a few.
const DECODE_BATCH: usize = 4;

/// What a worker computes while the others do.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Work {
    /// Passes of one prompt of this many tokens, as a prefill worker runs them.
    Prefill(usize),
    /// Decode steps of a few short sequences.
    Decode,
}

/// Most workers measured together; a simulation holds the last count's factor past it.
const MOST_WORKERS: usize = 16;

/// `(workers computing at once, slowdown)` for 2..=`max_workers` workers (at most
/// [`MOST_WORKERS`]) of `threads` compute threads each on `cores` cores, each alternate
/// worker prefilling `prefill_tokens`-token prompts and decoding (the two pools side by
/// side). The slowdown is the mean, over the workers, of a pass's time against the
/// same pass alone, divided by the share of the cores the count leaves each (`k ×
/// threads / cores`, at least 1): 1.0 where sharing costs only cores. Compute-bound
/// workers cannot beat their share, so a factor under 1 is the measurement's noise and
/// reads as 1. Each count runs for at least `period`.
pub(crate) fn measure(
    snapshot: &Path,
    max_workers: usize,
    threads: usize,
    cores: usize,
    prefill_tokens: usize,
    period: Duration,
) -> anyhow::Result<Vec<(u32, f64)>> {
    let max_workers = max_workers.min(MOST_WORKERS);
    if max_workers < 2 {
        return Ok(Vec::new());
    }
    let threads = threads.max(1);
    let (snap, _) = preheat_engine::model::open_model(snapshot)
        .with_context(|| format!("opening {}", snapshot.display()))?;
    let prefill = Work::Prefill(prefill_tokens.max(1));
    let alone_prefill = run_together(&snap, &[prefill], threads, period)?[0];
    let alone_decode = run_together(&snap, &[Work::Decode], threads, period)?[0];
    let mut out = Vec::new();
    for k in 2..=max_workers {
        let work: Vec<Work> = (0..k)
            .map(|i| if i % 2 == 0 { prefill } else { Work::Decode })
            .collect();
        let times = run_together(&snap, &work, threads, period)?;
        let share = ((k * threads) as f64 / cores.max(1) as f64).max(1.0);
        let slowdown = work
            .iter()
            .zip(&times)
            .map(|(w, t)| {
                let alone = if *w == Work::Decode {
                    alone_decode
                } else {
                    alone_prefill
                };
                t / alone / share
            })
            .sum::<f64>()
            / k as f64;
        tracing::info!(workers = k, slowdown, "host sharing");
        if slowdown.is_finite() {
            out.push((u32::try_from(k)?, slowdown.max(1.0)));
        }
    }
    Ok(out)
}

/// One worker per entry of `work`, all computing at once for `period`: each one's
/// mean seconds per pass (a prefill pass, or a decode step). Every worker keeps
/// computing until the last has counted its passes, so none is timed with fewer
/// neighbours than the others.
fn run_together(
    snap: &Arc<preheat_snapshot::Snapshot>,
    work: &[Work],
    threads: usize,
    period: Duration,
) -> anyhow::Result<Vec<f64>> {
    // Everything that can fail before the start is done here, so that no worker is
    // left waiting for one that never comes.
    let built = work
        .iter()
        .map(|&w| -> anyhow::Result<_> {
            let blocks = match w {
                Work::Prefill(len) => len.div_ceil(BLOCK),
                Work::Decode => decode_blocks_at(DECODE_BATCH, DECODE_STEPS, DECODE_PROMPT),
            };
            let be = CpuBackend::new(Arc::clone(snap), blocks, BLOCK)?;
            Ok((w, be, compute_pool(Some(threads))?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let start = Barrier::new(work.len());
    let counting = AtomicUsize::new(work.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = built
            .into_iter()
            .map(|(w, be, pool)| {
                let (start, counting) = (&start, &counting);
                s.spawn(move || {
                    let mut left = Counting(counting, true);
                    start.wait();
                    pool.install(|| worker(be, w, period, &mut left))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().map_err(|p| {
                    let why = p
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    anyhow::anyhow!("a host-sharing worker panicked: {why}")
                })?
            })
            .collect()
    })
}

/// A worker still counting its passes: it leaves the count when it is done, fails
/// or panics, so the others never wait for it.
struct Counting<'a>(&'a AtomicUsize, bool);

impl Counting<'_> {
    fn done(&mut self) {
        if std::mem::take(&mut self.1) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn others_counting(&self) -> bool {
        self.0.load(Ordering::SeqCst) > 0
    }
}

impl Drop for Counting<'_> {
    fn drop(&mut self) {
        self.done();
    }
}

fn worker(
    mut be: CpuBackend,
    work: Work,
    period: Duration,
    left: &mut Counting<'_>,
) -> anyhow::Result<f64> {
    // Seconds of one pass: a prefill, or the mean of a call's decode steps.
    let mut one = || -> anyhow::Result<f64> {
        let t = match work {
            Work::Prefill(len) => prefill_passes(&mut be, len, 1)?,
            Work::Decode => decode_steps_at(&mut be, &[DECODE_BATCH], DECODE_STEPS, DECODE_PROMPT)?,
        };
        Ok(t.first().map_or(0.0, Duration::as_secs_f64))
    };
    // Warm: the first pass faults the weights in.
    one()?;
    let t0 = Instant::now();
    let (mut seconds, mut passes) = (0.0, 0usize);
    while left.1 {
        seconds += one()?;
        passes += 1;
        if t0.elapsed() >= period {
            left.done();
        }
    }
    while left.others_counting() {
        one()?;
    }
    Ok(seconds / passes.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_that_fails_or_panics_stops_being_waited_for() {
        let counting = AtomicUsize::new(3);
        let failed = std::thread::scope(|s| {
            s.spawn(|| {
                let _left = Counting(&counting, true);
                panic!("a pass failed");
            })
            .join()
        });
        assert!(failed.is_err());
        assert_eq!(counting.load(Ordering::SeqCst), 2);
        // One that counted and then failed leaves once, not twice.
        let mut left = Counting(&counting, true);
        left.done();
        drop(left);
        assert_eq!(counting.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn every_count_of_workers_gets_a_measured_slowdown() {
        let dir = tempfile::tempdir().unwrap();
        let snap = dir.path().join("tiny.preheat");
        preheat_snapshot::synth::synthesize(
            "tiny",
            &snap,
            preheat_snapshot::synth::SynthOptions::default(),
            &preheat_snapshot::NoProgress,
        )
        .unwrap();
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let got = measure(&snap, 3, 1, cores, 32, Duration::from_millis(100)).unwrap();
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), vec![2, 3]);
        for (k, f) in got {
            assert!(f.is_finite() && f > 0.0, "{k} workers: {f}");
        }
    }
}
