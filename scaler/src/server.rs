//! `preheat scaler run`: the KEDA gRPC endpoint, a health and metrics endpoint, and the
//! control loop, together.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::routing::get;

use crate::config::Config;
use crate::controller::Controller;
use crate::decisions::DecisionStore;
use crate::grpc::ScalerService;
use crate::policy::Pool;
use crate::profile::Profile;
use crate::{Result, ScalerError};

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
    // Each model's own profile, read before binding so a bad file fails the start.
    let mut model_profiles = Vec::new();
    for m in &cfg.models {
        if let Some(p) = &m.profile {
            model_profiles.push((m.name.clone(), Profile::from_file(p)?));
        }
    }
    let store = DecisionStore::new(models.clone());
    let grpc_listener = tokio::net::TcpListener::bind(cfg.grpc_listen).await?;
    let http_listener = tokio::net::TcpListener::bind(cfg.http_listen).await?;
    tracing::info!(grpc = %grpc_listener.local_addr()?, http = %http_listener.local_addr()?, models = ?models, profile = %profile.source, "scaler listening");
    let mut ctl = Controller::new(cfg, profile, Arc::clone(&store), kube)
        .with_agent_token(agent_token.clone());
    for (model, profile) in model_profiles {
        ctl = ctl.with_model_profile(&model, profile);
    }
    for (model, pool, list) in shared {
        ctl = ctl.with_shared(&model, pool, list);
    }
    let (tx, rx) = tokio::sync::watch::channel(false);
    let tx_stop = tx.clone();
    let controller = tokio::spawn(ctl.run(rx.clone()));
    type St = State<(Arc<DecisionStore>, Vec<String>)>;
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(|State((s, m)): St| async move { crate::status::metrics(&s, &m) }),
        )
        .route(
            "/status",
            get(|State((s, m)): St| async move { axum::Json(crate::status::report(&s, &m)) }),
        )
        .with_state((Arc::clone(&store), models));
    // `/status` names endpoints: our own processes and operators with the token only
    // (`/metrics` and `/healthz` stay open for Prometheus and probes).
    // (The command says when there is no token, naming the config key too.)
    let server = preheat_edge::listener::InternalServer::new(http_listener, app, agent_token);
    let closing = Arc::clone(&store);
    tokio::spawn(async move {
        stop.await;
        tracing::info!("scaler shutting down");
        closing.close();
        let _ = tx.send(true);
    });
    let mut rx_http = rx.clone();
    let http = tokio::spawn(server.serve(async move {
        let _ = rx_http.wait_for(|v| *v).await;
    }));
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
    // The controller finishes its tick and saves its state; a stuck one is not waited on.
    // Also when gRPC ended without a stop signal.
    let _ = tx_stop.send(true);
    let abort = controller.abort_handle();
    match tokio::time::timeout(std::time::Duration::from_secs(15), controller).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "the control loop ended abnormally"),
        Err(_) => {
            tracing::warn!(
                "the control loop did not stop within 15 s; the last state file save may be lost"
            );
            abort.abort();
        }
    }
    let _ = http.await;
    r.map_err(ScalerError::Grpc)
}
