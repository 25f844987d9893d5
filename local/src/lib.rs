//! `preheat up`: the whole stack on one machine. A gateway, the scaler with its KEDA
//! gRPC endpoint open, and a local replica driver that does what KEDA and Kubernetes
//! would: it asks the scaler over the same gRPC API (`IsActive`, `GetMetrics`) and
//! starts and stops prefill and decode worker processes to match, within the pools'
//! limits, promoting parked standbys first. The warm-pool agent runs in-process: it
//! stages the model's snapshot into the cache directory (verified, atomically) and keeps
//! it hot; workers start from the staged copy. Requests arriving at zero are held by the
//! gateway until the scaler wakes a pool.
//!
//! A library beside the CLI, which runs it as `preheat up`, because `bench simreal`
//! simulates exactly what it runs ([`setup`], [`INTERVAL_S`], [`WINDOW_S`]). Also here:
//! the capacity profile it measures ([`profile`], which `engine profile` writes too) and
//! the loopback ports its processes listen on ([`ports`]).

mod args;
mod driver;
mod models;
pub mod ports;
pub mod profile;
mod staging;

pub use args::UpArgs;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use preheat_engine::disagg::gateway::{self, GatewayOptions};
use preheat_scaler::config::{Config, ModelConfig, PoolConfig};
use preheat_scaler::controller::SharedEndpoints;
use preheat_scaler::policy::Pool;
use preheat_scaler::policy::PoolPolicy;
use preheat_scaler::profile::Profile;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_scaler::proto::{GetMetricsRequest, ScaledObjectRef};
use preheat_warmpool::config::{AgentConfig, ModelSpec, StandbySpec};
use preheat_warmpool::restart_backoff::{RestartBackoff, log_tail};
use preheat_warmpool::standby::StandbyPool;
use preheat_warmpool::worker_process::worker_command;
use tokio::process::{Child, Command};

use crate::ports::{free_port, free_port_run};

use self::driver::{PoolState, target};
use self::models::{ModelArg, Served, agent_config, model_arg};
use self::staging::{measured_profile, stage, staged_name};

/// The name of the embedded model, served when no `--model` is given.
const MODEL: &str = "default";

struct Options {
    gateway: SocketAddr,
    gateway_internal: SocketAddr,
    scaler: SocketAddr,
    scaler_http: SocketAddr,
    agent: SocketAddr,
    idle_grace_s: f64,
    limits: [(u32, u32); 2],
    cache: PathBuf,
    state_file: PathBuf,
    /// The models served, in the order given (the embedded one when none was).
    models: Vec<ModelArg>,
    chat_template: Option<String>,
    kv_cache_mib: usize,
    slo_ttft: f64,
    slo_itl: f64,
    standbys: u32,
    /// `--set` overrides of the pools' policies.
    overrides: Vec<String>,
}

fn options(a: &UpArgs) -> anyhow::Result<Options> {
    let mut errs = Vec::new();
    let gateway = preheat_flags::socket_addr(&a.host, a.port, &mut errs);
    let gateway_internal = a.gateway_internal.parse::<SocketAddr>().ok();
    if gateway_internal.is_none() {
        errs.push(format!(
            "--gateway-internal {:?} is not an address",
            a.gateway_internal
        ));
    }
    let scaler = a.scaler_listen.parse::<SocketAddr>().ok();
    if scaler.is_none() {
        errs.push(format!(
            "--scaler-listen {:?} is not an address",
            a.scaler_listen
        ));
    }
    let mut addr = |flag: &str, v: &str| {
        let a = v.parse::<SocketAddr>().ok();
        if a.is_none() {
            errs.push(format!("--{flag} {v:?} is not an address"));
        }
        a
    };
    let scaler_http = addr("scaler-http", &a.scaler_http);
    let agent = addr("agent-listen", &a.agent_listen);
    for (name, min, max) in [
        ("prefill", a.prefill_min, a.prefill_max),
        ("decode", a.decode_min, a.decode_max),
    ] {
        if max == 0 || min > max {
            errs.push(format!(
                "--{name}-min {min} / --{name}-max {max}: need 0 ≤ min ≤ max, max > 0"
            ));
        }
    }
    for (flag, v) in [("slo-ttft", a.slo_ttft), ("slo-itl", a.slo_itl)] {
        if !(v.is_finite() && v > 0.0) {
            errs.push(format!("--{flag} {v}: give a time above zero"));
        }
    }
    let served = a.model.len().max(1);
    errs.extend(
        a.overrides
            .iter()
            .filter_map(|o| policy_override_problem(o, served)),
    );
    let mut models: Vec<ModelArg> = a.model.iter().map(|m| model_arg(m)).collect();
    let mut names = std::collections::BTreeSet::new();
    for m in &models {
        if let Some(p) = &m.path
            && !p.exists()
        {
            errs.push(format!(
                "--model {}: no such file or directory",
                p.display()
            ));
        }
        if !names.insert(m.name.as_str()) {
            errs.push(format!(
                "--model: the name {:?} is given twice; name each model (NAME=PATH)",
                m.name
            ));
        }
    }
    if models.len() > 1 && a.chat_template.is_some() {
        errs.push(
            "--chat-template replaces one model's template; it cannot be given with several --model"
                .to_owned(),
        );
    }
    if models.is_empty() {
        models.push(ModelArg {
            name: MODEL.to_owned(),
            path: None,
        });
    }
    if !errs.is_empty() {
        bail!("invalid options:\n  {}", errs.join("\n  "));
    }
    Ok(Options {
        gateway: gateway.context("checked")?,
        gateway_internal: gateway_internal.context("checked")?,
        scaler: scaler.context("checked")?,
        scaler_http: scaler_http.context("checked")?,
        agent: agent.context("checked")?,
        idle_grace_s: a.idle_grace.as_secs_f64(),
        limits: [(a.prefill_min, a.prefill_max), (a.decode_min, a.decode_max)],
        cache: a.cache_dir.clone(),
        state_file: a
            .state_file
            .clone()
            .unwrap_or_else(|| a.cache_dir.join(STATE_FILE)),
        models,
        chat_template: preheat_flags::read_chat_template(a.chat_template.as_deref())?,
        kv_cache_mib: a.kv_cache_mib,
        slo_ttft: a.slo_ttft,
        slo_itl: a.slo_itl,
        standbys: a.standbys,
        overrides: a.overrides.clone(),
    })
}

/// Why `up` refuses a `--set`, if it does: it takes the pools' policy keys of each of
/// its `served` models (`models.N.prefill.*`, `models.N.decode.*`, N in `--model`
/// order) except those its own flags give (the driver holds each pool within
/// `--{pool}-min/max` whatever the scaler asks); the rest of its scaler config (its
/// addresses, the pools' sources, the models' names) is wired to the stack it starts.
fn policy_override_problem(spec: &str, served: usize) -> Option<String> {
    let Some((path, _)) = spec.split_once('=') else {
        return Some(format!("--set {spec:?}: expected path=value"));
    };
    // `models.N.rest` read as the first model's key, N checked against the models.
    let as_first = match path.strip_prefix("models.").and_then(|r| r.split_once('.')) {
        Some((n, rest)) => match n.parse::<usize>() {
            Ok(i) if i < served => format!("models.0.{rest}"),
            Ok(i) => {
                return Some(format!(
                    "--set {path}: `up` serves {served} model(s); N in models.N counts from 0 in --model order, so {i} names none"
                ));
            }
            Err(_) => path.to_owned(),
        },
        None => path.to_owned(),
    };
    match Config::first_model_policy_key(&as_first) {
        Some((pool, key)) => {
            let pool = pool.as_str();
            let flag = match key {
                "min_replicas" => format!("--{pool}-min"),
                "max_replicas" => format!("--{pool}-max"),
                "idle_grace_s" => "--idle-grace".to_owned(),
                "slo_ttft_s" => "--slo-ttft".to_owned(),
                "slo_itl_s" => "--slo-itl".to_owned(),
                _ => return None,
            };
            Some(format!("--set {path}: give it as `up {flag}`"))
        }
        None => Some(format!(
            "--set {path}: `up` takes only the pools' policy keys (models.N.prefill.KEY, \
             models.N.decode.KEY, N in --model order from 0); its addresses, the pools' \
             sources and the models come from its own flags"
        )),
    }
}

/// The scaler's decision interval and metric window in local mode: quick, since a
/// local replica starts in about a second.
pub const INTERVAL_S: f64 = 0.5;
pub const WINDOW_S: f64 = 10.0;

/// One pool's policy in local mode: this run's SLOs, limits and idle grace.
fn pool_policy(o: &Options, (min, max): (u32, u32)) -> PoolPolicy {
    PoolPolicy {
        min_replicas: min,
        max_replicas: max,
        idle_grace_s: o.idle_grace_s,
        scale_down_stabilization_s: 30.0,
        default_lead_s: 2.0,
        slo_ttft_s: o.slo_ttft,
        slo_itl_s: o.slo_itl,
        ..PoolPolicy::default()
    }
}

/// What `up` runs with, worked out from its flags as `run` does: the model staged,
/// its measured profile, and each pool's policy. `bench simreal` simulates exactly this.
#[derive(Debug)]
pub struct Setup {
    /// The staged snapshot the workers serve.
    pub snapshot: PathBuf,
    pub profile: Profile,
    pub prefill: PoolPolicy,
    pub decode: PoolPolicy,
}

pub fn setup(a: &UpArgs) -> anyhow::Result<Setup> {
    let o = options(a)?;
    let [model] = &o.models[..] else {
        bail!("one --model is simulated at a time");
    };
    let source = stage(&o, model)?;
    // The policies the scaler will run: this run's flags and `--set`.
    let cfg = policies_config(&o)?;
    let [m] = &cfg.models[..] else {
        bail!("scaler config: one model expected");
    };
    Ok(Setup {
        profile: measured_profile(&source, o.kv_cache_mib)?.1,
        snapshot: source,
        prefill: m.prefill.policy.clone(),
        decode: m.decode.policy.clone(),
    })
}

/// The scaler's state file in the cache directory unless `--state-file` says: a
/// restarted `up` resumes each pool's season (its load by time of day) instead of
/// relearning it over a day.
const STATE_FILE: &str = "scaler-state.json";

/// The scaler's config for this machine: every model's pools, whose endpoints come
/// from the driver at run time (`run_with`), each model sized by its own measured
/// profile (`profiles`, in the order of `o.models`, where known), quick ticks, this
/// run's SLOs and limits, then `--set`; checked as a file would be (`files`: the token
/// and state files' places too).
fn scaler_config(
    o: &Options,
    gw_url: &str,
    token_file: &Path,
    profiles: &[PathBuf],
    identities: &[String],
    files: bool,
) -> anyhow::Result<Config> {
    let pool = |limits| PoolConfig {
        policy: pool_policy(o, limits),
        ..PoolConfig::default()
    };
    let cfg = Config {
        grpc_listen: o.scaler,
        http_listen: o.scaler_http,
        // `/status` names endpoints: behind this run's token like the rest.
        cluster_token_file: Some(token_file.to_path_buf()),
        state_file: Some(o.state_file.clone()),
        interval_s: INTERVAL_S,
        window_s: WINDOW_S,
        models: o
            .models
            .iter()
            .enumerate()
            .map(|(i, m)| ModelConfig {
                name: m.name.clone(),
                // One gateway and one set of workers' pages hold every model's series.
                metrics_model_name: Some(m.name.clone()),
                gateway: vec![format!("{gw_url}/metrics")],
                gateway_selector: None,
                gateway_port: PoolConfig::default().metrics_port,
                standbys: None,
                profile: profiles.get(i).cloned(),
                // Its staged name: the name and the manifest's digest.
                identity: identities.get(i).cloned(),
                priority: 0,
                prefill: pool(o.limits[0]),
                decode: pool(o.limits[1]),
            })
            .collect(),
        ..Config::default()
    };
    cfg.with_overrides(&o.overrides, files)
        .map_err(|e| anyhow::anyhow!("scaler {e}"))
}

/// The scaler config with this run's pool policies, before the gateway and token it
/// will name exist: for the policies alone, and to check `--set` early.
fn policies_config(o: &Options) -> anyhow::Result<Config> {
    scaler_config(o, "http://127.0.0.1:1/metrics", &o.cache, &[], &[], false)
}

/// Runs the stack until `stop` resolves (the CLI's: SIGTERM or Ctrl-C), then drains it.
pub fn run(a: &UpArgs, stop: impl std::future::Future<Output = ()>) -> anyhow::Result<ExitCode> {
    let o = options(a)?;
    // A bad `--set` is refused before the model is staged and profiled.
    policies_config(&o)?;
    let started = Instant::now();
    let served = o
        .models
        .iter()
        .map(|m| Served::prepare(&o, m))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The shared profile is the first model's; each model is sized by its own.
    let profile = served[0].profile.clone();
    let logs = o.cache.join("logs");
    std::fs::create_dir_all(&logs)?;
    let agent_cfg = agent_config(&o, &served)?;
    let snaps: Vec<PathBuf> = served
        .iter()
        .map(|s| preheat_warmpool::stage::snapshot_path(&agent_cfg.dir, &s.staged))
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // One cluster token per run: every internal request between the processes below
    // carries it.
    let token_file = o.cache.join("cluster-token");
    let token = Arc::new(preheat_edge::ClusterToken::generate_to(&token_file)?);
    let mut agent_cfg = agent_cfg;
    let agent_dir = agent_cfg.dir.clone();
    agent_cfg.cluster_token = Some((Arc::clone(&token), token_file.clone()));
    let fatal = rt.block_on(async {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|v| *v).await;
        };
        // The warm-pool agent stages the snapshot into the node directory; workers
        // start only from its verified, published copy.
        let al = tokio::net::TcpListener::bind(agent_cfg.listen).await?;
        let agent_url = format!("http://{}", al.local_addr()?);
        let agent_task = tokio::spawn(preheat_warmpool::agent::run(agent_cfg, al, stopped(stop_rx.clone())));
        while !snaps.iter().all(|s| s.exists()) {
            if agent_task.is_finished() {
                bail!("the warm-pool agent stopped before staging the models");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Gateway, knowing the models from the start so it holds requests at zero.
        let gl = tokio::net::TcpListener::bind(o.gateway)
            .await
            .with_context(|| format!("binding {}", o.gateway))?;
        let gw_url = format!("http://{}", gl.local_addr()?);
        // Workers register on the gateway's internal port, behind the token.
        let gil = tokio::net::TcpListener::bind(o.gateway_internal)
            .await
            .with_context(|| format!("binding {} (--gateway-internal)", o.gateway_internal))?;
        let gw_internal = format!("http://{}", gil.local_addr()?);
        let outage = Arc::new(gateway::Outage::default());
        let gopts = GatewayOptions {
            models: served.iter().map(|s| gateway::GatewayModel::new(s.info.clone())).collect(),
            chat_template: o.chat_template.clone(),
            hold_timeout: Duration::from_secs(600),
            outage: Arc::clone(&outage),
            cluster_token: Some(Arc::clone(&token)),
            ..GatewayOptions::default()
        };
        let gw_task = tokio::spawn(gateway::run(gl, Some(gil), gopts, stopped(stop_rx.clone())));
        let exe = std::env::current_exe()?.to_string_lossy().into_owned();
        let standby_spec = |role: &str, s: &Served| -> anyhow::Result<StandbySpec> {
            Ok(StandbySpec {
                pool: role.to_owned(),
                model: s.staged.clone(),
                drain_grace: Duration::from_secs(30),
                // Local mode's driver owns promoted standbys (promote_take).
                unlist_delay: Duration::ZERO,
                count: o.standbys,
                // Standby i listens on base + 2i, its KV on base + 2i + 1.
                base_port: free_port_run(u16::try_from(o.standbys.max(1).saturating_mul(2)).unwrap_or(u16::MAX))?,
                command: [
                    exe.as_str(), "engine", role, "--model", "{model_path}", "--host", "127.0.0.1",
                    "--port", "{port}", "--gateway", &gw_internal, "--kv-cache-mib",
                    &o.kv_cache_mib.to_string(), "--served-model-name", &s.name, "--standby",
                ]
                .map(str::to_owned)
                .to_vec(),
            })
        };
        // Scaler, fed the live worker lists by the driver below: a prefill and a decode
        // pool per model.
        let mut pools: Vec<PoolState> = served
            .iter()
            .zip(&snaps)
            .flat_map(|(s, snap)| {
                [(Pool::Prefill, "prefill"), (Pool::Decode, "decode")]
                    .into_iter()
                    .zip(o.limits)
                    .map(move |(r, l)| (s, snap, r, l))
            })
            .map(|(s, snap, (pool, role), (min, max))| {
                Ok(PoolState {
                    model: s.name.clone(),
                    snap: snap.clone(),
                    several: served.len() > 1,
                    pool,
                    role,
                    min,
                    max,
                    replicas: Vec::new(),
                    stopping: Vec::new(),
                    endpoints: Arc::new(RwLock::new(Vec::new())),
                    standby: StandbyPool::new(standby_spec(role, s)?, snap)
                        .with_log_dir(&logs)
                        .with_token(Some((Arc::clone(&token), token_file.clone()))),
                    backoff: RestartBackoff::default(),
                    token_file: token_file.clone(),
                    parked: 0,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        let profiles: Vec<PathBuf> = served.iter().map(|s| s.profile_path.clone()).collect();
        let identities: Vec<String> = served.iter().map(|s| s.staged.clone()).collect();
        let cfg = scaler_config(&o, &gw_url, &token_file, &profiles, &identities, true)?;
        let shared = pools
            .iter()
            .map(|p| (p.model.clone(), p.pool, Arc::clone(&p.endpoints)))
            .collect();
        // The scaler stops first, on its own signal: its last state save then holds
        // the load as it was, not the workers' drain down to nothing.
        let (scaler_stop_tx, scaler_stop_rx) = tokio::sync::watch::channel(false);
        let mut scaler_task = tokio::spawn(preheat_scaler::server::run_with(
            cfg,
            profile,
            stopped(scaler_stop_rx),
            shared,
        ));
        for (s, snap) in served.iter().zip(&snaps) {
            println!("preheat up: model {} ({})", s.name, snap.display());
        }
        println!("  OpenAI API        {gw_url}/v1  (health {gw_url}/health, metrics {gw_url}/metrics)");
        println!("  KEDA scaler gRPC  {}  (/metrics and /status at http://{})", o.scaler, o.scaler_http);
        println!(
            "  warm pool         {agent_url}/models  (staged in {}; {} parked standby per pool)",
            agent_dir.display(),
            o.standbys
        );
        println!(
            "  cluster token     {}  (internal endpoints: -H \"Authorization: Bearer $(cat {})\")",
            token_file.display(),
            token_file.display()
        );
        println!(
            "  pools             prefill {}..{}, decode {}..{}, idle grace {} s; worker logs in {}",
            o.limits[0].0,
            o.limits[0].1,
            o.limits[1].0,
            o.limits[1].1,
            o.idle_grace_s,
            logs.display()
        );
        println!(
            "  status            preheat status --scaler http://{} --agent {agent_url} --cluster-token-file {} [--watch]",
            o.scaler_http,
            token_file.display()
        );
        println!("  Ctrl-C stops everything");
        let mut client = loop {
            if let Ok(c) = ExternalScalerClient::connect(format!("http://{}", o.scaler)).await {
                break c;
            }
            if scaler_task.is_finished() {
                match scaler_task.await {
                    Ok(Err(e)) => bail!("the scaler did not start: {e}"),
                    _ => bail!("the scaler did not start"),
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let mut stop = std::pin::pin!(stop);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let mut fatal: Option<String> = None;
        'driver: loop {
            tokio::select! {
                () = &mut stop => break,
                _ = tick.tick() => {}
            }
            for p in &mut pools {
                p.reap();
                let why = p.backoff.gave_up().or_else(|| p.standby.failing());
                if let Some(why) = why {
                    // Spinning would only hide the cause: say it, fail what is held
                    // at once, and stop.
                    let msg = format!("the {} workers of {} cannot start: {why}", p.role, p.model);
                    outage.set(msg.clone());
                    fatal = Some(msg);
                    break 'driver;
                }
                let Some(want) = target(&mut client, &p.model, p.pool).await else { continue };
                let want = want.clamp(p.min, p.max);
                let have = p.replicas.len() as u32;
                let mut how = Vec::new();
                for _ in have..want {
                    if !p.backoff.may_start(Instant::now()) {
                        break;
                    }
                    how.push(p.add(&gw_internal, &logs, o.kv_cache_mib).await?);
                }
                for _ in want..have {
                    p.stop_newest();
                }
                let now_have = p.replicas.len() as u32;
                if now_have != have {
                    let how = if how.is_empty() { String::new() } else { format!(" ({})", how.join(", ")) };
                    println!("[{:>7.1}s] {}{}: {have} → {now_have} replicas{how}", started.elapsed().as_secs_f64(), p.label(), p.role);
                }
                if let Err(e) = p.standby.reconcile().await {
                    tracing::warn!(model = %p.model, pool = p.role, error = %e, "standbys not kept");
                }
                // A promotion is reported with the replicas; a new parked one here.
                let parked = p.standby.ready();
                if parked > p.parked {
                    println!("[{:>7.1}s] {}{}: standby parked ({parked} ready)", started.elapsed().as_secs_f64(), p.label(), p.role);
                }
                p.parked = parked;
            }
        }
        println!("stopping: the scaler (saving its state), then draining workers");
        let _ = scaler_stop_tx.send(true);
        // Bounded: the scaler waits at most 15 s for its control loop's last save.
        match tokio::time::timeout(Duration::from_secs(20), &mut scaler_task).await {
            Err(_) => tracing::warn!("the scaler did not stop within 20 s; draining the workers anyway"),
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the scaler stopped with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the scaler's task failed"),
            Ok(Ok(Ok(_))) => {}
        }
        let mut all: Vec<Child> = Vec::new();
        for p in &mut pools {
            all.extend(p.replicas.drain(..).map(|r| r.child));
            all.append(&mut p.stopping);
            p.publish();
        }
        preheat_warmpool::standby::drain_children(&mut all, Duration::from_secs(30), "up").await;
        for p in &mut pools {
            p.standby.shutdown().await;
        }
        let _ = stop_tx.send(true);
        let _ = gw_task.await;
        if !scaler_task.is_finished() {
            scaler_task.abort();
        }
        let _ = agent_task.await;
        anyhow::Ok(fatal)
    });
    // A scaler state file save stuck on a hung disk must not hold the exit forever.
    rt.shutdown_timeout(Duration::from_secs(5));
    let fatal = fatal?;
    match fatal {
        Some(why) => {
            eprintln!(
                "preheat up: stopped: {why} (worker logs in {})",
                logs.display()
            );
            Ok(ExitCode::FAILURE)
        }
        None => Ok(ExitCode::SUCCESS),
    }
}
