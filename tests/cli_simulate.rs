//! `preheat simulate` on the shared production traces: every policy runs, the report
//! has the documented shape, and bad input is a clear error.

mod harness;

use harness::{ok, preheat};
use preheat_testkit::testdata;

#[test]
fn simulate_all_policies_on_the_azure_trace_writes_json_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let (json, svg) = (dir.path().join("r.json"), dir.path().join("r.svg"));
    let trace = testdata().join("traces/azure_code_2023.csv");
    let out = ok([
        "simulate".as_ref(),
        "--trace".as_ref(),
        trace.as_os_str(),
        "--policy".as_ref(),
        "all".as_ref(),
        "--json".as_ref(),
        json.as_os_str(),
        "--plot".as_ref(),
        svg.as_os_str(),
    ]);
    assert!(out.contains("8819 requests"), "{out}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let policies = r["policies"].as_array().unwrap();
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "preheat",
            "static-peak",
            "clairvoyant",
            "hpa-utilization",
            "keda-queue",
            "kpa",
            "sla-planner"
        ]
    );
    for p in policies {
        for k in [
            "slo_attainment",
            "gpu_seconds",
            "cold_starts",
            "scale_events",
            "ttft_p50",
            "ttft_p99",
            "itl_p50",
            "itl_p99",
        ] {
            assert!(p[k].is_number(), "{k} in {}", p["name"]);
        }
        assert_eq!(p["unfinished"], 0, "{}", p["name"]);
    }
    // static-peak is, by construction, a fixed size that reaches 99%; the clairvoyant
    // schedule reaches it too, for less.
    let st = &policies[1];
    assert!(st["slo_attainment"].as_f64().unwrap() >= 0.99);
    let seer = &policies[2];
    assert!(seer["slo_attainment"].as_f64().unwrap() >= 0.99);
    assert!(seer["gpu_seconds"].as_f64() < st["gpu_seconds"].as_f64());
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("prefill replicas"));
    for n in names {
        assert!(plot.contains(&format!(">{n}</text>")), "{n} in the legend");
    }
}

#[test]
fn simulate_the_mooncake_trace_reuses_prefixes() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let trace = testdata().join("traces/mooncake_synthetic.jsonl");
    ok([
        "simulate".as_ref(),
        "--trace".as_ref(),
        trace.as_os_str(),
        "--policy".as_ref(),
        "preheat,kpa".as_ref(),
        "--json".as_ref(),
        json.as_os_str(),
    ]);
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let hit = r["policies"][0]["prefix_hit_rate"].as_f64().unwrap();
    assert!(
        hit > 0.1 && hit < 0.64,
        "hit rate {hit} (at most the trace's 64% reuse)"
    );
}

#[test]
fn simulate_bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,12,3\n2023-11-16 18:17:04.1,x,3\n",
    )
    .unwrap();
    for (args, want) in [
        (vec!["--trace", bad.to_str().unwrap()], "bad.csv:3:"),
        // Flags of a few values are clap's: it names the value, the flag and the choices.
        (
            vec!["--trace", bad.to_str().unwrap(), "--policy", "magic"],
            "invalid value 'magic' for '--policy <POLICY>'\n  [possible values: all, preheat,",
        ),
        (
            vec!["--trace", bad.to_str().unwrap(), "--start", "tepid"],
            "invalid value 'tepid' for '--start <START>'",
        ),
        // Every problem of the values themselves at once.
        (
            vec![
                "--trace",
                bad.to_str().unwrap(),
                "--slo-ttft=-1",
                "--slo-itl=-1",
            ],
            "slo_ttft_s must be > 0",
        ),
        (
            vec![
                "--trace",
                bad.to_str().unwrap(),
                "--slo-ttft=-1",
                "--slo-itl=-1",
            ],
            "slo_itl_s must be > 0",
        ),
        (vec!["--trace", "/nonexistent.csv"], "/nonexistent.csv"),
        (
            vec!["--trace", bad.to_str().unwrap(), "--rate-scale", "0"],
            "--rate-scale 0: give a whole number from 1 to 1000",
        ),
        (
            vec!["--trace", bad.to_str().unwrap(), "--startup-s=5,-1"],
            "--startup-s -1: give start times from 0 to 3600 seconds",
        ),
        (
            vec!["--trace", bad.to_str().unwrap(), "--actuation", "magic"],
            "invalid value 'magic' for '--actuation <ACTUATION>'",
        ),
        (
            vec![
                "--trace",
                bad.to_str().unwrap(),
                "--frontier",
                "--startup-s",
                "5",
            ],
            "cannot be used with",
        ),
        (
            vec![
                "--trace",
                bad.to_str().unwrap(),
                "--need-curve",
                "4",
                "--frontier",
            ],
            "cannot be used with",
        ),
        (
            vec![
                "--trace",
                bad.to_str().unwrap(),
                "--need-curve",
                "4",
                "--policy",
                "kpa",
            ],
            "cannot be used with",
        ),
        (
            vec!["--trace", bad.to_str().unwrap(), "--need-curve", "1"],
            "1 is not in 2..=64",
        ),
        // Keys that configure a deployment are not a simulation's: refused by name.
        (
            vec!["--trace", bad.to_str().unwrap(), "--set", "mode=direct"],
            "--set mode: a simulation reads only",
        ),
        (
            vec![
                "--trace",
                bad.to_str().unwrap(),
                "--set",
                "models.1.prefill.headroom=2",
            ],
            "--set models.1.prefill.headroom: a simulation reads only",
        ),
        (
            vec![
                "--trace",
                bad.to_str().unwrap(),
                "--set",
                "models.0.prefill.endpoints=[http://p0/metrics]",
            ],
            "--set models.0.prefill.endpoints: a simulation reads only",
        ),
        (
            vec![
                "--trace",
                bad.to_str().unwrap(),
                "--set",
                "profile=/nonexistent-profile.json",
            ],
            "profile /nonexistent-profile.json",
        ),
    ] {
        let out = preheat(std::iter::once("simulate").chain(args.iter().copied()));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn rate_scale_loads_the_same_shape_k_times_over() {
    let dir = tempfile::tempdir().unwrap();
    let trace = testdata().join("traces/azure_code_2023.csv");
    let run = |k: &str| {
        let json = dir.path().join(format!("r{k}.json"));
        let out = ok([
            "simulate".as_ref(),
            "--trace".as_ref(),
            trace.as_os_str(),
            "--policy".as_ref(),
            "static-peak".as_ref(),
            "--rate-scale".as_ref(),
            k.as_ref(),
            "--json".as_ref(),
            json.as_os_str(),
        ]);
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        (out, r)
    };
    let (_, one) = run("1");
    let (out, three) = run("3");
    assert!(out.contains(&format!("{} requests", 3 * 8819)), "{out}");
    assert!(
        three["trace"].as_str().unwrap().ends_with("×3"),
        "{}",
        three["trace"]
    );
    // Three times the load needs a larger fixed size, which still meets 99%.
    let size = |r: &serde_json::Value| -> u64 {
        let f = r["policies"][0]["fixed_replicas"].as_array().unwrap();
        f.iter().map(|v| v.as_u64().unwrap()).sum()
    };
    assert!(
        size(&three) > size(&one),
        "{} vs {}",
        size(&three),
        size(&one)
    );
    assert!(three["policies"][0]["slo_attainment"].as_f64().unwrap() >= 0.99);
}

#[test]
fn trace_day_makes_a_seeded_swinging_day_the_simulator_reads() {
    let dir = tempfile::tempdir().unwrap();
    let from = testdata().join("traces/mooncake_synthetic.jsonl");
    let make = |name: &str, seed: &str| {
        let out = dir.path().join(name);
        let text = ok([
            "trace".as_ref(),
            "day".as_ref(),
            "--from".as_ref(),
            from.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
            "--peak-rps".as_ref(),
            "2".as_ref(),
            "--hours".as_ref(),
            "3".as_ref(),
            "--peak-hour".as_ref(),
            "2".as_ref(),
            "--seed".as_ref(),
            seed.as_ref(),
        ]);
        (out, text)
    };
    let (a, text) = make("a.jsonl", "7");
    let (b, _) = make("b.jsonl", "7");
    assert_eq!(
        std::fs::read(&a).unwrap(),
        std::fs::read(&b).unwrap(),
        "seeded"
    );
    let n = std::fs::read_to_string(&a).unwrap().lines().count();
    // Three hours around a 2 req/s peak at 02:00 (trough 1/15 req/s at 14:00): the
    // rate stays within 1.87..2 req/s, about 21,000 arrivals.
    assert!(text.contains(&format!("{n} requests over 3 h")), "{text}");
    assert!((19_000..23_000).contains(&n), "{n}");
    let out = ok([
        "simulate".as_ref(),
        "--trace".as_ref(),
        a.as_os_str(),
        "--policy".as_ref(),
        "static-peak".as_ref(),
    ]);
    assert!(out.contains(&format!("{n} requests")), "{out}");
    // A bad shape is refused with every problem named.
    let bad = preheat([
        "trace",
        "day",
        "--from",
        from.to_str().unwrap(),
        "--out",
        "/tmp/never.jsonl",
        "--swing",
        "0.5",
        "--hours",
        "0",
    ]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(
        err.contains("swing 0.5") && err.contains("hours 0"),
        "{err}"
    );
}

#[test]
fn frontier_and_start_up_sweeps_report_every_point_with_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let trace = testdata().join("traces/azure_code_2023.csv");
    let (json, svg) = (dir.path().join("f.json"), dir.path().join("f.svg"));
    let out = ok([
        "simulate".as_ref(),
        "--trace".as_ref(),
        trace.as_os_str(),
        "--policy".as_ref(),
        "preheat,kpa,static-peak".as_ref(),
        "--frontier".as_ref(),
        "--json".as_ref(),
        json.as_os_str(),
        "--plot".as_ref(),
        svg.as_os_str(),
    ]);
    let f: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let points = f["points"].as_array().unwrap();
    let count = |name: &str| points.iter().filter(|p| p["policy"] == name).count();
    assert_eq!(
        (count("preheat"), count("kpa"), count("static-peak")),
        (8, 7, 1)
    );
    assert_eq!(f["preheat"]["knob"], 1.0);
    assert!(out.contains("preheat (shipped setting)"), "{out}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("GPU-seconds"));
    for n in ["preheat", "kpa", "static-peak"] {
        assert!(plot.contains(&format!(">{n}</text>")), "{n} in the legend");
    }

    let (json, svg) = (dir.path().join("s.json"), dir.path().join("s.svg"));
    let out = ok([
        "simulate".as_ref(),
        "--trace".as_ref(),
        trace.as_os_str(),
        "--policy".as_ref(),
        "preheat,keda-queue".as_ref(),
        "--startup-s".as_ref(),
        "2,20s,2m".as_ref(),
        "--actuation".as_ref(),
        "direct".as_ref(),
        "--json".as_ref(),
        json.as_os_str(),
        "--plot".as_ref(),
        svg.as_os_str(),
    ]);
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = s["rows"].as_array().unwrap();
    let starts: Vec<f64> = rows.iter().map(|r| r[0].as_f64().unwrap()).collect();
    assert_eq!(starts, [2.0, 20.0, 120.0]);
    for r in rows {
        let names: Vec<&str> = r[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["policy"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["preheat", "keda-queue"]);
    }
    assert!(
        out.lines().filter(|l| l.contains("keda-queue")).count() == 3,
        "{out}"
    );
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.contains("start-up seconds") && plot.contains("SLO attainment %"));
}

#[test]
fn need_curve_reports_the_steady_need_by_rate_against_static_peak_with_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    // Ten minutes climbing from one request every 5 s to one a second, 16k-token prompts.
    let trace = dir.path().join("ramp.jsonl");
    let mut lines = String::new();
    let mut t = 0.0f64;
    while t < 600.0 {
        lines.push_str(&format!(
            "{{\"timestamp\":{},\"input_length\":16384,\"output_length\":16,\"hash_ids\":[]}}\n",
            (t * 1000.0) as u64
        ));
        t += 5.0 - 4.0 * t / 600.0;
    }
    std::fs::write(&trace, lines).unwrap();
    let (json, svg) = (dir.path().join("n.json"), dir.path().join("n.svg"));
    let out = ok([
        "simulate".as_ref(),
        "--trace".as_ref(),
        trace.as_os_str(),
        "--need-curve".as_ref(),
        "2".as_ref(),
        "--json".as_ref(),
        json.as_os_str(),
        "--plot".as_ref(),
        svg.as_os_str(),
    ]);
    assert!(out.contains("static-peak on the trace"), "{out}");
    assert!(out.contains("run on the trace in whole replicas"), "{out}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let points = r["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    assert!(points[0]["rate"].as_f64().unwrap() < points[1]["rate"].as_f64().unwrap());
    assert_eq!(r["minute_rates"].as_array().unwrap().len(), 10);
    let c = &r["charges"];
    let total = |k: &str| c[k]["prefill"].as_f64().unwrap() + c[k]["decode"].as_f64().unwrap();
    let [sp, sd] = [0, 1].map(|i| r["static_peak"][i].as_f64().unwrap());
    assert_eq!(total("fixed"), (sp + sd) * 600.0);
    assert!(total("tracking") > 0.0 && total("relaxed") <= total("tracking"));
    // Sized minute by minute, the need holds the ramp, and so does its least scale.
    assert!(
        r["tracking_run"]["slo_attainment"].as_f64().unwrap() >= 0.99,
        "{r}"
    );
    let scaled = &r["scaled_run"];
    assert!(
        scaled["run"]["slo_attainment"].as_f64().unwrap() >= 0.99,
        "{r}"
    );
    assert!(scaled["prefill"].as_f64().unwrap() <= 1.0, "{r}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("requests/s"));
    assert!(plot.contains(">steady need</text>"), "the legend");
}

/// `simulate --set models.0.prefill.headroom=0.8` without `--config` was refused
/// ("models: at least one model is required"), so the simulator's knobs could only be
/// turned by writing a scaler config file. It now starts from one model at the shipped
/// defaults, and the override is honoured.
#[test]
fn regression_simulate_set_without_a_config_was_refused() {
    let trace = testdata().join("traces/mooncake_synthetic.jsonl");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "simulate",
            "--trace",
            trace.to_str().unwrap(),
            "--policy",
            "preheat",
        ];
        args.extend_from_slice(extra);
        let out = ok(args);
        let row = out
            .lines()
            .find(|l| l.starts_with("preheat "))
            .unwrap_or_else(|| panic!("no preheat row in:\n{out}"))
            .to_owned();
        let gpu_s: f64 = row.split_whitespace().nth(2).unwrap().parse().unwrap();
        gpu_s
    };
    let shipped = run(&[]);
    let lower = run(&[
        "--set",
        "models.0.prefill.headroom=0.8",
        "--set",
        "models.0.decode.headroom=0.8",
    ]);
    assert!(
        lower < shipped * 0.97,
        "headroom 0.8 spent {lower} GPU-s against {shipped} at the shipped 1.0"
    );
    // The shipped defaults, restated, change nothing.
    assert_eq!(run(&["--set", "models.0.prefill.headroom=1"]), shipped);
}

/// A scaler config's profile is the one its scaler sizes with, so the simulation uses
/// it too (it was silently ignored: the default profile ran); `--profile` names another.
#[test]
fn a_scaler_configs_profile_is_simulated_unless_profile_names_another() {
    let dir = tempfile::tempdir().unwrap();
    let trace = testdata().join("traces/mooncake_synthetic.jsonl");
    let profile = |name: &str| {
        let p = dir.path().join(format!("{name}.json"));
        std::fs::write(
            &p,
            serde_json::json!({
                "source": name,
                "prefill_tokens_per_s": [[128, 9000], [512, 14000], [2048, 16000], [8192, 12000], [32768, 7000]],
                "decode_itl_s": [[1, 0.008], [16, 0.011], [64, 0.018], [128, 0.028], [256, 0.048]],
                "kv_tokens": 450000,
                "startup_s": {"cold": 300, "staged": 60, "hot": 3, "standby": 2}
            })
            .to_string(),
        )
        .unwrap();
        p
    };
    let (scalers, flags) = (profile("the-scalers"), profile("the-flags"));
    let config = dir.path().join("scaler.yaml");
    std::fs::write(
        &config,
        format!(
            "profile: {}\nmodels:\n  - name: m\n    prefill: {{}}\n    decode: {{}}\n",
            scalers.display()
        ),
    )
    .unwrap();
    let base = [
        "simulate",
        "--trace",
        trace.to_str().unwrap(),
        "--policy",
        "preheat",
        "--config",
        config.to_str().unwrap(),
    ];
    let out = ok(base);
    assert!(out.contains("profile: the-scalers"), "{out}");
    assert!(out.contains("replicas start in 3 s"), "{out}");
    let out = ok(base
        .iter()
        .copied()
        .chain(["--profile", flags.to_str().unwrap()]));
    assert!(out.contains("profile: the-flags"), "{out}");
}

#[path = "cli_simulate/fleet.rs"]
mod fleet;
