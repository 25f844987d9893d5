//! `preheat`: one binary whose subcommands run each part of the system.

mod cli;
mod commands;
mod endpoint_slices;
mod signals;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

/// When this process began, for start-up phases: the spawner's clock when it passed
/// `preheat_warmpool::worker_process::SPAWNED_AT_ENV` (so exec and dynamic loading count),
/// else now.
static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

pub(crate) fn process_started() -> std::time::Instant {
    *STARTED.get_or_init(std::time::Instant::now)
}

fn main() -> ExitCode {
    let now = std::time::Instant::now();
    let spawned_ago = preheat_warmpool::worker_process::spawned_ago();
    let _ = STARTED.set(spawned_ago.and_then(|d| now.checked_sub(d)).unwrap_or(now));
    let cli = cli::Cli::parse();
    // Logs go to stderr so stdout stays clean for human output and --json.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match commands::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
