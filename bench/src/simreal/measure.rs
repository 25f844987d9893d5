//! The real run: `up` under the load, its replicas and starts watched, and the CPU
//! the stack itself used.

use std::time::Duration;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use super::saved_run::{SAVED_RUN_FORMAT, SavedRun};
use super::stack::{
    Endpoints, STATE_FILE, Start, UpProcess, new_starts, parse_up, status, up_args, wait_ready,
};
use crate::args::BenchSimrealArgs;
use crate::host_share;
use crate::serve::{self, Outcome, Planned};

/// How long each count of workers computes together when the host's sharing is
/// measured: a few prefill passes each.
const HOST_SHARE_PERIOD: Duration = Duration::from_secs(5);

/// How often the pools' replicas are read.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// What the real run produced.
#[derive(Serialize, Deserialize)]
pub(super) struct Measured {
    pub(super) outcomes: Vec<Outcome>,
    pub(super) replicas: Vec<(f64, u32, u32)>,
    pub(super) starts: Vec<Start>,
    pub(super) window_s: f64,
    /// CPU seconds the stack itself used over the window, besides its workers: `up`'s
    /// gateway, scaler and warm-pool agent, and this load generator. `None` where
    /// `/proc` cannot say.
    pub(super) stack_cpu_s: Option<f64>,
    /// This machine's cores, and each worker's compute threads (`RAYON_NUM_THREADS`,
    /// inherited, else every core): with `stack_cpu_s`, the workers that fit side by
    /// side.
    pub(super) host_cores: usize,
    pub(super) worker_threads: usize,
    /// Why `up` was gone before the load ended.
    pub(super) up_exited: Option<String>,
    /// `(workers computing at once, slowdown beyond their share of the cores)` on
    /// this machine, measured before the run ([`host_share::measure`]); empty in runs
    /// saved before it was.
    #[serde(default)]
    pub(super) host_slowdown: Vec<(u32, f64)>,
}

/// CPU seconds (user + system) process `pid` has used itself (not its children).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces, hence the last ')'): state is
    // field 3 of proc(5), utime 14 and stime 15.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // In clock ticks of USER_HZ, which Linux fixes at 100 for user space.
    Some(ticks / 100.0)
}

/// CPU seconds used by this process and `up`'s.
fn stack_cpu(up_pid: Option<u32>) -> Option<f64> {
    Some(cpu_seconds(std::process::id())? + cpu_seconds(up_pid?)?)
}

async fn measure(
    a: &BenchSimrealArgs,
    planned: &[Planned],
    args: &[String],
    e: &Endpoints,
) -> anyhow::Result<Measured> {
    std::fs::create_dir_all(&a.cache_dir)?;
    // From idle with nothing learnt, as the simulation starts: an earlier run's season
    // would pre-warm this one. Its own file, never an operator's `up`'s.
    match std::fs::remove_file(a.cache_dir.join(STATE_FILE)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            anyhow::bail!("removing the last run's scaler state: {e}")
        }
        _ => {}
    }
    let mut up = UpProcess::start(args, &a.cache_dir.join("simreal-up.log"))?;
    let c = reqwest::Client::new();
    let token = match wait_ready(&c, e, &mut up, a.standbys).await {
        Ok(t) => t,
        Err(err) => {
            up.stop().await;
            return Err(err);
        }
    };
    let t0 = tokio::time::Instant::now();
    let up_pid = up.child.id();
    let cpu0 = stack_cpu(up_pid);
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let watcher = {
        let (c, e, token) = (c.clone(), e.clone(), token.clone());
        tokio::spawn(async move {
            let mut replicas = Vec::new();
            let mut starts = Vec::new();
            let mut seen = std::collections::HashSet::new();
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop_rx.changed() => break,
                }
                let t = t0.elapsed().as_secs_f64();
                if let Some((p, d)) = status(&c, &e, &token).await {
                    replicas.push((t, p, d));
                }
                starts.extend(new_starts(&c, &e, &token, &mut seen).await);
            }
            // Workers that registered since the last look.
            starts.extend(new_starts(&c, &e, &token, &mut seen).await);
            (replicas, starts)
        })
    };
    let bar = serve::request_bar(planned.len())?;
    let timeout = a.load.timeout.max(Duration::from_millis(1));
    let sent = serve::replay(&e.gateway, None, planned, timeout, t0, &bar).await;
    let window_s = t0.elapsed().as_secs_f64();
    let up_exited = up.exited();
    let stack_cpu_s = stack_cpu(up_pid).zip(cpu0).map(|(b, a)| (b - a).max(0.0));
    bar.finish_and_clear();
    let _ = stop_tx.send(true);
    let watched = watcher.await;
    up.stop().await;
    let (outcomes, _) = sent?;
    let (replicas, starts) = watched.context("the replica watcher")?;
    Ok(Measured {
        outcomes,
        replicas,
        starts,
        window_s,
        stack_cpu_s,
        host_cores: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        worker_threads: rayon::current_num_threads(),
        up_exited,
        host_slowdown: Vec::new(),
    })
}

/// Runs `up` under the load and records what happened.
pub(super) fn measure_run(a: &BenchSimrealArgs) -> anyhow::Result<SavedRun> {
    let planned = serve::plan(&a.load)?;
    // Stages the model and measures its profile (once per model, KV budget and
    // threads) here, so `up` below finds both in its cache and starts as it would on a
    // second run; its ports are picked after that, so nothing takes them meanwhile.
    let setup = preheat_local::setup(&parse_up(&up_args(a)?)?)?;
    tracing::info!("measuring how workers slow each other on this machine");
    let host_slowdown = host_share::measure(
        &setup.snapshot,
        usize::try_from(a.prefill_max.saturating_add(a.decode_max)).unwrap_or(usize::MAX),
        rayon::current_num_threads(),
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        preheat_engine::scheduler::DEFAULT_MAX_BATCHED_TOKENS,
        HOST_SHARE_PERIOD,
    )?;
    let args = up_args(a)?;
    let up_flags = parse_up(&args)?;
    let e = Endpoints::of(&up_flags);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    tracing::info!(
        requests = planned.len(),
        "running `preheat up` under the load"
    );
    let mut m = rt.block_on(measure(a, &planned, &args, &e))?;
    m.host_slowdown = host_slowdown;
    if m.replicas.is_empty() {
        bail!(
            "the scaler's /status gave no replica counts during the run (log: {})",
            a.cache_dir.join("simreal-up.log").display()
        );
    }
    Ok(SavedRun {
        format: SAVED_RUN_FORMAT,
        planned,
        measured: m,
        profile: setup.profile,
        prefill: setup.prefill,
        decode: setup.decode,
        standbys: a.standbys,
        interval_s: preheat_local::INTERVAL_S,
        window_s: preheat_local::WINDOW_S,
        prefill_batch_tokens: preheat_engine::scheduler::DEFAULT_MAX_BATCHED_TOKENS as f64,
        disagg_min_tokens: u32::try_from(
            preheat_engine::disagg::gateway::DEFAULT_DISAGG_MIN_TOKENS,
        )
        .unwrap_or(u32::MAX),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn cpu_seconds_come_from_proc_and_grow_with_work() {
        let before = cpu_seconds(std::process::id()).expect("this process's /proc stat");
        // Work until the count moves (a busy machine may give this thread little time),
        // for at most 20 s.
        let t = Instant::now();
        let mut x = 0u64;
        let mut after = before;
        while after - before < 0.05 && t.elapsed() < Duration::from_secs(20) {
            for _ in 0..1_000_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            after = cpu_seconds(std::process::id()).unwrap();
        }
        assert!(after - before >= 0.05, "{before} → {after}");
        assert_eq!(cpu_seconds(u32::MAX), None);
    }
}
