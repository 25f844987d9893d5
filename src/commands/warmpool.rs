//! `preheat warmpool …`

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use preheat_output::{human_bytes, outln};
use preheat_warmpool::AgentConfig;
use preheat_warmpool::stage::{self, StageOptions};
use preheat_warmpool::{Fetcher, Source};

use crate::cli::WarmpoolCmd;

pub fn run(cmd: WarmpoolCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        WarmpoolCmd::Run {
            config,
            advertise_host,
            listen,
            token,
            open,
        } => {
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let mut cfg = AgentConfig::from_yaml(&text, std::env::var("NODE_NAME").ok())?;
            if let Some(h) = advertise_host {
                anyhow::ensure!(
                    !h.is_empty() && !h.contains(['/', ' ', '@']),
                    "--advertise-host {h:?} is not a host"
                );
                cfg.advertise_host = h;
            }
            if let Some(l) = listen {
                cfg.listen = l;
            }
            if let (Some(t), Some(p)) = (
                token.require(open, "the warm-pool agent")?,
                token.cluster_token_file,
            ) {
                cfg.cluster_token = Some((t, p));
            }
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let l = tokio::net::TcpListener::bind(cfg.listen)
                    .await
                    .with_context(|| format!("binding {}", cfg.listen))?;
                tracing::info!(addr = %cfg.listen, dir = %cfg.dir.display(), models = cfg.models.len(), "warm-pool agent");
                preheat_warmpool::agent::run(cfg, l, crate::signals::shutdown_signal()).await?;
                anyhow::Ok(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        WarmpoolCmd::Own { dirs, uid, gid } => {
            let mut changed = 0;
            for d in &dirs {
                changed += preheat_warmpool::own_tree(d, uid, gid)?;
            }
            outln!(
                "{changed} entries given to {uid}:{gid} under {} directories",
                dirs.len()
            );
            Ok(ExitCode::SUCCESS)
        }
        WarmpoolCmd::Stage {
            source,
            dir,
            name,
            concurrency,
            piece_mib,
            disk_budget,
            json,
        } => {
            let mut errs = Vec::new();
            let budget = disk_budget.as_deref().and_then(|b| {
                preheat_warmpool::config::parse_size(b)
                    .map_err(|e| errs.push(format!("--disk-budget {b}: {e}")))
                    .ok()
            });
            if concurrency == 0 || concurrency > 256 {
                errs.push(format!("--concurrency {concurrency} must be in 1..=256"));
            }
            if piece_mib == 0 || piece_mib > 1024 {
                errs.push(format!("--piece-mib {piece_mib} must be in 1..=1024"));
            }
            let src = Source::parse(&source);
            let name = name.or_else(|| stage::default_name(&src));
            match &name {
                None => errs.push(format!("--name is needed: no model name in {src}")),
                Some(n) => {
                    if let Err(e) = stage::validate_name(n) {
                        errs.push(e.to_string());
                    }
                }
            }
            if !errs.is_empty() {
                anyhow::bail!("invalid options:\n  {}", errs.join("\n  "));
            }
            let name = name.context("checked above")?;
            let opts = StageOptions {
                concurrency,
                piece_bytes: piece_mib << 20,
                ..StageOptions::default()
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let o = rt.block_on(async {
                let f = Fetcher::new(src, Duration::from_secs(60))?;
                let bar = Arc::new(preheat_output::Bar::new());
                match budget {
                    // Beside the node's agent, under its budget: demand makes room.
                    Some(b) => {
                        let store = preheat_warmpool::Store::open(&dir, b)?;
                        let none = std::collections::HashSet::new();
                        match store.ensure(&name, &f, &opts, &none, bar.clone()).await {
                            // The pod needs the model to start at all: staged past the
                            // budget rather than never, and said.
                            Err(preheat_warmpool::Error::OverBudget(why)) => {
                                tracing::warn!(model = %name, %why, "no room within the disk budget; staging past it");
                                let o = stage::stage(&f, &dir, &name, &opts, bar).await;
                                store.touch(&name);
                                o
                            }
                            other => other,
                        }
                    }
                    None => stage::stage(&f, &dir, &name, &opts, bar).await,
                }
            })?;
            if json {
                preheat_output::print_json(&serde_json::json!({
                    "path": o.path, "bytes": o.bytes, "fetched_bytes": o.fetched_bytes,
                    "resumed_bytes": o.resumed_bytes, "already_staged": o.already_staged,
                    "seconds": o.seconds,
                }))?;
            } else if o.already_staged {
                outln!(
                    "{} already staged and verified ({})",
                    o.path.display(),
                    human_bytes(o.bytes)
                );
            } else {
                outln!(
                    "staged {} ({}; fetched {}, resumed {}) in {:.2} s ({}/s)",
                    o.path.display(),
                    human_bytes(o.bytes),
                    human_bytes(o.fetched_bytes),
                    human_bytes(o.resumed_bytes),
                    o.seconds,
                    human_bytes(
                        (o.bytes.saturating_sub(o.resumed_bytes) as f64 / o.seconds.max(1e-3))
                            as u64
                    )
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
