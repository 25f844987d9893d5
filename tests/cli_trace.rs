//! `preheat trace fleet`: a serverless fleet's traffic made from a single-model trace,
//! in the form of the shipped example.

mod harness;

use harness::{ok, preheat};
use preheat_testkit::testdata;

#[test]
fn trace_fleet_makes_many_models_traffic_from_one_trace_and_reads_as_the_shipped_example() {
    let dir = tempfile::tempdir().unwrap();
    let from = testdata().join("traces/azure_code_2023.csv");
    let out = dir.path().join("fleet.jsonl");
    let text = ok([
        "trace".as_ref(),
        "fleet".as_ref(),
        "--from".as_ref(),
        from.as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
        "--models".as_ref(),
        "24".as_ref(),
        "--hours".as_ref(),
        "4".as_ref(),
        "--seed".as_ref(),
        "3".as_ref(),
    ]);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        text.contains(&format!("{} requests of 24 models over 4 h", lines.len())),
        "{text}"
    );
    // The base trace's rate (2.6 req/s) over four hours, within noise.
    assert!((25_000..50_000).contains(&lines.len()), "{}", lines.len());
    let mut per_model = std::collections::BTreeMap::<String, usize>::new();
    for l in &lines {
        *per_model
            .entry(l["model"].as_str().unwrap().to_owned())
            .or_default() += 1;
        assert!(l["input_length"].as_u64().unwrap() > 0, "{l}");
    }
    assert!(per_model.keys().all(|m| m.len() == 3 && m.starts_with('m')));
    assert!(per_model["m00"] > 10 * per_model.values().min().unwrap());
    // The shipped example has the same form.
    let example = testdata().join("traces/fleet_example.jsonl");
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(example)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let keys: Vec<&String> = first.as_object().unwrap().keys().collect();
    let ours: Vec<&String> = lines[0].as_object().unwrap().keys().collect();
    assert_eq!(keys, ours);
    // A bad shape is refused with every problem named.
    let bad = preheat([
        "trace",
        "fleet",
        "--from",
        from.to_str().unwrap(),
        "--out",
        dir.path().join("never.jsonl").to_str().unwrap(),
        "--models",
        "0",
        "--zipf",
        "9",
    ]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(err.contains("models 0") && err.contains("zipf 9"), "{err}");
    assert!(!dir.path().join("never.jsonl").exists());
}
