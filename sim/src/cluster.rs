//! The simulated replicas. A prefill replica serves its queue one prompt at a time at
//! the profile's prefill rate for that prompt length, skipping the prefix it holds in
//! its cache; a decode replica runs continuous batching: every running sequence gets
//! one token per step, a step lasting the profile's ITL at the current batch size, and
//! a sequence holds its prompt + output tokens of KV from admission to completion.

use std::collections::{BTreeMap, HashMap, VecDeque};

use preheat_scaler::profile::Profile;

/// LRU set of prefix blocks held by one prefill replica.
#[derive(Clone, Debug, Default)]
pub struct PrefixCache {
    capacity: usize,
    stamp: u64,
    by_id: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
}

impl PrefixCache {
    #[must_use]
    pub fn new(capacity_blocks: usize) -> Self {
        PrefixCache {
            capacity: capacity_blocks,
            ..PrefixCache::default()
        }
    }

    /// Leading blocks of `blocks` present in the cache.
    #[must_use]
    pub fn overlap(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.by_id.contains_key(b))
            .count()
    }

    /// Marks `blocks` as used now, inserting missing ones and evicting the least
    /// recently used past capacity.
    pub fn touch(&mut self, blocks: &[u64]) {
        for &b in blocks {
            self.stamp += 1;
            if let Some(old) = self.by_id.insert(b, self.stamp) {
                self.by_stamp.remove(&old);
            }
            self.by_stamp.insert(self.stamp, b);
        }
        while self.by_id.len() > self.capacity {
            let Some((_, id)) = self.by_stamp.pop_first() else {
                break;
            };
            self.by_id.remove(&id);
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
    pub queue: VecDeque<PrefillJob>,
    /// The job running and when it finishes.
    pub running: Option<(PrefillJob, f64)>,
    pub cache: PrefixCache,
    /// Seconds spent computing, for utilisation.
    pub busy_s: f64,
}

impl PrefillReplica {
    #[must_use]
    pub fn new(ready_at: f64, cache_blocks: usize) -> Self {
        PrefillReplica {
            ready_at,
            draining: false,
            queue: VecDeque::new(),
            running: None,
            cache: PrefixCache::new(cache_blocks),
            busy_s: 0.0,
        }
    }

    #[must_use]
    pub fn is_ready(&self, t: f64) -> bool {
        t >= self.ready_at
    }

    /// Seconds of work queued or left on the running job at `t`.
    #[must_use]
    pub fn backlog_s(&self, t: f64) -> f64 {
        let left = self.running.map_or(0.0, |(_, end)| (end - t).max(0.0));
        left + self.queue.iter().map(|j| j.service_s).sum::<f64>()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.running.is_none() && self.queue.is_empty()
    }

    /// The next time this replica changes state on its own.
    #[must_use]
    pub fn next_event(&self, t: f64) -> f64 {
        if t < self.ready_at {
            return self.ready_at;
        }
        match self.running {
            Some((_, end)) => end,
            None if !self.queue.is_empty() => t,
            None => f64::INFINITY,
        }
    }

    /// Finishes the running job if it is due and starts the next one; returns the
    /// finished request.
    pub fn step(&mut self, t: f64) -> Option<usize> {
        if t < self.ready_at {
            return None;
        }
        let mut done = None;
        if let Some((job, end)) = self.running
            && end <= t
        {
            done = Some(job.req);
            self.running = None;
        }
        if self.running.is_none()
            && let Some(job) = self.queue.pop_front()
        {
            self.busy_s += job.service_s;
            self.running = Some((job, t + job.service_s));
        }
        done
    }
}

/// A sequence decoding on a replica.
#[derive(Clone, Copy, Debug)]
pub struct Seq {
    pub req: usize,
    pub remaining: u32,
    pub kv_tokens: f64,
}

#[derive(Clone, Debug)]
pub struct DecodeReplica {
    pub ready_at: f64,
    pub draining: bool,
    pub seqs: Vec<Seq>,
    pub kv_used: f64,
    /// Time of the last step boundary.
    pub clock: f64,
    pub busy_s: f64,
}

impl DecodeReplica {
    #[must_use]
    pub fn new(ready_at: f64) -> Self {
        DecodeReplica {
            ready_at,
            draining: false,
            seqs: Vec::new(),
            kv_used: 0.0,
            clock: ready_at,
            busy_s: 0.0,
        }
    }

    #[must_use]
    pub fn is_ready(&self, t: f64) -> bool {
        t >= self.ready_at
    }

    /// Whether a sequence needing `kv` tokens fits (a replica with nothing running
    /// takes any sequence, so an oversized one cannot wait forever).
    #[must_use]
    pub fn fits(&self, kv: f64, max_batch: usize, kv_capacity: f64) -> bool {
        self.seqs.is_empty() || (self.seqs.len() < max_batch && self.kv_used + kv <= kv_capacity)
    }

    pub fn admit(&mut self, t: f64, seq: Seq) {
        if self.seqs.is_empty() {
            self.clock = self.clock.max(t);
        }
        self.kv_used += seq.kv_tokens;
        self.seqs.push(seq);
    }

    /// When the next sequence completes if nothing else changes.
    #[must_use]
    pub fn next_event(&self, t: f64, profile: &Profile) -> f64 {
        if t < self.ready_at {
            return self.ready_at;
        }
        match self.seqs.iter().map(|s| s.remaining).min() {
            Some(min) => self.clock + f64::from(min) * profile.itl(self.seqs.len() as f64),
            None => f64::INFINITY,
        }
    }

    /// Runs whole steps up to `t`, stopping at the first completion so the caller can
    /// admit at that boundary; returns `(request, completion time)` of finished ones.
    pub fn advance(&mut self, t: f64, profile: &Profile, done: &mut Vec<(usize, f64)>) {
        if self.seqs.is_empty() {
            self.clock = self.clock.max(t);
            return;
        }
        let itl = profile.itl(self.seqs.len() as f64);
        let min = self.seqs.iter().map(|s| s.remaining).min().unwrap_or(0);
        // Float slack: a completion due at exactly `t` must count as reached.
        let steps = (((t - self.clock) / itl) + 1e-9).floor().max(0.0);
        let k = (steps as u32).min(min);
        if k == 0 {
            return;
        }
        self.clock += f64::from(k) * itl;
        self.busy_s += f64::from(k) * itl;
        for s in &mut self.seqs {
            s.remaining -= k;
        }
        let clock = self.clock;
        let mut freed = 0.0;
        self.seqs.retain(|s| {
            if s.remaining == 0 {
                done.push((s.req, clock));
                freed += s.kv_tokens;
                false
            } else {
                true
            }
        });
        self.kv_used = (self.kv_used - freed).max(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_cache_is_lru() {
        let mut c = PrefixCache::new(3);
        c.touch(&[1, 2, 3]);
        assert_eq!(c.overlap(&[1, 2, 3, 4]), 3);
        c.touch(&[1]);
        c.touch(&[4]);
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
        r.advance(1.0, &p, &mut done);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, 0);
        assert!((done[0].1 - 10.0 * itl2).abs() < 1e-9);
        assert_eq!(r.kv_used, 100.0);
        // The survivor continues alone, at batch-1 ITL.
        r.advance(1.0, &p, &mut done);
        assert_eq!(done.len(), 2);
        assert!((done[1].1 - (10.0 * itl2 + 10.0 * p.itl(1.0))).abs() < 1e-9);
    }
}
