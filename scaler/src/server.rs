//! `preheat scaler run`: the KEDA gRPC endpoint, a health and metrics endpoint, and the
//! control loop, together.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::routing::get;

use crate::config::Config;
use crate::controller::Controller;
use crate::grpc::{DecisionStore, ScalerService};
use crate::policy::Pool;
use crate::profile::Profile;
use crate::{Result, ScalerError};

/// A pool's series of one family: extra labels (`,k="v"`) and the value.
type Series = Vec<(String, f64)>;

/// The scaler's own metrics: what it decided for each pool, why, and what it saw.
fn render(store: &DecisionStore, models: &[String]) -> String {
    use crate::signals::names::own;
    let mut out = String::new();
    let pools = || {
        models
            .iter()
            .flat_map(|m| [Pool::Prefill, Pool::Decode].map(|p| (m, p)))
    };
    let family =
        |out: &mut String, name: &str, help: &str, value: &dyn Fn(&str, Pool) -> Series| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (m, p) in pools() {
                for (extra, v) in value(m, p) {
                    let _ = writeln!(
                        out,
                        "{name}{{model=\"{}\",pool=\"{}\"{extra}}} {v}",
                        escape(m),
                        p.as_str()
                    );
                }
            }
        };
    let one = |v: f64| vec![(String::new(), v)];
    family(
        &mut out,
        own::DESIRED,
        "Replicas the policy wants per pool",
        &|m, p| {
            store
                .get(m, p)
                .map_or_else(Vec::new, |d| one(f64::from(d.desired)))
        },
    );
    family(
        &mut out,
        own::ACTIVE,
        "Whether the pool is active (KEDA activation)",
        &|m, p| {
            store
                .get(m, p)
                .map_or_else(Vec::new, |d| one(f64::from(u8::from(d.active))))
        },
    );
    family(
        &mut out,
        own::CURRENT,
        "Replicas the pool had at the last tick",
        &|m, p| one(f64::from(store.status(m, p).current)),
    );
    family(
        &mut out,
        own::ENDPOINTS,
        "Endpoints scraped in the last tick, by state",
        &|m, p| {
            let s = store.status(m, p);
            vec![
                (",state=\"ok\"".to_owned(), s.endpoints_ok as f64),
                (",state=\"failed\"".to_owned(), s.endpoints_failed as f64),
            ]
        },
    );
    family(
        &mut out,
        own::BLIND,
        "1 while every endpoint of the pool fails (held, not sized)",
        &|m, p| one(f64::from(u8::from(store.status(m, p).blind))),
    );
    family(
        &mut out,
        own::DECISION,
        "1 for the reason of the pool's last decision",
        &|m, p| {
            let s = store.status(m, p);
            if s.reason.is_empty() {
                return Vec::new();
            }
            vec![(format!(",reason=\"{}\"", escape(s.reason)), 1.0)]
        },
    );
    out
}

/// A label value as the text format wants it.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Longest a TLS handshake on the gRPC endpoint may take.
pub const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The gRPC endpoint's TLS from PEM files.
fn tls_config(t: &crate::config::TlsSettings) -> Result<tonic::transport::ServerTlsConfig> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let read = |p: &std::path::Path| {
        std::fs::read(p)
            .map_err(|e| ScalerError::Config(vec![format!("tls: {}: {e}", p.display())]))
    };
    // A peer that opens a connection and never finishes the handshake gives up its
    // slot after this.
    let mut c = ServerTlsConfig::new()
        .identity(Identity::from_pem(read(&t.cert)?, read(&t.key)?))
        .timeout(TLS_HANDSHAKE_TIMEOUT);
    if let Some(ca) = &t.client_ca {
        c = c.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(c)
}

/// Runs until `stop` resolves.
pub async fn run(
    cfg: Config,
    profile: Profile,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    run_with(cfg, profile, stop, Vec::new()).await
}

/// [`run`], with some pools' endpoints supplied live by the caller (local mode).
pub async fn run_with(
    cfg: Config,
    profile: Profile,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
    shared: Vec<(String, Pool, crate::controller::SharedEndpoints)>,
) -> Result<()> {
    let models: Vec<String> = cfg.models.iter().map(|m| m.name.clone()).collect();
    let cfg_tls = cfg.tls.clone();
    if let Some(t) = &cfg_tls {
        // Read the PEM files before binding, so a bad file fails the start.
        tls_config(t)?;
    }
    // Fail at start, not at the first tick, when the cluster cannot be reached.
    let kube = if Controller::needs_kube(&cfg) {
        Some(crate::kube::client(cfg.kubernetes.api_url.as_deref()).await?)
    } else {
        None
    };
    let agent_token = match &cfg.cluster_token_file {
        Some(p) => Some(Arc::new(
            preheat_edge::ClusterToken::from_file(p)
                .map_err(|e| crate::error::ScalerError::Config(vec![e.to_string()]))?,
        )),
        None => None,
    };
    let store = DecisionStore::new(models.clone());
    let grpc_listener = tokio::net::TcpListener::bind(cfg.grpc_listen).await?;
    let http_listener = tokio::net::TcpListener::bind(cfg.http_listen).await?;
    tracing::info!(grpc = %grpc_listener.local_addr()?, http = %http_listener.local_addr()?, models = ?models, profile = %profile.source, "scaler listening");
    let mut ctl =
        Controller::new(cfg, profile, Arc::clone(&store), kube).with_agent_token(agent_token);
    for (model, pool, list) in shared {
        ctl = ctl.with_shared(&model, pool, list);
    }
    let controller = tokio::spawn(ctl.run());
    let app =
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route(
                "/metrics",
                get(
                    |State((s, m)): State<(Arc<DecisionStore>, Vec<String>)>| async move {
                        render(&s, &m)
                    },
                ),
            )
            .with_state((Arc::clone(&store), models));
    let (tx, rx) = tokio::sync::watch::channel(false);
    let closing = Arc::clone(&store);
    tokio::spawn(async move {
        stop.await;
        tracing::info!("scaler shutting down");
        closing.close();
        let _ = tx.send(true);
    });
    let mut rx_http = rx.clone();
    let http = tokio::spawn(async move {
        preheat_edge::listener::serve(
            http_listener,
            app,
            preheat_edge::listener::Limits::INTERNAL,
            async move {
                let _ = rx_http.wait_for(|v| *v).await;
            },
        )
        .await
    });
    let mut rx_grpc = rx;
    // KEDA holds one stream per ScaledObject plus its polls: bounded per connection,
    // and dead peers found by keep-alives instead of holding their streams forever.
    let mut builder = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(256)
        .max_concurrent_streams(1024)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        .tcp_keepalive(Some(std::time::Duration::from_secs(60)));
    if let Some(t) = &cfg_tls {
        builder = builder
            .tls_config(tls_config(t)?)
            .map_err(|e| ScalerError::Config(vec![format!("tls: {e}")]))?;
    }
    let grpc = builder
        .add_service(ScalerService::new(store).into_server())
        .serve_with_incoming_shutdown(
            crate::grpc_incoming::capped(grpc_listener, crate::grpc_incoming::MAX_CONNECTIONS),
            async move {
                let _ = rx_grpc.wait_for(|v| *v).await;
            },
        );
    let r = grpc.await;
    controller.abort();
    let _ = http.await;
    r.map_err(|e| ScalerError::Io(std::io::Error::other(e.to_string())))
}
