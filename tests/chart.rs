//! The Helm chart: Helm's own strict lint and rendering (helm-python-sdk, Helm's Go SDK),
//! every object validated against the Kubernetes and KEDA schemas (tests/chart/
//! validate.py), the rendered scaler and warm-pool configs accepted by the real
//! parsers of those components, and the ScaledObjects' HPA behaviour what the
//! simulator's KEDA model assumes.

mod harness;

use std::path::Path;
use std::process::Command;

#[test]
fn helm_chart_lints_renders_and_validates_for_every_variant() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let py = root.join(".cache/python");
    if !preheat_testkit::present_or_skip(
        py.join("helm_python").exists(),
        "helm-python-sdk in .cache/python",
        ".ci/fetch-tools",
    ) {
        return;
    }
    let dump = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .arg(root.join("tests/chart/validate.py"))
        .arg("--dump")
        .arg(dump.path())
        .env("PYTHONPATH", &py)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "chart validation failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The pod's mounted TLS Secret, as files where the rendered config names them.
    let tls = tempfile::tempdir().unwrap();
    for f in ["tls.crt", "tls.key", "ca.crt"] {
        std::fs::write(tls.path().join(f), "PEM").unwrap();
    }
    // ...and its state volume, where the scaler keeps its state file.
    let state = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for variant in std::fs::read_dir(dump.path()).unwrap().flatten() {
        let scaler = variant.path().join("scaler.yaml");
        let text = std::fs::read_to_string(&scaler).unwrap();
        // `simulate --config` reads the rendered config as it is, off the cluster,
        // where its TLS files and state volume are not.
        let policies = preheat_scaler::config::Config::load_policies(Some(&scaler), &[])
            .unwrap_or_else(|e| panic!("{} as simulate reads it: {e}", scaler.display()));
        let mounted = format!("{}/", tls.path().display());
        let state_dir = format!("{}/", state.path().display());
        std::fs::write(
            &scaler,
            text.replace("/var/run/preheat/scaler-tls/", &mounted)
                .replace("/var/lib/preheat/", &state_dir),
        )
        .unwrap();
        let cfg = preheat_scaler::config::Config::load(Some(&scaler), &[])
            .unwrap_or_else(|e| panic!("{}: {e}", scaler.display()));
        assert_eq!(policies.models, cfg.models, "{}", scaler.display());
        // The fleet variant serves three models (`models:`), every other one.
        let fleet = variant.file_name().to_string_lossy().starts_with("fleet");
        let names: Vec<&str> = cfg.models.iter().map(|m| m.name.as_str()).collect();
        if fleet {
            assert_eq!(names, ["llama-8b", "qwen-1b", "mistral-7b"]);
            assert_eq!(cfg.fleet.max_gpus, 12);
            assert_eq!(cfg.models[0].priority, 1);
        } else {
            assert_eq!(names.len(), 1, "{names:?}");
        }
        // The state file is kept unless the values turn it off (one variant does).
        let stateless = variant
            .file_name()
            .to_string_lossy()
            .starts_with("no-warmpool");
        assert_eq!(
            cfg.state_file,
            (!stateless).then(|| state.path().join("scaler-state.json")),
            "{}",
            scaler.display()
        );
        // Every variant keeps the chart's default headroom: the policy the simulator's
        // frontiers measure is the one the chart deploys.
        for m in &cfg.models {
            assert_eq!(
                (m.prefill.policy.headroom, m.decode.policy.headroom),
                (1.0, 1.0),
                "{}",
                scaler.display()
            );
        }
        let m = &cfg.models[0];
        // So is the season: the chart's period and bucket are the policy's defaults,
        // and values that set them reach both pools.
        let always_on = variant
            .file_name()
            .to_string_lossy()
            .starts_with("always-on");
        let shipped = preheat_scaler::policy::PoolPolicy::default();
        let season = if always_on {
            (604_800.0, 600.0)
        } else {
            (shipped.season_period_s, shipped.season_bucket_s)
        };
        for p in [&m.prefill.policy, &m.decode.policy] {
            assert_eq!(
                (p.season_period_s, p.season_bucket_s),
                season,
                "{}",
                scaler.display()
            );
        }
        // A scheduled floor in the values reaches the scaler's policy as written.
        if variant
            .file_name()
            .to_string_lossy()
            .starts_with("always-on")
        {
            let s = &m.prefill.policy.schedule;
            assert_eq!(s.len(), 1, "{}", scaler.display());
            assert_eq!(
                (s[0].cron.as_str(), s[0].duration_s, s[0].min_replicas),
                ("0 8 * * 1-5", 36000.0, 2)
            );
        }
        checked += 1;
        let wp = variant.path().join("warmpool.yaml");
        if wp.exists() {
            let text = std::fs::read_to_string(&wp).unwrap();
            // As the pod has it: the model source from its Secret, through the env.
            let env = |k: &str| {
                k.starts_with("PREHEAT_MODEL_SOURCE")
                    .then(|| "https://models.example.com/m.phpack".to_owned())
            };
            preheat_warmpool::config::AgentConfig::from_yaml_env(
                &text,
                Some("node-1".into()),
                &env,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", wp.display()));
            checked += 1;
        }
    }
    assert!(checked >= 7, "{checked} configs checked");
    // The simulator's `--actuation keda` models HPA and KEDA as the chart renders them:
    // the shipped values' ScaledObjects say what the model must be.
    let default = dump.path().join("default");
    let objects: Vec<serde_json::Value> = std::fs::read_dir(&default)
        .unwrap()
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().starts_with("scaledobject-"))
        .map(|f| serde_json::from_slice(&std::fs::read(f.path()).unwrap()).unwrap())
        .collect();
    assert_eq!(objects.len(), 2, "one ScaledObject per pool");
    for so in &objects {
        check_hpa_model_matches(so);
    }
}

/// One rendered ScaledObject against `preheat_sim`'s KEDA model (`KedaSettings`'
/// defaults, `HpaBehavior::CHART`).
fn check_hpa_model_matches(so: &serde_json::Value) {
    use preheat_sim::hpa::HpaBehavior;
    let name = so["metadata"]["name"].as_str().unwrap_or("?");
    let model = preheat_sim::keda::KedaSettings::default();
    assert_eq!(model.behavior, HpaBehavior::CHART);
    let b = &so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"];
    let num = |v: &serde_json::Value| -> f64 {
        v.as_f64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .unwrap_or_else(|| panic!("{name}: not a number: {v}"))
    };
    let policy = |dir: &str, kind: &str| -> (f64, f64) {
        let p = b[dir]["policies"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["type"] == kind))
            .unwrap_or_else(|| panic!("{name}: no {dir} {kind} policy in {b}"));
        (num(&p["value"]), num(&p["periodSeconds"]))
    };
    let c = HpaBehavior::CHART;
    assert_eq!(num(&b["scaleUp"]["tolerance"]), c.up_tolerance, "{name}");
    assert_eq!(
        num(&b["scaleDown"]["tolerance"]),
        c.down_tolerance,
        "{name}"
    );
    // The model has no scale-up stabilisation: the chart must render none.
    assert_eq!(
        num(&b["scaleUp"]["stabilizationWindowSeconds"]),
        0.0,
        "{name}"
    );
    assert_eq!(
        num(&b["scaleDown"]["stabilizationWindowSeconds"]),
        c.down_stabilization_s,
        "{name}"
    );
    assert_eq!(
        policy("scaleUp", "Percent"),
        (c.up_percent, c.up_period_s),
        "{name}"
    );
    assert_eq!(
        policy("scaleUp", "Pods"),
        (f64::from(c.up_pods), c.up_period_s),
        "{name}"
    );
    assert_eq!(
        policy("scaleDown", "Pods"),
        (
            f64::from(c.down_pods.expect("the chart limits scale-down")),
            c.down_period_s
        ),
        "{name}"
    );
    assert_eq!(
        b["scaleDown"]["policies"].as_array().map(Vec::len),
        Some(1),
        "{name}: the model has one scale-down policy"
    );
    assert_eq!(
        b["scaleUp"]["policies"].as_array().map(Vec::len),
        Some(2),
        "{name}: the model has two scale-up policies"
    );
    // ...and takes the larger change, HPA's default.
    for dir in ["scaleUp", "scaleDown"] {
        let select = b[dir]["selectPolicy"].as_str().unwrap_or("Max");
        assert_eq!(select, "Max", "{name}: {dir}.selectPolicy");
    }
    assert_eq!(
        num(&so["spec"]["cooldownPeriod"]),
        model.cooldown_s,
        "{name}"
    );
}
