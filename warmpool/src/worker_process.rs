//! The one way preheat starts a worker process of its own (`preheat up`'s replicas,
//! the agent's standbys, `bench coldstart`'s replicas): the cluster token (or the
//! explicit lack of one) in its environment, stamped with the spawn time so its
//! start-up phases count exec, tied to its parent's life, its stderr to a log; and the
//! one way its readiness is read back (`/health`, `/internal/state`).

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use preheat_edge::{ClusterToken, WithClusterToken};

/// A worker command: `program args…` with the token file `token` in its environment
/// (`None`: run it with `PREHEAT_INSECURE_NO_TOKEN`, as its parent runs), stderr to
/// `log` (stdout then nowhere; without a log both are the parent's, so an agent's
/// standbys log with it), no stdin, receiving SIGTERM when the parent dies.
/// Callers add what is theirs (more env) and spawn it; a tokio caller converts it with
/// `tokio::process::Command::from` and sets `kill_on_drop`.
pub fn worker_command<I, S>(
    program: impl AsRef<OsStr>,
    args: I,
    token: Option<&Path>,
    log: Option<&Path>,
) -> std::io::Result<Command>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(program);
    cmd.args(args);
    die_with_parent(&mut cmd);
    let (k, v) = spawned_at_now();
    cmd.env(k, v);
    match token {
        Some(file) => {
            cmd.env(preheat_edge::token::TOKEN_FILE_ENV, file);
        }
        // A parent run without a token (as it was told to) runs its workers the same
        // way; they would refuse to start otherwise.
        None => {
            cmd.env("PREHEAT_INSECURE_NO_TOKEN", "true");
        }
    }
    cmd.stdin(Stdio::null());
    if let Some(path) = log {
        cmd.stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(path)?));
    }
    Ok(cmd)
}

/// Set by whoever spawns a replica, read by the replica: the spawner's clock at the
/// spawn, so start-up phases count exec and dynamic loading too, not only from `main`.
pub const SPAWNED_AT_ENV: &str = "PREHEAT_SPAWNED_AT_UNIX_MS";

/// `(SPAWNED_AT_ENV, now)` for a `Command::env` call at the spawn.
#[must_use]
pub fn spawned_at_now() -> (&'static str, String) {
    (SPAWNED_AT_ENV, unix_ms().to_string())
}

/// In the replica: how long ago its spawner stamped it; `None` when unset, or stale or
/// skewed (over 10 minutes, or in the future), which is ignored rather than trusted.
#[must_use]
pub fn spawned_ago() -> Option<std::time::Duration> {
    let at: u128 = std::env::var(SPAWNED_AT_ENV).ok()?.parse().ok()?;
    let ago = unix_ms().checked_sub(at)?;
    (ago < 600_000).then(|| std::time::Duration::from_millis(u64::try_from(ago).unwrap_or(0)))
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// Makes the child receive SIGTERM (and drain) when the process that started it
/// dies, even by SIGKILL: parked and promoted replicas never outlive their manager.
/// (Linux ties this to the thread that forks; tokio's runtime threads, which spawn
/// here, live as long as the process.)
pub fn die_with_parent(cmd: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    // SAFETY: the closure runs in the forked child before exec and only calls prctl,
    // which is async-signal-safe; it touches no memory of the parent.
    #[allow(unsafe_code)]
    unsafe {
        use std::os::unix::process::CommandExt as _;
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// The worker's `/internal/state`: `loading`, `standby` or `serving`.
pub async fn reported_state(
    client: &reqwest::Client,
    url: &str,
    token: Option<&ClusterToken>,
) -> Option<String> {
    let r = client
        .get(format!("{url}/internal/state"))
        .cluster_token(token)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    let v: serde_json::Value = r.json().await.ok()?;
    v.get("state")?.as_str().map(str::to_owned)
}

/// Whether the worker at `url` answers `/health` with 200 (loaded and serving).
pub async fn healthy(client: &reqwest::Client, url: &str) -> bool {
    client
        .get(format!("{url}/health"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}
