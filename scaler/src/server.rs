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

/// The scaler's own metrics: the decisions it publishes.
fn render(store: &DecisionStore, models: &[String]) -> String {
    let mut out = String::new();
    out.push_str("# HELP preheat:scaler_desired_replicas Replicas the policy wants per pool\n# TYPE preheat:scaler_desired_replicas gauge\n");
    for m in models {
        for p in [Pool::Prefill, Pool::Decode] {
            let _ = writeln!(
                out,
                "preheat:scaler_desired_replicas{{model=\"{m}\",pool=\"{}\"}} {}",
                p.as_str(),
                store.get(m, p).desired
            );
        }
    }
    out.push_str("# HELP preheat:scaler_active Whether the pool is active (KEDA activation)\n# TYPE preheat:scaler_active gauge\n");
    for m in models {
        for p in [Pool::Prefill, Pool::Decode] {
            let _ = writeln!(
                out,
                "preheat:scaler_active{{model=\"{m}\",pool=\"{}\"}} {}",
                p.as_str(),
                u8::from(store.get(m, p).active)
            );
        }
    }
    out
}

/// The gRPC endpoint's TLS from PEM files.
fn tls_config(t: &crate::config::TlsSettings) -> Result<tonic::transport::ServerTlsConfig> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let read = |p: &std::path::Path| {
        std::fs::read(p)
            .map_err(|e| ScalerError::Config(vec![format!("tls: {}: {e}", p.display())]))
    };
    let mut c = ServerTlsConfig::new().identity(Identity::from_pem(read(&t.cert)?, read(&t.key)?));
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
    let store = DecisionStore::new(models.clone());
    let grpc_listener = tokio::net::TcpListener::bind(cfg.grpc_listen).await?;
    let http_listener = tokio::net::TcpListener::bind(cfg.http_listen).await?;
    tracing::info!(grpc = %grpc_listener.local_addr()?, http = %http_listener.local_addr()?, models = ?models, profile = %profile.source, "scaler listening");
    let mut ctl = Controller::new(cfg, profile, Arc::clone(&store), kube);
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
        axum::serve(http_listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx_http.wait_for(|v| *v).await;
            })
            .await
    });
    let mut rx_grpc = rx;
    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = &cfg_tls {
        builder = builder
            .tls_config(tls_config(t)?)
            .map_err(|e| ScalerError::Config(vec![format!("tls: {e}")]))?;
    }
    let grpc = builder
        .add_service(ScalerService::new(store).into_server())
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(grpc_listener),
            async move {
                let _ = rx_grpc.wait_for(|v| *v).await;
            },
        );
    let r = grpc.await;
    controller.abort();
    let _ = http.await;
    r.map_err(|e| ScalerError::Io(std::io::Error::other(e.to_string())))
}
