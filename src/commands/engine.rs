//! `preheat engine …`

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use preheat_engine::colocated::{Device, ServeOptions, serve};
use preheat_engine::scheduler::SchedulerConfig;

use crate::cli::{EngineCmd, GatewayArgs, ServeArgs, WorkerArgs};
use crate::signals::shutdown_signal;
use preheat_engine::disagg::WorkerRole;
use preheat_engine::disagg::{gateway, worker};
use preheat_engine::metrics::Role;

pub fn run(cmd: EngineCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        EngineCmd::Serve(args) => {
            let opts = serve_options(&args, false)?;
            let _lease = lease(&args.model, args.standby);
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(serve(opts, shutdown_signal()))?;
            Ok(ExitCode::SUCCESS)
        }
        EngineCmd::Gateway(args) => run_gateway(&args),
        EngineCmd::Prefill(args) => run_worker(&args, WorkerRole::Prefill),
        EngineCmd::Decode(args) => run_worker(&args, WorkerRole::Decode),
        EngineCmd::Profile {
            model,
            output,
            lengths,
            batches,
            steps,
            kv_cache_mib,
        } => {
            preheat_local::profile::measure(
                &model,
                &output,
                &lengths,
                &batches,
                steps,
                kv_cache_mib,
            )?;
            preheat_output::outln!("wrote {}", output.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The deployment's cluster token, which also keys this process's prefix-cache hashes
/// (the gateway's router and the workers must agree, and outsiders must not know them).
/// `needed_by` names the process when it serves internal endpoints (then the token is
/// required).
pub(crate) fn deployment_token(
    a: &crate::cli::ClusterTokenArgs,
    open: crate::cli::NoTokenArg,
    needed_by: Option<&str>,
) -> anyhow::Result<Option<std::sync::Arc<preheat_edge::ClusterToken>>> {
    let t = match needed_by {
        Some(what) => a.require(open, what)?,
        None => a.load()?,
    };
    Ok(t)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn run_gateway(a: &GatewayArgs) -> anyhow::Result<ExitCode> {
    let mut errs = Vec::new();
    if a.worker_timeout.is_zero() {
        errs.push("--worker-timeout must be > 0".to_owned());
    }
    if a.block_size == 0 {
        errs.push("--block-size must be > 0".to_owned());
    }
    let addr = preheat_flags::socket_addr(&a.host, a.port, &mut errs);
    // `--model-env NAME=VAR`: the source read from $VAR, never shown.
    let mut from_env: Vec<(&str, String)> = Vec::new();
    for m in &a.model_env {
        match split_named(m) {
            (Some(name), var) => match std::env::var(var) {
                Ok(v) if !v.trim().is_empty() => from_env.push((name, v)),
                _ => errs.push(format!("--model-env {m}: ${var} is not set (or empty)")),
            },
            (None, _) => errs.push(format!("--model-env {m}: give it as NAME=VAR")),
        }
    }
    let specs: Vec<(Option<&str>, &str)> = a
        .model
        .iter()
        .map(|m| split_named(m))
        .chain(from_env.iter().map(|(n, v)| (Some(*n), v.as_str())))
        .collect();
    let discovering = a.discover_namespace.is_some();
    if discovering && specs.is_empty() {
        errs.push("--discover-namespace needs --model (or --model-env): the gateway holds requests for the models it knows".to_owned());
    }

    if specs.len() > 1 {
        if a.served_model_name.is_some() {
            errs.push("--served-model-name names one model; with several --model give each as NAME=SOURCE".to_owned());
        }
        if a.chat_template.is_some() {
            errs.push("--chat-template replaces one model's template; it cannot be given with several --model".to_owned());
        }
    }
    if let (Some(_), Some(_)) = (
        a.served_model_name.as_ref(),
        specs.first().and_then(|s| s.0),
    ) {
        errs.push(
            "--served-model-name and --model NAME=SOURCE both name the model; give one".to_owned(),
        );
    }
    // Each model's pools' Services, by model name (`None`: the one model's).
    let mut services: Vec<(Option<&str>, WorkerRole, &str)> = Vec::new();
    for (role, flag, given) in [
        (WorkerRole::Prefill, "--prefill-service", &a.prefill_service),
        (WorkerRole::Decode, "--decode-service", &a.decode_service),
    ] {
        for s in given {
            let (name, svc) = split_named(s);
            if specs.len() > 1 && name.is_none() {
                errs.push(format!(
                    "{flag} {s}: with several --model, give it as NAME=SERVICE"
                ));
            }
            services.push((name, role, svc));
        }
        if discovering {
            for (name, _) in specs.iter().filter(|_| specs.len() > 1) {
                let n = given.iter().filter(|s| split_named(s).0 == *name).count();
                if n != 1 {
                    errs.push(format!(
                        "{flag}: model {} needs one NAME=SERVICE, {n} given",
                        name.unwrap_or("(unnamed: give --model NAME=SOURCE)")
                    ));
                }
            }
            if specs.len() == 1 && given.len() != 1 {
                errs.push(format!(
                    "{flag}: one Service for the one model, {} given",
                    given.len()
                ));
            }
        }
    }
    if !errs.is_empty() {
        anyhow::bail!("invalid options:\n  {}", errs.join("\n  "));
    }
    let rt = runtime()?;
    let reads = specs.iter().map(|&(name, source)| {
        let name = name.or(a.served_model_name.as_deref());
        gateway_model(source, name, a.block_size)
    });
    let read = rt.block_on(futures_util::future::join_all(reads));
    let mut models = Vec::new();
    for ((name, source), info) in specs.iter().zip(read) {
        match info {
            Ok(info) => models.push(gateway::GatewayModel::new(info)),
            // Alone, a model that cannot be read stops the gateway: it could serve nothing.
            Err(e) if specs.len() == 1 => return Err(e),
            Err(e) => {
                // Clients read this cause (the model's 503, `/v1/models`): the source
                // only as shown in logs, a URL's user info and query redacted, even
                // where an inner error (a request's) repeats it.
                let shown = preheat_warmpool::Source::parse(source).to_string();
                let cause = format!("{e:#}").replace(source, &shown);
                let name = match name {
                    Some(n) => (*n).to_owned(),
                    None => served_name_of(source).with_context(|| {
                        format!(
                            "--model {shown}: {cause}; and no model name in it: give NAME=SOURCE"
                        )
                    })?,
                };
                models.push(gateway::GatewayModel::unreadable(name, cause));
            }
        }
    }
    let internal_addr = if discovering {
        if a.internal_port.is_some() {
            anyhow::bail!(
                "--internal-port is for workers that register; a discovering gateway (--discover-namespace) takes no registrations"
            );
        }
        None
    } else {
        let port = match a.internal_port {
            Some(p) => p,
            None => a
                .port
                .checked_add(1)
                .context("--port + 1 overflows; give --internal-port")?,
        };
        let mut errs = Vec::new();
        let addr = preheat_flags::socket_addr(&a.host, port, &mut errs);
        if !errs.is_empty() {
            anyhow::bail!("invalid options:\n  {}", errs.join("\n  "));
        }
        addr
    };
    let api_keys = a
        .api_keys_file
        .as_deref()
        .map(preheat_edge::ApiKeys::load)
        .transpose()?
        .map(std::sync::Arc::new);
    let mut opts = gateway::GatewayOptions {
        cluster_token: deployment_token(&a.token, a.open, Some("the gateway"))?,
        api_keys,
        worker_timeout: a.worker_timeout,
        hold_timeout: a.hold_timeout,
        disagg_min_tokens: a.disagg_min_tokens,
        drain_grace: a.drain_grace,
        chat_template: preheat_flags::read_chat_template(a.chat_template.as_deref())?,
        models,
        ..gateway::GatewayOptions::default()
    };
    let addr = addr.context("checked above")?;
    rt.block_on(async move {
        if let Some(ns) = &a.discover_namespace {
            let client = preheat_scaler::kube::client(a.kube_api_url.as_deref()).await?;
            let one = opts.models.len() == 1;
            for m in &mut opts.models {
                // Each model's own Services (the one model's are unnamed).
                let pools: Vec<(WorkerRole, String)> = services
                    .iter()
                    .filter(|(name, _, _)| one || *name == Some(m.name.as_str()))
                    .map(|&(_, role, svc)| (role, svc.to_owned()))
                    .collect();
                let source: std::sync::Arc<dyn gateway::WorkerSource> =
                    crate::endpoint_slices::EndpointSlices::watch(
                        client.clone(),
                        ns,
                        &pools,
                        a.standby_agents_service
                            .as_deref()
                            .map(|svc| (svc, standby_pools(&m.name, one))),
                        opts.cluster_token.clone(),
                    );
                m.discovery = Some(source);
            }
        }
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let internal = match internal_addr {
            Some(ia) => Some(
                tokio::net::TcpListener::bind(ia)
                    .await
                    .with_context(|| format!("binding {ia} (--internal-port)"))?,
            ),
            None => None,
        };
        gateway::run(l, internal, opts, shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The agents' pools whose serving standbys join model `name`'s prefill and decode
/// pools: `NAME-prefill` and `NAME-decode`, and, where it is the gateway's only model,
/// `prefill` and `decode` (the chart's one-model form).
fn standby_pools(name: &str, only: bool) -> Vec<(WorkerRole, String)> {
    let mut out = Vec::new();
    for role in [WorkerRole::Prefill, WorkerRole::Decode] {
        out.push((role, format!("{name}-{}", role.as_str())));
        if only {
            out.push((role, role.as_str().to_owned()));
        }
    }
    out
}

/// `--model [NAME=]SOURCE` as (name, source): the part before the first `=` is a name
/// when it could be one (letters, digits, `.`, `_`, `-`; a path or URL has `/` or `:`
/// before any `=` it holds).
fn split_named(arg: &str) -> (Option<&str>, &str) {
    preheat_flags::split_named(arg, |name| {
        name.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    })
}

/// The name a model from `source` is served under when none is given: its file's
/// name, as a worker of it would say.
fn served_name_of(source: &str) -> anyhow::Result<String> {
    let s = preheat_warmpool::Source::parse(source);
    match &s {
        preheat_warmpool::Source::Path(p)
            if p.is_dir() || p.extension().is_some_and(|e| e == "gguf") =>
        {
            Ok(preheat_engine::colocated::default_name(p))
        }
        _ => preheat_warmpool::stage::default_name(&s).context("no model name in it"),
    }
}

/// The model a gateway fronts, from `--model`: a snapshot (plain or packed, path or
/// URL) is read for its card alone; an HF directory or GGUF file is converted.
async fn gateway_model(
    model: &str,
    name: Option<&str>,
    block_size: usize,
) -> anyhow::Result<preheat_engine::disagg::ModelInfo> {
    let source = preheat_warmpool::Source::parse(model);
    let is_snapshot = match &source {
        preheat_warmpool::Source::Http(_) => true,
        preheat_warmpool::Source::Path(p) => {
            p.is_file() && p.extension().is_none_or(|e| e != "gguf")
        }
    };
    if !is_snapshot {
        let path = std::path::PathBuf::from(model);
        let name = name.map(str::to_owned);
        return tokio::task::spawn_blocking(move || {
            gateway::model_info(&path, block_size, name.as_deref())
        })
        .await?
        .with_context(|| format!("--model {model}"));
    }
    // Shown without credentials (a URL's user info and query are redacted).
    let shown = source.to_string();
    let name = match name {
        Some(n) => n.to_owned(),
        None => preheat_warmpool::stage::default_name(&source).with_context(|| {
            format!("--model {shown}: no model name in it; give --served-model-name")
        })?,
    };
    let fetcher = preheat_warmpool::Fetcher::new(source, Duration::from_secs(30))?;
    let card = preheat_warmpool::fetch_card(&fetcher)
        .await
        .with_context(|| format!("--model {shown}: reading its manifest"))?;
    let info = gateway::model_info_from_card(&card, block_size, &name)?;
    tracing::info!(model = %info.model, source = %shown, "gateway model read from its manifest (no weights)");
    Ok(info)
}

fn run_worker(a: &WorkerArgs, role: WorkerRole) -> anyhow::Result<ExitCode> {
    // Refused by name rather than ignored: a worker has one, internal, listener.
    if a.serve.api_keys_file.is_some() {
        anyhow::bail!(
            "--api-keys-file is for `engine serve` and `engine gateway`: workers take no client traffic (their port is internal, behind the cluster token)"
        );
    }
    if a.serve.internal_port.is_some() {
        anyhow::bail!(
            "--internal-port is for `engine serve`: a worker's one port is already internal"
        );
    }
    let mut serve = serve_options(&a.serve, true)?;
    let _lease = lease(&a.serve.model, a.serve.standby);
    if let Some(g) = &a.gateway
        && !(g.starts_with("http://") || g.starts_with("https://"))
    {
        anyhow::bail!("--gateway {g:?} is not an http(s) URL");
    }
    serve.role = match role {
        WorkerRole::Prefill => Role::Prefill,
        WorkerRole::Decode => Role::Decode,
    };
    let advertise = a.advertise.clone().unwrap_or_else(|| {
        let host = if a.serve.host == "0.0.0.0" {
            "127.0.0.1"
        } else {
            a.serve.host.as_str()
        };
        format!("http://{host}:{}", a.serve.port)
    });
    let kv_listener = if role == WorkerRole::Prefill {
        let port = match a.kv_port {
            Some(p) => p,
            None => a
                .serve
                .port
                .checked_add(1)
                .context("--port + 1 overflows; give --kv-port")?,
        };
        let mut kv_addr = serve.addr;
        kv_addr.set_port(port);
        // The host others reach the HTTP side at reaches the KV side too.
        let host = advertise
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .rsplit_once(':')
            .map_or("127.0.0.1", |(h, _)| h)
            .to_owned();
        Some((kv_addr, format!("tcp://{host}:{port}")))
    } else {
        None
    };
    let opts = worker::WorkerOptions {
        kv_listener,
        serve: serve.clone(),
        role,
        gateway: a
            .gateway
            .as_ref()
            .map(|g| g.trim_end_matches('/').to_owned()),
        advertise: advertise.trim_end_matches('/').to_owned(),
        heartbeat: Duration::from_secs(1),
        transfer_timeout: a.transfer_timeout,
    };
    runtime()?.block_on(async move {
        let l = tokio::net::TcpListener::bind(serve.addr)
            .await
            .with_context(|| format!("binding {}", serve.addr))?;
        worker::run(l, opts, shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// This replica's claim on the snapshot file it maps, held until it exits: the node's
/// warm pool never evicts a snapshot a replica maps. Not a snapshot file (a Hugging
/// Face directory, a GGUF converted in memory): nothing to claim. A standby claims
/// nothing: it is the agent's own, which retires it when its model must make room
/// (parked standbys holding leases would pin every model that has them).
fn lease(model: &std::path::Path, standby: bool) -> Option<preheat_warmpool::lease::Lease> {
    if standby || !model.is_file() {
        return None;
    }
    preheat_warmpool::lease::Lease::take(model)
        .inspect_err(|e| {
            tracing::warn!(path = %model.display(), error = %e, "no lease on the snapshot: the warm pool may evict it while it is mapped");
        })
        .ok()
}

/// Raw flags → validated options, with every problem reported at once.
pub(crate) fn serve_options(a: &ServeArgs, worker: bool) -> anyhow::Result<ServeOptions> {
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
    let addr = preheat_flags::socket_addr(&a.host, a.port, &mut errs);
    if !errs.is_empty() {
        anyhow::bail!("invalid options:\n  {}", errs.join("\n  "));
    }
    let mut o = ServeOptions::new(a.model.clone(), addr.context("checked above")?);
    o.served_model_name = a.served_model_name.clone();
    o.chat_template = preheat_flags::read_chat_template(a.chat_template.as_deref())?;
    o.block_size = a.block_size;
    o.kv_cache_bytes = a.kv_cache_mib << 20;
    o.scheduler = SchedulerConfig {
        max_batched_tokens: a.max_batched_tokens,
        max_running: a.max_running,
        max_waiting: a.max_waiting,
    };
    o.drain_grace = a.drain_grace;
    o.standby = a.standby;
    o.device = Device::parse(a.device.as_str()).context("checked by clap")?;
    o.kernel_cache = a.kernel_cache.clone();
    o.started = crate::process_started();
    // `engine serve` has internal endpoints only as a standby with a control port;
    // workers' one port is internal.
    let needed_by = if worker {
        Some("a worker")
    } else if a.internal_port.is_some() {
        Some("`engine serve --internal-port`")
    } else {
        None
    };
    o.cluster_token = deployment_token(&a.token, a.open, needed_by)?;
    o.api_keys = a
        .api_keys_file
        .as_deref()
        .map(preheat_edge::ApiKeys::load)
        .transpose()?
        .map(std::sync::Arc::new);
    if let Some(p) = a.internal_port {
        let mut ia = o.addr;
        ia.set_port(p);
        o.internal_addr = Some(ia);
    }
    Ok(o)
}
