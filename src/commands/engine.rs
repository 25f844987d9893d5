//! `preheat engine …`

use std::net::ToSocketAddrs;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use preheat_engine::scheduler::SchedulerConfig;
use preheat_engine::serve::{ServeOptions, serve};

use crate::cli::{EngineCmd, ServeArgs};

pub fn run(cmd: EngineCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        EngineCmd::Serve(args) => {
            let opts = serve_options(&args)?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(serve(opts))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Raw flags → validated options, with every problem reported at once.
fn serve_options(a: &ServeArgs) -> anyhow::Result<ServeOptions> {
    let mut errs = Vec::new();
    if !a.model.exists() {
        errs.push(format!(
            "--model {}: no such file or directory",
            a.model.display()
        ));
    }
    if a.block_size == 0 || a.block_size > 1024 {
        errs.push(format!("--block-size {} must be in 1..=1024", a.block_size));
    }
    for (flag, v) in [
        ("--kv-cache-mib", a.kv_cache_mib),
        ("--max-batched-tokens", a.max_batched_tokens),
        ("--max-running", a.max_running),
        ("--max-waiting", a.max_waiting),
    ] {
        if v == 0 {
            errs.push(format!("{flag} must be > 0"));
        }
    }
    let addr = (a.host.as_str(), a.port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut i| i.next());
    if addr.is_none() {
        errs.push(format!(
            "--host {} --port {} is not an address",
            a.host, a.port
        ));
    }
    if !errs.is_empty() {
        anyhow::bail!("invalid options:\n  {}", errs.join("\n  "));
    }
    let mut o = ServeOptions::new(a.model.clone(), addr.context("checked above")?);
    o.served_model_name = a.served_model_name.clone();
    o.block_size = a.block_size;
    o.kv_cache_bytes = a.kv_cache_mib << 20;
    o.scheduler = SchedulerConfig {
        max_batched_tokens: a.max_batched_tokens,
        max_running: a.max_running,
        max_waiting: a.max_waiting,
    };
    o.drain_grace = Duration::from_secs(a.drain_grace_secs);
    Ok(o)
}
