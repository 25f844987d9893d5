//! `preheat simulate --fleet`: the fleet policies on the shipped example, and what it
//! refuses.

use crate::harness::{ok, preheat};
use preheat_testkit::testdata;

/// The fleet simulator on the shipped example: every fleet policy on the same trace
/// and budgets, the report in its documented shape, the plot with both charts.
#[test]
fn simulate_fleet_runs_every_fleet_policy_on_the_example() {
    let dir = tempfile::tempdir().unwrap();
    let (json, svg) = (dir.path().join("f.json"), dir.path().join("f.svg"));
    let trace = testdata().join("traces/fleet_example.jsonl");
    let fleet = testdata().join("fleets/example.yaml");
    let out = ok([
        "simulate".as_ref(),
        "--trace".as_ref(),
        trace.as_os_str(),
        "--fleet".as_ref(),
        fleet.as_os_str(),
        "--policy".as_ref(),
        "all".as_ref(),
        "--json".as_ref(),
        json.as_os_str(),
        "--plot".as_ref(),
        svg.as_os_str(),
    ]);
    assert!(
        out.contains("19545 requests") && out.contains("12 models"),
        "{out}"
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let policies = r["policies"].as_array().unwrap();
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "always-on",
            "zero-cold",
            "serverlessllm",
            "preheat",
            "clairvoyant"
        ]
    );
    let by = |name: &str| policies.iter().find(|p| p["name"] == name).unwrap();
    for p in policies {
        for k in ["gpu_seconds", "ttft_attainment", "slo_attainment"] {
            assert!(p[k].is_number(), "{k} in {}", p["name"]);
        }
        assert!(p["cold_ttft_p99_s"].is_number() || p["cold_ttft_p99_s"].is_null());
        for k in ["gpu_standby", "host_standby", "hot", "staged", "remote"] {
            assert!(p["starts"][k].is_u64(), "starts.{k} in {}", p["name"]);
        }
        assert_eq!(
            p["per_model"].as_array().unwrap().len(),
            12,
            "{}",
            p["name"]
        );
        let served: u64 = p["per_model"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["requests"].as_u64().unwrap())
            .sum();
        assert_eq!(served, 19545, "{}", p["name"]);
    }
    // zero-cold fetches every start; the fleet cache starts from warmer tiers.
    let zc = &by("zero-cold")["starts"];
    assert_eq!(zc["host_standby"], 0);
    assert_eq!(zc["hot"], 0);
    assert_eq!(zc["staged"], 0);
    assert!(zc["remote"].as_u64().unwrap() > 0);
    let ph = &by("preheat")["starts"];
    assert!(ph["host_standby"].as_u64().unwrap() > 0, "{ph}");
    // Holding every model up costs the most GPU time.
    let gpu = |n: &str| by(n)["gpu_seconds"].as_f64().unwrap();
    assert!(gpu("always-on") > gpu("preheat"), "{}", gpu("preheat"));
    assert!(
        by("preheat")["ttft_attainment"].as_f64() > by("zero-cold")["ttft_attainment"].as_f64()
    );
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.contains("TTFT attainment against GPU-seconds") && plot.contains("warmest tier"));
}

/// What the fleet simulator refuses, each naming what is wrong.
#[test]
fn simulate_fleet_refuses_a_bad_fleet_a_stranger_model_and_a_wrong_policy() {
    let dir = tempfile::tempdir().unwrap();
    let trace = testdata().join("traces/fleet_example.jsonl");
    let fleet = testdata().join("fleets/example.yaml");
    let run = |args: &[&std::ffi::OsStr]| {
        let out = preheat(
            ["simulate".as_ref(), "--trace".as_ref()]
                .into_iter()
                .chain(args.iter().copied()),
        );
        assert!(!out.status.success(), "{args:?} ran");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // A key misspelt and a value out of range: both named at once.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "nodes: 0\ngpus_per_node: 8\nnvme_gb: 800\nhost_ram_gb: 512\nmodels:\n  - {name: m00, param_b: 8, gpus_per_replica: 1}\n",
    )
    .unwrap();
    let e = run(&[trace.as_os_str(), "--fleet".as_ref(), bad.as_os_str()]);
    assert!(e.contains("param_b"), "{e}");
    let bad = dir.path().join("bad2.yaml");
    std::fs::write(
        &bad,
        "nodes: 0\ngpus_per_node: 8\nnvme_gb: -1\nhost_ram_gb: 512\nmodels:\n  - {name: m00, params_b: 8, gpus_per_replica: 1}\n",
    )
    .unwrap();
    let e = run(&[trace.as_os_str(), "--fleet".as_ref(), bad.as_os_str()]);
    assert!(e.contains("nodes:") && e.contains("nvme_gb:"), "{e}");
    // A trace naming a model the fleet lacks: refused at its line.
    let stranger = dir.path().join("t.jsonl");
    std::fs::write(
        &stranger,
        "{\"timestamp\": 0, \"model\": \"m00\", \"input_length\": 10, \"output_length\": 5}\n\
         {\"timestamp\": 5, \"model\": \"zz\", \"input_length\": 10, \"output_length\": 5}\n",
    )
    .unwrap();
    let e = run(&[stranger.as_os_str(), "--fleet".as_ref(), fleet.as_os_str()]);
    assert!(
        e.contains(":2") && e.contains("\"zz\" is not in the fleet"),
        "{e}"
    );
    // Policies of the other simulator, each way round.
    let e = run(&[
        trace.as_os_str(),
        "--fleet".as_ref(),
        fleet.as_os_str(),
        "--policy".as_ref(),
        "kpa".as_ref(),
    ]);
    assert!(e.contains("--policy kpa: a single-model policy"), "{e}");
    let single = testdata().join("traces/azure_code_2023.csv");
    let e = run(&[
        single.as_os_str(),
        "--policy".as_ref(),
        "zero-cold".as_ref(),
    ]);
    assert!(e.contains("--policy zero-cold: a fleet policy"), "{e}");
}
