//! `preheat up` end to end, as KEDA would see it: both pools inactive when idle, a
//! `StreamIsActive` push within 1 s of the first request at zero, that request
//! answered, a burst scaling decode up, idleness bringing both pools back to zero, and
//! no request failing.

mod harness;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use harness::preheat;
use preheat_scaler::proto::ScaledObjectRef;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_testkit::{free_port, testdata};
use serde_json::{Value, json};
use tokio_stream::StreamExt;

fn sref(pool: &str) -> ScaledObjectRef {
    ScaledObjectRef {
        name: format!("default-{pool}"),
        namespace: "local".into(),
        scaler_metadata: HashMap::from([("pool".to_owned(), pool.to_owned())]),
    }
}

struct Up(std::process::Child);

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-INT", &self.0.id().to_string()])
            .status();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Registered (prefill, decode) workers.
async fn workers(c: &reqwest::Client, gwi: &str, token: &std::path::Path) -> (usize, usize) {
    let token = std::fs::read_to_string(token).unwrap();
    let v: Value = c
        .get(format!("{gwi}/internal/workers"))
        .bearer_auth(token.trim())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let w = v["workers"].as_array().unwrap();
    let n = |role: &str| w.iter().filter(|x| x["role"] == role).count();
    (n("prefill"), n("decode"))
}

fn long_request(
    c: &reqwest::Client,
    gw: &str,
    i: usize,
) -> tokio::task::JoinHandle<reqwest::StatusCode> {
    let (c, gw) = (c.clone(), gw.to_owned());
    tokio::spawn(async move {
        c.post(format!("{gw}/v1/completions"))
            .json(&json!({"prompt": format!("burst {i}"), "max_tokens": 400, "ignore_eos": true}))
            .send()
            .await
            .unwrap()
            .status()
    })
}

#[test]
fn up_scales_from_zero_under_load_and_back_to_zero() {
    let (gport, giport, sport) = (free_port(), free_port(), free_port());
    let cache = tempfile::tempdir().unwrap();
    let _up = Up(Command::new(env!("CARGO_BIN_EXE_preheat"))
        .args([
            "up",
            "--port",
            &gport.to_string(),
            "--gateway-internal",
            &format!("127.0.0.1:{giport}"),
            "--scaler-listen",
            &format!("127.0.0.1:{sport}"),
        ])
        .args([
            "--idle-grace",
            "3s",
            // Below any ITL this CPU can reach at batch 1, so the profile `up` measures
            // at start (noisy) always allows one sequence per replica and two running
            // sequences need two replicas. At 0.5 ms a fast profile run allowed 6+ per
            // replica, and the short tiny-model generations rarely had that many running
            // at a scrape ("the burst did not scale decode up", 2 runs in 15 here).
            "--slo-itl",
            "0.0001",
            "--decode-max",
            "2",
            "--prefill-max",
            "1",
        ])
        .arg("--cache-dir")
        .arg(cache.path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    let gw = format!("http://127.0.0.1:{gport}");
    // Registration is internal, behind the token `up` writes for this run.
    let gwi = format!("http://127.0.0.1:{giport}");
    let token_file = cache.path().join("cluster-token");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let t0 = Instant::now();
        let mut keda = loop {
            if let Ok(c) = ExternalScalerClient::connect(format!("http://127.0.0.1:{sport}")).await
            {
                break c;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "scaler never listened"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Idle: both pools inactive once the grace has passed.
        let mut decode = keda
            .stream_is_active(sref("decode"))
            .await
            .unwrap()
            .into_inner();
        let t0 = Instant::now();
        loop {
            let active = decode.next().await.unwrap().unwrap().result;
            let prefill = keda
                .is_active(sref("prefill"))
                .await
                .unwrap()
                .into_inner()
                .result;
            if !active && !prefill {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "pools never went inactive"
            );
        }
        let c = reqwest::Client::new();
        assert_eq!(workers(&c, &gwi, &token_file).await, (0, 0));
        // First request at zero: pushed active within 1 s, and answered.
        let sent = Instant::now();
        let first = tokio::spawn({
            let (c, gw) = (c.clone(), gw.clone());
            async move {
                c.post(format!("{gw}/v1/completions"))
                    .json(&json!({"prompt": "hello", "max_tokens": 8}))
                    .send()
                    .await
                    .unwrap()
            }
        });
        let pushed = tokio::time::timeout(Duration::from_secs(1), decode.next()).await;
        let pushed = pushed
            .expect("no StreamIsActive push within 1 s")
            .unwrap()
            .unwrap();
        assert!(pushed.result, "the push says active");
        assert!(sent.elapsed() <= Duration::from_secs(1));
        let r = first.await.unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
        // A burst: concurrent long generations need more decode replicas at this ITL
        // target.
        let mut burst: Vec<_> = (0..6).map(|i| long_request(&c, &gw, i)).collect();
        let t0 = Instant::now();
        let mut most_decode = 0;
        while most_decode < 2 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the burst did not scale decode up"
            );
            most_decode = most_decode.max(workers(&c, &gwi, &token_file).await.1);
            // Keep the load on until the pool grows.
            if burst.iter().filter(|b| !b.is_finished()).count() < 6 {
                let n = burst.len();
                burst.extend((n..n + 4).map(|i| long_request(&c, &gw, i)));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for b in burst {
            assert_eq!(b.await.unwrap(), 200, "a request failed");
        }
        // Idle again: back to zero.
        let t0 = Instant::now();
        while workers(&c, &gwi, &token_file).await != (0, 0) {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "pools never returned to zero"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The load generator against it: a time-compressed production trace, from zero,
        // with the replicas of each pool in its report and plot.
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("up.svg");
        let trace = testdata().join("traces/azure_code_2023.csv");
        let gw2 = gw.clone();
        let svg2 = svg.clone();
        let out = tokio::task::spawn_blocking(move || {
            preheat([
                "bench".as_ref(),
                "serve".as_ref(),
                "--url".as_ref(),
                gw2.as_ref(),
                "--trace".as_ref(),
                trace.as_os_str(),
                "--speedup".as_ref(),
                "100".as_ref(),
                "--max-requests".as_ref(),
                "60".as_ref(),
                "--token-scale".as_ref(),
                "0.01".as_ref(),
                "--max-output-tokens".as_ref(),
                "16".as_ref(),
                "--json".as_ref(),
                "--plot".as_ref(),
                svg2.as_os_str(),
            ] as [&std::ffi::OsStr; 17])
        })
        .await
        .unwrap();
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["failed"], 0, "{r}");
        let reps = r["replicas"].as_array().unwrap();
        assert!(
            reps.iter().any(|x| x[2].as_u64().unwrap() > 0),
            "decode came up: {reps:?}"
        );
        let plot = std::fs::read_to_string(&svg).unwrap();
        assert!(plot.contains(">decode</text>") && plot.contains("TTFT p90"));
    });
}

/// `preheat up ARGS` on loopback ports with `cache` as its cache; its stderr goes to
/// `stderr`.
fn up(cache: &std::path::Path, args: &[&str], stderr: Stdio) -> (Up, String) {
    let (gport, sport) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_preheat"))
        .args([
            "up",
            "--port",
            &gport.to_string(),
            "--scaler-listen",
            &format!("127.0.0.1:{sport}"),
            "--idle-grace",
            "60s",
        ])
        .args(args)
        .arg("--cache-dir")
        .arg(cache)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    (Up(child), format!("http://127.0.0.1:{gport}"))
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// One completion through `gw` (waiting for the gateway to listen), its status and body.
async fn one_completion(gw: &str) -> (u16, Value) {
    let c = reqwest::Client::new();
    let t0 = Instant::now();
    loop {
        let r = c
            .post(format!("{gw}/v1/completions"))
            .json(&json!({"prompt": "hello", "max_tokens": 4}))
            .timeout(Duration::from_secs(120))
            .send()
            .await;
        match r {
            Ok(r) => {
                let status = r.status().as_u16();
                return (status, r.json().await.unwrap_or(Value::Null));
            }
            Err(e) if e.is_connect() && t0.elapsed() < Duration::from_secs(120) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn regression_up_served_a_stale_staged_model_after_switching_models() {
    // The bug: both runs staged their model as `node/default.preheat`, so the second
    // run's workers served the first run's model, the gateway refused them (another
    // KV compatibility hash) and every request failed.
    let cache = tempfile::tempdir().unwrap();
    {
        let (_up, gw) = up(cache.path(), &[], Stdio::null());
        let (status, body) = rt().block_on(one_completion(&gw));
        assert_eq!(status, 200, "embedded model: {body}");
    }
    let fixture = preheat_testkit::model_fixture("llama-tiny");
    let (_up, gw) = up(
        cache.path(),
        &["--model", fixture.to_str().unwrap()],
        Stdio::null(),
    );
    let (status, body) = rt().block_on(one_completion(&gw));
    assert_eq!(status, 200, "after switching --model: {body}");
}

#[test]
fn up_stops_with_the_workers_own_error_when_they_cannot_start() {
    // Workers that die at start are restarted with growing pauses, and after a few
    // quick deaths `up` stops, saying why in the workers' own words; the request it
    // held fails at once with that reason instead of after the hold time.
    let cache = tempfile::tempdir().unwrap();
    let log = cache.path().join("up.stderr");
    let (mut up, gw) = up(
        cache.path(),
        &["--kv-cache-mib", "0"],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let t0 = Instant::now();
    let (status, body) = rt().block_on(one_completion(&gw));
    assert_eq!(status, 503, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("--kv-cache-mib must be > 0"), "{body}");
    assert!(
        t0.elapsed() < Duration::from_secs(100),
        "failed only after {:?}",
        t0.elapsed()
    );
    let status = loop {
        if let Some(s) = up.0.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "up kept running");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success());
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(
        err.contains("cannot start") && err.contains("--kv-cache-mib must be > 0"),
        "{err}"
    );
    let logs = std::fs::read_dir(cache.path().join("logs"))
        .unwrap()
        .count();
    assert!(
        logs <= 12,
        "{logs} worker logs: workers were respawned without pause"
    );
}
