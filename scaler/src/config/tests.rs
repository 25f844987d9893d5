use super::*;

const YAML: &str = r#"
interval_s: 2
models:
  - name: llama
    gateway: [http://gw:8000/metrics]
    prefill:
      endpoints: [http://p0:8000/metrics]
      slo_ttft_s: 1.5
    decode:
      endpoints: [http://d0:8000/metrics, http://d1:8000/metrics]
      max_replicas: 16
"#;

fn load(yaml: &str, sets: &[&str]) -> Result<Config> {
    // A file of its own per call: tests run in parallel.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), yaml).unwrap();
    Config::load(
        Some(file.path()),
        &sets.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
    )
}

#[test]
fn sources_and_direct_mode_are_checked() {
    let e = load(
        "mode: direct\nmodels:\n  - name: m\n    prefill:\n      selector: app=p\n      endpoints: [http://x/metrics]\n    decode:\n      prometheus_selector: 'pool=\"d\"'\n      metrics_path: metrics\n",
        &[],
    )
    .unwrap_err()
    .to_string();
    for want in [
        "models.0.prefill: endpoints, selector and prometheus_selector are alternatives",
        "models.0.decode.prometheus_selector needs prometheus_url",
        "models.0.prefill.deployment is required in direct mode",
        "models.0.decode.deployment is required in direct mode",
        "models.0.decode.metrics_path must start with /",
    ] {
        assert!(e.contains(want), "{want} missing from: {e}");
    }
    let ok = load(
        "mode: direct\nkubernetes: {namespace: llm}\nmodels:\n  - name: m\n    prefill: {selector: 'app=p', deployment: p}\n    decode: {selector: 'app=d', deployment: d, metrics_port: 9000}\n",
        &[],
    )
    .unwrap();
    assert_eq!(ok.mode, Mode::Direct);
    assert_eq!(ok.kubernetes.namespace, "llm");
    assert_eq!(ok.models[0].decode.metrics_port, 9000);
    assert_eq!(ok.models[0].prefill.metrics_path, "/metrics");
    assert!(
        load(
            "models:\n  - name: m\n    prefill: {}\n    decode: {}\n",
            &[]
        )
        .is_ok(),
        "a pool with no source is a static pool with no replicas"
    );
    assert!(
        Config::load_policies(
            None,
            &["models=[{name: m, prefill: {}, decode: {}}]".into()]
        )
        .is_ok()
    );
}

#[test]
fn file_and_overrides() {
    let c = load(
        YAML,
        &[
            "models.0.decode.max_replicas=8",
            "window_s=90",
            "grpc_listen=127.0.0.1:7000",
        ],
    )
    .unwrap();
    assert_eq!(c.interval_s, 2.0);
    assert_eq!(c.window_s, 90.0);
    assert_eq!(c.models[0].decode.policy.max_replicas, 8);
    assert_eq!(c.models[0].prefill.policy.slo_ttft_s, 1.5);
    assert!(
        matches!(&c.models[0].decode.source, MetricsSource::Endpoints(e) if e.len() == 2),
        "{:?}",
        c.models[0].decode.source
    );
    assert_eq!(c.grpc_listen.port(), 7000);
}

#[test]
fn every_error_is_reported_at_once() {
    let bad = load(
        YAML,
        &[
            "models.0.decode.min_replicas=20",
            "models.0.prefill.slo_ttft_s=-1",
            "models.0.prefill.endpoints=[p0:8000]",
            "models.5.x=1",
            "interval_s=0",
        ],
    )
    .unwrap_err();
    let ScalerError::Config(errs) = bad else {
        panic!()
    };
    let all = errs.join("\n");
    for needle in [
        "min_replicas 20 > max_replicas 16",
        "slo_ttft_s",
        "not an http",
        "index 5",
        "interval_s",
    ] {
        assert!(all.contains(needle), "{needle} missing from:\n{all}");
    }
}

#[test]
fn a_prometheus_window_must_hold_two_of_its_scrapes() {
    let set = |w: &str| {
        load(
            YAML,
            &[
                "prometheus_url=http://prometheus:9090",
                "prometheus_scrape_interval_s=30",
                w,
            ],
        )
    };
    let e = set("window_s=45").unwrap_err().to_string();
    assert!(e.contains("two Prometheus scrapes (60)"), "{e}");
    assert!(set("window_s=60").is_ok());
}

#[test]
fn unknown_keys_are_errors() {
    let e = load("models: []\nintreval_s: 3\n", &[]).unwrap_err();
    assert!(e.to_string().contains("intreval_s"), "{e}");
}

#[test]
fn a_state_file_needs_a_directory_that_is_there() {
    let dir = tempfile::tempdir().unwrap();
    let at = |p: &std::path::Path| format!("state_file={}", p.display());
    let ok = dir.path().join("scaler-state.json");
    let cfg = load(YAML, &[&at(&ok)]).unwrap();
    assert_eq!(cfg.state_file.as_deref(), Some(ok.as_path()));
    let e = load(YAML, &[&at(&dir.path().join("gone/scaler-state.json"))])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("state_file: its directory") && e.contains("gone"),
        "{e}"
    );
    let e = load(YAML, &[&at(dir.path())]).unwrap_err().to_string();
    assert!(e.contains("is not a file name"), "{e}");
}

/// `--set models.0.prefill.headroom=0.8` with no `models` list made a map with a key
/// "0", and serde then said "invalid type: map, expected a sequence", naming neither
/// the flag nor the list.
#[test]
fn regression_a_list_entry_set_without_its_list_read_as_a_map() {
    let err = Config::load_policies(None, &["models.0.prefill.headroom=0.8".into()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--set models.0.prefill.headroom") && err.contains("no list at `models`"),
        "{err}"
    );
    assert!(!err.contains("expected a sequence"), "{err}");
}

/// Local mode builds its config in code; `up --set` changes it as `scaler run --set`
/// changes a file, and a config that takes no override comes back as it went in.
#[test]
fn a_config_built_in_code_takes_overrides_and_round_trips() {
    let built = load(YAML, &[]).unwrap();
    assert_eq!(built.clone().with_overrides(&[], true).unwrap(), built);
    let c = built
        .clone()
        .with_overrides(
            &[
                "models.0.prefill.schedule=[{cron: '0 8 * * 1-5', duration_s: 36000, min_replicas: 2}]"
                    .into(),
                "window_s=90".into(),
            ],
            true,
        )
        .unwrap();
    assert_eq!(c.window_s, 90.0);
    let floors = &c.models[0].prefill.policy.schedule;
    assert_eq!(floors.len(), 1);
    assert_eq!(
        (floors[0].cron.as_str(), floors[0].min_replicas),
        ("0 8 * * 1-5", 2)
    );
    assert_eq!(c.models[0].decode, built.models[0].decode);
    // The refused overrides and what serde refuses, together, each named.
    let err = built
        .clone()
        .with_overrides(
            &["models.0.prefill.bogus=1".into(), "models.3.x=1".into()],
            true,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("models.3.x") && err.contains("index 3 out of range"),
        "{err}"
    );
    assert!(err.contains("bogus"), "{err}");
    // Values that parse are checked as a file's are.
    let err = built
        .with_overrides(&["models.0.decode.min_replicas=99".into()], true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("min_replicas 99 > max_replicas 16"), "{err}");
}

#[test]
fn a_set_path_names_a_first_model_policy_key_or_not() {
    use crate::policy::Pool;
    for (path, want) in [
        (
            "models.0.prefill.headroom",
            Some((Pool::Prefill, "headroom")),
        ),
        (
            "models.0.decode.schedule.0.cron",
            Some((Pool::Decode, "schedule")),
        ),
        ("models.0.prefill.endpoints", None),
        ("models.1.prefill.headroom", None),
        ("models.0.prefill", None),
        ("models.0.name", None),
        ("window_s", None),
    ] {
        assert_eq!(Config::first_model_policy_key(path), want, "{path}");
    }
}
