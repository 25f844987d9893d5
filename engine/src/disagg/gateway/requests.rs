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
        let _held = Held::count(&self.pending);
        let deadline = Instant::now() + self.opts.hold_timeout;
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Some(p) = self.pick(WorkerRole::Decode, &[], blocks, exclude, None) {
                return Ok(p);
            }
            if let Some(why) = self.opts.outage.reason() {
                return Err(outage(why));
            }
            if Instant::now() >= deadline {
                return Err(EngineError::NoWorkers {
                    message: format!(
                        "no decode worker became available within the hold time ({} s); the pool may still be starting",
                        self.opts.hold_timeout.as_secs()
                    ),
                    retry_after_secs: self.opts.hold_timeout.as_secs().clamp(1, 30),
                });
            }
        }
    }

    /// Runs one request on the workers, retrying what a client need never see:
    /// - a prefill worker that fails before the first token: another prefill worker,
    ///   then a prefill on the decode worker itself;
    /// - a decode worker that is draining, unreachable or has no room now: another one;
    ///   with none free, the request waits at the gateway (counted in
    ///   `preheat:gateway_pending_requests`, which the scaler reads) and tries again,
    ///   within the hold time;
    /// - a decode worker lost before the request finished: the request runs again
    ///   elsewhere from the start, after an [`Event::Replayed`] when output had come
    ///   (a consumer that showed none of it discards it; a stream under way ends with
    ///   the error). With a `seed`, the replay samples the same answer.
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
        let hashes = self.prefix_key.block_hashes(&req.prompt, bs);
        // What the decode worker reserves before the K/V flows.
        let blocks = req.prompt.len().div_ceil(bs);
        let mut tries = Tries::new(self.opts.hold_timeout);
        loop {
            if let Err(e) = self.wait_while_busy(&mut tries).await {
                return fail(e);
            }
            let decode = match self.wait_decode(blocks, &tries.passed_over()).await {
                Ok(d) => d,
                Err(e) => return fail(e),
            };
            let disagg = tries.prefill_failures < MAX_PREFILL_TRIES
                && req.prompt.len() >= self.opts.disagg_min_tokens;
            if disagg {
                self.await_announcement(&decode.id).await;
            }
            let mut prefill = if disagg {
                self.pick(
                    WorkerRole::Prefill,
                    &hashes,
                    0,
                    &tries.failed_prefill,
                    Some(&decode.id),
                )
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
            let lost = match tokio::time::timeout(self.opts.stream_idle_timeout, sent).await {
                Ok(Ok(resp)) if resp.status().is_success() => {
                    // The K/V has been pulled: the prefill worker is done with it.
                    if let Some(p) = prefill.take() {
                        self.lock()
                            .prefix
                            .0
                            .entry(p.id)
                            .or_default()
                            .remember(&hashes);
                    }
                    match self.relay(&decode, resp, &out, &mut tries).await {
                        Relayed::Done => return,
                        Relayed::Failed(e) => return fail(e),
                        Relayed::Lost(e) => e,
                    }
                }
                Ok(Ok(resp)) => {
                    match self
                        .refused(&decode, prefill.as_ref(), resp, &mut tries)
                        .await
                    {
                        Ok(()) => continue,
                        Err(e) => return fail(e),
                    }
                }
                // Never connected: nothing was sent, so another decode worker takes
                // it (a refusal, not a replay).
                Ok(Err(e)) if e.is_connect() && tries.refusals < MAX_REFUSALS => {
                    tracing::warn!(decode = %decode.url, error = %e, "decode worker unreachable; trying another");
                    self.drop_worker(&decode.id, "unreachable");
                    tries.refusals += 1;
                    tries.refused.push(decode.id.clone());
                    continue;
                }
                // Died with the request in hand: the client has had nothing from it.
                Ok(Err(e)) => {
                    self.drop_worker(&decode.id, "unreachable");
                    EngineError::Unavailable(format!("decode worker {}: {e}", decode.url))
                }
                // Headers wait for the K/V: with a prefill worker named, a silent
                // decode worker is most likely waiting on a backlogged prefill. That
                // prefill worker is set aside (then the prompt is prefilled on the decode
                // worker itself), and the decode worker, likely healthy, is kept.
                Err(_)
                    if prefill.is_some()
                        && tries.prefill_failures < MAX_PREFILL_TRIES
                        && !tries.silent.contains(&decode.id) =>
                {
                    // Once per decode worker: silent again, it is itself at fault.
                    tries.silent.push(decode.id.clone());
                    let p = prefill.take().map(|p| p.id).unwrap_or_default();
                    tracing::warn!(decode = %decode.url, prefill = %p, "no K/V within the stream's idle time; prefilling elsewhere");
                    tries.prefill_failures += 1;
                    tries.failed_prefill.push(p);
                    continue;
                }
                Err(_) => {
                    self.drop_worker(&decode.id, "no answer");
                    EngineError::Unavailable(format!(
                        "decode worker {} did not answer within {} s",
                        decode.url,
                        self.opts.stream_idle_timeout.as_secs()
                    ))
                }
            };
            // The decode worker is gone before the request finished: run it again, with
            // the hold time and the pause for room started anew.
            tries.refused.push(decode.id.clone());
            if tries.replays >= MAX_REPLAYS {
                return fail(lost);
            }
            tries.replays += 1;
            tries.lost = Some(EngineError::Unavailable(lost.to_string()));
            tries.busy_deadline = Instant::now() + self.opts.hold_timeout;
            tries.busy_pause = FIRST_BUSY_PAUSE;
            self.replays.inc();
            tracing::warn!(decode = %decode.url, error = %lost, replay = tries.replays, "decode worker lost before the request finished; replaying it elsewhere");
            if std::mem::take(&mut tries.forwarded) && out.send(Event::Replayed(lost)).is_err() {
                return;
            }
        }
    }

    /// While every decode worker has answered "no room now" and none other is free:
    /// waits (counted as pending) with a growing pause, then lets them be asked again;
    /// past the hold time, the request fails.
    async fn wait_while_busy(&self, tries: &mut Tries) -> Result<()> {
        if tries.busy.is_empty() || self.has_worker(WorkerRole::Decode, &tries.passed_over()) {
            return Ok(());
        }
        if Instant::now() >= tries.busy_deadline {
            return Err(EngineError::Overloaded {
                retry_after_secs: 1,
            });
        }
        {
            let _held = Held::count(&self.pending);
            tokio::time::sleep(tries.busy_pause).await;
        }
        tries.busy_pause = (tries.busy_pause * 2).min(MAX_BUSY_PAUSE);
        tries.busy.clear();
        Ok(())
    }

    /// A decode worker's refusal (an error status before any event): `Ok` where the
    /// request can be tried again, with the worker or prefill worker at fault set
    /// aside; the client's error otherwise.
    async fn refused(
        &self,
        decode: &Picked,
        prefill: Option<&Picked>,
        resp: reqwest::Response,
        tries: &mut Tries,
    ) -> Result<()> {
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
            too_large: false,
        });
        // Longer than this worker's whole cache: another worker may be larger; with
        // none, the client learns the limit at once.
        if w.too_large {
            tries.refused.push(decode.id.clone());
            // (A busy worker passed its own length check: it counts as one to wait for.)
            if tries.refusals < MAX_REFUSALS && self.has_worker(WorkerRole::Decode, &tries.refused)
            {
                tries.refusals += 1;
                return Ok(());
            }
            // A request that ran before its worker was lost was not too long: the
            // loss is what the client should hear.
            return Err(tries.lost.take().unwrap_or_else(|| w.into_engine()));
        }
        if !w.prefill_failed {
            // A worker draining for scale-down refuses new work: the request has not
            // started, so another decode worker takes it.
            if status == StatusCode::SERVICE_UNAVAILABLE && tries.refusals < MAX_REFUSALS {
                tries.refusals += 1;
                tracing::info!(decode = %decode.url, "decode worker refused (draining); trying another");
                tries.refused.push(decode.id.clone());
                return Ok(());
            }
            // No room in this decode worker now (its cache, its batch or its queue):
            // nothing has started, so another one takes it, or it waits for room.
            if status == StatusCode::TOO_MANY_REQUESTS {
                tracing::debug!(decode = %decode.url, "decode worker had no room; trying another or waiting");
                tries.busy.push(decode.id.clone());
                return Ok(());
            }
            return Err(w.into_engine());
        }
        // The decode worker lacks the list naming that prefill worker (it restarted at
        // the same address): tell it again; the prefill worker is not at fault.
        if w.unannounced && tries.refusals < MAX_REFUSALS {
            tries.refusals += 1;
            tracing::info!(decode = %decode.url, "decode worker did not know the prefill worker; announcing again");
            self.forget_told(&decode.id);
            return Ok(());
        }
        if tries.prefill_failures < MAX_PREFILL_TRIES {
            tries.prefill_failures += 1;
            if let Some(p) = prefill {
                tracing::warn!(prefill = %p.url, error = %w.message, "prefill failed before the first token; retrying elsewhere");
                tries.failed_prefill.push(p.id.clone());
            }
            return Ok(());
        }
        Err(w.into_engine())
    }

    /// Streams a decode worker's events to `out` until the request ends. `Lost` when
    /// the worker went away first (the request may be replayed).
    async fn relay(
        &self,
        decode: &Picked,
        resp: reqwest::Response,
        out: &tokio::sync::mpsc::UnboundedSender<Event>,
        tries: &mut Tries,
    ) -> Relayed {
        let mut stream = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        loop {
            let next = tokio::time::timeout(self.opts.stream_idle_timeout, stream.next()).await;
            let chunk = match next {
                Ok(Some(Ok(c))) => c,
                Ok(Some(Err(e))) => {
                    self.drop_worker(&decode.id, "stream broke");
                    return Relayed::Lost(EngineError::Unavailable(format!(
                        "decode worker {} failed mid-stream: {e}",
                        decode.url
                    )));
                }
                Ok(None) => {
                    self.drop_worker(&decode.id, "stream ended early");
                    return Relayed::Lost(EngineError::Unavailable(format!(
                        "decode worker {} ended the stream early",
                        decode.url
                    )));
                }
                Err(_) => {
                    self.drop_worker(&decode.id, "stream stalled");
                    return Relayed::Lost(EngineError::Unavailable(format!(
                        "decode worker {} stalled",
                        decode.url
                    )));
                }
            };
            buf.extend_from_slice(&chunk);
            if buf.len() > MAX_EVENT_LINE && !buf.contains(&b'\n') {
                self.drop_worker(&decode.id, "oversized event");
                return Relayed::Failed(EngineError::Internal(format!(
                    "decode worker {} sent an event line over {MAX_EVENT_LINE} bytes",
                    decode.url
                )));
            }
            while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let ev = match serde_json::from_slice::<WireEvent>(&line) {
                    Ok(w) => w.into_event(),
                    Err(e) => {
                        return Relayed::Failed(EngineError::Internal(format!(
                            "decode worker sent garbage: {e}"
                        )));
                    }
                };
                let end = matches!(ev, Event::Finished { .. } | Event::Error(_));
                tries.forwarded |= matches!(ev, Event::Delta { .. });
                if out.send(ev).is_err() || end {
                    return Relayed::Done;
                }
            }
        }
    }
}

/// Tries on other decode workers after one refused (draining, unreachable) or lacked
/// the prefill worker's announcement; a refusal for want of room is not counted (the
/// hold time bounds those).
const MAX_REFUSALS: usize = 4;
/// Prefill workers tried before the decode worker prefills the prompt itself.
const MAX_PREFILL_TRIES: usize = 2;
/// Decode workers lost (killed, crashed, cut off) before one request finished, after
/// which it fails: a request that kills its workers should not kill the pool.
const MAX_REPLAYS: usize = 2;
/// The first and the longest pause between asks while every decode worker is busy.
const FIRST_BUSY_PAUSE: Duration = Duration::from_millis(20);
const MAX_BUSY_PAUSE: Duration = Duration::from_secs(1);

/// What one request has been through on its way to a worker.
#[derive(Debug)]
struct Tries {
    /// Decode workers set aside for this request: draining, unreachable, lost.
    refused: Vec<String>,
    /// Decode workers that gave no headers within the idle time once already.
    silent: Vec<String>,
    /// Why the last decode worker running this request was lost.
    lost: Option<EngineError>,
    /// Decode workers that had no room when last asked (asked again after a pause).
    busy: Vec<String>,
    /// Prefill workers that failed this request.
    failed_prefill: Vec<String>,
    prefill_failures: usize,
    refusals: usize,
    replays: usize,
    /// Output has gone to the consumer since the last replay.
    forwarded: bool,
    busy_pause: Duration,
    /// When waiting for room ends.
    busy_deadline: Instant,
}

impl Tries {
    fn new(hold: Duration) -> Self {
        Tries {
            refused: Vec::new(),
            silent: Vec::new(),
            lost: None,
            busy: Vec::new(),
            failed_prefill: Vec::new(),
            prefill_failures: 0,
            refusals: 0,
            replays: 0,
            forwarded: false,
            busy_pause: FIRST_BUSY_PAUSE,
            busy_deadline: Instant::now() + hold,
        }
    }

    /// Decode workers not to ask now.
    fn passed_over(&self) -> Vec<String> {
        self.refused.iter().chain(&self.busy).cloned().collect()
    }
}

/// How relaying a decode worker's stream ended.
enum Relayed {
    /// Finished, failed as the worker said, or the consumer went away.
    Done,
    /// The worker broke the protocol: not retried.
    Failed(EngineError),
    /// The worker went away first.
    Lost(EngineError),
}

/// One request counted in `preheat:gateway_pending_requests` while this lives: a
/// request's task is dropped wherever it waits when its client goes away, and the
/// count must go with it.
struct Held<'a>(&'a IntGauge);

impl<'a> Held<'a> {
    fn count(g: &'a IntGauge) -> Self {
        g.inc();
        Held(g)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}
