//! The Helm chart: Helm's own strict lint and rendering (helm-python-sdk, Helm's Go SDK),
//! every object validated against the Kubernetes and KEDA schemas (tests/chart/
//! validate.py), and the rendered scaler and warm-pool configs accepted by the real
//! parsers of those components.

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
        assert_eq!(cfg.models.len(), 1);
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
        let m = &cfg.models[0];
        assert_eq!(
            (m.prefill.policy.headroom, m.decode.policy.headroom),
            (1.0, 1.0),
            "{}",
            scaler.display()
        );
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
                (k == "PREHEAT_MODEL_SOURCE")
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
}
