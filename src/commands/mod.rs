//! Subcommand dispatch: validated options in, human text or JSON out.

/// `println!` through [`emit`]: a closed pipe ends output instead of panicking.
macro_rules! outln {
    ($($a:tt)*) => {
        $crate::commands::emit(&format!("{}\n", format_args!($($a)*)))?
    };
}
pub(crate) use outln;

mod engine;
mod scaler;
mod simulate;
mod snapshot;
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
        Command::Simulate(args) => simulate::run(&args),
        Command::Bench(BenchCmd::Snapshot(args)) => crate::bench::snapshot::run(&args),
        Command::Bench(BenchCmd::Engine(args)) => crate::bench::engine::run(&args),
        Command::Bench(BenchCmd::Scaler(args)) => crate::bench::scaler::run(&args),
        Command::Bench(BenchCmd::Serve(args)) => crate::bench::serve::run(&args),
        Command::Bench(BenchCmd::Router(args)) => crate::bench::router::run(&args),
        Command::Bench(BenchCmd::Kv(args)) => crate::bench::kv::run(&args),
        Command::Bench(BenchCmd::Coldstart(args)) => crate::bench::coldstart::run(&args),
        Command::Bench(BenchCmd::Gpu(args)) => crate::bench::gpu::run(&args),
    }
}

/// Default worker threads: every core.
pub fn default_threads(flag: Option<usize>) -> usize {
    flag.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1)
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    emit(&format!("{}\n", serde_json::to_string_pretty(value)?))
}

/// Writes `text` to stdout. A reader that went away (`preheat … | head`) is not an
/// error worth reporting, so a broken pipe ends output quietly.
pub fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// Bytes as a short human string.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
