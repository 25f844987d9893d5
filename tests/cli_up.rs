//! `preheat up` end to end, as KEDA would see it: both pools inactive when idle, a
//! `StreamIsActive` push within 1 s of the first request at zero, that request
//! answered, a burst scaling decode up, idleness bringing both pools back to zero, and
//! no request failing.
//!
//! Why one file over 600 lines: every test drives the same `preheat up` stack through its
//! own scenario (KEDA's view, the operators' view with a real Prometheus, restarts), and
//! they share its helpers here.

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
    let ports = Ports::free();
    let (gport, giport, sport) = (ports.gateway, ports.gateway_internal, ports.scaler);
    let cache = tempfile::tempdir().unwrap();
    let _up = spawn_up(
        cache.path(),
        &ports,
        &[
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
        ],
        Stdio::null(),
    );
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
        let mut keda = keda_client(sport).await;
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
    // The scaler keeps what it learnt in the cache dir, for the next `up`.
    let state = preheat_scaler::state::load(&cache.path().join("scaler-state.json"))
        .unwrap()
        .expect("a state file after the first tick");
    let pools: Vec<&str> = state.pools.iter().map(|p| p.pool.as_str()).collect();
    assert_eq!(pools, ["prefill", "decode"]);
}

/// `preheat up ARGS` on loopback ports with `cache` as its cache; its stderr goes to
/// `stderr`.
fn up(cache: &std::path::Path, args: &[&str], stderr: Stdio) -> (Up, String) {
    let ports = Ports::free();
    let args: Vec<&str> = ["--idle-grace", "60s"]
        .iter()
        .chain(args)
        .copied()
        .collect();
    let up = spawn_up(cache, &ports, &args, stderr);
    (up, format!("http://127.0.0.1:{}", ports.gateway))
}

/// The loopback ports of one `preheat up`.
struct Ports {
    gateway: u16,
    gateway_internal: u16,
    scaler: u16,
    scaler_http: u16,
    agent: u16,
}

impl Ports {
    fn free() -> Self {
        Ports {
            gateway: free_port(),
            gateway_internal: free_port(),
            scaler: free_port(),
            scaler_http: free_port(),
            agent: free_port(),
        }
    }
}

/// `preheat up ARGS` on `ports` with `cache` as its cache; its stderr goes to `stderr`.
fn spawn_up(cache: &std::path::Path, ports: &Ports, args: &[&str], stderr: Stdio) -> Up {
    let at = |p: u16| format!("127.0.0.1:{p}");
    let child = Command::new(env!("CARGO_BIN_EXE_preheat"))
        .args(["up", "--port", &ports.gateway.to_string()])
        .args(["--gateway-internal", &at(ports.gateway_internal)])
        .args(["--scaler-listen", &at(ports.scaler)])
        .args(["--scaler-http", &at(ports.scaler_http)])
        .args(["--agent-listen", &at(ports.agent)])
        .args(args)
        .arg("--cache-dir")
        .arg(cache)
        .env("RUST_LOG", "warn")
        .stdout(std::fs::File::create(cache.join("up.stdout")).unwrap())
        .stderr(stderr)
        .spawn()
        .unwrap();
    Up(child)
}

/// KEDA's client of the scaler `up` runs on `port`, once it listens.
async fn keda_client(port: u16) -> ExternalScalerClient<tonic::transport::Channel> {
    let t0 = Instant::now();
    loop {
        if let Ok(c) = ExternalScalerClient::connect(format!("http://127.0.0.1:{port}")).await {
            return c;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "scaler never listened"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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

/// Every PromQL expression of the dashboard's panels, by panel title.
fn dashboard_queries(dash: &Value) -> Vec<(String, String)> {
    dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |t| (title.clone(), t["expr"].as_str().unwrap().to_owned()))
        })
        .collect()
}

/// The dashboard's variables as Grafana fills them for the namespace `llm`, the model
/// `up` serves and every pool (a scrape interval of 1 s).
fn with_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "10s")
        .replace("$namespace", "llm")
        .replace("$model", "default")
        .replace("$pool", "prefill|decode")
}

/// Metric names (`vllm:…`, `preheat:…`) an expression reads, histogram suffixes off
/// where the base is a known histogram.
fn metric_names(expr: &str, known: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for prefix in ["vllm:", "preheat:"] {
        let mut rest = expr;
        while let Some(i) = rest.find(prefix) {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len());
            let mut name = &tail[..end];
            for suffix in ["_bucket", "_count", "_sum"] {
                if let Some(base) = name.strip_suffix(suffix)
                    && known.contains(&base)
                {
                    name = base;
                }
            }
            out.push(name.to_owned());
            rest = &tail[end..];
        }
    }
    out
}

/// An instant query's result series, or Prometheus' refusal.
async fn instant(c: &reqwest::Client, prom: &str, q: &str) -> Result<Vec<Value>, String> {
    let r = c
        .get(format!("{prom}/api/v1/query"))
        .query(&[("query", q)])
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let v: Value = r.json().await.map_err(|e| e.to_string())?;
    if v["status"] != "success" {
        return Err(format!("{}: {}", v["errorType"], v["error"]));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

#[test]
fn the_charts_dashboard_and_alerts_answer_from_a_real_prometheus_scraping_up_and_status_reports_it()
{
    // The chart as Helm renders it with the dashboard and alerts on; Prometheus
    // scrapes `up`'s gateway, workers, scaler and agent with the labels the chart's
    // ServiceMonitor gives (namespace, node); every panel query and every alert's
    // selectors are run while load is applied. Then `preheat status` reads the same
    // stack.
    let Some(prom_bin) = preheat_testkit::prometheus() else {
        return;
    };
    if !harness::helm_present() {
        return;
    }
    let objs = harness::helm_render(&json!({
        "dashboard": {"enabled": true},
        "prometheusRule": {"enabled": true},
    }));
    let dash: Value = objs
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "rel-preheat-dashboard")
        .map(|cm| serde_json::from_str(cm["data"]["preheat.json"].as_str().unwrap()).unwrap())
        .expect("the chart renders the dashboard ConfigMap");
    let rules: Vec<(String, String)> = objs
        .iter()
        .filter(|o| o["kind"] == "PrometheusRule")
        .flat_map(|o| o["spec"]["groups"].as_array().unwrap().clone())
        .flat_map(|g| g["rules"].as_array().unwrap().clone())
        .map(|r| {
            (
                r["alert"].as_str().unwrap().to_owned(),
                r["expr"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert!(!rules.is_empty(), "no alerts rendered");
    let queries = dashboard_queries(&dash);
    assert!(queries.len() >= 30, "{} queries", queries.len());
    // Names from the metric-name modules: every one a query reads is exported.
    let known: Vec<&str> = preheat_engine::metrics::names::ALL
        .iter()
        .chain(preheat_warmpool::metrics::names::ALL)
        .chain(preheat_scaler::signals::names::own::ALL)
        .copied()
        .collect();
    for (what, expr) in queries.iter().chain(&rules) {
        for name in metric_names(expr, &known) {
            assert!(
                known.contains(&name.as_str()),
                "{what}: {name} is not a metric preheat exports ({expr})"
            );
        }
    }

    let ports = Ports::free();
    let (gport, giport, hport, aport) = (
        ports.gateway,
        ports.gateway_internal,
        ports.scaler_http,
        ports.agent,
    );
    let cache = tempfile::tempdir().unwrap();
    let log = cache.path().join("up.stderr");
    let mut up = spawn_up(
        cache.path(),
        &ports,
        &[
            "--idle-grace",
            "120s",
            "--prefill-max",
            "1",
            "--decode-max",
            "1",
        ],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let gw = format!("http://127.0.0.1:{gport}");
    let token_file = cache.path().join("cluster-token");
    let dir = tempfile::tempdir().unwrap();
    let workers_sd = dir.path().join("workers.json");
    std::fs::write(&workers_sd, "[]").unwrap();
    let config = format!(
        "- job_name: preheat\n\
         \x20 static_configs:\n\
         \x20 - targets: ['127.0.0.1:{gport}']\n\
         \x20   labels: {{namespace: llm, component: gateway}}\n\
         \x20 - targets: ['127.0.0.1:{hport}']\n\
         \x20   labels: {{namespace: llm, component: scaler}}\n\
         \x20 - targets: ['127.0.0.1:{aport}']\n\
         \x20   labels: {{namespace: llm, component: warmpool, node: local}}\n\
         \x20 file_sd_configs:\n\
         \x20 - files: ['{}']\n\
         \x20   refresh_interval: 1s\n",
        workers_sd.display()
    );
    let (_prom, prom) = preheat_testkit::start_prometheus(&prom_bin, dir.path(), &config);
    rt().block_on(async {
        // `up` may stop (a port taken meanwhile): then say why instead of timing out.
        let t0 = Instant::now();
        while reqwest::get(format!("{gw}/health")).await.is_err() {
            if let Ok(Some(exit)) = up.0.try_wait() {
                panic!("up exited ({exit}): {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "the gateway never answered");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The first request wakes both pools through their parked standbys (the
        // "promoted" panel needs one): wait until `up` says they are parked.
        let out = cache.path().join("up.stdout");
        while !["prefill", "decode"].iter().all(|p| {
            std::fs::read_to_string(&out).unwrap_or_default().contains(&format!("{p}: standby parked"))
        }) {
            assert!(t0.elapsed() < Duration::from_secs(120), "standbys never parked: {}", std::fs::read_to_string(&out).unwrap_or_default());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (status, body) = one_completion(&gw).await;
        assert_eq!(status, 200, "{body}");
        let c = reqwest::Client::new();
        // Load: three clients with a shared prompt prefix (prefix-cache hits).
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let load: Vec<_> = (0..3)
            .map(|i| {
                let (c, gw, stop) = (c.clone(), gw.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let prompt = format!("The operators' view of the fleet, client {i}, request {n}");
                        let _ = c
                            .post(format!("{gw}/v1/completions"))
                            .json(&json!({"prompt": prompt, "max_tokens": 24}))
                            .timeout(Duration::from_secs(60))
                            .send()
                            .await;
                        n += 1;
                    }
                })
            })
            .collect();
        let gwi = format!("http://127.0.0.1:{giport}");
        let token = std::fs::read_to_string(&token_file).unwrap();
        // `up` does not keep the agent's standbys (its own driver parks them), so the
        // agent exports no parked-standby series here; the panel's other query (promoted
        // standbys serving) must still answer.
        let exempt = ["preheat:warmpool_parked_standbys"];
        let mut answered = std::collections::BTreeSet::new();
        let t0 = Instant::now();
        loop {
            // Workers come and go: Prometheus finds them through a discovery file of
            // the gateway's workers (in the chart: the pools' pods through the
            // ServiceMonitor, and promoted standbys, which `up` runs too, through the
            // standbys' PodMonitor — tests/chart/validate.py checks both are rendered
            // with the labels used here).
            if let Ok(r) = c.get(format!("{gwi}/internal/workers")).bearer_auth(token.trim()).send().await
                && let Ok(v) = r.json::<Value>().await
            {
                let groups: Vec<Value> = v["workers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|w| {
                        let url = w["url"].as_str().unwrap_or_default();
                        json!({"targets": [url.trim_start_matches("http://")],
                               "labels": {"namespace": "llm", "component": w["role"]}})
                    })
                    .collect();
                let tmp = dir.path().join("workers.json.tmp");
                std::fs::write(&tmp, serde_json::to_vec(&groups).unwrap()).unwrap();
                std::fs::rename(&tmp, &workers_sd).unwrap();
            }
            for (title, expr) in &queries {
                let q = with_variables(expr);
                match instant(&c, &prom, &q).await {
                    Ok(r) if !r.is_empty() => {
                        answered.insert(q);
                    }
                    Ok(_) => {}
                    // Not up yet.
                    Err(e) if e.contains("error sending request") => {}
                    Err(e) => panic!("panel {title:?}: Prometheus refused {q}: {e}"),
                }
            }
            let missing: Vec<&(String, String)> = queries
                .iter()
                .filter(|(_, e)| !answered.contains(&with_variables(e)) && !exempt.iter().any(|x| e.contains(x)))
                .collect();
            if missing.is_empty() && t0.elapsed() > Duration::from_secs(20) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(180),
                "under load, these panel queries never returned data:\n{}",
                missing.iter().map(|(t, e)| format!("  {t}: {}", with_variables(e))).collect::<Vec<_>>().join("\n")
            );
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        // Every panel answers (the exempt query's panel through its other query).
        for p in dash["panels"].as_array().unwrap().iter().filter(|p| p["type"] != "row") {
            let any = p["targets"].as_array().unwrap().iter().any(|t| answered.contains(&with_variables(t["expr"].as_str().unwrap())));
            assert!(any, "panel {:?} returned no data", p["title"]);
        }
        // Alerts: Prometheus accepts each expression, and every series it compares
        // exists (an alert on a series nobody exports would never fire).
        for (alert, expr) in &rules {
            instant(&c, &prom, expr)
                .await
                .unwrap_or_else(|e| panic!("alert {alert}: Prometheus refused {expr}: {e}"));
            for name in metric_names(expr, &known) {
                let sel = format!("{name}{{namespace=\"llm\"}}");
                let r = instant(&c, &prom, &sel).await.unwrap();
                assert!(!r.is_empty(), "alert {alert} reads {sel}, which has no series");
            }
        }

        // `preheat status` reads the same stack: the scaler's decisions with their
        // reasons and SLO figures, and the agent's staged and hot model.
        let status = |args: &[&str]| {
            Command::new(env!("CARGO_BIN_EXE_preheat"))
                .arg("status")
                .args(["--scaler", &format!("http://127.0.0.1:{hport}")])
                .args(["--agent", &format!("http://127.0.0.1:{aport}")])
                .args(args)
                .output()
                .unwrap()
        };
        let token_arg = token_file.to_str().unwrap();
        let token_arg_owned = token_arg.to_owned();
        let out = status(&["--cluster-token-file", token_arg, "--json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["errors"], json!([]), "{v}");
        let pools = v["scaler"]["models"][0]["pools"].as_array().unwrap();
        assert_eq!(v["scaler"]["models"][0]["model"], "default");
        for (p, want) in pools.iter().zip(["prefill", "decode"]) {
            assert_eq!(p["pool"], want);
            assert_eq!(p["desired"], 1, "{want} under load: {p}");
            assert_eq!(p["current"], 1, "{p}");
            assert!(!p["reason"].as_str().unwrap().is_empty(), "{p}");
            assert_eq!(p["blind"], false);
            assert!(p["load"]["lead_s"].as_f64().unwrap() > 0.0, "{p}");
        }
        assert_eq!(pools[0]["slo"]["ttft_target_s"], 2.0);
        assert_eq!(pools[1]["slo"]["itl_target_s"], 0.05);
        assert!(pools[1]["slo"]["itl_attainment"].is_f64(), "{}", pools[1]);
        let agent = &v["agents"][0];
        assert_eq!(agent["models"][0]["state"], "hot", "{agent}");
        let out = status(&["--cluster-token-file", token_arg]);
        let text = String::from_utf8_lossy(&out.stdout);
        for want in ["default", "prefill", "decode", "hot", "LAST DECISION"] {
            assert!(text.contains(want), "{want:?} not in\n{text}");
        }
        // Without the token both refuse, and status says what it needs.
        let out = status(&[]);
        assert!(!out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("401") && text.contains("--cluster-token-file"), "{text}");
        // --watch: snapshot after snapshot into a pipe; redrawn in place on a terminal
        // (a pseudo-terminal from util-linux's `script`).
        let watch = |pty: bool| {
            // Ctrl-C after 2 s (SIGKILL 5 s later, should it be lost).
            let cmd = format!(
                "timeout --preserve-status -k 5 -s INT 2 {} status --scaler http://127.0.0.1:{hport} --agent http://127.0.0.1:{aport} --cluster-token-file {token_arg} --watch --interval 300ms",
                env!("CARGO_BIN_EXE_preheat")
            );
            let out = if pty {
                Command::new("script").args(["-qfec", &cmd, "/dev/null"]).output()
            } else {
                let argv: Vec<&str> = cmd.split(' ').collect();
                Command::new(argv[0]).args(&argv[1..]).output()
            }
            .unwrap();
            // Ctrl-C ends a watch cleanly.
            assert!(out.status.success(), "{:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let piped = watch(false);
        assert!(piped.matches("LAST DECISION").count() >= 3, "{piped}");
        assert!(!piped.contains("\x1b["), "escape codes into a pipe");
        let tty = watch(true);
        assert!(tty.matches("\x1b[H\x1b[2J").count() >= 3, "not redrawn in place: {tty:?}");

        // `--kube`: the release's scaler and agent pods, and the token from its
        // Secret, read through kube-rs from a Kubernetes API (a small one here that
        // answers those two reads as the API server does, pods at this machine's
        // address).
        let (api_url, selectors) = kube_api(hport, aport, token.trim()).await;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \"{api_url}\"}}}}]\nusers: [{{name: u, user: {{}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: u, namespace: default}}}}]\ncurrent-context: c\n"
            ),
        )
        .unwrap();
        let out = tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_preheat"))
                .args(["status", "--kube", "--namespace", "llm", "--release", "rel", "--json"])
                .env("KUBECONFIG", &kubeconfig)
                .env_remove("PREHEAT_CLUSTER_TOKEN_FILE")
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["errors"], json!([]), "{v}");
        assert_eq!(v["scaler"]["url"], format!("http://127.0.0.1:{hport}"));
        assert_eq!(v["scaler"]["models"][0]["pools"].as_array().unwrap().len(), 2);
        assert_eq!(v["agents"][0]["node"], "node-1");
        assert_eq!(v["agents"].as_array().unwrap().len(), 1, "{v}");
        // A release with no scaler pod is an error naming what was looked for.
        let kc = dir.path().join("kubeconfig");
        let out = tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_preheat"))
                .args(["status", "--kube", "--namespace", "llm", "--release", "other"])
                .args(["--cluster-token-file", token_arg_owned.as_str()])
                .env("KUBECONFIG", &kc)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        assert!(!out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("no Ready scaler pod of release \"other\""), "{text}");
        assert_eq!(v["agents"][0]["models"][0]["state"], "hot");
        let asked = selectors.lock().unwrap().clone();
        for component in ["scaler", "warmpool"] {
            assert!(
                asked.iter().any(|s| s.contains("app.kubernetes.io/instance=rel") && s.contains(&format!("app.kubernetes.io/component={component}"))),
                "{asked:?}"
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for l in load {
            let _ = l.await;
        }
    });
}

/// A Kubernetes API answering `preheat status --kube`'s reads in namespace `llm`: the
/// release `rel`'s scaler and agent pods (at 127.0.0.1, their `http` ports) by label
/// selector, and its cluster token Secret. Returns its URL and the selectors asked.
async fn kube_api(
    scaler_port: u16,
    agent_port: u16,
    token: &str,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::extract::{Query, State};
    use axum::routing::get;
    let pod = |name: &str, component: &str, port: u16, node: &str, ready: &str| {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": "llm", "labels": {
                   "app.kubernetes.io/name": "preheat", "app.kubernetes.io/instance": "rel",
                   "app.kubernetes.io/component": component}},
               "spec": {"nodeName": node, "containers": [{"name": component, "image": "preheat",
                   "ports": [{"name": "http", "containerPort": port}]}]},
               "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": ready}]}})
    };
    let pods = vec![
        pod(
            "rel-preheat-scaler-0",
            "scaler",
            scaler_port,
            "node-2",
            "True",
        ),
        pod(
            "rel-preheat-warmpool-a",
            "warmpool",
            agent_port,
            "node-1",
            "True",
        ),
        // Not Ready (still staging, or going away): not asked.
        pod("rel-preheat-warmpool-b", "warmpool", 1, "node-3", "False"),
    ];
    let b64 = Command::new("sh")
        .args(["-c", &format!("printf %s '{token}' | base64 -w0")])
        .output()
        .unwrap()
        .stdout;
    let secret = json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "rel-preheat-cluster-token", "namespace": "llm"},
        "data": {"token": String::from_utf8(b64).unwrap()}});
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    type St = (Vec<Value>, std::sync::Arc<std::sync::Mutex<Vec<String>>>);
    let app = axum::Router::new()
        .route(
            "/api/v1/namespaces/llm/pods",
            get(|State((pods, asked)): State<St>, Query(q): Query<HashMap<String, String>>| async move {
                let sel = q.get("labelSelector").cloned().unwrap_or_default();
                asked.lock().unwrap().push(sel.clone());
                let items: Vec<Value> = pods
                    .into_iter()
                    .filter(|p| {
                        sel.split(',').filter(|kv| !kv.is_empty()).all(|kv| {
                            let (k, v) = kv.split_once('=').unwrap();
                            p["metadata"]["labels"][k] == v
                        })
                    })
                    .collect();
                axum::Json(json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": items}))
            }),
        )
        .route(
            "/api/v1/namespaces/llm/secrets/rel-preheat-cluster-token",
            get(move || async move { axum::Json(secret) }),
        )
        .with_state((pods, std::sync::Arc::clone(&asked)));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (url, asked)
}

/// A scheduled floor given to `up` with `--set` holds the prefill pool up with no
/// traffic at all, as the same key does in the chart's scaler config; keys `up` wires
/// itself, and keys no policy has, are refused by name before anything is staged.
#[test]
fn up_set_takes_a_scheduled_floor_and_refuses_what_up_wires_itself() {
    let cache = tempfile::tempdir().unwrap();
    let out = preheat([
        "up",
        "--cache-dir",
        cache.path().to_str().unwrap(),
        "--set",
        "grpc_listen=0.0.0.0:1",
        "--set",
        "models.0.prefill.bogus=1",
        "--set",
        "models.0.decode.endpoints=[http://x/metrics]",
        "--set",
        "models.0.prefill.max_replicas=8",
        "--set",
        "models.0.decode.headroom",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for want in [
        "--set grpc_listen",
        "--set models.0.prefill.bogus",
        "--set models.0.decode.endpoints",
        // The driver holds the pool within the flag's limit whatever the scaler asks.
        "--set models.0.prefill.max_replicas: give it as `up --prefill-max`",
        "--set \"models.0.decode.headroom\": expected path=value",
    ] {
        assert!(err.contains(want), "{want} missing from: {err}");
    }
    // A value that parses but is wrong is refused before anything is staged too.
    let out = preheat([
        "up",
        "--cache-dir",
        cache.path().to_str().unwrap(),
        "--set",
        "models.0.prefill.headroom=-1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("headroom must be > 0"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(cache.path()).unwrap().count(),
        0,
        "refused before anything was staged"
    );

    let ports = Ports::free();
    let cache = tempfile::tempdir().unwrap();
    let _up = spawn_up(
        cache.path(),
        &ports,
        &[
            "--idle-grace",
            "3s",
            "--set",
            "models.0.prefill.schedule=[{cron: '* * * * *', duration_s: 3600, min_replicas: 1}]",
        ],
        Stdio::null(),
    );
    let gwi = format!("http://127.0.0.1:{}", ports.gateway_internal);
    let token_file = cache.path().join("cluster-token");
    rt().block_on(async {
        let t0 = Instant::now();
        let keda = keda_client(ports.scaler).await;
        let c = reqwest::Client::new();
        loop {
            let active = |pool: &'static str| {
                let mut keda = keda.clone();
                async move {
                    keda.is_active(sref(pool))
                        .await
                        .map(|r| r.into_inner().result)
                }
            };
            let (prefill, decode) = (active("prefill").await, active("decode").await);
            if prefill.as_ref().is_ok_and(|a| *a)
                && decode.as_ref().is_ok_and(|a| !*a)
                && token_file.exists()
                && workers(&c, &gwi, &token_file).await == (1, 0)
            {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "the floor never brought prefill up with no traffic: prefill active \
                 {prefill:?}, decode active {decode:?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        // Held, not a passing decision: still one prefill worker past the idle grace.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(workers(&c, &gwi, &token_file).await, (1, 0));
    });
}
