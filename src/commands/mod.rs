//! Subcommand dispatch: validated options in, human text or JSON out.

mod engine;
mod scaler;
mod simulate;
mod snapshot;
mod status;
mod trace;
mod warmpool;

use std::process::ExitCode;

use crate::cli::{Cli, Command};
use crate::signals::shutdown_signal;

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Snapshot(cmd) => snapshot::run(cmd),
        Command::Engine(cmd) => engine::run(cmd),
        Command::Scaler(cmd) => scaler::run(cmd),
        Command::Up(args) => preheat_local::run(&args, shutdown_signal()),
        Command::Warmpool(cmd) => warmpool::run(cmd),
        Command::Status(args) => status::run(&args),
        Command::Simulate(args) => simulate::run(&args),
        Command::Trace(cmd) => trace::run(cmd),
        Command::Bench(cmd) => preheat_bench::run(cmd),
    }
}

/// Default worker threads: every core.
pub fn default_threads(flag: Option<usize>) -> usize {
    flag.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1)
}
