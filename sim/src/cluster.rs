//! The simulated replicas. A prefill replica serves its queue one prompt at a time at
//! the profile's prefill rate for that prompt length, skipping the prefix it holds in
//! its cache; a decode replica runs continuous batching: every running sequence gets
//! one token per step, a step lasting the profile's ITL at the current batch size, and
//! a sequence holds its prompt + output tokens of KV from admission to completion. A
//! prompt too short for the prefill pool is computed on its decode replica, in one of
//! its steps, which takes that much longer for every sequence in it.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::hash::{BuildHasher, Hasher};

use preheat_scaler::profile::Profile;

use crate::block_map::BlockMap;

/// LRU set of prefix blocks held by one prefill replica: a map from block to its node
/// in a list ordered by last use (nodes kept in a slab, reused after eviction), so a
/// touch costs one map lookup per block whether the block is new or not. The simulator
/// touches every routed request's blocks, so this is one of its innermost loops.
#[derive(Clone, Debug)]
pub struct PrefixCache {
    capacity: usize,
    /// Each held block's node.
    by_id: BlockMap<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Least and most recently used nodes.
    head: Option<u32>,
    tail: Option<u32>,
}

#[derive(Clone, Copy, Debug)]
struct Node {
    block: u64,
    prev: Option<u32>,
    next: Option<u32>,
}

/// Block ids are trace-assigned integers (Mooncake's `hash_ids`, or `--rate-scale`'s
/// salted copies of them): a multiply and a shift spread them over the table without
/// SipHash's cost; no peer chooses them.
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockIdHasher;

impl BuildHasher for BlockIdHasher {
    type Hasher = BlockIdHash;
    fn build_hasher(&self) -> BlockIdHash {
        BlockIdHash(0)
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct BlockIdHash(u64);

impl Hasher for BlockIdHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0 ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 ^= self.0 >> 29;
    }
}

impl PrefixCache {
    #[must_use]
    pub fn new(capacity_blocks: usize) -> Self {
        PrefixCache {
            capacity: capacity_blocks,
            by_id: BlockMap::new(u32::MAX),
            nodes: Vec::new(),
            free: Vec::new(),
            head: None,
            tail: None,
        }
    }

    /// Leading blocks of `blocks` present in the cache.
    #[must_use]
    pub fn overlap(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.by_id.get(**b).is_some())
            .count()
    }

    /// Whether nothing is cached.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.by_id.len() == 0
    }

    /// Blocks held, least recently used first.
    pub fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        std::iter::successors(self.head, |&i| self.nodes[i as usize].next)
            .map(|i| self.nodes[i as usize].block)
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            Some(p) => self.nodes[p as usize].next = next,
            None => self.head = next,
        }
        match next {
            Some(n) => self.nodes[n as usize].prev = prev,
            None => self.tail = prev,
        }
    }

    fn push_back(&mut self, i: u32) {
        self.nodes[i as usize].prev = self.tail;
        self.nodes[i as usize].next = None;
        match self.tail {
            Some(t) => self.nodes[t as usize].next = Some(i),
            None => self.head = Some(i),
        }
        self.tail = Some(i);
    }

    /// Marks `blocks` as used now, inserting missing ones and evicting the least
    /// recently used past capacity; `changed(block, added)` hears of each block that
    /// comes or goes.
    pub fn touch(&mut self, blocks: &[u64], mut changed: impl FnMut(u64, bool)) {
        for &b in blocks {
            if let Some(i) = self.by_id.get(b) {
                if self.tail != Some(i) {
                    self.unlink(i);
                    self.push_back(i);
                }
                continue;
            }
            let node = Node {
                block: b,
                prev: None,
                next: None,
            };
            let i = match self.free.pop() {
                Some(i) => {
                    self.nodes[i as usize] = node;
                    i
                }
                None => {
                    self.nodes.push(node);
                    (self.nodes.len() - 1) as u32
                }
            };
            self.by_id.set(b, i);
            self.push_back(i);
            changed(b, true);
        }
        while self.by_id.len() > self.capacity {
            let Some(i) = self.head else { break };
            self.unlink(i);
            let block = self.nodes[i as usize].block;
            self.by_id.set(block, u32::MAX);
            self.free.push(i);
            changed(block, false);
        }
    }
}

/// A prompt queued at or running on a prefill replica.
#[derive(Clone, Copy, Debug)]
pub struct PrefillJob {
    pub req: usize,
    /// Tokens to compute (prompt less the cached prefix).
    pub tokens: f64,
    /// Seconds it takes on this replica.
    pub service_s: f64,
}

#[derive(Clone, Debug)]
pub struct PrefillReplica {
    pub ready_at: f64,
    pub draining: bool,
    queue: VecDeque<PrefillJob>,
    /// Service seconds and tokens of `queue`, kept as it changes: routing asks every
    /// replica for its backlog on every request.
    queued_s: f64,
    queued_tokens: f64,
    /// The job running and when it finishes.
    pub running: Option<(PrefillJob, f64)>,
    pub cache: PrefixCache,
    /// Its slot in the simulator's prefix index, taken when it first caches a block.
    pub(crate) slot: Option<u8>,
    /// Seconds spent computing, for utilisation.
    pub busy_s: f64,
    /// Its share of the profile's speed (below 1 on a host shared with busy peers).
    speed: f64,
    /// Prompts computed in the running job's forward passes beside it (batched
    /// prefill), and those of a finished batch not yet handed out.
    batch: Vec<usize>,
    finished: Vec<usize>,
}

impl PrefillReplica {
    #[must_use]
    pub fn new(ready_at: f64, cache_blocks: usize) -> Self {
        PrefillReplica {
            ready_at,
            draining: false,
            queue: VecDeque::new(),
            queued_s: 0.0,
            queued_tokens: 0.0,
            running: None,
            cache: PrefixCache::new(cache_blocks),
            slot: None,
            busy_s: 0.0,
            speed: 1.0,
            batch: Vec::new(),
            finished: Vec::new(),
        }
    }

    /// Whether it is computing a prompt.
    #[must_use]
    pub fn is_busy(&self) -> bool {
        self.running.is_some()
    }

    /// Prompts being computed: the running job and those batched with it.
    #[must_use]
    pub fn running_prompts(&self) -> usize {
        usize::from(self.running.is_some()) + self.batch.len()
    }

    /// Runs at `speed` × the profile's rate from `t`: the running prompt's remaining
    /// work finishes at the new speed.
    pub fn set_speed(&mut self, t: f64, speed: f64) {
        if speed == self.speed {
            return;
        }
        if let Some((_, end)) = &mut self.running
            && *end > t
        {
            *end = t + (*end - t) * self.speed / speed;
        }
        self.speed = speed;
    }

    #[must_use]
    pub fn is_ready(&self, t: f64) -> bool {
        t >= self.ready_at
    }

    /// Seconds of work queued or left on the running job at `t`.
    #[must_use]
    pub fn backlog_s(&self, t: f64) -> f64 {
        let left = self.running.map_or(0.0, |(_, end)| (end - t).max(0.0));
        left + self.queued_s
    }

    /// Prompts waiting (not running).
    #[must_use]
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Tokens of the prompts waiting.
    #[must_use]
    pub fn queued_tokens(&self) -> f64 {
        self.queued_tokens
    }

    /// Queues a prompt behind the others.
    pub fn enqueue(&mut self, job: PrefillJob) {
        self.queued_s += job.service_s;
        self.queued_tokens += job.tokens;
        self.queue.push_back(job);
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.running.is_none() && self.queue.is_empty() && self.finished.is_empty()
    }

    /// The next time this replica changes state on its own.
    #[must_use]
    pub fn next_event(&self, t: f64) -> f64 {
        if t < self.ready_at {
            return self.ready_at;
        }
        if !self.finished.is_empty() {
            return t;
        }
        match self.running {
            Some((_, end)) => end,
            None if !self.queue.is_empty() => t,
            None => f64::INFINITY,
        }
    }

    /// Finishes the running job if it is due and starts the next one; returns a
    /// finished request (call until `None`: a batch finishes several at once).
    ///
    /// With `batching` (a token budget per forward pass, and the profile), the next job
    /// takes the prompts queued behind it while they fit its last pass, and the head of
    /// the next one into the room still left, as an engine with chunked prefill does;
    /// it runs at the profile's rate for the batch's length. Without, prompts run one
    /// at a time.
    pub fn step(&mut self, t: f64, batching: Option<(f64, &Profile)>) -> Option<usize> {
        if t < self.ready_at {
            return None;
        }
        if let Some(req) = self.finished.pop() {
            return Some(req);
        }
        let mut done = None;
        if let Some((job, end)) = self.running
            && end <= t
        {
            done = Some(job.req);
            // Handed out from the back: in the order the batch took them.
            self.finished.extend(self.batch.drain(..).rev());
            self.running = None;
        }
        if self.running.is_none()
            && let Some(mut job) = self.pop_queued()
        {
            if let Some((budget, profile)) = batching {
                // Room left in the job's last forward pass.
                let room = |tokens: f64| {
                    let last = tokens % budget;
                    if last > 0.0 { budget - last } else { 0.0 }
                };
                while let Some(next) = self.queue.front()
                    && next.tokens <= room(job.tokens)
                    && let Some(next) = self.pop_queued()
                {
                    job.tokens += next.tokens;
                    self.batch.push(next.req);
                }
                if !self.batch.is_empty() {
                    job.service_s = job.tokens / profile.prefill_rate(job.tokens);
                }
                // The engine fills that pass with the head of the next prompt (chunked
                // prefill, first come first served): computed now, while that prompt's
                // first token waits for the rest of it. Its share of the prompt's time
                // moves with it, priced as the prompt was (its length and cached prefix
                // set the rate), so the work queued stays the same.
                let chunk = room(job.tokens);
                if chunk > 0.0
                    && let Some(next) = self.queue.front_mut()
                {
                    let moved = next.service_s * chunk / next.tokens;
                    self.queued_s -= moved;
                    self.queued_tokens -= chunk;
                    next.tokens -= chunk;
                    next.service_s -= moved;
                    job.tokens += chunk;
                    job.service_s += moved;
                }
            }
            self.busy_s += job.service_s / self.speed;
            self.running = Some((job, t + job.service_s / self.speed));
        }
        done
    }

    fn pop_queued(&mut self) -> Option<PrefillJob> {
        let job = self.queue.pop_front()?;
        if self.queue.is_empty() {
            // Sums of floats drift: an empty queue holds exactly nothing.
            (self.queued_s, self.queued_tokens) = (0.0, 0.0);
        } else {
            self.queued_s -= job.service_s;
            self.queued_tokens -= job.tokens;
        }
        Some(job)
    }
}

/// A sequence decoding on a replica.
#[derive(Clone, Copy, Debug)]
pub struct Seq {
    pub req: usize,
    pub remaining: u32,
    pub kv_tokens: f64,
}

/// A sequence decoding on a replica, by the replica's step count at which it ends.
/// Ordered soonest end first (then by request, so ties resolve the same every run).
#[derive(Clone, Copy, Debug)]
struct Running {
    end_step: u64,
    req: usize,
    kv_tokens: f64,
}

impl PartialEq for Running {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Running {}
impl PartialOrd for Running {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Running {
    /// Reversed: `BinaryHeap` is a max-heap and the soonest end must come out first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.end_step, other.req).cmp(&(self.end_step, self.req))
    }
}

/// Every running sequence gets one token per step, so a replica counts steps and each
/// sequence remembers the step it ends at: a step costs O(1) whatever the batch, and
/// the next completion is the heap's top.
#[derive(Clone, Debug)]
pub struct DecodeReplica {
    /// Which replica this is, for the requests that reserved KV here.
    id: u64,
    pub ready_at: f64,
    pub draining: bool,
    seqs: BinaryHeap<Running>,
    steps: u64,
    pub kv_used: f64,
    /// KV tokens and requests reserved here for prompts still in the prefill pool: the
    /// gateway picks a request's decode worker, which reserves the prompt's blocks,
    /// before the prompt is sent to prefill.
    kv_reserved: f64,
    reservations: u32,
    /// Σ (reserved KV − end step) over the running sequences: a sequence's context at
    /// step count `s` is its reserved KV less the tokens it has still to generate,
    /// `kv − (end − s)`, so the batch's mean context is `ends / n + s`.
    ends: f64,
    /// Time of the last step boundary.
    pub clock: f64,
    pub busy_s: f64,
    /// How much longer a step takes than the profile says (above 1 on a host shared
    /// with busy peers).
    slow: f64,
    /// The profile's ITL at the last batch size and mean context asked, (batch,
    /// context's bits, seconds): asked for every replica at every event, and they
    /// seldom change between them. One replica only ever sees its simulation's profile.
    itl_at: std::cell::Cell<(usize, u64, f64)>,
    /// Prompts computed here, by the step count at whose boundary each one's first
    /// token comes (a handful at a time: a plain list).
    firsts: Vec<(u64, usize)>,
    /// Steps longer than the profile's by a prompt computed in them, (step count at
    /// its end, seconds at full speed), in step order.
    longer: Vec<(u64, f64)>,
    /// Places in the steps to come that give no token the engine counts as generated
    /// here, nor an inter-token gap: a prompt computed here waiting for, or giving, its
    /// first token (counted as a first token, after no gap), and K/V that landed in the
    /// step under way, which decodes from the next. They are the earliest places of the
    /// steps to come. (A sequence prefilled elsewhere gives a gap from
    /// its first decode step: the engine takes the shipped first token in at import
    /// and times the next one from then.)
    no_token: u64,
    no_gap: u64,
}

/// The tokens of the decode steps one [`DecodeReplica::advance`] ran, as the engine's
/// metrics count them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stepped {
    /// Tokens generated (first tokens not included).
    pub tokens: f64,
    /// Inter-token gaps observed in steps of the profile's length, each `gap_s` long.
    pub gaps: f64,
    pub gap_s: f64,
    /// Gaps observed in steps lengthened by a prompt computed in them, each
    /// `long_gap_s` long (their mean).
    pub long_gaps: f64,
    pub long_gap_s: f64,
}

impl DecodeReplica {
    /// The same replica, known as `id` to the requests that reserve KV on it.
    #[must_use]
    pub fn with_id(mut self, id: u64) -> Self {
        self.id = id;
        self
    }

    #[must_use]
    pub fn new(ready_at: f64) -> Self {
        DecodeReplica {
            id: 0,
            ready_at,
            draining: false,
            seqs: BinaryHeap::new(),
            steps: 0,
            kv_used: 0.0,
            kv_reserved: 0.0,
            reservations: 0,
            ends: 0.0,
            clock: ready_at,
            busy_s: 0.0,
            slow: 1.0,
            itl_at: std::cell::Cell::new((usize::MAX, 0, 0.0)),
            firsts: Vec::new(),
            longer: Vec::new(),
            no_token: 0,
            no_gap: 0,
        }
    }

    /// Runs at `speed` × the profile's rate from `t`: the step under way keeps the
    /// fraction it has done and finishes the rest at the new speed.
    pub fn set_speed(&mut self, t: f64, speed: f64) {
        let slow = 1.0 / speed;
        if slow == self.slow {
            return;
        }
        // A clock ahead of `t` (only while a prompt computed here awaits its first
        // token) is that compute still to come: it stretches too.
        if !self.seqs.is_empty() && (t > self.clock || !self.firsts.is_empty()) {
            let clock = t - (t - self.clock) * slow / self.slow;
            if self.clock > t {
                self.busy_s += clock - self.clock;
            }
            self.clock = clock;
        }
        self.slow = slow;
    }

    #[must_use]
    pub fn is_ready(&self, t: f64) -> bool {
        t >= self.ready_at
    }

    /// Sequences running.
    #[must_use]
    pub fn running(&self) -> usize {
        self.seqs.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Nothing running and nothing reserved: a draining replica can go.
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty() && self.reservations == 0
    }

    /// KV tokens held: running sequences' and reserved.
    #[must_use]
    pub fn kv_held(&self) -> f64 {
        self.kv_used + self.kv_reserved
    }

    #[must_use]
    pub fn id(&self) -> u64 {
        self.id
    }

    /// KV tokens reserved here for prompts still in the prefill pool.
    #[must_use]
    pub fn kv_reserved(&self) -> f64 {
        self.kv_reserved
    }

    /// Whether `kv` more tokens fit beside those running and reserved (a replica holding
    /// nothing takes any, so an oversized request cannot wait forever).
    #[must_use]
    pub fn has_room(&self, kv: f64, kv_capacity: f64) -> bool {
        self.is_idle() || self.kv_held() + kv <= kv_capacity
    }

    /// Whether a sequence needing `kv` tokens fits: room in the cache and a place in the
    /// batch (reservations hold blocks, not places, as the engine's do).
    #[must_use]
    pub fn fits(&self, kv: f64, max_batch: usize, kv_capacity: f64) -> bool {
        self.is_idle() || (self.seqs.len() < max_batch && self.has_room(kv, kv_capacity))
    }

    /// Reserves `kv` tokens for a prompt that will be prefilled elsewhere.
    pub fn reserve(&mut self, kv: f64) {
        self.kv_reserved += kv;
        self.reservations += 1;
    }

    /// Gives back a reservation of `kv` tokens, made with [`Self::reserve`] (its
    /// sequence lands).
    pub fn unreserve(&mut self, kv: f64) {
        debug_assert!(self.reservations > 0, "gave back a reservation never made");
        self.reservations = self.reservations.saturating_sub(1);
        // The last one out leaves exactly nothing, whatever the rounding on the way.
        self.kv_reserved = if self.reservations == 0 {
            0.0
        } else {
            (self.kv_reserved - kv).max(0.0)
        };
    }

    pub fn admit(&mut self, t: f64, seq: Seq) {
        if self.seqs.is_empty() {
            self.clock = self.clock.max(t);
        }
        self.join(seq, self.steps);
    }

    /// Puts `seq` in the batch, its KV held, generating its tokens in the steps after
    /// step count `from`.
    fn join(&mut self, seq: Seq, from: u64) {
        self.kv_used += seq.kv_tokens;
        let end_step = from + u64::from(seq.remaining);
        self.ends += seq.kv_tokens - end_step as f64;
        self.seqs.push(Running {
            end_step,
            req: seq.req,
            kv_tokens: seq.kv_tokens,
        });
    }

    /// Admits a sequence prefilled elsewhere as the engine takes its K/V in: between
    /// steps. Into a step under way it waits for that step's end, where its first token
    /// streams, and decodes from the next step on; on a replica between steps (idle, or
    /// at a boundary) it lands at once. Returns when it lands.
    pub fn resume(&mut self, t: f64, seq: Seq, profile: &Profile) -> f64 {
        if self.seqs.is_empty() || self.clock >= t {
            // A clock ahead of `t` is an idle replica's prompt pass under way, which
            // ends at the current step count: the next step is the sequence's first.
            let at = if self.seqs.is_empty() { t } else { self.clock };
            self.admit(t, seq);
            return at;
        }
        // No token or gap of its own in the step under way.
        self.no_token += 1;
        self.no_gap += 1;
        self.join(seq, self.steps + 1);
        // The step under way is timed with it in the batch (a step's time is its
        // batch's here), a fraction of one step's difference. Never before now: the
        // clock can trail `t` by more than a step where steps are timed at their own,
        // shorter context (`advance`), and the new sequence can shorten the mean.
        self.boundary(self.steps + 1, self.step_s(profile, 1))
            .max(t)
    }

    /// Admits a sequence whose prompt (`prefill_s` of compute at full speed) is
    /// computed here rather than on the prefill pool, as the gateway does with prompts
    /// shorter than its `--disagg-min-tokens`. The prompt joins the step after the one
    /// under way, as the engine's scheduler (decodes first, new prompts in the next
    /// pass) gives it: that step takes its compute longer for every sequence in it, and
    /// the prompt's first token comes at its end. On an idle replica the step is the
    /// prompt alone, from now. `seq.remaining` counts the tokens after the first.
    pub fn admit_prefilling(&mut self, t: f64, seq: Seq, prefill_s: f64) {
        let first_step = if self.seqs.is_empty() {
            self.clock = self.clock.max(t);
            let compute = prefill_s * self.slow;
            self.clock += compute;
            self.busy_s += compute;
            self.steps
        } else {
            // A clock ahead of `t` is an idle replica's prompt pass under way, which
            // ends at the current step count; otherwise a decode step is.
            let next = if self.clock > t {
                self.steps + 1
            } else {
                self.steps + 2
            };
            match self.longer.last_mut() {
                Some((at, s)) if *at == next => *s += prefill_s,
                _ => self.longer.push((next, prefill_s)),
            }
            next
        };
        // In the batch from the next step, its first token at the end of step
        // `first_step`: no token counted here, nor a gap, up to then.
        self.no_token += first_step - self.steps;
        self.no_gap += first_step - self.steps;
        self.firsts.push((first_step, seq.req));
        self.join(seq, first_step);
    }

    /// Steps until the next sequence completes or a prompt computed here gives its
    /// first token.
    fn steps_to_next(&self) -> Option<u64> {
        let first = self.firsts.iter().map(|f| f.0).min();
        let end = self.seqs.peek().map(|s| s.end_step);
        let next = match (first, end) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some(next - self.steps)
    }

    /// Seconds one step takes now, over the `ahead` steps to the next event: the
    /// profile's ITL at this batch and, where the profile measured how it grows with
    /// the context, at the batch's mean context halfway through those steps (each
    /// sequence's prompt and the tokens it has generated by then).
    fn step_s(&self, profile: &Profile, ahead: u64) -> f64 {
        let n = self.seqs.len();
        let context = if profile.decode_itl_long.is_some() && n > 0 {
            (self.ends / n as f64 + self.steps as f64 + ahead as f64 / 2.0).max(0.0)
        } else {
            0.0
        };
        let (at, ctx, itl) = self.itl_at.get();
        let itl = if at == n && ctx == context.to_bits() {
            itl
        } else {
            let itl = profile.itl_at(n as f64, context);
            self.itl_at.set((n, context.to_bits(), itl));
            itl
        };
        itl * self.slow
    }

    /// Seconds, at the current speed, that prompts computed here add to the steps up
    /// to step count `step` (0.0, and no work, when none are).
    fn longer_up_to(&self, step: u64) -> f64 {
        if self.longer.is_empty() {
            return 0.0;
        }
        let s: f64 = self
            .longer
            .iter()
            .take_while(|l| l.0 <= step)
            .map(|l| l.1)
            .sum();
        s * self.slow
    }

    /// When step count `step` (ahead of the current one) is reached if nothing
    /// changes, steps lasting `itl`.
    fn boundary(&self, step: u64, itl: f64) -> f64 {
        self.clock + (step - self.steps) as f64 * itl + self.longer_up_to(step)
    }

    /// When the next sequence completes, or a prompt computed here gives its first
    /// token, if nothing else changes.
    #[must_use]
    pub fn next_event(&self, t: f64, profile: &Profile) -> f64 {
        if t < self.ready_at {
            return self.ready_at;
        }
        match self.steps_to_next() {
            Some(min) => self.boundary(self.steps + min, self.step_s(profile, min)),
            None => f64::INFINITY,
        }
    }

    /// Runs whole steps up to `t`, stopping at the first event so the caller can admit
    /// at that boundary; returns `(request, time)` of first tokens of prompts computed
    /// here and of finished sequences.
    pub fn advance(
        &mut self,
        t: f64,
        profile: &Profile,
        first: &mut Vec<(usize, f64)>,
        done: &mut Vec<(usize, f64)>,
    ) -> Stepped {
        let Some(min) = self.steps_to_next() else {
            self.clock = self.clock.max(t);
            return Stepped::default();
        };
        let itl = self.step_s(profile, min);
        // The event `next_event` reports is reached at that very time, computed the
        // same way: dividing back rounds below it once the clock is large.
        let due = self.boundary(self.steps + min, itl);
        let k = if t >= due {
            min
        } else {
            // Whole steps done by `t`, short of the event: the cast truncates toward
            // zero and saturates below at 0, which is floor-then-clamp for these
            // values without a libm call (this runs for every replica at every event).
            let mut k = ((((t - self.clock) / itl) + 1e-9) as u64).min(min.saturating_sub(1));
            // Longer steps on the way: fewer done (a few passes, a prompt being a
            // few steps' compute).
            while k > 0 && !self.longer.is_empty() && self.boundary(self.steps + k, itl) > t {
                k -= 1;
            }
            k
        };
        // Steps short of the event are timed at their own context (halfway through
        // them, not to the event): the clock stays at or before `t`, as the context
        // only grows. At the event, as `next_event` timed it.
        let itl = if k < min {
            self.step_s(profile, k)
        } else {
            itl
        };
        // As `boundary` sums it, so that the event is reached at its own time; and
        // with no prompt computed here, exactly the steps' time.
        let span = k as f64 * itl;
        let longer = self.longer_up_to(self.steps + k);
        let lengthened = if longer > 0.0 {
            let last = self.steps + k;
            self.longer.iter().take_while(|l| l.0 <= last).count() as u64
        } else {
            0
        };
        self.clock = self.clock + span + longer;
        self.busy_s += span + longer;
        self.steps += k;
        let steps = self.steps;
        self.longer.retain(|l| l.0 > steps);
        let stepped = self.count(k, itl, lengthened, longer);
        // Short of the event (a sequence admitted with nothing to generate is due at
        // once, without a step; a prompt computed here, once its compute is done).
        if k < min || t < due {
            return stepped;
        }
        let steps = self.steps;
        let clock = self.clock;
        self.firsts.retain(|&(at, req)| {
            let due = at <= steps;
            if due {
                first.push((req, clock));
            }
            !due
        });
        let mut freed = 0.0;
        while let Some(s) = self.seqs.peek()
            && s.end_step <= self.steps
        {
            done.push((s.req, self.clock));
            freed += s.kv_tokens;
            self.ends -= s.kv_tokens - s.end_step as f64;
            self.seqs.pop();
        }
        if self.seqs.is_empty() {
            debug_assert!(
                self.no_token == 0 && self.no_gap == 0,
                "places left for sequences that are gone"
            );
            (self.kv_used, self.ends) = (0.0, 0.0);
            (self.no_token, self.no_gap) = (0, 0);
        } else {
            self.kv_used = (self.kv_used - freed).max(0.0);
        }
        stepped
    }

    /// The tokens and gaps of `k` steps of `itl` seconds just run by every running
    /// sequence, `lengthened` of them longer by `longer` seconds in all (prompts
    /// computed in them): their gaps are that much longer, the others' are not.
    fn count(&mut self, k: u64, itl: f64, lengthened: u64, longer: f64) -> Stepped {
        if k == 0 {
            return Stepped::default();
        }
        let n = self.seqs.len() as u64;
        let places = k * n;
        let take = |pending: &mut u64| {
            let taken = (*pending).min(places);
            *pending -= taken;
            (places - taken) as f64
        };
        let tokens = take(&mut self.no_token);
        let gaps = take(&mut self.no_gap);
        // A lengthened step's gaps are those of every sequence but the prompts computed
        // in it (at least one), which give their first tokens there.
        let long_gaps = if lengthened > 0 {
            gaps.min((lengthened.min(k) * n.saturating_sub(1)) as f64)
        } else {
            0.0
        };
        Stepped {
            tokens,
            gaps: gaps - long_gaps,
            gap_s: itl,
            long_gaps,
            long_gap_s: if long_gaps > 0.0 {
                itl + longer / lengthened as f64
            } else {
                0.0
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_cache_is_lru() {
        let mut c = PrefixCache::new(3);
        c.touch(&[1, 2, 3], |_, _| {});
        assert_eq!(c.overlap(&[1, 2, 3, 4]), 3);
        c.touch(&[1], |_, _| {});
        c.touch(&[4], |_, _| {});
        // 2 was least recently used.
        assert_eq!(c.overlap(&[1, 2]), 1);
        assert_eq!(c.overlap(&[4]), 1);
    }

    #[test]
    fn decode_steps_at_the_batch_itl() {
        let p = Profile::default();
        let mut r = DecodeReplica::new(0.0);
        r.admit(
            0.0,
            Seq {
                req: 0,
                remaining: 10,
                kv_tokens: 100.0,
            },
        );
        r.admit(
            0.0,
            Seq {
                req: 1,
                remaining: 20,
                kv_tokens: 100.0,
            },
        );
        let itl2 = p.itl(2.0);
        assert!((r.next_event(0.0, &p) - 10.0 * itl2).abs() < 1e-9);
        let mut done = Vec::new();
        r.advance(1.0, &p, &mut Vec::new(), &mut done);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, 0);
        assert!((done[0].1 - 10.0 * itl2).abs() < 1e-9);
        assert_eq!(r.kv_used, 100.0);
        // The survivor continues alone, at batch-1 ITL.
        r.advance(1.0, &p, &mut Vec::new(), &mut done);
        assert_eq!(done.len(), 2);
        assert!((done[1].1 - (10.0 * itl2 + 10.0 * p.itl(1.0))).abs() < 1e-9);
    }

    #[test]
    fn a_slowed_replica_finishes_the_rest_of_its_work_at_the_new_speed() {
        let p = Profile::default();
        let itl = p.itl(1.0);
        let mut d = DecodeReplica::new(0.0);
        d.admit(
            0.0,
            Seq {
                req: 0,
                remaining: 10,
                kv_tokens: 1.0,
            },
        );
        // Two and a half steps done at full speed, the rest at half.
        let t = 2.5 * itl;
        let mut done = Vec::new();
        d.advance(t, &p, &mut Vec::new(), &mut done);
        d.set_speed(t, 0.5);
        let end = d.next_event(t, &p);
        assert!((end - (t + 7.5 * 2.0 * itl)).abs() < 1e-12, "{end}");
        d.advance(end, &p, &mut Vec::new(), &mut done);
        assert_eq!(done.len(), 1);
        assert!((done[0].1 - end).abs() < 1e-12);

        let mut r = PrefillReplica::new(0.0, 4);
        r.enqueue(PrefillJob {
            req: 3,
            tokens: 100.0,
            service_s: 1.0,
        });
        assert_eq!(r.step(0.0, None), None);
        r.set_speed(0.25, 0.5);
        assert_eq!(r.next_event(0.25), 0.25 + 0.75 * 2.0);
        assert_eq!(r.step(1.75, None), Some(3));
    }

    #[test]
    fn a_reservation_holds_room_in_the_cache_and_keeps_the_replica_from_idling() {
        let mut r = DecodeReplica::new(0.0).with_id(7);
        assert!(r.is_idle());
        r.reserve(60.0);
        // Reserved room counts against the cache, not the batch (the engine's
        // reservations hold blocks), and keeps the replica from going.
        assert!(!r.is_idle() && r.is_empty());
        assert_eq!(r.kv_held(), 60.0);
        assert!(r.fits(40.0, 4, 100.0) && !r.fits(41.0, 4, 100.0));
        assert!(r.fits(1.0, 1, 100.0));
        r.unreserve(60.0);
        r.admit(0.0, seq(1, 3));
        assert!(!r.is_idle() && r.kv_reserved() == 0.0);
        assert_eq!(r.id(), 7);
    }

    fn seq(req: usize, remaining: u32) -> Seq {
        Seq {
            req,
            remaining,
            kv_tokens: 10.0,
        }
    }

    /// Advances `r` from `t` event by event until it is empty: the tokens and gaps it
    /// counted, its lengthened gaps as (count, seconds), and the time it ended.
    fn run_dry(
        r: &mut DecodeReplica,
        mut t: f64,
        first: &mut Vec<(usize, f64)>,
        done: &mut Vec<(usize, f64)>,
    ) -> (f64, f64, Vec<(f64, f64)>, f64) {
        let p = Profile::default();
        let (mut tokens, mut gaps, mut long) = (0.0, 0.0, Vec::new());
        while !r.is_empty() {
            t = r.next_event(t, &p);
            let s = r.advance(t, &p, first, done);
            assert!(s.gaps == 0.0 || s.gap_s > 0.0, "{s:?}");
            tokens += s.tokens;
            gaps += s.gaps + s.long_gaps;
            if s.long_gaps > 0.0 {
                long.push((s.long_gaps, s.long_gap_s));
            }
        }
        (tokens, gaps, long, t)
    }

    #[test]
    fn kv_handed_over_mid_step_lands_when_the_step_ends_and_decodes_from_the_next() {
        let p = Profile::default();
        let step = p.itl(1.0);
        let (mut first, mut done) = (Vec::new(), Vec::new());
        // Idle: it lands at once, and its first decode step starts now.
        let mut idle = DecodeReplica::new(0.0);
        assert_eq!(idle.resume(0.3, seq(0, 2), &p), 0.3);
        let (tokens, gaps, _, end) = run_dry(&mut idle, 0.3, &mut first, &mut done);
        assert_eq!((tokens, gaps), (2.0, 2.0));
        assert!((end - (0.3 + 2.0 * step)).abs() < 1e-12, "{end}");
        // Into a step under way: the engine imports between steps, so the first token
        // streams when that step ends, and the sequence's own tokens come from the next
        // step on; the step under way gives no token or gap of its own.
        let mut r = DecodeReplica::new(0.0);
        r.admit(0.0, seq(1, 1));
        let at = r.resume(0.5 * step, seq(2, 3), &p);
        // (The step under way is timed at the batch with it.)
        assert!((at - p.itl(2.0)).abs() < 1e-12, "{at}");
        done.clear();
        let (tokens, gaps, _, _) = run_dry(&mut r, 0.5 * step, &mut first, &mut done);
        assert_eq!((tokens, gaps), (1.0 + 3.0, 1.0 + 3.0));
        let ended = done.iter().find(|d| d.0 == 2).unwrap().1;
        // Sequence 1 ends with the step under way; 2 decodes alone after it.
        let expected = at + 3.0 * step;
        assert!(
            (ended - expected).abs() < 1e-9,
            "{ended} against {expected}"
        );
    }

    #[test]
    fn kv_never_lands_before_it_is_handed_over() {
        // Steps that grow steeply with the context: `advance` times the steps short of
        // an event at their own (shorter) context, so the clock can trail the present
        // by more than a step; and a short newcomer shortens the batch's mean context.
        use preheat_scaler::profile::ContextItl;
        let p = Profile {
            decode_itl_long: Some(ContextItl {
                short_context: 8.0,
                context: 2048.0,
                itl_s: vec![(1.0, 0.2), (256.0, 0.4)],
            }),
            ..Profile::default()
        };
        let long = |req| Seq {
            req,
            remaining: 400,
            kv_tokens: 4_000.0,
        };
        let mut r = DecodeReplica::new(0.0);
        r.admit(0.0, long(0));
        r.admit(0.0, long(1));
        let (mut first, mut done) = (Vec::new(), Vec::new());
        let mut t = 0.0;
        // Long strides with no event between: tens of steps each.
        for _ in 0..6 {
            t += 13.7;
            r.advance(t, &p, &mut first, &mut done);
            let mut probe = r.clone();
            let at = probe.resume(t, seq(9, 3), &p);
            assert!(at >= t, "landed at {at}, handed over at {t}");
            assert!(at <= t + p.itl_at(3.0, 4_000.0) + 1e-9, "{at} at {t}");
        }
        // An idle replica's prompt pass under way: it lands when the pass ends.
        let mut passing = DecodeReplica::new(0.0);
        passing.admit_prefilling(1.0, seq(3, 2), 0.5);
        assert_eq!(passing.resume(1.2, seq(4, 2), &p), 1.5);
    }

    #[test]
    fn each_step_counts_the_tokens_and_gaps_the_engine_would() {
        let p = Profile::default();
        let mut r = DecodeReplica::new(0.0);
        let (mut first, mut done) = (Vec::new(), Vec::new());
        // Prefilled elsewhere: 5 tokens here, each with a gap (the first from the
        // import, where the engine takes the shipped first token in).
        r.admit(0.0, seq(0, 5));
        // A prompt computed here while a step is under way: no token in that step, its
        // first token (counted as one) in the next, then 3 tokens with a gap each.
        let at = 0.5 * p.itl(1.0);
        r.admit_prefilling(at, seq(1, 3), 0.01);
        let (tokens, gaps, long, t) = run_dry(&mut r, at, &mut first, &mut done);
        assert_eq!(first.len(), 1);
        assert_eq!(done.len(), 2);
        assert_eq!((tokens, gaps), (5.0 + 3.0, 5.0 + 3.0));
        // The step computing the prompt is the one decoding sequence's gap made longer
        // by the prompt's compute; no other gap is.
        assert_eq!(long.len(), 1, "{long:?}");
        assert_eq!(long[0].0, 1.0);
        assert!((long[0].1 - (p.itl(2.0) + 0.01)).abs() < 1e-12, "{long:?}");
        // An idle replica computes a prompt alone, then decodes: each token after the
        // first has a gap.
        let mut idle = DecodeReplica::new(0.0);
        idle.admit_prefilling(t, seq(2, 4), 0.01);
        let (tokens, gaps, long, _) = run_dry(&mut idle, t, &mut first, &mut done);
        assert_eq!((tokens, gaps), (4.0, 4.0));
        assert!(long.is_empty(), "{long:?}");
    }

    #[test]
    fn regression_a_one_token_answer_took_a_gap_from_a_later_sequence() {
        let p = Profile::default();
        let mut r = DecodeReplica::new(0.0);
        let (mut first, mut done) = (Vec::new(), Vec::new());
        // Nothing to generate after the first token: done without a step.
        r.admit(0.0, seq(0, 0));
        assert_eq!(
            r.advance(0.0, &p, &mut first, &mut done),
            Stepped::default()
        );
        assert_eq!(done.len(), 1);
        r.admit(0.0, seq(1, 2));
        let (tokens, gaps, _, _) = run_dry(&mut r, 0.0, &mut first, &mut done);
        assert_eq!((tokens, gaps), (2.0, 2.0));
    }

    #[test]
    fn a_prompt_computed_on_decode_gives_its_first_token_when_its_step_ends() {
        let p = Profile::default();
        let (itl1, itl2) = (p.itl(1.0), p.itl(2.0));
        let seq = |req, remaining| Seq {
            req,
            remaining,
            kv_tokens: 10.0,
        };
        let (mut first, mut done) = (Vec::new(), Vec::new());
        // Idle: the step is the prompt alone, then a token a step.
        let mut r = DecodeReplica::new(0.0);
        r.admit_prefilling(1.0, seq(0, 3), 0.1);
        r.advance(r.next_event(1.0, &p), &p, &mut first, &mut done);
        assert_eq!(first, vec![(0, 1.1)]);
        r.advance(r.next_event(1.1, &p), &p, &mut first, &mut done);
        assert_eq!(done.len(), 1);
        assert!((done[0].1 - (1.1 + 3.0 * itl1)).abs() < 1e-12, "{done:?}");
        assert!((r.busy_s - (0.1 + 3.0 * itl1)).abs() < 1e-12);

        // Busy: the prompt joins the step after the one under way, which is longer by
        // its compute for the sequence already running too.
        let (mut first, mut done) = (Vec::new(), Vec::new());
        let mut r = DecodeReplica::new(0.0);
        r.admit(0.0, seq(0, 10));
        let t = 2.5 * itl1;
        r.advance(t, &p, &mut first, &mut done);
        r.admit_prefilling(t, seq(1, 2), 0.1);
        let at = r.next_event(t, &p);
        assert!((at - (2.0 * itl1 + 0.1 + 2.0 * itl2)).abs() < 1e-12, "{at}");
        // Nothing is handed out before its time.
        r.advance(at - 1e-6, &p, &mut first, &mut done);
        assert!(first.is_empty());
        r.advance(at, &p, &mut first, &mut done);
        assert_eq!(first, vec![(1, at)]);
        while !r.is_empty() {
            let at = r.next_event(at, &p);
            r.advance(at, &p, &mut first, &mut done);
        }
        let b_done = 2.0 * itl1 + 0.1 + 4.0 * itl2;
        assert_eq!(done[0].0, 1);
        assert!((done[0].1 - b_done).abs() < 1e-12);
        assert_eq!(done[1].0, 0);
        assert!((done[1].1 - (b_done + 4.0 * itl1)).abs() < 1e-12);

        // A second prompt arriving during an idle replica's prompt pass joins the
        // next pass: the first one's first token is not held back by it.
        let (mut first, mut done) = (Vec::new(), Vec::new());
        let mut r = DecodeReplica::new(0.0);
        r.admit_prefilling(1.0, seq(0, 1), 0.1);
        r.admit_prefilling(1.05, seq(1, 1), 0.1);
        let at = r.next_event(1.05, &p);
        assert!((at - 1.1).abs() < 1e-12, "{at}");
        r.advance(at, &p, &mut first, &mut done);
        assert_eq!(first, vec![(0, at)]);
        let second = r.next_event(at, &p);
        assert!((second - (1.1 + itl2 + 0.1)).abs() < 1e-12, "{second}");
        // Nothing before its time; then the second's first token, in the step that
        // gave the first one its second token; then the second's second, alone.
        r.advance(second - 1e-3, &p, &mut first, &mut done);
        assert_eq!((first.len(), done.len()), (1, 0));
        r.advance(second, &p, &mut first, &mut done);
        assert_eq!((first[1].0, &done[..]), (1, &[(0, second)][..]));
        let last = r.next_event(second, &p);
        assert!((last - (second + itl1)).abs() < 1e-12, "{last}");
        r.advance(last, &p, &mut first, &mut done);
        assert_eq!(done[1].0, 1);
        assert!((r.busy_s - (0.1 + itl2 + 0.1 + itl1)).abs() < 1e-12);

        // The compute still to come runs at the replica's speed.
        let mut r = DecodeReplica::new(0.0);
        r.admit_prefilling(0.0, seq(2, 1), 0.2);
        r.set_speed(0.1, 0.5);
        assert!((r.next_event(0.1, &p) - 0.3).abs() < 1e-12);
    }

    #[test]
    fn a_batch_hands_out_its_prompts_in_order_and_counts_each_running() {
        let p = Profile::default();
        let mut r = PrefillReplica::new(0.0, 4);
        for req in [5, 6, 7] {
            r.enqueue(PrefillJob {
                req,
                tokens: 100.0,
                service_s: 1.0,
            });
        }
        assert_eq!(r.step(0.0, Some((1000.0, &p))), None);
        assert_eq!((r.running_prompts(), r.waiting()), (3, 0));
        let end = r.next_event(0.0);
        assert!((end - 300.0 / p.prefill_rate(300.0)).abs() < 1e-12);
        let out: Vec<usize> = std::iter::from_fn(|| r.step(end, Some((1000.0, &p)))).collect();
        assert_eq!(out, [5, 6, 7]);
        assert!(r.is_empty());
    }

    #[test]
    fn regression_decode_stalled_when_its_next_completion_was_a_day_and_more_away() {
        // Past a day and a half of simulated time, `(due - clock) / itl` rounds below
        // the steps that `next_event` promised: `advance` at that event took no step,
        // the event stayed due, and the replay spun for ever (a 40-hour trace never
        // finished). Every event a replica reports must be one `advance` reaches.
        let p = Profile::default();
        for i in 0..2_000u32 {
            let start = 100_000.0 + f64::from(i) * 37.123_456_789;
            let mut r = DecodeReplica::new(start);
            for (req, remaining) in [(0, 1 + i % 97), (1, 3 + i % 389)] {
                r.admit(
                    start,
                    Seq {
                        req,
                        remaining,
                        kv_tokens: 10.0,
                    },
                );
            }
            let mut done = Vec::new();
            while !r.is_empty() {
                let at = r.next_event(start, &p);
                let before = done.len();
                r.advance(at, &p, &mut Vec::new(), &mut done);
                assert!(
                    done.len() > before,
                    "clock {start}: no completion at its own event {at}"
                );
            }
        }
        // Nothing to generate: done at once, not a step that never comes.
        let mut r = DecodeReplica::new(5.0);
        let seq = Seq {
            req: 7,
            remaining: 0,
            kv_tokens: 1.0,
        };
        r.admit(5.0, seq);
        let mut done = Vec::new();
        r.advance(r.next_event(5.0, &p), &p, &mut Vec::new(), &mut done);
        assert_eq!(done, vec![(7, 5.0)]);
    }
}
