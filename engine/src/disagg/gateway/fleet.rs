//! One gateway process, many models: a [`Gateway`] per model (its own workers, router,
//! queue for room and front) behind one public listener, whose API picks the model a
//! request names, and one internal listener, whose registrations go to the model
//! their worker serves.

use super::routes::{deregister, heartbeat, register, workers};
use super::*;
use crate::api::{DEFAULT_MAX_BODY, drain, public_router};

/// The models of one gateway process.
pub(super) struct Fleet {
    /// One per model with a readable manifest, in the order given; with no model
    /// given, one that learns its model from the first worker to register.
    pub(super) gateways: Vec<Arc<Gateway>>,
}

impl Fleet {
    /// The gateway a registering worker belongs to: the model it names, else the
    /// model whose KV compatibility hash it has (a worker started without the served
    /// name), else the only one (which refuses it, saying why). `Err` names the
    /// models served.
    pub(super) fn for_worker(
        &self,
        r: &Registration,
    ) -> std::result::Result<&Arc<Gateway>, String> {
        if let Some(g) = self
            .gateways
            .iter()
            .find(|g| g.model_name() == Some(r.model.as_str()))
        {
            return Ok(g);
        }
        if let Some(g) = self
            .gateways
            .iter()
            .find(|g| g.lock().compat.as_deref() == Some(r.compat.as_str()))
        {
            return Ok(g);
        }
        match self.gateways.as_slice() {
            [only] => Ok(only),
            all => Err(format!(
                "worker {} ({} at {}, KV compatibility hash {}) serves none of this gateway's models: {}",
                r.id,
                r.model,
                r.url,
                r.compat,
                all.iter()
                    .filter_map(|g| g.model_name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// The gateway whose rotation holds the worker `id`.
    pub(super) fn holding(&self, id: &str) -> Option<&Arc<Gateway>> {
        self.gateways
            .iter()
            .find(|g| g.lock().workers.contains_key(id))
    }
}

/// Runs the gateway until `stop` resolves: the OpenAI API on `public` for every model
/// in `opts`, worker registration (when workers register rather than being
/// discovered) on `internal`, behind the cluster token.
pub async fn run(
    public: tokio::net::TcpListener,
    internal: Option<tokio::net::TcpListener>,
    opts: GatewayOptions,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    check_models(&opts.models)?;
    let listener = public;
    let api = ApiState::new(DEFAULT_MAX_BODY).with_api_keys(opts.api_keys.clone());
    // A worker that does not accept a connection within seconds is not there.
    let client = preheat_edge::client::internal()
        .build()
        .map_err(|e| EngineError::Internal(e.to_string()))?;
    let instance = |i: usize| {
        format!(
            "gw-{}-{}-{i}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        )
    };
    let mut gateways = Vec::new();
    if opts.models.is_empty() {
        gateways.push(Arc::new(Gateway::new(
            api.clone(),
            client.clone(),
            &opts,
            None,
            instance(0),
        )));
    }
    for (i, m) in opts.models.iter().enumerate() {
        match &m.info {
            Ok(info) => {
                let gw = Arc::new(Gateway::new(
                    api.clone(),
                    client.clone(),
                    &opts,
                    Some(m),
                    instance(i),
                ));
                gw.install_front(info.clone())?;
                gateways.push(gw);
            }
            Err(why) => {
                tracing::error!(model = %m.name, reason = %why, "model not served: its manifest could not be read");
                api.set_unavailable(&m.name, why.clone());
            }
        }
    }
    let fleet = Arc::new(Fleet { gateways });
    let discovering = opts.models.iter().any(|m| m.discovery.is_some());
    let mut tasks = Vec::new();
    if discovering {
        for gw in &fleet.gateways {
            let Some(source) = gw.discovery.clone() else {
                continue;
            };
            let gw = Arc::clone(gw);
            tasks.push(tokio::spawn(async move {
                let mut refused = HashMap::new();
                loop {
                    gw.discover(source.as_ref(), &mut refused).await;
                    tokio::time::sleep(DISCOVERY_PERIOD).await;
                }
            }));
        }
    } else {
        let Some(internal) = internal else {
            return Err(EngineError::Unavailable(
                "a gateway whose workers register needs an internal listener for them".into(),
            ));
        };
        let routes = axum::Router::new()
            .route("/internal/register", post(register))
            .route("/internal/heartbeat", post(heartbeat))
            .route("/internal/deregister", post(deregister))
            .route("/internal/workers", axum::routing::get(workers))
            .route("/health", axum::routing::get(|| async { "ok" }))
            .layer(axum::extract::DefaultBodyLimit::max(MAX_REGISTRY_BODY))
            .with_state(Arc::clone(&fleet));
        let server = preheat_edge::listener::InternalServer::new(
            internal,
            routes,
            opts.cluster_token.clone(),
        )
        .warn_if_open("worker registration");
        tasks.push(tokio::spawn(async move {
            if let Err(e) = server.serve(std::future::pending()).await {
                tracing::error!(error = %e, "the gateway's internal listener failed");
            }
        }));
    }
    for gw in &fleet.gateways {
        tasks.push(tokio::spawn(announcer(Arc::clone(gw))));
        tasks.push(tokio::spawn(reaper(Arc::clone(gw))));
    }
    let app = public_router(api.clone());
    let served: Vec<&str> = opts.models.iter().map(|m| m.name.as_str()).collect();
    tracing::info!(addr = %listener.local_addr().map_err(|e| EngineError::Unavailable(e.to_string()))?, models = ?served, discovery = discovering, "gateway listening");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let grace = opts.drain_grace;
    let outage = Arc::clone(&opts.outage);
    tokio::spawn(async move {
        stop.await;
        tracing::info!("gateway shutting down: draining in-flight requests");
        // Held requests have not started: they get 503 + Retry-After now, and the
        // client's retry reaches another replica, instead of a reset at the grace's end.
        outage.set("this gateway is shutting down; retry");
        drain(&api, grace).await;
        let _ = stop_tx.send(());
    });
    let r = preheat_edge::listener::serve(
        listener,
        app,
        preheat_edge::listener::Limits::PUBLIC,
        async move {
            let _ = stop_rx.await;
        },
    )
    .await;
    for t in tasks {
        t.abort();
    }
    r.map_err(|e| EngineError::Unavailable(format!("gateway: {e}")))
}

/// Every problem with the models given, at once: a name twice, a name that does not
/// match its manifest's, discovery for some models and registration for others.
fn check_models(models: &[GatewayModel]) -> Result<()> {
    let mut errs = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for m in models {
        if !seen.insert(m.name.as_str()) {
            errs.push(format!("model {:?} is given twice", m.name));
        }
        if let Ok(info) = &m.info
            && info.model != m.name
        {
            errs.push(format!(
                "model {:?} is served as {:?} by its workers",
                m.name, info.model
            ));
        }
    }
    let discovered = models.iter().filter(|m| m.discovery.is_some()).count();
    if discovered > 0 && discovered < models.iter().filter(|m| m.info.is_ok()).count() {
        errs.push(
            "either every model's workers are discovered or every model's register; not both"
                .into(),
        );
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(EngineError::Model(errs.join("; ")))
    }
}

/// Tells `gw`'s decode workers which prefill workers they may pull from, on a tick
/// and whenever a worker joins.
async fn announcer(gw: Arc<Gateway>) {
    loop {
        gw.announce_peers().await;
        tokio::select! {
            () = tokio::time::sleep(PEERS_TICK) => {}
            () = gw.announce_now.notified() => {}
        }
    }
}

/// Drops `gw`'s workers whose heartbeats stopped.
async fn reaper(gw: Arc<Gateway>) {
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let horizon = if gw.discovery.is_some() {
            gw.opts.worker_timeout.max(DISCOVERED_SILENCE)
        } else {
            gw.opts.worker_timeout
        };
        let dead: Vec<String> = gw
            .lock()
            .workers
            .values()
            .filter(|e| e.last_seen.elapsed() > horizon)
            .map(|e| e.reg.id.clone())
            .collect();
        for id in dead {
            gw.drop_worker(&id, "missed heartbeats");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str) -> ModelInfo {
        ModelInfo {
            model: name.into(),
            compat: format!("compat-{name}"),
            block_size: 16,
            max_model_len: 64,
            vocab_size: 32,
            tokenizer: crate::tokenizer::TokenizerParts {
                json: String::new(),
                template: None,
                tool_template: None,
                bos_token: None,
                eos_token: None,
                add_bos: None,
                eos_ids: Vec::new(),
            },
        }
    }

    #[test]
    fn every_problem_with_the_models_is_reported_at_once() {
        let mut renamed = GatewayModel::new(info("b"));
        renamed.name = "c".into();
        let e = check_models(&[
            GatewayModel::new(info("a")),
            GatewayModel::new(info("a")),
            renamed,
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("\"a\" is given twice"), "{e}");
        assert!(e.contains("\"c\" is served as \"b\""), "{e}");
        // An unreadable model beside them is not a problem of the list.
        check_models(&[
            GatewayModel::new(info("a")),
            GatewayModel::unreadable("b", "gone"),
        ])
        .unwrap();
    }
}
