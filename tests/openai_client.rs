//! The API as users drive it: the official `openai` Python client (PyPI, fetched by
//! `.ci/fetch-tools` into `.cache/openai`) runs `tests/openai/suite.py` against the real
//! SmolLM2 served colocated (`engine serve`) and disaggregated (a gateway with a
//! prefill and a decode worker); the two deployments answer alike. Both render chats
//! with `--chat-template testdata/chat_templates/smollm2_hermes_tools.jinja` (SmolLM2's
//! own template plus tools), so the suite's tool calls have a template that knows them.

mod harness;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use preheat_testkit::{free_port, present_or_skip, smollm2_gguf, workspace_root};
use serde_json::Value;

fn openai_package() -> Option<PathBuf> {
    let dir = workspace_root().join(".cache/openai");
    present_or_skip(
        dir.join("openai").is_dir(),
        "the openai package in .cache/openai",
        ".ci/fetch-tools",
    )
    .then_some(dir)
}

/// Runs the suite against `base`; returns the answers it recorded.
fn run_suite(py: &Path, base: &str, out: &Path) -> Value {
    let o = Command::new("python3")
        .arg(workspace_root().join("tests/openai/suite.py"))
        .arg(base)
        .arg(out)
        .env("PYTHONPATH", py)
        .output()
        .expect("python3");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        o.status.success(),
        "the openai client suite failed against {base}:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
    serde_json::from_slice(&std::fs::read(out).expect("the suite's answers")).expect("JSON")
}

fn registered_workers(gw_internal: &str) -> usize {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reqwest::Client::new()
            .get(format!("{gw_internal}/internal/workers"))
            .header("authorization", harness::bearer())
            .send()
            .await;
        match r {
            Ok(r) => r
                .json::<Value>()
                .await
                .map_or(0, |v| v["workers"].as_array().map_or(0, Vec::len)),
            Err(_) => 0,
        }
    })
}

#[test]
fn the_official_openai_client_gets_the_same_answers_colocated_and_disaggregated() {
    let (Some(model), Some(py)) = (smollm2_gguf(), openai_package()) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model_s = model.to_str().unwrap();
    let template = preheat_testkit::testdata().join("chat_templates/smollm2_hermes_tools.jinja");
    let template = template.to_str().unwrap();

    let port = free_port();
    let _serve = harness::spawn(
        &[
            "engine",
            "serve",
            "--model",
            model_s,
            "--port",
            &port.to_string(),
            "--kv-cache-mib",
            "64",
            "--chat-template",
            template,
        ],
        Stdio::inherit(),
    );
    harness::wait_healthy(port, 180);
    let colocated = run_suite(
        &py,
        &format!("http://127.0.0.1:{port}"),
        &dir.path().join("a.json"),
    );

    let (_gateway, gw, gw_internal) =
        harness::disagg_gateway(&["--chat-template", template], Stdio::inherit());
    let _prefill = harness::disagg_worker("prefill", &model, &gw_internal, 64, Stdio::inherit());
    let _decode = harness::disagg_worker("decode", &model, &gw_internal, 64, Stdio::inherit());
    let t0 = Instant::now();
    while registered_workers(&gw_internal) < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "the workers never registered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let disaggregated = run_suite(&py, &gw, &dir.path().join("b.json"));
    // Greedy text, seeded choices and best_of's pick do not depend on where the
    // prompt was prefilled.
    assert_eq!(colocated, disaggregated);
}
