//! One request's path through the workers: a decode worker (held while the pool is at
//! zero), a prefill worker it may pull from (prefix-aware), the K/V handed over, and
//! the decode worker's events streamed back; failures retried on another worker.

use super::*;

impl Gateway {
    /// A worker of `role`; a prefill worker only among those announced to the decode
    /// worker `for_decode` (it pulls from no other). Counted in that worker's load
    /// (with `blocks` reserved there) until the [`Picked`] drops: chosen and counted
    /// under one lock, so concurrent requests see each other.
    pub(super) fn pick(
        &self,
        role: WorkerRole,
        hashes: &[u64],
        blocks: usize,
        exclude: &[String],
        for_decode: Option<&str>,
    ) -> Option<Picked> {
        let g = self.lock();
        let told = for_decode
            .and_then(|d| g.workers.get(d))
            .map_or(&[][..], Entry::told_now);
        let mut cands: Vec<&Entry> = g
            .workers
            .values()
            .filter(|e| e.reg.role == role && !exclude.contains(&e.reg.id))
            .filter(|e| {
                role != WorkerRole::Prefill
                    || (self.can_serve_kv(e) && told.contains(&e.kv_address()))
            })
            .collect();
        if cands.is_empty() {
            return None;
        }
        let turn = self
            .rotation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let first = turn % cands.len();
        cands.rotate_left(first);
        let loads: Vec<Load> = cands.iter().map(|e| e.routing_load()).collect();
        let i = match role {
            WorkerRole::Decode => pick_decode(&loads.iter().collect::<Vec<_>>())?,
            WorkerRole::Prefill => {
                let empty = crate::disagg::router::PrefixMemory::default();
                let pairs: Vec<_> = cands
                    .iter()
                    .zip(&loads)
                    .map(|(e, l)| (l, g.prefix.0.get(&e.reg.id).unwrap_or(&empty)))
                    .collect();
                pick_prefill(&pairs, hashes, 4.0)?
            }
        };
        let e = cands[i];
        Some(Picked {
            id: e.reg.id.clone(),
            url: e.reg.url.clone(),
            kv: e.kv_address(),
            _in_flight: e.in_flight.start(blocks),
        })
    }

    /// Waits for a decode worker (held at the gateway while the pool is at zero), up
    /// to the hold time, or until the workers are known not to start.
    pub(super) async fn wait_decode(&self, blocks: usize, exclude: &[String]) -> Result<Picked> {
        let outage = |why: String| EngineError::NoWorkers {
            message: format!("no decode worker can be had: {why}"),
            retry_after_secs: 30,
        };
        if let Some(p) = self.pick(WorkerRole::Decode, &[], blocks, exclude, None) {
            return Ok(p);
        }
        if let Some(why) = self.opts.outage.reason() {
            return Err(outage(why));
        }
        self.pending.inc();
        let deadline = Instant::now() + self.opts.hold_timeout;
        let got = loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Some(p) = self.pick(WorkerRole::Decode, &[], blocks, exclude, None) {
                break Ok(p);
            }
            if let Some(why) = self.opts.outage.reason() {
                break Err(outage(why));
            }
            if Instant::now() >= deadline {
                break Err(EngineError::NoWorkers {
                    message: format!(
                        "no decode worker became available within the hold time ({} s); the pool may still be starting",
                        self.opts.hold_timeout.as_secs()
                    ),
                    retry_after_secs: self.opts.hold_timeout.as_secs().clamp(1, 30),
                });
            }
        };
        self.pending.dec();
        got
    }

    pub(super) async fn serve_request(
        self: Arc<Self>,
        id: u64,
        req: GenerateRequest,
        out: tokio::sync::mpsc::UnboundedSender<Event>,
    ) {
        let fail = |e: EngineError| {
            let _ = out.send(Event::Error(e));
        };
        let bs = self.lock().block_size.max(1);
        let hashes = block_hashes(&req.prompt, bs);
        // What the decode worker reserves before the K/V flows.
        let blocks = req.prompt.len().div_ceil(bs);
        let mut excluded: Vec<String> = Vec::new();
        // Decode workers that turned the request away before starting it (draining).
        let mut refused: Vec<String> = Vec::new();
        // Two tries on prefill workers, then prefill on the decode worker itself.
        for attempt in 0..3 {
            let decode = match self.wait_decode(blocks, &refused).await {
                Ok(d) => d,
                Err(e) => return fail(e),
            };
            let disagg = attempt < 2 && req.prompt.len() >= self.opts.disagg_min_tokens;
            if disagg {
                self.await_announcement(&decode.id).await;
            }
            let mut prefill = if disagg {
                self.pick(WorkerRole::Prefill, &hashes, 0, &excluded, Some(&decode.id))
            } else {
                None
            };
            let body = GenerateBody {
                request_id: format!("gw-{id}"),
                prompt: req.prompt.clone(),
                params: req.params.clone(),
                prefill: prefill.as_ref().map(|p| p.kv.clone()),
            };
            // Headers come once the worker has the request in hand (K/V pulled, or
            // its local prefill queued): as long as a stream may stay silent.
            let sent = self
                .client
                .post(format!("{}/internal/generate", decode.url))
                .cluster_token(self.token())
                .json(&body)
                .send();
            let resp = match tokio::time::timeout(self.opts.stream_idle_timeout, sent).await {
                Ok(Ok(r)) => r,
                // Not connected: nothing was sent, another decode worker takes it.
                Ok(Err(e)) if e.is_connect() && attempt < 2 => {
                    tracing::warn!(decode = %decode.url, error = %e, "decode worker unreachable; trying another");
                    self.drop_worker(&decode.id, "unreachable");
                    refused.push(decode.id.clone());
                    continue;
                }
                Ok(Err(e)) => {
                    self.drop_worker(&decode.id, "unreachable");
                    return fail(EngineError::Unavailable(format!(
                        "decode worker {}: {e}",
                        decode.url
                    )));
                }
                Err(_) => {
                    self.drop_worker(&decode.id, "no answer");
                    return fail(EngineError::Unavailable(format!(
                        "decode worker {} did not answer within {} s",
                        decode.url,
                        self.opts.stream_idle_timeout.as_secs()
                    )));
                }
            };
            if !resp.status().is_success() {
                let status = resp.status();
                let w: WireError = match read_capped(resp, MAX_ERROR_BYTES).await {
                    Ok(b) => serde_json::from_slice(&b).ok(),
                    Err(_) => None,
                }
                .unwrap_or(WireError {
                    class: "internal".into(),
                    message: format!("decode worker answered HTTP {status}"),
                    prefill_failed: false,
                    unannounced: false,
                });
                // A worker draining for scale-down refuses new work: the request has not
                // started, so another decode worker takes it.
                if status == StatusCode::SERVICE_UNAVAILABLE && !w.prefill_failed && attempt < 2 {
                    tracing::info!(decode = %decode.url, "decode worker refused (draining); trying another");
                    refused.push(decode.id.clone());
                    continue;
                }
                // No room in this decode worker's cache for the prompt's K/V now (it
                // reserves before pulling): nothing has started, so another decode
                // worker with room takes it. Only a pool with no other answers 429.
                if status == StatusCode::TOO_MANY_REQUESTS && !w.prefill_failed && attempt < 2 {
                    refused.push(decode.id.clone());
                    if self.has_worker(WorkerRole::Decode, &refused) {
                        tracing::info!(decode = %decode.url, "decode worker had no room; trying another");
                        continue;
                    }
                    return fail(w.into_engine());
                }
                // The decode worker lacks the list naming that prefill worker (it
                // restarted at the same address): tell it again; the prefill worker is
                // not at fault.
                if w.prefill_failed && w.unannounced && attempt < 2 {
                    tracing::info!(decode = %decode.url, "decode worker did not know the prefill worker; announcing again");
                    self.forget_told(&decode.id);
                    continue;
                }
                if w.prefill_failed && attempt < 2 {
                    if let Some(p) = &prefill {
                        tracing::warn!(prefill = %p.url, error = %w.message, "prefill failed before the first token; retrying elsewhere");
                        excluded.push(p.id.clone());
                    }
                    continue;
                }
                return fail(w.into_engine());
            }
            // The K/V has been pulled: the prefill worker is done with this request.
            if let Some(p) = prefill.take() {
                self.lock()
                    .prefix
                    .0
                    .entry(p.id)
                    .or_default()
                    .remember(&hashes);
            }
            let mut stream = resp.bytes_stream();
            let mut buf: Vec<u8> = Vec::new();
            loop {
                let next = tokio::time::timeout(self.opts.stream_idle_timeout, stream.next()).await;
                let chunk = match next {
                    Ok(Some(Ok(c))) => c,
                    Ok(Some(Err(e))) => {
                        self.drop_worker(&decode.id, "stream broke");
                        return fail(EngineError::Unavailable(format!(
                            "decode worker {} failed mid-stream: {e}",
                            decode.url
                        )));
                    }
                    Ok(None) => {
                        self.drop_worker(&decode.id, "stream ended early");
                        return fail(EngineError::Unavailable(format!(
                            "decode worker {} ended the stream early",
                            decode.url
                        )));
                    }
                    Err(_) => {
                        self.drop_worker(&decode.id, "stream stalled");
                        return fail(EngineError::Unavailable(format!(
                            "decode worker {} stalled",
                            decode.url
                        )));
                    }
                };
                buf.extend_from_slice(&chunk);
                if buf.len() > MAX_EVENT_LINE && !buf.contains(&b'\n') {
                    self.drop_worker(&decode.id, "oversized event");
                    return fail(EngineError::Internal(format!(
                        "decode worker {} sent an event line over {MAX_EVENT_LINE} bytes",
                        decode.url
                    )));
                }
                while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=pos).collect();
                    let ev = match serde_json::from_slice::<WireEvent>(&line) {
                        Ok(w) => w.into_event(),
                        Err(e) => {
                            return fail(EngineError::Internal(format!(
                                "decode worker sent garbage: {e}"
                            )));
                        }
                    };
                    let end = matches!(ev, Event::Finished { .. } | Event::Error(_));
                    if out.send(ev).is_err() || end {
                        return;
                    }
                }
            }
        }
        fail(EngineError::Internal("no attempt left".into()));
    }
}
