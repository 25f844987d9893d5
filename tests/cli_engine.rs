//! `preheat engine serve` as an operator runs it: a real process, real SIGTERM.

mod harness;

use std::process::{Command, Stdio};
use std::time::Duration;

use harness::Log;
use preheat_testkit::{free_port, model_fixture, wait_for};

#[test]
fn serve_answers_then_drains_and_exits_on_sigterm() {
    let mut serve = harness::serve(&model_fixture("llama-tiny"))
        .kv_mib(8)
        .log(Log::Piped)
        .start();
    serve.wait_healthy(60);
    let base = serve.url.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = reqwest::Client::new();
        let r: serde_json::Value = c
            .post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({"prompt": "def", "max_tokens": 4, "temperature": 0}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(r["choices"][0]["text"].is_string(), "{r}");
    });
    let st = Command::new("kill")
        .args(["-TERM", &serve.proc.0.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let status = wait_for("the exit after SIGTERM", Duration::from_secs(20), || {
        serve.proc.0.try_wait().unwrap()
    });
    assert!(status.success(), "exit status {status}");
}

#[test]
fn bad_serve_flags_are_reported_together() {
    let out = harness::preheat([
        "engine",
        "serve",
        "--model",
        "/nonexistent",
        "--block-size",
        "0",
        "--max-running",
        "0",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["--model", "--block-size", "--max-running"] {
        assert!(err.contains(needle), "{needle} not reported: {err}");
    }
}

#[test]
fn profile_writes_what_the_scaler_reads() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("profile.json");
    let o = harness::preheat([
        "engine".as_ref(),
        "profile".as_ref(),
        "--model".as_ref(),
        model_fixture("llama-tiny").as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
        "--lengths".as_ref(),
        "8,32".as_ref(),
        "--batches".as_ref(),
        "1,2".as_ref(),
        "--steps".as_ref(),
        "2".as_ref(),
        "--kv-cache-mib".as_ref(),
        "4".as_ref(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p: preheat_scaler::profile::Profile =
        serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    p.validate().unwrap();
    assert_eq!(
        p.prefill_tokens_per_s
            .iter()
            .map(|x| x.0)
            .collect::<Vec<_>>(),
        vec![8.0, 32.0]
    );
    assert_eq!(p.decode_itl_s.len(), 2);
    assert!(
        p.prefill_tokens_per_s.iter().all(|x| x.1 > 0.0)
            && p.decode_itl_s.iter().all(|x| x.1 > 0.0)
    );
    assert!(p.source.contains("measured"));
}

#[test]
fn health_is_503_while_the_model_loads() {
    let Some(model) = preheat_testkit::smollm2_gguf() else {
        return;
    };
    let serve = harness::serve(&model).kv_mib(16).log(Log::Null).start();
    // Every status /health answers, each change once, until it is 200.
    let mut seen: Vec<u16> = Vec::new();
    let health = format!("{}/health", serve.url);
    let waited = preheat_testkit::Wait::new("health 200", Duration::from_secs(120))
        .every(Duration::from_millis(20))
        .poll(|| {
            let s = harness::http_get(&health, None)?.0;
            if seen.last() != Some(&s) {
                seen.push(s);
            }
            (s == 200).then_some(())
        });
    drop(serve);
    assert_eq!(
        seen,
        vec![503, 200],
        "health while converting a GGUF, then ready ({waited:?})"
    );
}

/// Processes with internal endpoints started without a cluster token and served them to
/// anyone (a warning in the log was all). Now each refuses to start without one, naming
/// the flag, unless told `--insecure-no-token`.
#[test]
fn regression_a_process_without_a_token_served_its_internal_endpoints_to_anyone() {
    let m = model_fixture("llama-tiny");
    let m = m.to_str().unwrap();
    let agent_cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        agent_cfg.path(),
        format!(
            r#"{{"dir": "{}", "disk_budget": "1GiB", "models": []}}"#,
            std::env::temp_dir().join("no-token-agent").display()
        ),
    )
    .unwrap();
    let port = free_port().to_string();
    let cfg = agent_cfg.path().to_str().unwrap();
    for args in [
        vec!["engine", "decode", "--model", m, "--port", &port],
        vec!["engine", "prefill", "--model", m, "--port", &port],
        vec!["engine", "gateway", "--model", m, "--port", &port],
        vec![
            "engine",
            "serve",
            "--model",
            m,
            "--port",
            &port,
            "--standby",
            "--internal-port",
            "1",
        ],
        vec!["warmpool", "run", "--config", cfg],
    ] {
        let mut p = preheat_testkit::KillOnDrop(
            Command::new(env!("CARGO_BIN_EXE_preheat"))
                .args(&args)
                .env_remove("PREHEAT_CLUSTER_TOKEN_FILE")
                .env_remove("PREHEAT_INSECURE_NO_TOKEN")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        // A process that starts serving never exits by itself: give it 20 s.
        let status = wait_for(
            format!("{args:?} to refuse to start without a token"),
            Duration::from_secs(20),
            || p.0.try_wait().unwrap(),
        );
        let mut err = String::new();
        std::io::Read::read_to_string(p.0.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "{args:?}: {err}");
        assert!(
            err.contains("--cluster-token-file") && err.contains("--insecure-no-token"),
            "{args:?}: {err}"
        );
    }
    // Told so explicitly, a worker runs without one.
    let port = free_port();
    let mut w = spawn_without_token(&[
        "engine",
        "decode",
        "--model",
        m,
        "--port",
        &port.to_string(),
        "--kv-cache-mib",
        "8",
        "--insecure-no-token",
    ]);
    harness::wait_healthy(port, 60);
    assert!(w.0.try_wait().unwrap().is_none());
    // `engine serve` without an internal port has none to protect: no token needed.
    let port = free_port();
    let _s = spawn_without_token(&[
        "engine",
        "serve",
        "--model",
        m,
        "--port",
        &port.to_string(),
        "--kv-cache-mib",
        "8",
    ]);
    harness::wait_healthy(port, 60);
}

/// `preheat ARGS` with no cluster token in its environment, output discarded.
fn spawn_without_token(args: &[&str]) -> preheat_testkit::KillOnDrop {
    preheat_testkit::KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_preheat"))
            .args(args)
            .env_remove("PREHEAT_CLUSTER_TOKEN_FILE")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}
