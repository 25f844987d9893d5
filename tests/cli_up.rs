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
use std::process::Command;
use std::time::{Duration, Instant};

use harness::{Log, Up, preheat};
use preheat_scaler::proto::ScaledObjectRef;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_testkit::{Wait, testdata, wait_for, wait_for_async};
use serde_json::{Value, json};
use tokio_stream::StreamExt;

fn sref(pool: &str) -> ScaledObjectRef {
    ScaledObjectRef {
        name: format!("default-{pool}"),
        namespace: "local".into(),
        scaler_metadata: HashMap::from([("pool".to_owned(), pool.to_owned())]),
    }
}

/// Registered (prefill, decode) workers of `up`, once its gateway answers.
fn workers(up: &Up) -> (usize, usize) {
    up.workers().expect("the gateway's worker list")
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
    let cache = tempfile::tempdir().unwrap();
    let up = harness::up(cache.path())
        .args(&[
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
        .start();
    // Registration is internal, behind the token `up` writes for this run.
    let gw = up.url.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut keda = keda_client(up.ports.scaler).await;
        // Idle: both pools inactive once the grace has passed.
        let mut decode = keda
            .stream_is_active(sref("decode"))
            .await
            .unwrap()
            .into_inner();
        // (Each look waits for the scaler's next push: no pause between looks.)
        Wait::new("both pools inactive", Duration::from_secs(20))
            .every(Duration::ZERO)
            .until_async(async || {
                let decode = decode.next().await.unwrap().unwrap().result;
                let prefill = keda
                    .is_active(sref("prefill"))
                    .await
                    .unwrap()
                    .into_inner()
                    .result;
                if decode || prefill {
                    Err(format!("decode active {decode}, prefill active {prefill}"))
                } else {
                    Ok(())
                }
            })
            .await;
        let c = reqwest::Client::new();
        assert_eq!(workers(&up), (0, 0));
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
        // Looked at every 100 ms, the pace the load is topped up at.
        let grown = Wait::new(
            "the burst to scale decode to two replicas",
            Duration::from_secs(60),
        )
        .every(Duration::from_millis(100));
        grown
            .until_async(async || {
                let decode = workers(&up).1;
                // Keep the load on until the pool grows.
                if burst.iter().filter(|b| !b.is_finished()).count() < 6 {
                    let n = burst.len();
                    burst.extend((n..n + 4).map(|i| long_request(&c, &gw, i)));
                }
                if decode >= 2 {
                    Ok(())
                } else {
                    Err(format!("{decode} decode workers"))
                }
            })
            .await;
        for b in burst {
            assert_eq!(b.await.unwrap(), 200, "a request failed");
        }
        // Idle again: back to zero.
        wait_for_async(
            "both pools back to zero",
            Duration::from_secs(60),
            async || {
                let w = workers(&up);
                if w == (0, 0) {
                    Ok(())
                } else {
                    Err(format!("{w:?} (prefill, decode)"))
                }
            },
        )
        .await;
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

/// `preheat up ARGS` with `cache` as its cache, an idle grace of a minute unless
/// `args` say otherwise; its stderr goes to `log`.
fn up(cache: &std::path::Path, args: &[&str], log: Log) -> Up {
    harness::up(cache)
        .args(&["--idle-grace", "60s"])
        .args(args)
        .log(log)
        .start()
}

/// KEDA's client of the scaler `up` runs on `port`, once it listens.
async fn keda_client(port: u16) -> ExternalScalerClient<tonic::transport::Channel> {
    let url = format!("http://127.0.0.1:{port}");
    wait_for_async(
        "the scaler to listen",
        Duration::from_secs(120),
        async || ExternalScalerClient::connect(url.clone()).await,
    )
    .await
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// One completion through `gw` (waiting for the gateway to listen), its status and body.
/// A prompt prefix that clients share, longer than `--disagg-min-tokens` (32) in any
/// tokenizer the tests use.
const SHARED_PREFIX: &str = "The operators' view of the fleet: every model at zero until asked, \
    each pool sized on its own from queue depth, cache pressure and latency against \
    its targets, with a forecast whose lead time is the measured start of a replica, \
    and the warm tiers decided by demand, so that a model asked for after hours of \
    silence answers within seconds.";

async fn one_completion(gw: &str) -> (u16, Value) {
    completion_of(gw, json!({"prompt": "hello", "max_tokens": 4})).await
}

/// A completion of `body` at the gateway `gw`, once it listens.
async fn completion_of(gw: &str, body: Value) -> (u16, Value) {
    let c = reqwest::Client::new();
    let r = wait_for_async(
        "the gateway to listen",
        Duration::from_secs(120),
        async || match c
            .post(format!("{gw}/v1/completions"))
            .json(&body)
            .timeout(Duration::from_secs(120))
            .send()
            .await
        {
            Err(e) if !e.is_connect() => panic!("{e}"),
            r => r,
        },
    )
    .await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[test]
fn regression_up_served_a_stale_staged_model_after_switching_models() {
    // The bug: both runs staged their model as `node/default.preheat`, so the second
    // run's workers served the first run's model, the gateway refused them (another
    // KV compatibility hash) and every request failed.
    let cache = tempfile::tempdir().unwrap();
    {
        let up = up(cache.path(), &[], Log::Null);
        let (status, body) = rt().block_on(one_completion(&up.url));
        assert_eq!(status, 200, "embedded model: {body}");
    }
    let fixture = preheat_testkit::model_fixture("llama-tiny");
    let up = up(
        cache.path(),
        &["--model", fixture.to_str().unwrap()],
        Log::Null,
    );
    let (status, body) = rt().block_on(one_completion(&up.url));
    assert_eq!(status, 200, "after switching --model: {body}");
}

/// Two models from one `up` (`--model NAME=PATH`, twice): each at zero until asked,
/// asking one wakes that model's pools only, and `preheat status` lists both.
#[test]
fn up_serves_two_models_each_from_zero_on_its_own() {
    let src = tempfile::tempdir().unwrap();
    let a = harness::synth_tiny(src.path(), "alpha-src", 1);
    let b = harness::synth_tiny(src.path(), "beta-src", 2);
    let cache = tempfile::tempdir().unwrap();
    let named = |n: &str, p: &std::path::Path| format!("{n}={}", p.display());
    let up = harness::up(cache.path())
        .args(&[
            "--model",
            &named("alpha", &a),
            "--model",
            &named("beta", &b),
        ])
        .args(&["--standbys", "0", "--idle-grace", "30s"])
        .start();
    let complete = async |model: &str| {
        completion_of(
            &up.url,
            json!({"model": model, "prompt": "hello", "max_tokens": 4}),
        )
        .await
    };
    rt().block_on(async {
        let (status, body) = complete("alpha").await;
        assert_eq!(status, 200, "alpha: {body}");
        let alpha = up.workers_of(Some("alpha")).unwrap();
        assert!(alpha.1 >= 1, "alpha's decode pool woke: {alpha:?}");
        assert_eq!(
            up.workers_of(Some("beta")),
            Some((0, 0)),
            "beta stayed at zero"
        );
        let (status, body) = complete("beta").await;
        assert_eq!(status, 200, "beta: {body}");
        assert!(up.workers_of(Some("beta")).unwrap().1 >= 1);
    });
    let out = Command::new(env!("CARGO_BIN_EXE_preheat"))
        .arg("status")
        .args([
            "--scaler",
            &format!("http://127.0.0.1:{}", up.ports.scaler_http),
        ])
        .args(["--agent", &format!("http://127.0.0.1:{}", up.ports.agent)])
        .args([
            "--cluster-token-file",
            up.token_file().to_str().unwrap(),
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let models: Vec<&str> = v["scaler"]["models"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["model"].as_str())
        .collect();
    assert_eq!(models, ["alpha", "beta"], "{v}");
}

#[test]
fn up_stops_with_the_workers_own_error_when_they_cannot_start() {
    // Workers that die at start are restarted with growing pauses, and after a few
    // quick deaths `up` stops, saying why in the workers' own words; the request it
    // held fails at once with that reason instead of after the hold time.
    let cache = tempfile::tempdir().unwrap();
    let log = cache.path().join("up.stderr");
    let mut up = up(
        cache.path(),
        &["--kv-cache-mib", "0"],
        Log::File(log.clone()),
    );
    let t0 = Instant::now();
    let (status, body) = rt().block_on(one_completion(&up.url));
    assert_eq!(status, 503, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("--kv-cache-mib must be > 0"), "{body}");
    assert!(
        t0.elapsed() < Duration::from_secs(100),
        "failed only after {:?}",
        t0.elapsed()
    );
    let status = wait_for(
        "up to stop",
        Duration::from_secs(120).saturating_sub(t0.elapsed()),
        || up.child.try_wait().unwrap(),
    );
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
        "model": {"source": "https://models.example.com/llama-1b.phpack"},
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

    let cache = tempfile::tempdir().unwrap();
    let log = cache.path().join("up.stderr");
    let mut up = harness::up(cache.path())
        .args(&[
            "--idle-grace",
            "120s",
            "--prefill-max",
            "1",
            "--decode-max",
            "1",
        ])
        .log(Log::File(log.clone()))
        .start();
    let (gport, hport, aport) = (up.ports.gateway, up.ports.scaler_http, up.ports.agent);
    let gw = up.url.clone();
    let token_file = up.token_file();
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
        wait_for_async("the gateway to answer", Duration::from_secs(120), async || {
            if let Ok(Some(exit)) = up.child.try_wait() {
                panic!("up exited ({exit}): {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            reqwest::get(format!("{gw}/health")).await
        })
        .await;
        // The first requests wake both pools through their parked standbys (the
        // "promoted" panel needs one): wait until `up` says they are parked.
        wait_for("both standbys parked", Duration::from_secs(120).saturating_sub(t0.elapsed()), || {
            let out = up.stdout();
            if ["prefill", "decode"].iter().all(|p| out.contains(&format!("{p}: standby parked"))) {
                Ok(())
            } else {
                Err(out)
            }
        });
        let (status, body) = one_completion(&gw).await;
        assert_eq!(status, 200, "{body}");
        let c = reqwest::Client::new();
        // Load: three clients with a shared prompt prefix (prefix-cache hits), long
        // enough to be prefilled apart, so they want the prefill pool too (a short
        // prompt wakes decode alone).
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let load: Vec<_> = (0..3)
            .map(|i| {
                let (c, gw, stop) = (c.clone(), gw.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let prompt = format!("{SHARED_PREFIX} client {i}, request {n}");
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
        let gwi = up.internal.clone();
        let token = std::fs::read_to_string(&token_file).unwrap();
        // `up` does not keep the agent's standbys (its own driver parks them), so the
        // agent exports no parked-standby series here; the panel's other query (promoted
        // standbys serving) must still answer.
        let exempt = ["preheat:warmpool_parked_standbys"];
        let mut answered = std::collections::BTreeSet::new();
        let t0 = Instant::now();
        // Paced: each look is a round of every query, and Prometheus scrapes each second.
        let under_load = Wait::new("every panel query to return data under load", Duration::from_secs(180))
            .every(Duration::from_secs(2));
        under_load.until_async(async || {
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
            // Twenty seconds of load at least, whatever answered sooner.
            if missing.is_empty() && t0.elapsed() > Duration::from_secs(20) {
                return Ok(());
            }
            Err(format!(
                "these panel queries returned no data yet:\n{}",
                missing.iter().map(|(t, e)| format!("  {t}: {}", with_variables(e))).collect::<Vec<_>>().join("\n")
            ))
        })
        .await;
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

    let cache = tempfile::tempdir().unwrap();
    let up = harness::up(cache.path())
        .args(&[
            "--idle-grace",
            "3s",
            "--set",
            "models.0.prefill.schedule=[{cron: '* * * * *', duration_s: 3600, min_replicas: 1}]",
        ])
        .start();
    rt().block_on(async {
        let t0 = Instant::now();
        let keda = keda_client(up.ports.scaler).await;
        let floor = "the floor to bring prefill up with no traffic";
        wait_for_async(
            floor,
            Duration::from_secs(120).saturating_sub(t0.elapsed()),
            async || {
                let active = |pool: &'static str| {
                    let mut keda = keda.clone();
                    async move {
                        keda.is_active(sref(pool))
                            .await
                            .map(|r| r.into_inner().result)
                    }
                };
                let (prefill, decode) = (active("prefill").await, active("decode").await);
                let workers = up.workers();
                if prefill.as_ref().is_ok_and(|a| *a)
                    && decode.as_ref().is_ok_and(|a| !*a)
                    && workers == Some((1, 0))
                {
                    Ok(())
                } else {
                    Err(format!(
                        "prefill active {prefill:?}, decode active {decode:?}, workers {workers:?}"
                    ))
                }
            },
        )
        .await;
        // Deliberate: held, not a passing decision — still one prefill worker past the
        // idle grace (3 s), which only time passing shows.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(workers(&up), (1, 0));
    });
}
