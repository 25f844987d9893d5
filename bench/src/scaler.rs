//! `preheat bench scaler`: KEDA-facing latency and control-loop cost at fleet scale.
//! (1) `GetMetrics` latency with 1,000 ScaledObjects each polling on its own schedule
//! (open loop, every `--interval`; KEDA's default is every 30 s), the callers in the
//! scaler's process and then in a process of their own; (2) one scrape-and-decide tick
//! over 1,000 pods served by a local fake `/metrics` server with what vLLM exposes, and
//! the parsing share of it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::Path;
use axum::routing::get;
use preheat_output::{outln, print_json};
use preheat_scaler::grpc::ScalerService;
use preheat_scaler::policy::{Observation, Pool, PoolPolicy, PreheatPolicy};
use preheat_scaler::profile::Profile;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_scaler::proto::{GetMetricsRequest, ScaledObjectRef};
use preheat_scaler::scrape::scrape_all;
use preheat_scaler::signals::PoolWindows;
use preheat_scaler::{DecisionStore, PoolDecision};
use serde_json::json;

use crate::args::{BenchScalerArgs, Callers};

/// The `q` percentile of `sorted` latencies, in ms (0 without any).
fn pct(sorted: &[Duration], q: f64) -> f64 {
    let ms: Vec<f64> = sorted.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    preheat_scaler::percentile::of_sorted(&ms, q).unwrap_or(0.0)
}

/// What a vLLM (0.10, V1 engine) pod serves on `/metrics`, for pod `i`: the Python
/// client's process and GC families, every `vllm:` gauge, counter and histogram with
/// its HELP/TYPE lines and `_created` samples, and the long `cache_config_info` label
/// set — about 400 lines, of which the scaler reads 10 families.
fn pod_metrics(i: usize) -> String {
    use std::fmt::Write as _;
    const LABELS: &str = "engine=\"0\",model_name=\"m\"";
    let mut s = String::with_capacity(48 * 1024);
    let family = |s: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    for (name, v) in [
        ("python_gc_objects_collected_total", 1432.0),
        ("python_gc_objects_uncollectable_total", 0.0),
        ("python_gc_collections_total", 287.0),
    ] {
        family(&mut s, name, "counter", "Objects collected during gc");
        for g in 0..3 {
            let _ = writeln!(s, "{name}{{generation=\"{g}\"}} {v:.1}");
        }
    }
    family(
        &mut s,
        "python_info",
        "gauge",
        "Python platform information",
    );
    s.push_str("python_info{implementation=\"CPython\",major=\"3\",minor=\"12\",patchlevel=\"11\",version=\"3.12.11\"} 1.0\n");
    for (name, kind, v) in [
        ("process_virtual_memory_bytes", "gauge", 1.2e11),
        ("process_resident_memory_bytes", "gauge", 4.1e9),
        ("process_start_time_seconds", "gauge", 1.76e9),
        ("process_cpu_seconds_total", "counter", 5321.7),
        ("process_open_fds", "gauge", 187.0),
        ("process_max_fds", "gauge", 1_048_576.0),
    ] {
        family(&mut s, name, kind, "Process metric.");
        let _ = writeln!(s, "{name} {v:e}");
    }
    let gauges = [
        ("vllm:num_requests_running", (i % 40) as f64),
        ("vllm:num_requests_waiting", (i % 3) as f64),
        ("vllm:kv_cache_usage_perc", (i % 10) as f64 / 10.0),
    ];
    for (name, v) in gauges {
        family(&mut s, name, "gauge", "Number of requests / KV usage.");
        let _ = writeln!(s, "{name}{{{LABELS}}} {v:.1}");
    }
    let n = 1000.0 * (i + 1) as f64;
    for (name, v) in [
        ("vllm:num_preemptions", 3.0),
        ("vllm:prompt_tokens", n),
        ("vllm:generation_tokens", n / 4.0),
        ("vllm:prefix_cache_queries", n),
        ("vllm:prefix_cache_hits", n / 3.0),
    ] {
        family(
            &mut s,
            &format!("{name}_total"),
            "counter",
            "Cumulative counter.",
        );
        let _ = writeln!(s, "{name}_total{{{LABELS}}} {v:.1}");
        let _ = writeln!(s, "{name}_created{{{LABELS}}} 1.7600001e+09");
    }
    family(
        &mut s,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for reason in ["stop", "length", "abort"] {
        let _ = writeln!(
            s,
            "vllm:request_success_total{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"m\"}} {:.1}",
            n / 100.0
        );
        let _ = writeln!(
            s,
            "vllm:request_success_created{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"m\"}} 1.7600001e+09"
        );
    }
    let seconds = [
        "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75",
        "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0",
        "+Inf",
    ];
    let tokens = [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0",
        "5000.0", "10000.0", "+Inf",
    ];
    for (name, bounds) in [
        ("vllm:time_to_first_token_seconds", &seconds[..]),
        ("vllm:inter_token_latency_seconds", &seconds[..]),
        ("vllm:time_per_output_token_seconds", &seconds[..]),
        ("vllm:e2e_request_latency_seconds", &seconds[..]),
        ("vllm:request_queue_time_seconds", &seconds[..]),
        ("vllm:request_inference_time_seconds", &seconds[..]),
        ("vllm:request_prefill_time_seconds", &seconds[..]),
        ("vllm:request_decode_time_seconds", &seconds[..]),
        ("vllm:iteration_tokens_total", &tokens[..]),
        ("vllm:request_prompt_tokens", &tokens[..]),
        ("vllm:request_generation_tokens", &tokens[..]),
        ("vllm:request_params_max_tokens", &tokens[..]),
    ] {
        family(
            &mut s,
            name,
            "histogram",
            "Histogram of request latency or size.",
        );
        let mut cum = 0;
        for (k, le) in bounds.iter().enumerate() {
            cum += k + i % 5;
            let _ = writeln!(s, "{name}_bucket{{{LABELS},le=\"{le}\"}} {cum}.0");
        }
        let _ = writeln!(
            s,
            "{name}_count{{{LABELS}}} {cum}.0\n{name}_sum{{{LABELS}}} 12.5"
        );
        let _ = writeln!(s, "{name}_created{{{LABELS}}} 1.7600001e+09");
    }
    family(
        &mut s,
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    s.push_str("vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_offload_gb=\"0\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",num_cpu_blocks=\"None\",num_gpu_blocks=\"27000\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"builtin\",sliding_window=\"None\",swap_space=\"4\",swap_space_bytes=\"4294967296\"} 1.0\n");
    s
}

/// Model names of `objects` ScaledObjects (a prefill and a decode pool each).
fn bench_models(objects: usize) -> Vec<String> {
    (0..objects.div_ceil(2))
        .map(|i| format!("model-{i}"))
        .collect()
}

/// `GetMetrics` latencies of `objects` ScaledObjects polling the scaler at `addr`, each on
/// its own staggered schedule like independent ScaledObjects; sorted, with the wall time.
async fn poll_get_metrics(
    addr: &str,
    args: &BenchScalerArgs,
) -> anyhow::Result<(Vec<Duration>, Duration)> {
    let models = bench_models(args.objects);
    let client = ExternalScalerClient::connect(format!("http://{addr}")).await?;
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..args.objects)
        .map(|i| {
            let mut c = client.clone();
            let model = models[i / 2].clone();
            let pool = if i % 2 == 0 { "prefill" } else { "decode" };
            let polls = args.polls;
            let every = args.poll_interval();
            let offset = every.mul_f64(i as f64 / args.objects as f64);
            tokio::spawn(async move {
                tokio::time::sleep(offset).await;
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let r = ScaledObjectRef {
                    name: format!("{model}-{pool}"),
                    namespace: "bench".into(),
                    scaler_metadata: [
                        ("model".to_owned(), model.clone()),
                        ("pool".to_owned(), pool.to_owned()),
                    ]
                    .into_iter()
                    .collect(),
                };
                let mut lat = Vec::with_capacity(polls);
                for _ in 0..polls {
                    tick.tick().await;
                    let s = Instant::now();
                    c.get_metrics(GetMetricsRequest {
                        scaled_object_ref: Some(r.clone()),
                        metric_name: String::new(),
                    })
                    .await?;
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
    Ok((lat, wall))
}

fn latency_report(lat: &[Duration], wall: Duration) -> serde_json::Value {
    if lat.is_empty() {
        return json!({"calls": 0});
    }
    json!({
        "calls": lat.len(), "calls_per_s": lat.len() as f64 / wall.as_secs_f64(),
        "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), "max_ms": pct(lat, 1.0),
    })
}

pub(crate) fn run(args: &BenchScalerArgs) -> anyhow::Result<std::process::ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Some(addr) = &args.call_server {
        // The callers of `--callers own-process`, run by the benchmark itself.
        let (lat, wall) = rt.block_on(poll_get_metrics(addr, args))?;
        print_json(&latency_report(&lat, wall))?;
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let report = rt.block_on(async {
        // (1) GetMetrics with `objects` ScaledObjects polling.
        let models = bench_models(args.objects);
        let store = DecisionStore::new(models.clone());
        for (i, m) in models.iter().enumerate() {
            store.set(m, Pool::Prefill, PoolDecision { desired: (i % 7) as u32, active: true });
            store.set(m, Pool::Decode, PoolDecision { desired: (i % 11) as u32, active: true });
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?.to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(ScalerService::new(Arc::clone(&store)).into_server())
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let mut get_metrics = serde_json::Map::new();
        if args.callers != Callers::OwnProcess {
            // Callers share the scaler's runtime and cores.
            let (lat, wall) = poll_get_metrics(&addr, args).await?;
            get_metrics.insert("same_process".into(), latency_report(&lat, wall));
        }
        if args.callers != Callers::SameProcess {
            // Callers in a process of their own, as KEDA is (still on the same cores here).
            let mut cmd = std::process::Command::new(std::env::current_exe()?);
            cmd.args(["bench", "scaler", "--json", "--call-server", &addr])
                .args(["--objects", &args.objects.to_string()])
                .args(["--polls", &args.polls.to_string()])
                .args(["--interval", &format!("{}ms", args.poll_interval().as_millis())]);
            let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
            if !out.status.success() {
                anyhow::bail!("the caller process failed: {}", String::from_utf8_lossy(&out.stderr));
            }
            get_metrics.insert("own_process".into(), serde_json::from_slice(&out.stdout)?);
        }
        // (2) One scrape-and-decide tick over `pods` pods.
        // Rendered once, so the ticks time the scaler, not the fake pods' formatting.
        let pages: Arc<Vec<Bytes>> = Arc::new((0..args.pods).map(|i| Bytes::from(pod_metrics(i))).collect());
        let page_bytes = pages.iter().map(Bytes::len).sum::<usize>() as f64 / pages.len().max(1) as f64;
        // Parsing alone, every page once: the scaler's share of a tick that is not I/O.
        let s = Instant::now();
        for page in pages.iter() {
            let text = std::str::from_utf8(page)?;
            std::hint::black_box(preheat_scaler::signals::exposition::parse(text, Some("m"))?);
        }
        let parse_us = s.elapsed().as_secs_f64() * 1e6 / pages.len().max(1) as f64;
        let served = Arc::clone(&pages);
        let app = Router::new().route(
            "/metrics/{i}",
            get(move |Path(i): Path<usize>| {
                let page = served.get(i).cloned();
                async move { page.ok_or(axum::http::StatusCode::NOT_FOUND) }
            }),
        );
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
                if let Some(f) = failed.first() {
                    anyhow::bail!("{} of {} fake pods failed to scrape, {}: {}", failed.len(), urls.len(), f.url, f.reason);
                }
                let current = ok.len() as u32;
                let signals = windows[k].tick(tick as f64 * 5.0, ok, &[]);
                let _ = policies[k].decide(tick as f64 * 5.0, &Observation { signals, current, ..Observation::default() });
            }
            ticks.push(s.elapsed());
        }
        let worst_tick = ticks.iter().max().copied().unwrap_or_default();
        let best_tick = ticks.iter().min().copied().unwrap_or_default();
        Ok::<_, anyhow::Error>(json!({
            "scaled_objects": args.objects, "polls_each": args.polls, "interval_ms": args.poll_interval().as_millis() as u64,
            "get_metrics": get_metrics,
            "pods": args.pods, "ticks": args.ticks,
            "tick_best_s": best_tick.as_secs_f64(), "tick_worst_s": worst_tick.as_secs_f64(),
            "page_bytes": page_bytes, "parse_us_per_page": parse_us,
        }))
    })?;
    if args.out.json {
        print_json(&report)?;
    } else {
        let f = |k: &str| report[k].as_f64().unwrap_or(f64::NAN);
        outln!("scaler benchmark");
        for (callers, r) in report["get_metrics"].as_object().into_iter().flatten() {
            let g = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
            outln!(
                "  GetMetrics, {} ScaledObjects polling every {} ms, {} polls each, callers in the {}: p50 {:.3} ms, p99 {:.3} ms (target < 1 ms), max {:.3} ms, {:.0} calls/s",
                args.objects,
                args.poll_interval().as_millis(),
                args.polls,
                callers.replace('_', " "),
                g("p50_ms"),
                g("p99_ms"),
                g("max_ms"),
                g("calls_per_s")
            );
        }
        outln!(
            "  scrape-and-decide over {} pods: best {:.3} s, worst {:.3} s of {} ticks (target < 1 s)",
            args.pods,
            f("tick_best_s"),
            f("tick_worst_s"),
            args.ticks
        );
        outln!(
            "  parsing one pod's exposition ({:.0} bytes, vLLM's families): {:.1} µs",
            f("page_bytes"),
            f("parse_us_per_page")
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
