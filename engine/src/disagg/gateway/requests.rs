//! One request's path through the workers: a decode worker (held while the pool is at
//! zero), a prefill worker it may pull from (prefix-aware), the K/V handed over, and
//! the decode worker's events streamed back; failures retried on another worker.

use super::room_queue::{FreesRoom, Ticket};
use super::*;
use crate::disagg::wire::decode_client::{DecodeClient, DecodeStream, Refusal, StreamFault};

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
    /// to the hold time, or until the workers are known not to start. While held, the
    /// request counts as waiting for the decode pool and, when its prompt is `long`
    /// enough to be prefilled apart and no prefill worker is there, for the prefill
    /// pool too: the scaler wakes the pools a request needs, and only those.
    pub(super) async fn wait_decode(
        &self,
        blocks: usize,
        exclude: &[String],
        long: bool,
    ) -> Result<Picked> {
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
        let _held = Held::count(self.pending_for(WorkerRole::Decode));
        let mut for_prefill = None;
        let deadline = Instant::now() + self.opts.hold_timeout;
        loop {
            let no_prefill = long && !self.has_worker(WorkerRole::Prefill, &[]);
            if no_prefill && for_prefill.is_none() {
                for_prefill = Some(Held::count(self.pending_for(WorkerRole::Prefill)));
            } else if !no_prefill {
                for_prefill = None;
            }
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
    ///   with none free, the request waits at the gateway, first come first served
    ///   ([`RoomQueue`](super::room_queue::RoomQueue); counted in `preheat:gateway_pending_requests`, which the scaler
    ///   reads), within the hold time;
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
        // Counted for the prefill pool while this request, long enough to be
        // prefilled apart, runs without a prefill worker because the pool has none:
        // the scaler's only sign that prefill is wanted while decode serves.
        let mut wants_prefill: Option<Held> = None;
        let client = DecodeClient {
            http: &self.client,
            token: self.token(),
            idle: self.opts.stream_idle_timeout,
        };
        loop {
            if let Err(e) = self.wait_for_room(&mut tries).await {
                return fail(e);
            }
            tries.room_mark = self.room.mark();
            let long = req.prompt.len() >= self.opts.disagg_min_tokens;
            let decode = match self.wait_decode(blocks, &tries.passed_over(), long).await {
                Ok(d) => d,
                Err(e) => return fail(e),
            };
            let disagg = tries.prefill_failures < MAX_PREFILL_TRIES && long;
            if disagg {
                self.await_announcement(&decode.id).await;
            }
            let prefill = if disagg {
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
            if prefill.is_some() {
                wants_prefill = None;
            } else if disagg
                && wants_prefill.is_none()
                && !self.has_worker(WorkerRole::Prefill, &[])
            {
                wants_prefill = Some(Held::count(self.pending_for(WorkerRole::Prefill)));
            }
            let body = GenerateBody {
                request_id: format!("gw-{id}"),
                prompt: req.prompt.clone(),
                params: req.params.clone(),
                prefill: prefill.as_ref().map(|p| p.kv.clone()),
            };
            let ask = client.generate(&decode.url, &body);
            let asked = if tries.ticket.is_some() {
                // A worker without room refuses at once; an ask still out after
                // `ADMITTED_AFTER` has been taken (its K/V is being pulled, which can
                // take a prefill's time): the next request in the queue asks then,
                // instead of after this one's first token. Refused late, this one
                // takes its place back.
                tokio::pin!(ask);
                tokio::select! {
                    r = &mut ask => r,
                    () = tokio::time::sleep(ADMITTED_AFTER) => {
                        if let Some(t) = tries.ticket.take() {
                            tries.place = Some(t.place());
                        }
                        ask.await
                    }
                }
            } else {
                ask.await
            };
            let lost = match asked {
                Ok(stream) => {
                    // Admitted: this one's end may free room for those after it.
                    // (Only an admitted request: a refusal frees nothing, and
                    // signalling it sent the refused request straight back to ask
                    // again, in a loop without a pause.)
                    tries.ticket = None;
                    tries.place = None;
                    let _frees_room = FreesRoom(Arc::clone(&self.room));
                    // The K/V has been pulled: the prefill worker is done with it.
                    if let Some(p) = prefill {
                        self.lock()
                            .prefix
                            .0
                            .entry(p.id)
                            .or_default()
                            .remember(&hashes);
                    }
                    match self.relay(&decode, stream, &out, &mut tries).await {
                        Relayed::Done => return,
                        Relayed::Failed(e) => return fail(e),
                        Relayed::Lost(e) => e,
                    }
                }
                Err(refusal) => {
                    match self.refused(refusal, &decode, prefill.as_ref(), &mut tries) {
                        Then::Retry => continue,
                        Then::Fail(e) => return fail(e),
                        Then::Replay(e) => e,
                    }
                }
            };
            // The decode worker is gone before the request finished: run it again, with
            // the hold time and the pause for room started anew. It was dropped from the
            // rotation, so it is not asked again unless it registers anew (its next
            // heartbeat): set aside for good, a pool's only worker would hold the
            // replay for the whole hold time. MAX_REPLAYS bounds the retries.
            if tries.replays >= MAX_REPLAYS {
                return fail(lost);
            }
            tries.replays += 1;
            tries.lost = Some(EngineError::Unavailable(lost.to_string()));
            tries.busy_deadline = tokio::time::Instant::now() + self.opts.hold_timeout;
            if let Some(m) = self.metrics.get() {
                m.replays.inc();
            }
            tracing::warn!(decode = %decode.url, error = %lost, replay = tries.replays, "decode worker lost before the request finished; replaying it elsewhere");
            if std::mem::take(&mut tries.forwarded) && out.send(Event::Replayed(lost)).is_err() {
                return;
            }
        }
    }

    /// While every decode worker has answered "no room now" and none other is free, or
    /// other requests already wait for room: waits in the [`RoomQueue`](super::room_queue::RoomQueue) (counted as
    /// pending) for this request's turn, and, once refused, for a sign that room may
    /// have freed; past the hold time, the request fails.
    async fn wait_for_room(&self, tries: &mut Tries) -> Result<()> {
        let refused_everywhere =
            !tries.busy.is_empty() && !self.has_worker(WorkerRole::Decode, &tries.passed_over());
        if tries.ticket.is_none() {
            if !refused_everywhere && self.room.is_empty() {
                return Ok(());
            }
            // Back from asking a worker: the place it had, else the tail.
            tries.ticket = Some(match tries.place {
                Some(place) => self.room.rejoin(place),
                None => self.room.join(),
            });
        }
        let overloaded = || EngineError::Overloaded {
            retry_after_secs: 1,
        };
        let after = refused_everywhere.then_some(tries.room_mark);
        let _held = Held::count(self.pending_for(WorkerRole::Decode));
        loop {
            // A gateway shutting down (or workers that cannot start) answers at once.
            if let Some(why) = self.opts.outage.reason() {
                return Err(EngineError::NoWorkers {
                    message: format!("no decode worker can be had: {why}"),
                    retry_after_secs: 30,
                });
            }
            let now = tokio::time::Instant::now();
            let ticket = tries.ticket.as_ref().expect("joined above");
            // In steps of at most a second, to see an outage. Past the hold time, a
            // head with a worker not yet asked still asks it; the others fail.
            let step = tries
                .busy_deadline
                .max(now)
                .min(now + Duration::from_secs(1));
            if self.room.wait_turn(ticket, after, step).await {
                break;
            }
            if tokio::time::Instant::now() >= tries.busy_deadline {
                return Err(overloaded());
            }
        }
        // Every worker is asked again after a wait for room; a request that still has
        // one to ask (another worker not yet refused) keeps the ones that refused aside.
        if refused_everywhere {
            tries.busy.clear();
        }
        Ok(())
    }

    /// What follows a decode worker's refusal: another try, with the worker or prefill
    /// worker at fault set aside; the client's error; or, where the worker had the
    /// request in hand when it went, a replay.
    fn refused(
        &self,
        refusal: Refusal,
        decode: &Picked,
        prefill: Option<&Picked>,
        tries: &mut Tries,
    ) -> Then {
        let more_refusals = tries.refusals < MAX_REFUSALS;
        match refusal {
            // Longer than this worker's whole cache: another worker may be larger; with
            // none, the client learns the limit at once.
            Refusal::TooLarge(w) => {
                tries.refused.push(decode.id.clone());
                // (A busy worker passed its own length check: it counts as one to wait
                // for.)
                if more_refusals && self.has_worker(WorkerRole::Decode, &tries.refused) {
                    tries.refusals += 1;
                    return Then::Retry;
                }
                // A request that ran before its worker was lost was not too long: the
                // loss is what the client should hear.
                Then::Fail(tries.lost.take().unwrap_or_else(|| w.into_engine()))
            }
            // A worker draining for scale-down refuses new work: the request has not
            // started, so another decode worker takes it.
            Refusal::Unavailable(_) if more_refusals => {
                tries.refusals += 1;
                tracing::info!(decode = %decode.url, "decode worker refused (draining); trying another");
                tries.refused.push(decode.id.clone());
                Then::Retry
            }
            // No room in this decode worker now (its cache, its batch or its queue):
            // nothing has started, so another one takes it, or it waits for room.
            Refusal::Busy => {
                tracing::debug!(decode = %decode.url, "decode worker had no room; trying another or waiting");
                tries.busy.push(decode.id.clone());
                Then::Retry
            }
            Refusal::Unavailable(w) | Refusal::Failed(w) => Then::Fail(w.into_engine()),
            // The decode worker lacks the list naming that prefill worker (it restarted
            // at the same address): tell it again; the prefill worker is not at fault.
            Refusal::Unannounced(_) if more_refusals => {
                tries.refusals += 1;
                tracing::info!(decode = %decode.url, "decode worker did not know the prefill worker; announcing again");
                self.forget_told(&decode.id);
                Then::Retry
            }
            Refusal::Unannounced(w) | Refusal::PrefillFailed(w) => {
                if tries.prefill_failures >= MAX_PREFILL_TRIES {
                    return Then::Fail(w.into_engine());
                }
                tries.prefill_failures += 1;
                if let Some(p) = prefill {
                    tracing::warn!(prefill = %p.url, error = %w.message, "prefill failed before the first token; retrying elsewhere");
                    tries.failed_prefill.push(p.id.clone());
                }
                Then::Retry
            }
            // Never connected: nothing was sent, so another decode worker takes it (a
            // refusal, not a replay).
            Refusal::Unreachable(e) if more_refusals => {
                tracing::warn!(decode = %decode.url, error = %e, "decode worker unreachable; trying another");
                self.drop_worker(&decode.id, "unreachable");
                tries.refusals += 1;
                tries.refused.push(decode.id.clone());
                Then::Retry
            }
            // Died with the request in hand: the client has had nothing from it.
            Refusal::Unreachable(e) | Refusal::Gone(e) => {
                self.drop_worker(&decode.id, "unreachable");
                Then::Replay(EngineError::Unavailable(format!(
                    "decode worker {}: {e}",
                    decode.url
                )))
            }
            // Headers wait for the K/V: with a prefill worker named, a silent decode
            // worker is most likely waiting on a backlogged prefill. That prefill worker
            // is set aside (then the prompt is prefilled on the decode worker itself),
            // and the decode worker, likely healthy, is kept.
            Refusal::Silent
                if prefill.is_some()
                    && tries.prefill_failures < MAX_PREFILL_TRIES
                    && !tries.silent.contains(&decode.id) =>
            {
                // Once per decode worker: silent again, it is itself at fault.
                tries.silent.push(decode.id.clone());
                let p = prefill.map(|p| p.id.clone()).unwrap_or_default();
                tracing::warn!(decode = %decode.url, prefill = %p, "no K/V within the stream's idle time; prefilling elsewhere");
                tries.prefill_failures += 1;
                tries.failed_prefill.push(p);
                Then::Retry
            }
            Refusal::Silent => {
                self.drop_worker(&decode.id, "no answer");
                Then::Replay(EngineError::Unavailable(format!(
                    "decode worker {} did not answer within {} s",
                    decode.url,
                    self.opts.stream_idle_timeout.as_secs()
                )))
            }
        }
    }

    /// Streams a decode worker's events to `out` until the request ends. `Lost` when
    /// the worker went away first (the request may be replayed).
    async fn relay(
        &self,
        decode: &Picked,
        mut stream: DecodeStream,
        out: &tokio::sync::mpsc::UnboundedSender<Event>,
        tries: &mut Tries,
    ) -> Relayed {
        loop {
            let ev = match stream.next().await {
                Ok(ev) => ev,
                Err(StreamFault::Lost { why, error }) => {
                    self.drop_worker(&decode.id, why);
                    return Relayed::Lost(error);
                }
                Err(StreamFault::Oversized(e)) => {
                    self.drop_worker(&decode.id, "oversized event");
                    return Relayed::Failed(e);
                }
                Err(StreamFault::Garbage(e)) => return Relayed::Failed(e),
            };
            let end = matches!(ev, Event::Finished { .. } | Event::Error(_));
            tries.forwarded |= matches!(ev, Event::Delta { .. });
            if out.send(ev).is_err() || end {
                return Relayed::Done;
            }
        }
    }
}

/// How long an ask of a decode worker, made by a request at the head of the queue for
/// room, goes unanswered before it counts as taken and the next request may ask: a
/// refusal for room is answered at once.
const ADMITTED_AFTER: Duration = Duration::from_millis(200);

/// Tries on other decode workers after one refused (draining, unreachable) or lacked
/// the prefill worker's announcement; a refusal for want of room is not counted (the
/// hold time bounds those).
const MAX_REFUSALS: usize = 4;
/// Prefill workers tried before the decode worker prefills the prompt itself.
const MAX_PREFILL_TRIES: usize = 2;
/// Decode workers lost (killed, crashed, cut off) before one request finished, after
/// which it fails: a request that kills its workers should not kill the pool.
const MAX_REPLAYS: usize = 2;

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
    /// This request's ticket among those waiting for room, while it waits.
    ticket: Option<Ticket>,
    /// Its place, given up while it asks a worker, taken back if refused for room.
    place: Option<u64>,
    /// [`RoomQueue::mark`](super::room_queue::RoomQueue::mark) before the last ask.
    room_mark: u64,
    /// When waiting for room ends.
    busy_deadline: tokio::time::Instant,
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
            ticket: None,
            place: None,
            room_mark: 0,
            busy_deadline: tokio::time::Instant::now() + hold,
        }
    }

    /// Decode workers not to ask now.
    fn passed_over(&self) -> Vec<String> {
        self.refused.iter().chain(&self.busy).cloned().collect()
    }
}

/// What follows a decode worker's refusal.
enum Then {
    /// Try again (on another worker, or after a pause).
    Retry,
    /// The client's error.
    Fail(EngineError),
    /// The worker went away with the request in hand: run it again elsewhere.
    Replay(EngineError),
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
struct Held(Option<IntGauge>);

impl Held {
    fn count(g: Option<IntGauge>) -> Self {
        if let Some(g) = &g {
            g.inc();
        }
        Held(g)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(g) = &self.0 {
            g.dec();
        }
    }
}
