//! Flag syntax that the CLI's subcommands, the local orchestrator's `UpArgs` and the
//! benchmarks' arguments share, so that `up`, `bench` and the rest take a flag written
//! the same way: durations and latency targets ([`duration`]), `--host`/`--port`,
//! `--chat-template` and `--json`.

mod duration;

pub use duration::{duration_arg, seconds_arg};

use std::net::ToSocketAddrs;

use anyhow::Context;

/// `--json`, for commands that print a report.
#[derive(Debug, clap::Args, Clone, Copy)]
pub struct OutputArgs {
    /// Print machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `--host`/`--port` as an address, or an error in `errs`.
pub fn socket_addr(host: &str, port: u16, errs: &mut Vec<String>) -> Option<std::net::SocketAddr> {
    let addr = (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut i| i.next());
    if addr.is_none() {
        errs.push(format!("--host {host} --port {port} is not an address"));
    }
    addr
}

/// `--chat-template`'s text, read at start: a missing file fails the start, not the
/// first chat.
pub fn read_chat_template(path: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    path.map(|p| {
        std::fs::read_to_string(p).with_context(|| format!("--chat-template {}", p.display()))
    })
    .transpose()
}

/// `NAME=VALUE` as (name, value) where the part before the first `=` passes
/// `is_name`; otherwise the whole argument is the value (a path or URL holding `=`
/// keeps it: its `/` or `:` come before). Used by every flag that names a model.
pub fn split_named(arg: &str, is_name: impl Fn(&str) -> bool) -> (Option<&str>, &str) {
    match arg.split_once('=') {
        Some((name, value)) if !name.is_empty() && !value.is_empty() && is_name(name) => {
            (Some(name), value)
        }
        _ => (None, arg),
    }
}
