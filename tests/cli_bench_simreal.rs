//! `preheat bench simreal` as an operator runs it: `preheat up` on the embedded model
//! under a steady load from idle, then the simulator on the same run. Both pools wake
//! from zero, the workers' start times are read from their metrics, and the prediction
//! of a run this simple must land within the tolerances the simulator is held to.

mod harness;

use harness::preheat;
use serde_json::Value;

#[test]
fn simreal_measures_up_and_predicts_it_within_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let svg = dir.path().join("simreal.svg");
    let out = preheat([
        "bench",
        "simreal",
        "--rate",
        "2",
        "--requests",
        "30",
        "--input-tokens",
        "32",
        "--output-tokens",
        "6",
        // Generous targets: this checks the replicas and accounting, not a debug
        // build's latency on a busy machine.
        "--slo-ttft",
        "30s",
        "--slo-itl",
        "5s",
        "--idle-grace",
        "5s",
        "--cache-dir",
        cache.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let log = std::fs::read_to_string(cache.join("simreal-up.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "{stdout}\n{}\nup's log:\n{log}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(&stdout).expect("stdout is the JSON report alone");
    assert_eq!(
        (r["requests"].as_u64(), r["failed"].as_u64()),
        (Some(30), Some(0)),
        "{r}"
    );
    // Both pools woke from zero: a start each at least, read from the workers.
    let starts = r["starts"].as_array().unwrap();
    for role in ["prefill", "decode"] {
        assert!(
            starts.iter().any(|s| s["role"] == role),
            "no {role} start measured: {r}"
        );
    }
    for s in starts {
        let secs = s["seconds"].as_f64().unwrap();
        assert!((0.0..60.0).contains(&secs), "{s}");
    }
    // The simulation ran with what was measured and from idle, as `up` did.
    assert_eq!(r["measured"][0][1], 0, "up starts idle: {r}");
    assert_eq!(
        r["predicted"][0][1], 0,
        "the simulation starts idle too: {r}"
    );
    for p in r["pools"].as_array().unwrap() {
        let (m, pr) = (
            p["measured_replica_s"].as_f64().unwrap(),
            p["predicted_replica_s"].as_f64().unwrap(),
        );
        assert!(m > 0.0 && pr > 0.0, "{p}");
        let err = p["error"].as_f64().unwrap();
        assert!((err - (pr - m) / m).abs() < 1e-9, "{p}");
        assert!(
            err.abs() <= 0.2,
            "replica-seconds off by more than 20%: {p}"
        );
    }
    assert_eq!(r["measured_attainment"], 1.0, "{r}");
    assert_eq!(r["predicted_attainment"], 1.0, "{r}");
    // Far below the host's capacity, 5% of it either way changes nothing.
    assert_eq!(
        r["predicted_attainment_band"],
        serde_json::json!([1.0, 1.0]),
        "{r}"
    );
    assert_eq!(r["missed"], serde_json::json!([]), "{r}");
    // Every prompt reaches the gateway's threshold: all go through the prefill pool.
    assert_eq!(r["disagg_min_tokens"], 32, "{r}");
    assert_eq!(r["prefilled_on_decode"], 0, "{r}");
    assert_eq!(r["within_tolerance"], true, "{r}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.contains("measured") && plot.contains("predicted"));
}

#[test]
fn simreal_refuses_bad_load_flags_before_starting_anything() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let out = preheat([
        "bench",
        "simreal",
        "--rate",
        "0",
        "--speedup=-1",
        "--cache-dir",
        cache.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--rate") && err.contains("--speedup"), "{err}");
    assert!(
        !cache.exists(),
        "nothing staged for a run that cannot start"
    );
}
