//! KEDA 2.x and the HPA it creates, driving one rendered ScaledObject through the
//! scaler's real gRPC API the way KEDA does: `StreamIsActive` held open (a push of
//! `true` activates 0 → 1 at once; reconnects with a pause), `IsActive` and `GetMetrics`
//! every `pollingInterval`; deactivation 1 → 0 after `cooldownPeriod` without
//! activity; between 1 and max, HPA's AverageValue formula `desired = ceil(value /
//! target)` with the rendered per-direction tolerances, stabilisation windows and rate
//! policies; and the rendered `fallback` when the scaler cannot be read (newer KEDA:
//! errors alone never deactivate).
//!
//! HPA syncs every `pollingInterval` here instead of its default 15 s, so scenarios run
//! in seconds; the formula and limits are HPA's.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_scaler::proto::{GetMetricsRequest, ScaledObjectRef};
use serde_json::Value;
use tokio_stream::StreamExt;

use super::emulator::{Cluster, set_scale};

/// How KEDA reaches the scaler: plain gRPC, or TLS with what the ScaledObject's
/// TriggerAuthentication names (`caCert`, and `tlsClientCert`/`tlsClientKey` for
/// mutual TLS), read from the Secrets as KEDA reads them.
#[derive(Clone)]
struct Conn {
    url: String,
    tls: Option<tonic::transport::ClientTlsConfig>,
}

impl Conn {
    fn of(c: &Cluster, so: &Value, scaler: &str) -> Conn {
        let Some(auth) = so["spec"]["triggers"][0]["authenticationRef"]["name"].as_str() else {
            return Conn {
                url: format!("http://{scaler}"),
                tls: None,
            };
        };
        let ta = c.object("TriggerAuthentication", auth);
        let mut got: HashMap<String, Vec<u8>> = HashMap::new();
        for r in ta["spec"]["secretTargetRef"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let v = c.secret(r["name"].as_str().unwrap(), r["key"].as_str().unwrap());
            got.insert(r["parameter"].as_str().unwrap().to_owned(), v);
        }
        // The test certificate names localhost (KEDA would check the scalerAddress
        // host, `<release>-preheat-scaler.<namespace>.svc`, against a real one).
        let mut tls = tonic::transport::ClientTlsConfig::new()
            .domain_name("localhost")
            .ca_certificate(tonic::transport::Certificate::from_pem(&got["caCert"]));
        if let (Some(cert), Some(key)) = (got.get("tlsClientCert"), got.get("tlsClientKey")) {
            tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        Conn {
            url: format!("https://{scaler}"),
            tls: Some(tls),
        }
    }

    async fn connect(
        &self,
    ) -> Result<ExternalScalerClient<tonic::transport::Channel>, tonic::transport::Error> {
        let mut ep = tonic::transport::Endpoint::from_shared(self.url.clone())?;
        if let Some(t) = &self.tls {
            ep = ep.tls_config(t.clone())?;
        }
        Ok(ExternalScalerClient::new(ep.connect().await?))
    }
}

struct Spec {
    target: String,
    min: i64,
    max: i64,
    polling: Duration,
    cooldown: Duration,
    sref: ScaledObjectRef,
    metric_target: f64,
    up_tolerance: f64,
    down_tolerance: f64,
    up_window: Duration,
    down_window: Duration,
    /// (type, value, period) of each direction's policies.
    up_policies: Vec<(String, f64, Duration)>,
    down_policies: Vec<(String, f64, Duration)>,
    fallback: Option<(u32, i64, String)>,
}

fn secs(v: &Value, default: f64) -> Duration {
    Duration::from_secs_f64(v.as_f64().unwrap_or(default))
}

fn policies(v: &Value) -> Vec<(String, f64, Duration)> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            (
                p["type"].as_str().unwrap_or("Pods").to_owned(),
                p["value"].as_f64().unwrap_or(1.0),
                secs(&p["periodSeconds"], 15.0),
            )
        })
        .collect()
}

fn tolerance(v: &Value) -> f64 {
    v.as_f64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or(0.1)
}

impl Spec {
    fn of(so: &Value) -> Spec {
        let s = &so["spec"];
        let beh = &s["advanced"]["horizontalPodAutoscalerConfig"]["behavior"];
        let meta: HashMap<String, String> = s["triggers"][0]["metadata"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k != "scalerAddress")
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect();
        Spec {
            target: s["scaleTargetRef"]["name"].as_str().unwrap().to_owned(),
            min: s["minReplicaCount"].as_i64().unwrap_or(0),
            max: s["maxReplicaCount"].as_i64().unwrap_or(100),
            polling: secs(&s["pollingInterval"], 30.0),
            cooldown: secs(&s["cooldownPeriod"], 300.0),
            sref: ScaledObjectRef {
                name: so["metadata"]["name"].as_str().unwrap().to_owned(),
                namespace: so["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("llm")
                    .to_owned(),
                scaler_metadata: meta,
            },
            metric_target: 1.0,
            up_tolerance: tolerance(&beh["scaleUp"]["tolerance"]),
            down_tolerance: tolerance(&beh["scaleDown"]["tolerance"]),
            up_window: secs(&beh["scaleUp"]["stabilizationWindowSeconds"], 0.0),
            down_window: secs(&beh["scaleDown"]["stabilizationWindowSeconds"], 300.0),
            up_policies: policies(&beh["scaleUp"]["policies"]),
            down_policies: policies(&beh["scaleDown"]["policies"]),
            fallback: s.get("fallback").map(|f| {
                (
                    f["failureThreshold"].as_u64().unwrap_or(3) as u32,
                    f["replicas"].as_i64().unwrap_or(0),
                    f["behavior"].as_str().unwrap_or("static").to_owned(),
                )
            }),
        }
    }
}

/// Drives `so` until the cluster goes; `scaler` is the scaler Service's gRPC address.
pub fn drive(c: &Arc<Cluster>, so: &Value, scaler: &str) {
    let spec = Arc::new(Spec::of(so));
    let url = Conn::of(c, so, scaler);
    let last_push = Arc::new(std::sync::Mutex::new(Instant::now()));
    // External push: the stream held open, reconnected after a pause when it ends.
    {
        let (c, spec, url, last_push) = (
            Arc::clone(c),
            Arc::clone(&spec),
            url.clone(),
            Arc::clone(&last_push),
        );
        let rt = c.rt.clone();
        rt.spawn(async move {
            while !c.stopped() && c.has("ScaledObject", &spec.sref.name) {
                if let Ok(mut client) = url.connect().await
                    && let Ok(r) = client.stream_is_active(spec.sref.clone()).await
                {
                    let mut s = r.into_inner();
                    while let Some(Ok(m)) = s.next().await {
                        // LastActiveTime moves on a pushed "active" too.
                        if m.result {
                            *last_push.lock().unwrap() = Instant::now();
                        }
                        if m.result && c.scale(&spec.target) == 0 {
                            set_scale(&c.state, &spec.target, spec.min.max(1), "keda (push)");
                        }
                    }
                }
                // Deliberate: KEDA's pause before it reconnects.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
    let c = Arc::clone(c);
    let rt = c.rt.clone();
    rt.spawn(async move {
        let mut last_active = Instant::now();
        let mut failures = 0u32;
        let mut recs: VecDeque<(Instant, i64)> = VecDeque::new();
        let mut events: VecDeque<(Instant, i64)> = VecDeque::new();
        // Until the ScaledObject is gone (a `helm upgrade` removed it).
        while !c.stopped() && c.has("ScaledObject", &spec.sref.name) {
            // Deliberate: the ScaledObject's pollingInterval, as KEDA keeps it.
            tokio::time::sleep(spec.polling).await;
            let mut client = url.connect().await.ok();
            let is_active = match &mut client {
                Some(cl) => cl
                    .is_active(spec.sref.clone())
                    .await
                    .map(|r| r.into_inner().result),
                None => Err(tonic::Status::unavailable("no connection")),
            };
            let current = c.scale(&spec.target);
            match is_active {
                Ok(true) => {
                    last_active = Instant::now();
                    if current == 0 {
                        set_scale(&c.state, &spec.target, spec.min.max(1), "keda (poll)");
                        continue;
                    }
                }
                Ok(false) => {
                    last_active = last_active.max(*last_push.lock().unwrap());
                    if current > 0 && spec.min == 0 && last_active.elapsed() >= spec.cooldown {
                        set_scale(&c.state, &spec.target, 0, "keda (cooldown)");
                        continue;
                    }
                }
                // KEDA >= 2.16: a failing scaler alone neither activates nor
                // deactivates; with a fallback the HPA metric takes over.
                Err(_) => {}
            }
            if current == 0 {
                continue; // HPA is idle at zero replicas.
            }
            let metric = match &mut client {
                Some(cl) => cl
                    .get_metrics(GetMetricsRequest {
                        scaled_object_ref: Some(spec.sref.clone()),
                        metric_name: String::new(),
                    })
                    .await
                    .ok()
                    .and_then(|r| {
                        r.into_inner()
                            .metric_values
                            .first()
                            .map(|v| v.metric_value_float)
                    }),
                None => None,
            };
            let value = match metric {
                Some(v) => {
                    failures = 0;
                    v
                }
                None => {
                    failures += 1;
                    match &spec.fallback {
                        Some((threshold, replicas, behavior)) if failures > *threshold => {
                            let r = match behavior.as_str() {
                                "currentReplicas" => current,
                                "currentReplicasIfHigher" => current.max(*replicas),
                                "currentReplicasIfLower" => current.min(*replicas),
                                _ => *replicas,
                            };
                            r as f64 * spec.metric_target
                        }
                        // HPA cannot read the metric: it keeps the replicas it has.
                        _ => continue,
                    }
                }
            };
            let ratio = value / (spec.metric_target * current as f64);
            let raw = if (ratio > 1.0 && ratio - 1.0 <= spec.up_tolerance)
                || (ratio < 1.0 && 1.0 - ratio <= spec.down_tolerance)
            {
                current
            } else {
                (value / spec.metric_target).ceil() as i64
            };
            let now = Instant::now();
            recs.push_back((now, raw));
            let keep = spec.up_window.max(spec.down_window);
            while recs.front().is_some_and(|(t, _)| now - *t > keep) {
                recs.pop_front();
            }
            // Stabilisation: up to the lowest recommendation of the up window, down to
            // the highest of the down window.
            let in_window = |w: Duration| {
                recs.iter()
                    .filter(move |(t, _)| now - *t <= w)
                    .map(|(_, r)| *r)
            };
            let mut desired = raw;
            if raw > current {
                desired = in_window(spec.up_window).min().unwrap_or(raw).max(current);
            } else if raw < current {
                desired = in_window(spec.down_window)
                    .max()
                    .unwrap_or(raw)
                    .min(current);
            }
            // Rate policies: the most permissive one, over the replicas changed within
            // its period.
            let changed = |period: Duration| {
                events
                    .iter()
                    .filter(|(t, _)| now - *t <= period)
                    .map(|(_, d)| d.abs())
                    .sum::<i64>()
            };
            // The most permissive policy of the direction, less what changed within its
            // period.
            let allowed = |policies: &[(String, f64, Duration)]| {
                policies
                    .iter()
                    .map(|(ty, v, p)| {
                        let limit = if ty == "Percent" {
                            (current as f64 * v / 100.0).ceil() as i64
                        } else {
                            *v as i64
                        };
                        (limit - changed(*p)).max(0)
                    })
                    .max()
                    .unwrap_or(i64::MAX)
            };
            if desired > current {
                desired = desired.min(current.saturating_add(allowed(&spec.up_policies)));
            } else if desired < current {
                desired = desired.max(current.saturating_sub(allowed(&spec.down_policies)));
            }
            let desired = desired.clamp(spec.min.max(1), spec.max);
            if desired != current {
                events.push_back((now, desired - current));
                while events
                    .front()
                    .is_some_and(|(t, _)| now - *t > Duration::from_secs(600))
                {
                    events.pop_front();
                }
                set_scale(&c.state, &spec.target, desired, "hpa");
            }
        }
    });
}
