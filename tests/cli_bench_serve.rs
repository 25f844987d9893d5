//! `preheat bench serve` against a real `engine serve` on the tiny fixture, and against
//! a dead endpoint (every request fails, reported, exit 1, no hang).

mod harness;

use std::time::{Duration, Instant};

use harness::{Log, Worker, preheat};
use preheat_testkit::{free_port, model_fixture, testdata};

fn serve_tiny() -> (Worker, String) {
    let s = harness::serve(&model_fixture("llama-tiny"))
        .kv_mib(16)
        .log(Log::Null)
        .start();
    s.wait_healthy(60);
    let url = s.url.clone();
    (s, url)
}

#[test]
fn replays_a_trace_and_a_fixed_rate_against_the_engine() {
    let (_server, base) = serve_tiny();
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("serve.svg");
    let out = preheat([
        "bench",
        "serve",
        "--url",
        &base,
        "--rate",
        "20",
        "--requests",
        "12",
        "--input-tokens",
        "16",
        "--output-tokens",
        "6",
        "--slo-ttft",
        "30",
        "--slo-itl",
        "5",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (r["completed"].as_u64(), r["failed"].as_u64()),
        (Some(12), Some(0)),
        "{r}"
    );
    assert!(r["ttft_p50"].as_f64().unwrap() > 0.0);
    assert!(r["itl_p50"].as_f64().unwrap() > 0.0);
    assert_eq!(r["slo_attainment"], 1.0);
    assert!(r["output_tokens_per_s"].as_f64().unwrap() > 0.0);
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.contains("TTFT p90") && !plot.contains(">decode</text>"),
        "no replica panel against engine serve"
    );
    // A trace, time-compressed and token-scaled for a CPU model.
    let trace = testdata().join("traces/azure_code_2023.csv");
    let out = preheat([
        "bench".as_ref(),
        "serve".as_ref(),
        "--url".as_ref(),
        base.as_ref(),
        "--trace".as_ref(),
        trace.as_os_str(),
        "--speedup".as_ref(),
        "20".as_ref(),
        "--max-requests".as_ref(),
        "8".as_ref(),
        "--token-scale".as_ref(),
        "0.01".as_ref(),
        "--max-output-tokens".as_ref(),
        "4".as_ref(),
        "--per-request".as_ref(),
        "--json".as_ref(),
    ] as [&std::ffi::OsStr; 16]);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["completed"], 8, "{r}");
    let outcomes = r["outcomes"].as_array().unwrap();
    // The trace's first prompts are 4808 and 3180 tokens: scaled to ~48 and ~32.
    let p0 = outcomes[0]["prompt_tokens"].as_u64().unwrap();
    let p1 = outcomes[1]["prompt_tokens"].as_u64().unwrap();
    assert!(p0 > p1, "{p0} vs {p1}");
}

#[test]
fn a_dead_endpoint_fails_every_request_quickly_with_exit_1() {
    let port = free_port();
    let t0 = Instant::now();
    let out = preheat([
        "bench",
        "serve",
        "--url",
        &format!("http://127.0.0.1:{port}"),
        "--rate",
        "50",
        "--requests",
        "5",
        "--timeout-s",
        "5",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("0 completed, 5 failed") && s.contains("error: send"),
        "{s}"
    );
    assert!(t0.elapsed() < Duration::from_secs(20));
    let bad = preheat(["bench", "serve", "--rate", "0", "--speedup=-1"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        err.contains("--speedup must be > 0") && err.contains("--rate must be > 0"),
        "{err}"
    );
}
