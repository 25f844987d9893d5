//! A prefill replica: its queue of prompts, run one at a time or batched as an engine
//! with chunked prefill runs them, and its prefix cache.

use std::collections::VecDeque;

use preheat_scaler::profile::Profile;

use super::prefix_cache::PrefixCache;

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
    /// The node it runs on, in a fleet simulation (0 otherwise).
    pub node: u16,
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
            node: 0,
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
