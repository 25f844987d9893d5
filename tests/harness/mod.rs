//! A small harness for driving the `preheat` binary in integration tests.
#![allow(dead_code)]

use std::process::{Command, Output};

use preheat_testkit::KillOnDrop;

/// Runs `preheat ARGS…` to completion.
pub fn preheat<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    Command::new(env!("CARGO_BIN_EXE_preheat"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("spawn preheat")
}

/// Runs and asserts success; returns stdout.
pub fn ok<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = preheat(args);
    assert!(
        out.status.success(),
        "preheat failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Runs and parses stdout as JSON.
pub fn ok_json<I, S>(args: I) -> serde_json::Value
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let s = ok(args);
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

/// This test run's cluster token file: every process [`spawn`] starts has it, as
/// every process of a deployment does.
pub fn token_file() -> &'static std::path::Path {
    static FILE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temp dir").keep();
        let p = dir.join("cluster-token");
        preheat_edge::ClusterToken::generate_to(&p).expect("a token file");
        p
    })
}

/// `Authorization` value for our own internal endpoints.
pub fn bearer() -> String {
    preheat_edge::ClusterToken::from_file(token_file())
        .expect("the token file")
        .bearer()
}

/// Starts `preheat ARGS…` in the background (stdout discarded, quiet logs on
/// `stderr`), with this run's cluster token; killed when dropped.
pub fn spawn(args: &[&str], stderr: std::process::Stdio) -> KillOnDrop {
    KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_preheat"))
            .args(args)
            .env("RUST_LOG", "warn")
            .env("PREHEAT_CLUSTER_TOKEN_FILE", token_file())
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn preheat"),
    )
}

/// Starts an `engine gateway` that learns its model from the workers registering on
/// its internal port and sends every prompt through a prefill worker (with `extra`
/// flags); returns it, its public URL and its internal URL (where workers register).
pub fn disagg_gateway(extra: &[&str], stderr: std::process::Stdio) -> (KillOnDrop, String, String) {
    let (port, internal) = (preheat_testkit::free_port(), preheat_testkit::free_port());
    let (port_s, internal_s) = (port.to_string(), internal.to_string());
    let mut args = vec![
        "engine",
        "gateway",
        "--port",
        &port_s,
        "--internal-port",
        &internal_s,
        "--disagg-min-tokens",
        "1",
    ];
    args.extend(extra);
    let p = spawn(&args, stderr);
    (
        p,
        format!("http://127.0.0.1:{port}"),
        format!("http://127.0.0.1:{internal}"),
    )
}

/// Starts an `engine prefill` or `engine decode` worker (`role`) of `model` that
/// registers at `gw` (a gateway's internal URL), with a KV cache of `kv_mib`; returns
/// it and its HTTP port.
pub fn disagg_worker(
    role: &str,
    model: &std::path::Path,
    gw: &str,
    kv_mib: u32,
    stderr: std::process::Stdio,
) -> (KillOnDrop, u16) {
    let port = preheat_testkit::free_port();
    // A prefill worker's KV port is its own free port: the default (--port + 1) can be
    // the port another test's process was just given (the cause of "timed out waiting
    // for three workers" in a CI run).
    let kv_port = preheat_testkit::free_port().to_string();
    let model = model.to_str().expect("utf-8 path");
    let port_s = port.to_string();
    let kv_mib = kv_mib.to_string();
    let mut args = vec!["engine", role, "--model", model, "--port", &port_s];
    args.extend(["--kv-cache-mib", &kv_mib, "--gateway", gw]);
    if role == "prefill" {
        args.extend(["--kv-port", kv_port.as_str()]);
    }
    (spawn(&args, stderr), port)
}

/// Waits until `GET /health` on `port` answers 200 (a server answers 503 while its
/// model loads), up to `secs`.
pub fn wait_healthy(port: u16, secs: u64) {
    use std::io::{Read, Write};
    let healthy = || {
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
            return false;
        };
        let _ = s.write_all(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n");
        let mut buf = [0u8; 16];
        let n = s.read(&mut buf).unwrap_or(0);
        buf[..n].starts_with(b"HTTP/1.0 200") || buf[..n].starts_with(b"HTTP/1.1 200")
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !healthy() {
        assert!(
            std::time::Instant::now() < deadline,
            "port {port} never became healthy"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Writes the synthetic tiny model (`seed` picks its weights) as `DIR/NAME.preheat`
/// through the CLI, and returns its path.
pub fn synth_tiny(dir: &std::path::Path, name: &str, seed: u64) -> std::path::PathBuf {
    let snap = dir.join(format!("{name}.preheat"));
    let seed = seed.to_string();
    ok([
        "snapshot",
        "synth",
        "--preset",
        "tiny",
        "--seed",
        &seed,
        "-o",
        snap.to_str().expect("utf-8 path"),
    ]);
    snap
}

/// Packs `snap` into `DIR/NAME.phpack` (chunks of `chunk_mib`) and returns its path.
pub fn pack(snap: &std::path::Path, chunk_mib: u64) -> std::path::PathBuf {
    let packed = snap.with_extension("phpack");
    let chunk = chunk_mib.to_string();
    ok([
        "snapshot",
        "pack",
        snap.to_str().expect("utf-8 path"),
        "-o",
        packed.to_str().expect("utf-8 path"),
        "--chunk-mib",
        &chunk,
    ]);
    packed
}

/// The chart as `helm install` renders it (Helm's Go SDK through tests/cluster/render.py:
/// release "rel", namespace "llm") for `values`: every object, as JSON. Needs
/// `.ci/fetch-tools`.
pub fn helm_render(values: &serde_json::Value) -> Vec<serde_json::Value> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), values.to_string()).unwrap();
    let out = std::process::Command::new("python3")
        .arg(root.join("tests/cluster/render.py"))
        .arg(f.path())
        .env("PYTHONPATH", root.join(".cache/python"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm render: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Whether the Helm SDK `.ci/fetch-tools` installs is there (or a skip message).
pub fn helm_present() -> bool {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    preheat_testkit::present_or_skip(
        root.join(".cache/python/helm_python").exists(),
        "helm-python-sdk in .cache/python",
        ".ci/fetch-tools",
    )
}
