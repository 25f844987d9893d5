//! A small harness for driving the `preheat` binary in integration tests: one-shot
//! commands here, and (in [`stack`] and [`up`]) the one way to start a deployment to test
//! against.
#![allow(dead_code)]

mod stack;
mod up;

use std::process::{Command, Output};

// (Each test binary uses part of it.)
#[allow(unused_imports)]
pub use stack::*;
#[allow(unused_imports)]
pub use up::*;

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
