//! `preheat bench coldstart` on the synthetic tiny model: every source starts a real
//! replica to its first token, and `--fleet` starts a second and a third model from
//! each source while the first serves.

mod harness;

use harness::ok_json;

#[test]
fn coldstart_fleet_measures_a_second_and_third_model_from_each_tier_while_the_first_serves() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().to_str().unwrap();
    let r = ok_json([
        "bench",
        "coldstart",
        "--model",
        "tiny",
        "--work-dir",
        work,
        "--runs",
        "1",
        "--kv-cache-mib",
        "16",
        "--fleet",
        "--json",
    ]);
    let fleet = &r["fleet"];
    for source in ["convert", "staged", "hot", "standby"] {
        let single = r["sources"][source]["first_token_s"].as_f64().unwrap();
        assert!(single > 0.0, "{source}: {r}");
        for which in ["second_first_token_s", "third_first_token_s"] {
            let t = fleet["sources"][source][which].as_f64().unwrap_or(0.0);
            assert!(t > 0.0 && t < 300.0, "{source} {which}: {fleet}");
        }
    }
    // The first model kept answering all along, and its throughput was measured.
    assert!(
        fleet["first_model_requests_answered"].as_u64().unwrap_or(0) > 0,
        "{fleet}"
    );
    assert!(
        fleet["first_model_tokens_per_s_alone"]
            .as_f64()
            .unwrap_or(0.0)
            > 0.0,
        "{fleet}"
    );
    // The other models ran from their own files, kept for the next run.
    for n in [2, 3] {
        assert!(dir.path().join(format!("fleet/model-{n}.preheat")).exists());
    }
}
