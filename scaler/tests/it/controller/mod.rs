//! The scaler end to end: fake engine and gateway `/metrics` endpoints, the real
//! control loop and gRPC service, and a KEDA-style client.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use preheat_scaler::config::Config;
use preheat_scaler::profile::Profile;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_scaler::proto::{GetMetricsRequest, ScaledObjectRef};
use preheat_testkit::{Wait, wait_for_async};
use tokio_stream::StreamExt;

/// A `/metrics` endpoint whose body (or failure) the test controls.
async fn fake(body: Arc<Mutex<Option<String>>>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let b = body.lock().unwrap().clone();
            async move {
                match b {
                    Some(t) => (StatusCode::OK, t),
                    None => (StatusCode::INTERNAL_SERVER_ERROR, String::new()),
                }
            }
        }),
    );
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}/metrics")
}

fn engine_text(running: u32) -> String {
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"llama\"}} {running}\n# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{{model_name=\"llama\"}} 100\n"
    )
}

/// The pool's desired replicas as KEDA reads them (`GetMetrics`); -1 before the
/// scaler's first decision (it says Unavailable then).
async fn desired(c: &mut ExternalScalerClient<tonic::transport::Channel>, pool: &str) -> i64 {
    desired_for(c, sref(pool)).await
}

/// The same for the ScaledObject `r`.
async fn desired_for(
    c: &mut ExternalScalerClient<tonic::transport::Channel>,
    r: ScaledObjectRef,
) -> i64 {
    match c
        .get_metrics(GetMetricsRequest {
            scaled_object_ref: Some(r),
            metric_name: String::new(),
        })
        .await
    {
        Ok(r) => r.into_inner().metric_values[0].metric_value,
        Err(s) if s.code() == tonic::Code::Unavailable => -1,
        Err(s) => panic!("{s}"),
    }
}

fn sref(pool: &str) -> ScaledObjectRef {
    ScaledObjectRef {
        name: format!("llama-{pool}"),
        namespace: "default".into(),
        scaler_metadata: [("pool".to_owned(), pool.to_owned())].into_iter().collect(),
    }
}

/// A scaler serving KEDA's API on free ports, with `sets` on top of its listen
/// addresses, and a client connected to it.
struct Running {
    client: ExternalScalerClient<tonic::transport::Channel>,
    http_port: u16,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<preheat_scaler::Result<()>>,
}

impl Running {
    async fn start(sets: &[String]) -> Running {
        let (gport, hport) = (preheat_testkit::free_port(), preheat_testkit::free_port());
        let mut all = vec![
            format!("grpc_listen=127.0.0.1:{gport}"),
            format!("http_listen=127.0.0.1:{hport}"),
        ];
        all.extend_from_slice(sets);
        let cfg = Config::load(None, &all).unwrap();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(preheat_scaler::server::run(
            cfg,
            Profile::default(),
            async move {
                let _ = stop_rx.await;
            },
        ));
        let url = format!("http://127.0.0.1:{gport}");
        let client = wait_for_async(
            "the scaler to listen",
            Duration::from_secs(30),
            async || ExternalScalerClient::connect(url.clone()).await,
        )
        .await;
        Running {
            client,
            http_port: hport,
            stop,
            server,
        }
    }

    /// The scaler's own `/metrics` text.
    async fn metrics(&self) -> String {
        reqwest::get(format!("http://127.0.0.1:{}/metrics", self.http_port))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Stops the scaler and checks it shut down cleanly.
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(20), self.server)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

type Body = Arc<Mutex<Option<String>>>;

/// Two busy decode engines (600 running sequences each) and a gateway, each a fake
/// `/metrics` endpoint whose body the test controls.
struct Fakes {
    d0: Body,
    d1: Body,
    gw: Body,
    u0: String,
    u1: String,
    ug: String,
}

impl Fakes {
    async fn start(gateway: &str) -> Fakes {
        let d0: Body = Arc::new(Mutex::new(Some(engine_text(600))));
        let d1: Body = Arc::new(Mutex::new(Some(engine_text(600))));
        let gw: Body = Arc::new(Mutex::new(Some(gateway.to_owned())));
        let (u0, u1, ug) = (
            fake(d0.clone()).await,
            fake(d1.clone()).await,
            fake(gw.clone()).await,
        );
        Fakes {
            d0,
            d1,
            gw,
            u0,
            u1,
            ug,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_follow_the_scraped_load_and_the_gateway_wakes_a_pool_at_zero() {
    let f = Fakes::start(
        "# TYPE preheat:gateway_pending_requests gauge\npreheat:gateway_pending_requests 0\n",
    )
    .await;
    let (d0, d1, gw) = (f.d0.clone(), f.d1.clone(), f.gw.clone());
    let (u0, u1, ug) = (f.u0.clone(), f.u1.clone(), f.ug.clone());
    let mut scaler = Running::start(&[
        "interval_s=0.1".into(),
        "window_s=2".into(),
        format!(
            "models=[{{name: llama, gateway: [{ug}], prefill: {{idle_grace_s: 0.5}}, decode: {{endpoints: [{u0}, {u1}]}}}}]"
        ),
    ])
    .await;
    let (client, hport) = (&mut scaler.client, scaler.http_port);
    // 1200 running sequences, ~230 per replica at a 45 ms ITL budget → about 6.
    wait_for_async(
        "decode desired 5 to 7",
        Duration::from_secs(10),
        async || {
            let d = desired(client, "decode").await;
            if (5..=7).contains(&d) {
                Ok(())
            } else {
                Err(format!("decode desired stuck at {d}"))
            }
        },
    )
    .await;
    // Both endpoints die: the scaler holds instead of reading the silence as idle.
    *d0.lock().unwrap() = None;
    *d1.lock().unwrap() = None;
    wait_for_async(
        "blind: the 2 replicas that exist held",
        Duration::from_secs(10),
        async || {
            let d = desired(client, "decode").await;
            if d == 2 {
                Ok(())
            } else {
                Err(format!("desired {d}"))
            }
        },
    )
    .await;
    // ...and keeps holding them (not passing through 2 on the way down). Deliberate:
    // only time passing shows it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(desired(client, "decode").await, 2, "blind: still held");
    // The prefill pool has no replicas and no traffic: inactive after its idle grace.
    let mut active = client
        .stream_is_active(sref("prefill"))
        .await
        .unwrap()
        .into_inner();
    // (Each look waits for the scaler's next push: no pause between looks.)
    Wait::new("prefill inactive", Duration::from_secs(5))
        .every(Duration::ZERO)
        .until_async(async || !active.next().await.unwrap().unwrap().result)
        .await;
    // A request held at the gateway: pushed active within a second.
    *gw.lock().unwrap() = Some(
        "# TYPE preheat:gateway_pending_requests gauge\npreheat:gateway_pending_requests 1\n"
            .to_owned(),
    );
    let t0 = Instant::now();
    let woke = tokio::time::timeout(Duration::from_secs(1), active.next())
        .await
        .expect("no push within 1 s")
        .unwrap()
        .unwrap();
    assert!(woke.result);
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert!(desired(client, "prefill").await >= 1);
    // The scaler's own metrics.
    let m = reqwest::get(format!("http://127.0.0.1:{hport}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("preheat:scaler_active{model=\"llama\",pool=\"prefill\"} 1"),
        "{m}"
    );
    // What it saw: the decode pool's two endpoints are dead, so it is blind and held,
    // and says so in a form an alert can use.
    for line in [
        "preheat:scaler_endpoints{model=\"llama\",pool=\"decode\",state=\"failed\"} 2",
        "preheat:scaler_endpoints{model=\"llama\",pool=\"decode\",state=\"ok\"} 0",
        "preheat:scaler_blind{model=\"llama\",pool=\"decode\"} 1",
        "preheat:scaler_blind{model=\"llama\",pool=\"prefill\"} 0",
        "preheat:scaler_current_replicas{model=\"llama\",pool=\"decode\"} 2",
        "preheat:scaler_decision{model=\"llama\",pool=\"decode\",reason=\"metrics unavailable: holding\"} 1",
    ] {
        assert!(m.contains(line), "missing {line:?} in\n{m}");
    }
    // And it is well-formed by the same parser it reads engines with.
    let samples = preheat_scaler::signals::text_format::samples(&m)
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    assert!(samples.len() >= 12, "{m}");
    scaler.stop().await;
}

/// A held request names the pool it waits for (`pool` on
/// `preheat:gateway_pending_requests`): a short prompt held for a decode worker wakes
/// the decode pool only; one long enough to be disaggregated, with no prefill worker,
/// wakes prefill too. Every held request woke both pools before (the count had no pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_request_wakes_only_the_pool_it_waits_for() {
    let held = |decode: u32, prefill: u32| {
        format!(
            "# TYPE preheat:gateway_pending_requests gauge\n\
             preheat:gateway_pending_requests{{model_name=\"llama\",pool=\"decode\"}} {decode}\n\
             preheat:gateway_pending_requests{{model_name=\"llama\",pool=\"prefill\"}} {prefill}\n\
             preheat:gateway_pending_requests{{model_name=\"other\",pool=\"prefill\"}} 3\n"
        )
    };
    let gw = Arc::new(Mutex::new(Some(held(0, 0))));
    let ug = fake(gw.clone()).await;
    let mut scaler = Running::start(&[
        "interval_s=0.1".into(),
        "window_s=2".into(),
        format!(
            "models=[{{name: llama, metrics_model_name: llama, gateway: [{ug}], prefill: {{idle_grace_s: 0.5}}, decode: {{idle_grace_s: 0.5}}}}]"
        ),
    ])
    .await;
    let client = &mut scaler.client;
    // `None` before the pool's first decision (the scaler answers Unavailable then).
    let active = async |c: &mut ExternalScalerClient<tonic::transport::Channel>, pool: &str| {
        c.is_active(sref(pool))
            .await
            .ok()
            .map(|r| r.into_inner().result)
    };
    Wait::new("both pools inactive", Duration::from_secs(10))
        .until_async(async || {
            active(&mut *client, "decode").await == Some(false)
                && active(&mut *client, "prefill").await == Some(false)
        })
        .await;
    // Held for a decode worker: decode wakes, prefill (another model's held requests
    // beside it) stays at zero.
    *gw.lock().unwrap() = Some(held(2, 0));
    Wait::new("decode active", Duration::from_secs(5))
        .until_async(async || active(&mut *client, "decode").await == Some(true))
        .await;
    for _ in 0..5 {
        // Deliberate: prefill must stay inactive, which only time passing shows.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            active(&mut *client, "prefill").await,
            Some(false),
            "prefill woke"
        );
        assert_eq!(desired(&mut *client, "prefill").await, 0);
    }
    // A long prompt with no prefill worker: prefill wakes too.
    *gw.lock().unwrap() = Some(held(2, 1));
    Wait::new("prefill active", Duration::from_secs(5))
        .until_async(async || active(&mut *client, "prefill").await == Some(true))
        .await;
    assert!(desired(&mut *client, "prefill").await >= 1);
    scaler.stop().await;
}

/// `fleet.max_gpus` smaller than the models' wants: a model with a request held at
/// zero gets its first replica, the busy model is granted the rest (less than it
/// wants), and both are visible in the scaler's metrics and `/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleets_gpu_budget_wakes_a_held_model_before_a_busy_one_grows() {
    let f = Fakes::start(
        "# TYPE preheat:gateway_pending_requests gauge\n\
         preheat:gateway_pending_requests{model_name=\"b\",pool=\"decode\"} 0\n",
    )
    .await;
    let (gw, u0, u1, ug) = (f.gw.clone(), f.u0.clone(), f.u1.clone(), f.ug.clone());
    let mut scaler = Running::start(&[
        "interval_s=0.1".into(),
        "window_s=2".into(),
        "fleet.max_gpus=3".into(),
        format!(
            "models=[{{name: a, prefill: {{idle_grace_s: 0.5}}, decode: {{endpoints: [{u0}, {u1}]}}}}, \
             {{name: b, gateway: [{ug}], prefill: {{idle_grace_s: 0.5}}, decode: {{idle_grace_s: 0.5}}}}]"
        ),
    ])
    .await;
    let at = |model: &str, pool: &str| ScaledObjectRef {
        name: format!("{model}-{pool}"),
        namespace: "default".into(),
        scaler_metadata: std::collections::HashMap::from([
            ("model".to_owned(), model.to_owned()),
            ("pool".to_owned(), pool.to_owned()),
        ]),
    };
    let client = &mut scaler.client;
    // Alone, the busy model takes the whole budget (it wants about 6).
    wait_for_async(
        "a granted the budget",
        Duration::from_secs(10),
        async || {
            let d = desired_for(client, at("a", "decode")).await;
            if d == 3 {
                Ok(())
            } else {
                Err(format!("a decode desired {d}"))
            }
        },
    )
    .await;
    // A request held for b, at zero: b's decode gets a GPU, taken from a.
    *gw.lock().unwrap() = Some(
        "# TYPE preheat:gateway_pending_requests gauge\n\
         preheat:gateway_pending_requests{model_name=\"b\",pool=\"decode\"} 1\n"
            .to_owned(),
    );
    wait_for_async(
        "b woken within the budget",
        Duration::from_secs(10),
        async || {
            let (a, b) = (
                desired_for(client, at("a", "decode")).await,
                desired_for(client, at("b", "decode")).await,
            );
            if (a, b) == (2, 1) {
                Ok(())
            } else {
                Err(format!("a {a}, b {b}"))
            }
        },
    )
    .await;
    let m = scaler.metrics().await;
    for line in [
        "preheat:scaler_fleet_gpus{model=\"a\",state=\"granted\"} 2",
        "preheat:scaler_fleet_gpus{model=\"b\",state=\"granted\"} 1",
        "preheat:scaler_decision{model=\"a\",pool=\"decode\",reason=\"fleet GPU budget: granted fewer replicas than wanted\"} 1",
    ] {
        assert!(m.contains(line), "missing {line:?} in\n{m}");
    }
    let wanted: f64 = m
        .lines()
        .find(|l| l.starts_with("preheat:scaler_fleet_gpus{model=\"a\",state=\"wanted\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap();
    assert!(wanted > 2.0, "a wanted more than it was granted: {wanted}");
    assert!(
        m.contains("preheat:scaler_fleet_gpu_seconds_total{model=\"a\"}"),
        "{m}"
    );
    // `a` waits on the budget (the alert compares this with its start-up); `b` does not.
    let waited = |model: &str| -> f64 {
        let head = format!("preheat:scaler_fleet_wait_seconds{{model=\"{model}\"}}");
        m.lines()
            .find(|l| l.starts_with(&head))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap()
    };
    assert!(waited("a") > 0.0 && waited("b") == 0.0, "{m}");
    scaler.stop().await;
}

/// What a fake Prometheus has seen beyond the steady 100k prompt tokens/s.
#[derive(Clone, Copy, PartialEq)]
enum History {
    /// Range queries return nothing (a fresh Prometheus).
    None,
    /// Five minutes ago, one tick of a burst at 400k tokens/s.
    Burst,
    /// Yesterday, 1M tokens/s from the season's next bucket on (five-minute buckets).
    Ramp,
}

/// A Prometheus server that has seen one prefill replica take 100k prompt tokens/s
/// for a long time, and `history`.
mod restart;
mod sizing;
mod state_file;
