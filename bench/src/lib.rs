//! `preheat bench …`: long measurements kept out of the test suite. Each figure is
//! reported next to a baseline measured in the same run, since absolute times on a
//! shared machine are not stable.
//!
//! A library beside the CLI, which embeds [`BenchCmd`] as its `bench` subcommand and
//! hands it to [`run`]. Benchmarks that start preheat processes (`coldstart`, `scaler
//! --callers own-process`, `simreal`'s `up`) start the running executable, so they
//! work only from the `preheat` binary.

mod args;
mod coldstart;
mod engine;
mod gpu;
mod grammar;
mod host_share;
mod kv;
mod router;
mod scaler;
mod serve;
mod simreal;
mod snapshot;

pub use args::*;

use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Runs one benchmark: its report on stdout, its files where its flags say.
pub fn run(cmd: BenchCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCmd::Snapshot(args) => snapshot::run(&args),
        BenchCmd::Engine(args) => engine::run(&args),
        BenchCmd::Grammar(args) => grammar::run(&args),
        BenchCmd::Scaler(args) => scaler::run(&args),
        BenchCmd::Serve(args) => serve::run(&args),
        BenchCmd::Simreal(args) => simreal::run(&args),
        BenchCmd::Router(args) => router::run(&args),
        BenchCmd::Kv(args) => kv::run(&args),
        BenchCmd::Coldstart(args) => coldstart::run(&args),
        BenchCmd::Gpu(args) => gpu::run(&args),
    }
}

/// Runs `f` `reps` times and returns the fastest wall time.
pub(crate) fn best_of<T>(
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
pub(crate) fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}
