//! Subcommand dispatch: validated options in, human text or JSON out.

pub(crate) mod bench;
mod engine;
mod scaler;
mod simulate;
mod snapshot;
mod status;
mod trace;
pub(crate) mod up;
mod warmpool;

use std::process::ExitCode;

use crate::cli::{BenchCmd, Cli, Command};

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Snapshot(cmd) => snapshot::run(cmd),
        Command::Engine(cmd) => engine::run(cmd),
        Command::Scaler(cmd) => scaler::run(cmd),
        Command::Up(args) => up::run(&args),
        Command::Warmpool(cmd) => warmpool::run(cmd),
        Command::Status(args) => status::run(&args),
        Command::Simulate(args) => simulate::run(&args),
        Command::Trace(cmd) => trace::run(cmd),
        Command::Bench(BenchCmd::Snapshot(args)) => bench::snapshot::run(&args),
        Command::Bench(BenchCmd::Engine(args)) => bench::engine::run(&args),
        Command::Bench(BenchCmd::Grammar(args)) => bench::grammar::run(&args),
        Command::Bench(BenchCmd::Scaler(args)) => bench::scaler::run(&args),
        Command::Bench(BenchCmd::Serve(args)) => bench::serve::run(&args),
        Command::Bench(BenchCmd::Simreal(args)) => bench::simreal::run(&args),
        Command::Bench(BenchCmd::Router(args)) => bench::router::run(&args),
        Command::Bench(BenchCmd::Kv(args)) => bench::kv::run(&args),
        Command::Bench(BenchCmd::Coldstart(args)) => bench::coldstart::run(&args),
        Command::Bench(BenchCmd::Gpu(args)) => bench::gpu::run(&args),
    }
}

/// Default worker threads: every core.
pub fn default_threads(flag: Option<usize>) -> usize {
    flag.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1)
}
