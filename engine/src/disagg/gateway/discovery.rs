//! Discovery: a gateway that reads its workers from a [`WorkerSource`] (Kubernetes
//! EndpointSlices) checks each listed worker's model and role, admits it, and reads its
//! load in place of a heartbeat.

use super::*;

impl Gateway {
    /// One discovery pass: new listed workers are checked (model, role) and admitted,
    /// unlisted ones dropped, and every admitted one's load read (its heartbeat).
    pub(super) async fn discover(
        &self,
        source: &dyn WorkerSource,
        refused: &mut HashMap<String, Instant>,
    ) {
        let listed = source.workers();
        let known: Vec<String> = self.lock().workers.keys().cloned().collect();
        for id in &known {
            if !listed.iter().any(|(_, u)| u == id) {
                self.drop_worker(id, "no longer a ready endpoint");
            }
        }
        refused.retain(|u, at| listed.iter().any(|(_, l)| l == u) && at.elapsed() < REFUSED_RETRY);
        let probes = listed.iter().map(|(role, url)| async move {
            let asked = self
                .lock()
                .workers
                .get(url.as_str())
                .map(|e| e.in_flight.snapshot());
            let status = self.read_status(url).await;
            (*role, url, status, asked)
        });
        let mut to_admit = Vec::new();
        for (role, url, status, asked) in futures_util::future::join_all(probes).await {
            let Ok(mut status) = status else {
                continue; // unanswered: the reaper drops it once it stays silent
            };
            status.blocks.truncate(MAX_PEER_BLOCKS);
            let mut g = self.lock();
            if let Some(e) = g.workers.get_mut(url.as_str()) {
                // Admitted while the poll was out: nothing of ours was there then.
                e.report(status.load.clone(), asked.unwrap_or_default());
                if role == WorkerRole::Decode {
                    self.room.room_may_have_freed();
                }
                if role == WorkerRole::Prefill {
                    g.prefix
                        .0
                        .entry(url.clone())
                        .or_default()
                        .replace(&status.blocks);
                }
            } else if !refused.contains_key(url.as_str()) {
                to_admit.push((role, url, status));
            }
        }
        // New workers are checked concurrently, after the known ones were refreshed, so
        // a slow newcomer delays nobody's liveness.
        let admits = to_admit.into_iter().map(|(role, url, status)| async move {
            (url, role, self.admit(role, url, status).await)
        });
        for (url, role, r) in futures_util::future::join_all(admits).await {
            match r {
                Ok(()) => {
                    tracing::info!(worker = %url, role = role.as_str(), "worker discovered");
                    self.room.room_may_have_freed();
                }
                Err(why) => {
                    tracing::warn!(worker = %url, reason = %why, "listed worker not used");
                    refused.insert(url.clone(), Instant::now());
                }
            }
        }
    }

    pub(super) async fn read_status(&self, url: &str) -> std::result::Result<WorkerStatus, String> {
        let r = self
            .client
            .get(format!("{url}/internal/load"))
            .cluster_token(self.token())
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| e.to_string())?;
        let body = read_capped(r, MAX_STATUS_BYTES).await?;
        serde_json::from_slice(&body).map_err(|e| e.to_string())
    }

    /// Checks a listed worker against this gateway's model and its pool, then puts it in
    /// the rotation.
    pub(super) async fn admit(
        &self,
        role: WorkerRole,
        url: &str,
        status: WorkerStatus,
    ) -> std::result::Result<(), String> {
        if let Some(why) = unannounceable(url, status.kv.as_deref()) {
            return Err(why);
        }
        if status.role != role {
            return Err(format!(
                "listed as {} but is a {} worker",
                role.as_str(),
                status.role.as_str()
            ));
        }
        let r = self
            .client
            .get(format!("{url}/internal/model"))
            .cluster_token(self.token())
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| format!("reading its model: {e}"))?;
        let body = read_capped(r, MAX_MODEL_BYTES)
            .await
            .map_err(|e| format!("reading its model: {e}"))?;
        let info: ModelInfo =
            serde_json::from_slice(&body).map_err(|e| format!("reading its model: {e}"))?;
        let mut g = self.lock();
        match &g.compat {
            Some(c) if *c == info.compat => {}
            Some(c) => {
                return Err(format!(
                    "it serves {} with KV compatibility hash {}, this gateway serves {c}: another model or KV layout",
                    info.model, info.compat
                ));
            }
            None => return Err("this gateway has no model to check it against".into()),
        }
        g.workers.insert(
            url.to_owned(),
            Entry::new(
                Registration {
                    id: url.to_owned(),
                    role,
                    url: url.to_owned(),
                    model: info.model,
                    compat: info.compat,
                    kv: status.kv,
                    // Checked above: its compatibility hash is this gateway's own
                    // (computed with this build's format version).
                    kv_format: crate::kv::payload::FORMAT_VERSION,
                },
                status.load,
            ),
        );
        self.count_workers(&g);
        drop(g);
        self.announce_now.notify_one();
        Ok(())
    }
}
