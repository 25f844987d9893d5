//! Parked standbys as operators run them: the warm-pool agent stages a snapshot,
//! keeps one standby parked per pool (not registered with the gateway), promotes one
//! on request in well under a second, starts a replacement, and every start is
//! measured in `preheat:startup_phase_seconds`.

mod harness;

use std::process::Stdio;
use std::time::Duration;

use harness::Log;
use preheat_testkit::{KillOnDrop, free_port, model_fixture, wait_for};
use serde_json::{Value, json};

fn spawn(args: &[&str]) -> KillOnDrop {
    harness::spawn(args, Stdio::null())
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// GET with this run's cluster token (internal endpoints ask for it; public ones
/// ignore it).
fn get(url: &str) -> Option<(u16, String)> {
    let r = reqwest::blocking::Client::new()
        .get(url)
        .header("authorization", harness::bearer())
        .send()
        .ok()?;
    Some((r.status().as_u16(), r.text().ok()?))
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::blocking::Client::new()
        .post(url)
        .header("authorization", harness::bearer())
        .json(body)
        .timeout(Duration::from_secs(60))
        .send()
        .unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

/// The value of `name{…}` whose labels include every one of `labels` (`k="v"`).
fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.split(',').all(|p| l.contains(p)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn colocated_standby_serves_only_after_promotion() {
    // The control routes live on the internal port only, behind the cluster token.
    let iport = free_port();
    let ibase = format!("http://127.0.0.1:{iport}");
    let s = harness::serve(&model_fixture("llama-tiny"))
        .kv_mib(16)
        .args(&["--internal-port", &iport.to_string(), "--standby"])
        .log(Log::Null)
        .start();
    let base = s.url.clone();
    wait_for("parked", secs(60), || {
        get(&format!("{ibase}/internal/state")).is_some_and(|(_, b)| b.contains("standby"))
    });
    assert_eq!(
        get(&format!("{base}/internal/state")).unwrap().0,
        404,
        "no /internal/ on the public port"
    );
    let anonymous = reqwest::blocking::Client::new()
        .post(format!("{ibase}/internal/promote"))
        .send()
        .unwrap();
    assert_eq!(anonymous.status(), 401, "promotion without the token");
    assert_eq!(
        get(&format!("{base}/health")).unwrap().0,
        503,
        "a standby is not ready"
    );
    let req = json!({"prompt": "hi", "max_tokens": 2, "temperature": 0});
    assert_eq!(post(&format!("{base}/v1/completions"), &req).0, 503);
    let metrics = get(&format!("{base}/metrics")).unwrap().1;
    assert!(
        metric(
            &metrics,
            "preheat:startup_phase_seconds",
            "phase=\"parked\""
        )
        .is_some(),
        "load phases are reported while parked:\n{metrics}"
    );
    let (st, v) = post(&format!("{ibase}/internal/promote"), &json!({}));
    assert_eq!(st, 200, "{v}");
    assert!(v["promote_ms"].as_f64().unwrap() < 100.0, "{v}");
    assert_eq!(get(&format!("{base}/health")).unwrap().0, 200);
    let (st, v) = post(&format!("{base}/v1/completions"), &req);
    assert_eq!(st, 200, "{v}");
    let metrics = get(&format!("{base}/metrics")).unwrap().1;
    for phase in ["ready", "first_token"] {
        let label = format!("phase=\"{phase}\",source=\"standby\"");
        assert!(
            metric(&metrics, "preheat:startup_phase_seconds", &label).is_some(),
            "{phase}:\n{metrics}"
        );
    }
    // Promoting twice is a clear refusal, not a second engine.
    assert_eq!(
        post(&format!("{ibase}/internal/promote"), &json!({})).0,
        409
    );
}

#[test]
fn the_agent_keeps_standbys_parked_and_promotes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = tmp.path().join("published/llama-tiny.preheat");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    let m = model_fixture("llama-tiny");
    harness::ok([
        "snapshot",
        "convert",
        m.to_str().unwrap(),
        "-o",
        snap.to_str().unwrap(),
    ]);
    // Workers register on the gateway's internal port (behind the cluster token).
    let gateway = harness::gateway().log(Log::Null).start();
    let (gw, gwi) = (gateway.url.clone(), gateway.internal.clone());
    let aport = free_port();
    let agent_url = format!("http://127.0.0.1:{aport}");
    let exe = env!("CARGO_BIN_EXE_preheat");
    let pool = |role: &str, base: u16| {
        json!({"pool": role, "model": "llama-tiny", "count": 1, "base_port": base,
               "command": [exe, "engine", role, "--model", "{model_path}", "--port", "{port}",
                           "--kv-cache-mib", "16", "--gateway", gwi, "--standby"],
               "unlist_delay_s": 0.5})
    };
    let cfg = json!({
        "dir": tmp.path().join("node"),
        "disk_budget": "1GiB",
        "memory_budget": "256MiB",
        "listen": format!("127.0.0.1:{aport}"),
        "refresh_secs": 0.2,
        "kernel_cache_dir": tmp.path().join("kernels"),
        "models": [{"name": "llama-tiny", "source": snap, "hot": true}],
        "standbys": [pool("prefill", free_port()), pool("decode", free_port())],
    });
    let cfg_path = tmp.path().join("agent.yaml");
    std::fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    let agent = spawn(&["warmpool", "run", "--config", cfg_path.to_str().unwrap()]);
    let parked = |pool: &str| {
        get(&format!("{agent_url}/metrics")).and_then(|(_, t)| {
            metric(
                &t,
                "preheat:warmpool_parked_standbys",
                &format!("pool=\"{pool}\""),
            )
        }) == Some(1.0)
    };
    wait_for("both pools parked", secs(120), || {
        parked("prefill") && parked("decode")
    });
    let (_, models) = get(&format!("{agent_url}/models")).unwrap();
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models[0]["state"], "hot", "{models}");
    assert!(
        models[0]["resident_bytes"].as_u64().unwrap() > 0,
        "{models}"
    );
    let workers = || gateway.workers().len();
    assert_eq!(workers(), 0, "parked standbys are not registered");
    let mut promoted = Vec::new();
    for p in ["prefill", "decode"] {
        let (st, v) = post(&format!("{agent_url}/standbys/{p}/promote"), &json!({}));
        assert_eq!(st, 200, "{v}");
        assert!(v["promote_ms"].as_f64().unwrap() < 1000.0, "{v}");
        promoted.push(v["url"].as_str().unwrap().to_owned());
    }
    assert_eq!(workers(), 2, "promoted standbys serve at once");
    let (st, v) = post(
        &format!("{gw}/v1/completions"),
        &json!({"prompt": "hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    let dm = get(&format!("{}/metrics", promoted[1])).unwrap().1;
    assert!(
        metric(
            &dm,
            "preheat:startup_phase_seconds",
            "phase=\"registered\",source=\"standby\""
        )
        .is_some_and(|s| s < 1.0),
        "{dm}"
    );
    // Replacements park again.
    wait_for("replacements parked", secs(120), || {
        parked("prefill") && parked("decode")
    });
    assert_eq!(workers(), 2);
    // The list gateways and the scaler read: the promoted standbys' ports.
    let listed = || -> Value {
        serde_json::from_str(&get(&format!("{agent_url}/standbys")).unwrap().1).unwrap()
    };
    let port_of = |u: &str| u.rsplit(':').next().unwrap().parse::<u64>().unwrap();
    // (The parked gauge above may still show the promoted ones: the list is current.)
    wait_for("the list to show the replacement parked", secs(120), || {
        listed()["decode"]["parked"] == 1
    });
    let l = listed();
    assert_eq!(
        l["decode"]["serving"],
        json!([port_of(&promoted[1])]),
        "{l}"
    );
    // Bounded by the config: no more serve at once than `count` (each promotion
    // starts a replacement, so unbounded promotions would start processes forever).
    let (st, v) = post(&format!("{agent_url}/standbys/decode/promote"), &json!({}));
    assert_eq!(st, 409, "{v}");
    // Retired: off the list at once, then drained (it deregisters).
    let (st, v) = post(&format!("{agent_url}/standbys/decode/retire"), &json!({}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(listed()["decode"]["serving"], json!([]));
    assert_eq!(workers(), 2, "still serving through the unlist delay");
    wait_for("the retired standby drained", secs(60), || workers() == 1);
    assert_eq!(
        post(&format!("{agent_url}/standbys/decode/retire"), &json!({})).0,
        409,
        "nothing left to retire"
    );
    // The staged snapshot is served to peers (with the token) with Range support.
    let r = reqwest::blocking::Client::new()
        .get(format!("{agent_url}/snapshots/llama-tiny.preheat"))
        .header("authorization", harness::bearer())
        .header("range", "bytes=0-7")
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 206);
    assert_eq!(&r.bytes().unwrap()[..], b"PREHEAT\0");
    assert_eq!(
        post(&format!("{agent_url}/standbys/nope/promote"), &json!({})).0,
        404
    );
    // Even killed outright, the agent takes its standbys with it (parent-death
    // signal): promoted ones deregister, parked ones exit.
    let mut agent = agent;
    agent.0.kill().unwrap();
    agent.0.wait().unwrap();
    wait_for("standbys stopped with the agent", secs(30), || {
        workers() == 0
    });
    let mine = format!("{}.*--standby", tmp.path().display());
    wait_for("no standby outlives the agent", secs(30), || {
        std::process::Command::new("pgrep")
            .args(["-f", &mine])
            .output()
            .is_ok_and(|o| o.stdout.is_empty())
    });
}
