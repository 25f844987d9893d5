//! A decode replica under continuous batching: a step clock, its sequences by the step
//! each ends at, the KV they hold and the KV reserved for prompts still in prefill.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use preheat_scaler::profile::Profile;

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
    /// The node it runs on, in a fleet simulation (0 otherwise).
    pub node: u16,
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
            node: 0,
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
