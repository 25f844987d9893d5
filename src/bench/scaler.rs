//! `preheat bench scaler`: KEDA-facing latency and control-loop cost at fleet scale.
//! (1) `GetMetrics` latency with 1,000 ScaledObjects each polling on its own schedule
//! (open loop, every `--interval-ms`; KEDA's default is every 30 s); (2) one
//! scrape-and-decide tick over 1,000 pods served by a local fake `/metrics` server.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Path;
use axum::routing::get;
use preheat_scaler::grpc::{DecisionStore, PoolDecision, ScalerService};
use preheat_scaler::policy::{Observation, Pool, PoolPolicy, PreheatPolicy};
use preheat_scaler::profile::Profile;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_scaler::proto::{GetMetricsRequest, ScaledObjectRef};
use preheat_scaler::scrape::scrape_all;
use preheat_scaler::signals::PoolWindows;
use serde_json::json;

use crate::cli::BenchScalerArgs;
use crate::commands::{outln, print_json};

fn pct(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// A realistic vLLM exposition for pod `i` (gauges, counters, two histograms).
fn pod_metrics(i: usize) -> String {
    let mut s = String::new();
    s.push_str("# TYPE vllm:num_requests_running gauge\n");
    s.push_str(&format!(
        "vllm:num_requests_running{{model_name=\"m\"}} {}\n",
        i % 40
    ));
    s.push_str("# TYPE vllm:num_requests_waiting gauge\n");
    s.push_str(&format!(
        "vllm:num_requests_waiting{{model_name=\"m\"}} {}\n",
        i % 3
    ));
    s.push_str("# TYPE vllm:kv_cache_usage_perc gauge\n");
    s.push_str(&format!(
        "vllm:kv_cache_usage_perc{{model_name=\"m\"}} {}\n",
        (i % 10) as f64 / 10.0
    ));
    for c in [
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ] {
        s.push_str(&format!(
            "# TYPE vllm:{c} counter\nvllm:{c}{{model_name=\"m\"}} {}\n",
            1000 * (i + 1)
        ));
    }
    for h in ["time_to_first_token_seconds", "inter_token_latency_seconds"] {
        s.push_str(&format!("# TYPE vllm:{h} histogram\n"));
        let mut cum = 0;
        for (k, le) in [
            "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "+Inf",
        ]
        .iter()
        .enumerate()
        {
            cum += k + i % 5;
            s.push_str(&format!(
                "vllm:{h}_bucket{{model_name=\"m\",le=\"{le}\"}} {cum}\n"
            ));
        }
        s.push_str(&format!(
            "vllm:{h}_sum{{model_name=\"m\"}} 12.5\nvllm:{h}_count{{model_name=\"m\"}} {cum}\n"
        ));
    }
    s
}

pub fn run(args: &BenchScalerArgs) -> anyhow::Result<std::process::ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        // (1) GetMetrics with `objects` ScaledObjects polling.
        let models: Vec<String> = (0..args.objects.div_ceil(2)).map(|i| format!("model-{i}")).collect();
        let store = DecisionStore::new(models.clone());
        for (i, m) in models.iter().enumerate() {
            store.set(m, Pool::Prefill, PoolDecision { desired: (i % 7) as u32, active: true });
            store.set(m, Pool::Decode, PoolDecision { desired: (i % 11) as u32, active: true });
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(ScalerService::new(Arc::clone(&store)).into_server())
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let client = ExternalScalerClient::connect(format!("http://{addr}")).await?;
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..args.objects)
            .map(|i| {
                let mut c = client.clone();
                let model = models[i / 2].clone();
                let pool = if i % 2 == 0 { "prefill" } else { "decode" };
                let polls = args.polls;
                let every = Duration::from_millis(args.interval_ms);
                // Staggered like independent ScaledObjects, each on its own schedule.
                let offset = every.mul_f64(i as f64 / args.objects as f64);
                tokio::spawn(async move {
                    tokio::time::sleep(offset).await;
                    let mut tick = tokio::time::interval(every);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    let r = ScaledObjectRef {
                        name: format!("{model}-{pool}"),
                        namespace: "bench".into(),
                        scaler_metadata: [("model".to_owned(), model.clone()), ("pool".to_owned(), pool.to_owned())].into_iter().collect(),
                    };
                    let mut lat = Vec::with_capacity(polls);
                    for _ in 0..polls {
                        tick.tick().await;
                        let s = Instant::now();
                        c.get_metrics(GetMetricsRequest { scaled_object_ref: Some(r.clone()), metric_name: String::new() }).await?;
                        lat.push(s.elapsed());
                    }
                    Ok::<_, tonic::Status>(lat)
                })
            })
            .collect();
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await??);
        }
        let wall = t0.elapsed();
        lat.sort();
        // (2) One scrape-and-decide tick over `pods` pods.
        let app = Router::new().route("/metrics/{i}", get(|Path(i): Path<usize>| async move { pod_metrics(i) }));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let maddr = l.local_addr()?;
        tokio::spawn(async move { axum::serve(l, app).await });
        let urls: Vec<String> = (0..args.pods).map(|i| format!("http://{maddr}/metrics/{i}")).collect();
        let (pf, dc) = urls.split_at(args.pods / 2);
        let http = reqwest::Client::builder().pool_max_idle_per_host(1024).build()?;
        let mut windows = [PoolWindows::new(60.0), PoolWindows::new(60.0)];
        let mut policies = [Pool::Prefill, Pool::Decode].map(|p| PreheatPolicy::new(p, PoolPolicy::default(), Profile::default()));
        let mut ticks = Vec::new();
        for tick in 0..args.ticks {
            let s = Instant::now();
            for (k, urls) in [pf, dc].into_iter().enumerate() {
                let (ok, failed) = scrape_all(&http, urls, Some("m"), Duration::from_secs(5)).await;
                if !failed.is_empty() {
                    anyhow::bail!("{} of {} fake pods failed to scrape", failed.len(), urls.len());
                }
                let current = ok.len() as u32;
                let signals = windows[k].tick(tick as f64 * 5.0, ok, &failed);
                let _ = policies[k].decide(tick as f64 * 5.0, &Observation { signals, current, ..Observation::default() });
            }
            ticks.push(s.elapsed());
        }
        let worst_tick = ticks.iter().max().copied().unwrap_or_default();
        let best_tick = ticks.iter().min().copied().unwrap_or_default();
        Ok::<_, anyhow::Error>(json!({
            "scaled_objects": args.objects, "polls_each": args.polls, "interval_ms": args.interval_ms, "calls": lat.len(),
            "get_metrics_p50_ms": pct(&lat, 0.5), "get_metrics_p99_ms": pct(&lat, 0.99), "get_metrics_max_ms": pct(&lat, 1.0),
            "calls_per_s": lat.len() as f64 / wall.as_secs_f64(),
            "pods": args.pods, "ticks": args.ticks,
            "tick_best_s": best_tick.as_secs_f64(), "tick_worst_s": worst_tick.as_secs_f64(),
        }))
    })?;
    if args.out.json {
        print_json(&report)?;
    } else {
        let f = |k: &str| report[k].as_f64().unwrap_or(f64::NAN);
        outln!("scaler benchmark");
        outln!(
            "  GetMetrics, {} ScaledObjects polling every {} ms, {} polls each: p50 {:.3} ms, p99 {:.3} ms (target < 1 ms), max {:.3} ms, {:.0} calls/s",
            args.objects,
            args.interval_ms,
            args.polls,
            f("get_metrics_p50_ms"),
            f("get_metrics_p99_ms"),
            f("get_metrics_max_ms"),
            f("calls_per_s")
        );
        outln!(
            "  scrape-and-decide over {} pods: best {:.3} s, worst {:.3} s of {} ticks (target < 1 s)",
            args.pods,
            f("tick_best_s"),
            f("tick_worst_s"),
            args.ticks
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
