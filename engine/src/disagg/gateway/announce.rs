//! Telling decode workers which prefill workers they may pull K/V from: a decode
//! worker pulls only from addresses its gateway announced (see [`crate::disagg::peers`]).

use super::*;

impl Gateway {
    /// Tells each decode worker which prefill workers it may pull from, when the list
    /// changed for it or its copy nears expiry.
    pub(super) async fn announce_peers(&self) {
        let (list, due) = {
            let g = self.lock();
            // (Addresses were checked against the announcement's bounds when the
            // workers joined; the count is capped here.)
            let mut list: Vec<String> = g
                .workers
                .values()
                .filter(|e| self.can_serve_kv(e))
                .map(Entry::kv_address)
                .collect();
            list.sort();
            list.dedup();
            list.truncate(crate::disagg::peers::MAX_PEERS);
            let due: Vec<(String, String)> = g
                .workers
                .values()
                .filter(|e| e.reg.role == WorkerRole::Decode)
                .filter(|e| {
                    e.told
                        .as_ref()
                        .is_none_or(|(at, told)| *told != list || at.elapsed() >= PEERS_REFRESH)
                })
                .map(|e| (e.reg.id.clone(), e.reg.url.clone()))
                .collect();
            (list, due)
        };
        if due.is_empty() {
            return;
        }
        let announcement = Announcement {
            from: self.instance.clone(),
            seq: self
                .announcements
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            prefill: list.clone(),
            ttl_ms: u64::try_from(PEERS_TTL.as_millis()).unwrap_or(u64::MAX),
        };
        let sends = due.into_iter().map(|(id, url)| {
            let announcement = &announcement;
            async move {
                let sent_at = Instant::now();
                let r = self
                    .client
                    .post(format!("{url}/internal/peers"))
                    .cluster_token(self.token())
                    .json(announcement)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().is_success() => Some((id, sent_at)),
                    Ok(r) => {
                        // Refused by a decode worker that is up: not a passing fault
                        // (said at most every 30 s, as it is retried every tick).
                        if self.refusal_log.ready() {
                            tracing::warn!(decode = %url, status = %r.status(), "peer announcement refused");
                        }
                        None
                    }
                    Err(e) => {
                        tracing::debug!(decode = %url, error = %e, "peer announcement failed");
                        None
                    }
                }
            }
        });
        let done = futures_util::future::join_all(sends).await;
        let mut g = self.lock();
        for (id, sent_at) in done.into_iter().flatten() {
            if let Some(e) = g.workers.get_mut(&id) {
                e.told = Some((sent_at, list.clone()));
            }
        }
    }

    /// Waits (up to [`FIRST_ANNOUNCEMENT_WAIT`]) until a decode worker that was never
    /// told about the prefill workers has been: one that just joined (scale from zero,
    /// a promoted standby) would otherwise prefill its first burst itself.
    pub(super) async fn await_announcement(&self, decode: &str) {
        let waiting = || {
            let g = self.lock();
            let never_told = g.workers.get(decode).is_some_and(|d| d.told.is_none());
            never_told && g.workers.values().any(|e| self.can_serve_kv(e))
        };
        let deadline = Instant::now() + FIRST_ANNOUNCEMENT_WAIT;
        while waiting() && Instant::now() < deadline {
            self.announce_now.notify_one();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Forgets what a decode worker was told (it refused a prefill address, e.g. after
    /// a restart at the same address): the next round announces again.
    pub(super) fn forget_told(&self, decode: &str) {
        if let Some(e) = self.lock().workers.get_mut(decode) {
            e.told = None;
        }
    }
}
