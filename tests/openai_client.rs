//! The API as users drive it: the official `openai` Python client (PyPI, fetched by
//! `.ci/fetch-tools` into `.cache/openai`) runs `tests/openai/suite.py` against the real
//! SmolLM2 served colocated (`engine serve`) and disaggregated (a gateway with a
//! prefill and a decode worker); the two deployments answer alike. Both render chats
//! with `--chat-template testdata/chat_templates/smollm2_hermes_tools.jinja` (SmolLM2's
//! own template plus tools), so the suite's tool calls have a template that knows them.

mod harness;

use std::path::{Path, PathBuf};
use std::process::Command;

use preheat_testkit::{present_or_skip, smollm2_gguf, workspace_root};
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

#[test]
fn the_official_openai_client_gets_the_same_answers_colocated_and_disaggregated() {
    let (Some(model), Some(py)) = (smollm2_gguf(), openai_package()) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let template = preheat_testkit::testdata().join("chat_templates/smollm2_hermes_tools.jinja");
    let template = template.to_str().unwrap();

    let serve = harness::serve(&model)
        .kv_mib(64)
        .args(&["--chat-template", template])
        .start();
    serve.wait_healthy(180);
    let colocated = run_suite(&py, &serve.url, &dir.path().join("a.json"));

    let s = harness::stack()
        .gateway(
            harness::gateway()
                .through_prefill()
                .args(&["--chat-template", template]),
        )
        .model(&model)
        .prefill(1)
        .decode(1)
        .kv_mib(64)
        .ready_within(180)
        .start();
    let disaggregated = run_suite(&py, s.url(), &dir.path().join("b.json"));
    // Greedy text, seeded choices and best_of's pick do not depend on where the
    // prompt was prefilled.
    assert_eq!(colocated, disaggregated);
}
