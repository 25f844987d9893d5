//! `preheat status`: what the scaler decided for each pool and why, against the SLOs,
//! and what every node's warm-pool agent has staged and hot — read from the scaler's
//! `GET /status` and the agents' `GET /models` and `GET /standbys`, given as URLs or
//! found in a Kubernetes namespace (`--kube`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use preheat_edge::ClusterToken;
use preheat_output::{emit, human_bytes};
use preheat_scaler::{AgentPool, PoolReport, StatusReport};
use preheat_warmpool::agent::ModelStatus;
use serde::Serialize;

use crate::cli::StatusArgs;

/// Longest answer read from the scaler or an agent: a status is a few KiB.
const MAX_ANSWER: usize = 4 << 20;
/// Per request: a status that takes longer is reported as unreachable.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Everything one `status` read saw. `errors` name what could not be read, and why.
#[derive(Debug, Default, Serialize)]
struct Snapshot {
    scaler: Option<ScalerView>,
    agents: Vec<AgentView>,
    errors: Vec<String>,
}

#[derive(Debug, Serialize)]
struct ScalerView {
    url: String,
    #[serde(flatten)]
    report: StatusReport,
}

#[derive(Debug, Serialize)]
struct AgentView {
    url: String,
    /// The node the agent runs on, where known (`--kube`).
    #[serde(skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    models: Vec<ModelStatus>,
    standbys: BTreeMap<String, AgentPool>,
}

/// Where to read from, resolved once (`--kube` looks the pods up on each refresh).
struct Targets {
    scaler: Option<String>,
    agents: Vec<(String, Option<String>)>,
}

pub fn run(a: &StatusArgs) -> anyhow::Result<ExitCode> {
    if a.interval < Duration::from_millis(100) {
        anyhow::bail!("--interval {:?}: want at least 100ms", a.interval);
    }
    let interval = a.interval.as_secs_f64();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let kube = if a.kube {
            Some(kube_client(a).await?)
        } else {
            None
        };
        let token = match (a.token.load()?, &kube) {
            (Some(t), _) => Some(t),
            (None, Some(k)) => Some(std::sync::Arc::new(kube_token(a, k).await?)),
            (None, None) => None,
        };
        let client = preheat_edge::client::internal_with_token(token.as_deref());
        let tty = std::io::stdout().is_terminal();
        // One stop for the whole run: a Ctrl-C during a read is not lost.
        let mut stop = std::pin::pin!(crate::signals::shutdown_signal());
        loop {
            let snap = tokio::select! {
                snap = async {
                    match &kube {
                        // A failed lookup is one more thing that could not be read.
                        Some(k) => match kube_targets(a, k).await {
                            Ok(t) => read(&client, &t).await,
                            Err(e) => Snapshot { errors: vec![format!("{e:#}")], ..Snapshot::default() },
                        },
                        None => read(&client, &given_targets(a)).await,
                    }
                } => snap,
                () = &mut stop => return Ok(ExitCode::SUCCESS),
            };
            if a.json {
                emit(&format!("{}\n", serde_json::to_string_pretty(&snap)?))?;
            } else {
                let text = render(&snap);
                // In place on a terminal; one snapshot after another elsewhere.
                if a.watch && tty {
                    emit(&format!("\x1b[H\x1b[2J{text}"))?;
                } else {
                    emit(&text)?;
                }
            }
            if !a.watch {
                return Ok(if snap.errors.is_empty() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                });
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs_f64(interval)) => {}
                () = &mut stop => return Ok(ExitCode::SUCCESS),
            }
            if !a.json && !tty {
                emit("\n")?;
            }
        }
    })
}

fn given_targets(a: &StatusArgs) -> Targets {
    let trim = |u: &str| u.trim_end_matches('/').to_owned();
    Targets {
        scaler: Some(trim(&a.scaler)),
        agents: a.agent.iter().map(|u| (trim(u), None)).collect(),
    }
}

/// GET `url` as JSON: bounded, and with errors that say what refused and why.
async fn get<T: serde::de::DeserializeOwned>(
    client: &reqwest::Client,
    url: &str,
) -> Result<T, String> {
    let r = client
        .get(url)
        .timeout(TIMEOUT)
        .send()
        .await
        .map_err(|e| format!("{url}: {}", error_chain(&e.without_url())))?;
    let status = r.status();
    if status == reqwest::StatusCode::UNAUTHORIZED {
        return Err(format!(
            "{url}: 401, it asks for the deployment's cluster token (--cluster-token-file, or --kube to read it from the cluster)"
        ));
    }
    if !status.is_success() {
        return Err(format!("{url}: HTTP {status}"));
    }
    let body = preheat_scaler::scrape::read_limited(r, MAX_ANSWER)
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    serde_json::from_slice(&body).map_err(|e| format!("{url}: not a status ({e})"))
}

/// An error with its causes, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let _ = write!(s, ": {inner}");
        src = inner.source();
    }
    s
}

async fn read(client: &reqwest::Client, t: &Targets) -> Snapshot {
    let mut snap = Snapshot::default();
    if let Some(url) = &t.scaler {
        match get::<StatusReport>(client, &format!("{url}/status")).await {
            Ok(report) => {
                snap.scaler = Some(ScalerView {
                    url: url.clone(),
                    report,
                })
            }
            Err(e) => snap.errors.push(format!("scaler {e}")),
        }
    }
    for (url, node) in &t.agents {
        let models = get::<Vec<ModelStatus>>(client, &format!("{url}/models")).await;
        let standbys = get::<BTreeMap<String, AgentPool>>(client, &format!("{url}/standbys")).await;
        match (models, standbys) {
            (Ok(models), Ok(standbys)) => snap.agents.push(AgentView {
                url: url.clone(),
                node: node.clone(),
                models,
                standbys,
            }),
            (Err(e), _) | (_, Err(e)) => snap.errors.push(format!("agent {e}")),
        }
    }
    snap
}

fn secs(v: Option<f64>) -> String {
    v.map_or_else(
        || "-".to_owned(),
        |s| {
            if s < 1.0 {
                format!("{:.0}ms", s * 1e3)
            } else {
                format!("{s:.2}s")
            }
        },
    )
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{:.1}%", x * 100.0))
}

fn rate(v: f64) -> String {
    if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// The human view: one line per pool, then what failed, then one block per node.
fn render(s: &Snapshot) -> String {
    let mut o = String::new();
    if let Some(sc) = &s.scaler {
        let _ = writeln!(o, "scaler {}", sc.url);
        let _ = writeln!(
            o,
            "{:<16} {:<8} {:>7} {:>7} {:>5}  {:<36} {:<24} {:<24} {:<18}",
            "MODEL",
            "POOL",
            "DESIRED",
            "CURRENT",
            "READY",
            "LAST DECISION",
            "TTFT p50/p90 (SLO, met)",
            "ITL p50/p90 (SLO, met)",
            "LOAD now→ahead"
        );
        for m in &sc.report.models {
            for p in &m.pools {
                let _ = writeln!(o, "{}", pool_line(&m.model, p));
            }
        }
        for m in &sc.report.models {
            for p in &m.pools {
                if p.blind {
                    let _ = writeln!(
                        o,
                        "BLIND {} {}: every metrics endpoint fails; the pool is held at its size, not sized",
                        m.model, p.pool
                    );
                }
                for f in &p.failing {
                    let _ = writeln!(o, "failing endpoint {} {}: {f}", m.model, p.pool);
                }
            }
        }
    }
    for a in &s.agents {
        let node = a
            .node
            .as_deref()
            .map_or(String::new(), |n| format!("node {n}, "));
        let _ = writeln!(o, "\n{node}agent {}", a.url);
        for m in &a.models {
            let mut line = format!(
                "  {:<24} {:<8} {:>10} staged, {:>10} resident",
                m.name,
                m.state,
                human_bytes(m.bytes),
                human_bytes(m.resident_bytes)
            );
            if m.state == "staging" {
                let _ = write!(line, ", {:.0}% done", m.progress * 100.0);
            }
            if m.mapped {
                line.push_str(", mapped by a replica");
            }
            if let Some(e) = &m.error {
                // A model waiting for demand is not failing: say why it waits.
                let what = if m.state == "pending" {
                    "waits"
                } else {
                    "error"
                };
                let _ = write!(line, ", {what}: {e}");
            }
            let _ = writeln!(o, "{line}");
        }
        for (pool, sb) in &a.standbys {
            let _ = writeln!(
                o,
                "  standbys {pool}: {} parked, {} serving",
                sb.parked,
                sb.serving.len()
            );
        }
    }
    for e in &s.errors {
        let _ = writeln!(o, "error: {e}");
    }
    o
}

fn pool_line(model: &str, p: &PoolReport) -> String {
    let desired = match (p.desired, p.active) {
        (Some(d), Some(false)) => format!("{d} (off)"),
        (Some(d), _) => d.to_string(),
        (None, _) => "-".to_owned(),
    };
    // Cut by the fleet's GPU budget: what the policy wanted too.
    let desired = match (p.wanted, p.desired) {
        (Some(w), Some(d)) if w > d => format!("{desired} of {w}"),
        _ => desired,
    };
    let slo = &p.slo;
    let ttft = format!(
        "{}/{} ({}, {})",
        secs(slo.ttft_p50_s),
        secs(slo.ttft_p90_s),
        secs(Some(slo.ttft_target_s)),
        pct(slo.ttft_attainment)
    );
    let itl = format!(
        "{}/{} ({}, {})",
        secs(slo.itl_p50_s),
        secs(slo.itl_p90_s),
        secs(Some(slo.itl_target_s)),
        pct(slo.itl_attainment)
    );
    let load = p.load.map_or_else(
        || "-".to_owned(),
        |l| {
            format!(
                "{}→{} /s ({:.0}s)",
                rate(l.observed),
                rate(l.forecast),
                l.lead_s
            )
        },
    );
    let reason = if p.reason.is_empty() {
        "(none yet)"
    } else {
        p.reason.as_str()
    };
    format!(
        "{:<16} {:<8} {:>7} {:>7} {:>5}  {:<36} {:<24} {:<24} {:<18}",
        model, p.pool, desired, p.current, p.ready, reason, ttft, itl, load
    )
}

/// A client from KUBECONFIG or the pod's service account, and the namespace to look in.
async fn kube_client(a: &StatusArgs) -> anyhow::Result<(kube::Client, String)> {
    let client = kube::Client::try_default()
        .await
        .context("--kube: no Kubernetes client configuration (KUBECONFIG or in-cluster)")?;
    let ns = a
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    Ok((client, ns))
}

/// The Ready pods of `component` in the release, with their IP and named `http` port.
async fn kube_pods(
    a: &StatusArgs,
    (client, ns): &(kube::Client, String),
    component: &str,
) -> anyhow::Result<Vec<(String, Option<String>)>> {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, ListParams};
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let sel = format!(
        "app.kubernetes.io/name=preheat,app.kubernetes.io/instance={},app.kubernetes.io/component={component}",
        a.release
    );
    let list = pods
        .list(&ListParams::default().labels(&sel))
        .await
        .with_context(|| format!("--kube: listing pods {sel} in {ns}"))?;
    let mut out = Vec::new();
    for p in list {
        // A pod going away, or not Ready, is not the one serving.
        let ready = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        if p.metadata.deletion_timestamp.is_some() || !ready {
            continue;
        }
        let Some(ip) = p.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
            continue;
        };
        let port = p
            .spec
            .as_ref()
            .and_then(|s| {
                s.containers
                    .iter()
                    .flat_map(|c| c.ports.iter().flatten())
                    .find(|cp| cp.name.as_deref() == Some("http"))
            })
            .map(|cp| cp.container_port);
        let Some(port) = port else { continue };
        let host = if ip.contains(':') {
            format!("[{ip}]")
        } else {
            ip
        };
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        out.push((format!("http://{host}:{port}"), node));
    }
    out.sort();
    Ok(out)
}

async fn kube_targets(a: &StatusArgs, k: &(kube::Client, String)) -> anyhow::Result<Targets> {
    let scaler = kube_pods(a, k, "scaler")
        .await?
        .into_iter()
        .next()
        .map(|(u, _)| u);
    if scaler.is_none() {
        anyhow::bail!(
            "--kube: no Ready scaler pod of release {:?} in namespace {} (labels app.kubernetes.io/instance={}, app.kubernetes.io/component=scaler; see --release, --namespace)",
            a.release,
            k.1,
            a.release
        );
    }
    Ok(Targets {
        scaler,
        agents: kube_pods(a, k, "warmpool").await?,
    })
}

/// The chart's name for the release's cluster token Secret (its `preheat.fullname`:
/// `<release>-preheat`, cut to 52 characters).
fn token_secret_name(release: &str) -> String {
    let full: String = format!("{release}-preheat").chars().take(52).collect();
    format!("{}-cluster-token", full.trim_end_matches('-'))
}

/// The cluster token from the release's Secret (the chart's name for it, or
/// `--token-secret`), as an operator with `kubectl get secret` rights reads it.
async fn kube_token(
    a: &StatusArgs,
    (client, ns): &(kube::Client, String),
) -> anyhow::Result<ClusterToken> {
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::Api;
    let name = a
        .token_secret
        .clone()
        .unwrap_or_else(|| token_secret_name(&a.release));
    let secret = Api::<Secret>::namespaced(client.clone(), ns)
        .get(&name)
        .await
        .with_context(|| format!("--kube: reading the cluster token Secret {ns}/{name} (or give --cluster-token-file)"))?;
    let bytes = secret
        .data
        .and_then(|d| d.get("token").cloned())
        .with_context(|| format!("--kube: Secret {ns}/{name} has no key `token`"))?;
    ClusterToken::from_bytes(&bytes.0, &format!("Secret {ns}/{name}"))
        .map_err(|e| anyhow::anyhow!("--kube: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use preheat_scaler::LoadView;
    use preheat_scaler::SloView;

    #[test]
    fn the_token_secret_is_named_as_the_chart_names_it() {
        assert_eq!(token_secret_name("llm"), "llm-preheat-cluster-token");
        let long = "r".repeat(60);
        assert_eq!(
            token_secret_name(&long),
            format!("{}-cluster-token", "r".repeat(52))
        );
        // The cut may leave a trailing '-', which the chart trims.
        assert_eq!(
            token_secret_name(&"r".repeat(51)),
            format!("{}-cluster-token", "r".repeat(51))
        );
    }

    #[test]
    fn the_human_view_names_every_pool_blind_pools_failing_endpoints_and_unreadable_parts() {
        let pool = |name: &str, blind: bool| PoolReport {
            pool: name.into(),
            desired: Some(3),
            active: Some(true),
            current: 2,
            ready: 1,
            reason: "scale up".into(),
            blind,
            failing: if blind {
                vec!["http://10.0.0.9:8100/metrics".into()]
            } else {
                vec![]
            },
            slo: SloView {
                ttft_target_s: 2.0,
                itl_target_s: 0.05,
                ttft_p50_s: Some(0.12),
                ttft_attainment: Some(0.991),
                ..SloView::default()
            },
            load: Some(LoadView {
                observed: 1500.0,
                forecast: 2100.0,
                lead_s: 20.0,
                needed: 2.2,
            }),
            ..PoolReport::default()
        };
        let snap = Snapshot {
            scaler: Some(ScalerView {
                url: "http://s".into(),
                report: StatusReport {
                    models: vec![
                        preheat_scaler::ModelReport {
                            model: "llama".into(),
                            pools: vec![pool("prefill", false), pool("decode", true)],
                        },
                        preheat_scaler::ModelReport {
                            model: "qwen".into(),
                            // Cut by the fleet's GPU budget.
                            pools: vec![PoolReport {
                                wanted: Some(5),
                                reason: "fleet GPU budget: granted fewer replicas than wanted"
                                    .into(),
                                ..pool("decode", false)
                            }],
                        },
                    ],
                },
            }),
            agents: vec![AgentView {
                url: "http://a".into(),
                node: Some("gpu-1".into()),
                models: vec![ModelStatus {
                    name: "llama".into(),
                    state: "hot".into(),
                    bytes: 3 << 30,
                    resident_bytes: 3 << 30,
                    progress: 1.0,
                    mapped: true,
                    last_wanted_s: Some(1.7e9),
                    error: None,
                }],
                standbys: BTreeMap::from([(
                    "decode".to_owned(),
                    AgentPool {
                        parked: 1,
                        serving: vec![18000],
                    },
                )]),
            }],
            errors: vec!["agent http://b/models: 401".into()],
        };
        let text = render(&snap);
        for want in [
            "llama            prefill        3       2     1  scale up",
            "qwen             decode    3 of 5       2     1  fleet GPU budget",
            "120ms/- (2.00s, 99.1%)",
            "1.5k→2.1k /s (20s)",
            "BLIND llama decode",
            "failing endpoint llama decode: http://10.0.0.9:8100/metrics",
            "node gpu-1, agent http://a",
            "hot",
            "3.00 GiB staged",
            "standbys decode: 1 parked, 1 serving",
            "error: agent http://b/models: 401",
        ] {
            assert!(text.contains(want), "{want:?} not in\n{text}");
        }
        let json = serde_json::to_value(&snap).unwrap();
        assert_eq!(json["scaler"]["models"][0]["pools"][1]["blind"], true);
        assert_eq!(json["agents"][0]["standbys"]["decode"]["parked"], 1);
    }
}
