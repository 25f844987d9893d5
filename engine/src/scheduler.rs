//! Continuous batching over the paged KV cache.
//!
//! Every step runs one forward pass over a mix of work: one token for each decoding
//! sequence (served first, so a long prompt never stalls running streams), then chunks
//! of prompts, FCFS, up to a token budget (chunked prefill). A new sequence first takes
//! the cached blocks of its longest known prefix. When blocks run out, the newest
//! running sequence is preempted: its blocks are released and it re-enters the queue
//! to be recomputed (prompt plus what it generated so far).
//!
//! The scheduler holds no threads and does no I/O; the engine loop drives it.

use std::collections::VecDeque;

use crate::kv::{BlockHash, BlockId, BlockPool, PrefixKey};

/// Tokens per forward pass unless configured (the workers' `--max-batched-tokens`).
pub const DEFAULT_MAX_BATCHED_TOKENS: usize = 256;

/// Scheduler limits.
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct SchedulerConfig {
    /// Tokens per forward pass (decode tokens + prefill chunks).
    pub max_batched_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Sequences waiting; beyond it new requests are refused (429).
    pub max_waiting: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_batched_tokens: DEFAULT_MAX_BATCHED_TOKENS,
            max_running: 64,
            max_waiting: 256,
        }
    }
}

/// What the scheduler tracks of one sequence.
#[derive(Debug)]
pub struct SeqState {
    pub id: u64,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    /// Prompt tokens served from the prefix cache at (first) admission.
    pub cached_tokens: usize,
    pub preemptions: u32,
}

impl SeqState {
    #[must_use]
    pub fn new(id: u64, prompt: Vec<u32>) -> Self {
        SeqState {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            blocks: Vec::new(),
            hashes: Vec::new(),
            computed: 0,
            cached_tokens: 0,
            preemptions: 0,
        }
    }

    /// A sequence whose prompt K/V arrived from elsewhere (KV transfer) into `blocks`;
    /// `hashes` are the chained hashes of its full blocks.
    #[must_use]
    pub fn resumed(
        id: u64,
        prompt: Vec<u32>,
        blocks: Vec<BlockId>,
        hashes: Vec<BlockHash>,
    ) -> Self {
        SeqState {
            id,
            prompt_len: prompt.len(),
            computed: prompt.len(),
            tokens: prompt,
            blocks,
            hashes,
            cached_tokens: 0,
            preemptions: 0,
        }
    }

    #[must_use]
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    pub seq: u64,
    /// First position fed this step.
    pub start: usize,
    pub len: usize,
    /// The step reaches the end of the sequence's tokens: sample a next token.
    pub sample: bool,
}

#[derive(Debug)]
pub struct Scheduler {
    pub config: SchedulerConfig,
    pub pool: BlockPool,
    waiting: VecDeque<SeqState>,
    running: Vec<SeqState>,
    /// Prefix-cache lookups and hits in tokens (for metrics).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    /// Sequences whose blocks are reserved while their K/V comes from a prefill
    /// worker: each will run on arrival, so each holds a running slot already.
    pub reserved_seqs: usize,
    /// What this deployment's block hashes start from.
    prefix_key: PrefixKey,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, pool: BlockPool) -> Self {
        Scheduler {
            config,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            reserved_seqs: 0,
            prefix_key: PrefixKey::UNKEYED,
        }
    }

    /// Hashes blocks under the deployment's `key`.
    pub fn with_prefix_key(mut self, key: PrefixKey) -> Self {
        self.prefix_key = key;
        self
    }

    #[must_use]
    pub fn prefix_key(&self) -> PrefixKey {
        self.prefix_key
    }

    /// Whether a sequence could start running now, counting the slots reservations
    /// hold.
    #[must_use]
    pub fn has_running_slot(&self) -> bool {
        self.running.len() + self.reserved_seqs < self.config.max_running
    }

    #[must_use]
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    #[must_use]
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Whether a queue slot is free.
    #[must_use]
    pub fn can_accept(&self) -> bool {
        self.waiting.len() < self.config.max_waiting
    }

    /// Tokens the whole cache can hold: a longer sequence could never run.
    #[must_use]
    pub fn capacity_tokens(&self) -> usize {
        self.pool.num_blocks() * self.pool.block_size()
    }

    pub fn add(&mut self, seq: SeqState) {
        self.waiting.push_back(seq);
    }

    /// Adds a sequence that already holds its blocks (resumed after a KV transfer)
    /// straight to the running set.
    pub fn add_running(&mut self, seq: SeqState) {
        self.running.push(seq);
    }

    pub fn get(&self, id: u64) -> Option<&SeqState> {
        self.running
            .iter()
            .chain(&self.waiting)
            .find(|s| s.id == id)
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut SeqState> {
        self.running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|s| s.id == id)
    }

    /// Removes a sequence (finished, aborted, client gone) and frees its blocks.
    pub fn remove(&mut self, id: u64) -> Option<SeqState> {
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i)?
        };
        self.pool.release(&seq.blocks);
        Some(seq)
    }

    fn preempt_newest(&mut self, except: u64) -> bool {
        let Some(i) = self.running.iter().rposition(|s| s.id != except) else {
            return false;
        };
        let s = self.running.remove(i);
        self.preemptions += 1;
        tracing::debug!(seq = s.id, "preempted (blocks exhausted); will recompute");
        self.requeue_front(s, true);
        true
    }

    /// Frees `s`'s blocks and puts it first in the queue, to be recomputed from its
    /// tokens (its cached prefix may still be found again at re-admission).
    fn requeue_front(&mut self, mut s: SeqState, preempted: bool) {
        self.pool.release(&s.blocks);
        s.blocks.clear();
        s.hashes.clear();
        s.computed = 0;
        s.preemptions += u32::from(preempted);
        self.waiting.push_front(s);
    }

    /// Grows `seq`'s block table to hold `upto` tokens, preempting others if needed.
    fn reserve(&mut self, idx: usize, upto: usize) -> Result<(), ()> {
        let bs = self.pool.block_size();
        loop {
            let seq = &self.running[idx];
            let need = upto.div_ceil(bs).saturating_sub(seq.blocks.len());
            if need == 0 {
                return Ok(());
            }
            if let Some(b) = self.pool.allocate(need) {
                self.running[idx].blocks.extend(b);
                return Ok(());
            }
            let id = seq.id;
            // Only sequences after `idx` are preempted, so `idx` stays valid.
            if idx + 1 < self.running.len() && self.preempt_newest(id) {
                continue;
            }
            return Err(());
        }
    }

    /// Plans the next step.
    pub fn schedule(&mut self) -> Vec<Work> {
        let mut budget = self.config.max_batched_tokens;
        let mut work = Vec::new();
        // Running sequences in admission order: decodes and unfinished prompts.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let len = (s.tokens.len() - s.computed).min(budget);
            let upto = s.computed + len;
            if self.reserve(i, upto).is_err() {
                // Even alone it cannot grow: requeue it; it runs when blocks free up.
                let id = self.running[i].id;
                if self.running.len() == 1 {
                    tracing::warn!(seq = id, "sequence does not fit the KV cache");
                }
                let s = self.running.remove(i);
                self.requeue_front(s, false);
                continue;
            }
            let s = &self.running[i];
            work.push(Work {
                seq: s.id,
                start: s.computed,
                len,
                sample: upto == s.tokens.len(),
            });
            budget -= len;
            i += 1;
        }
        // Admit waiting sequences while budget, slots and blocks last.
        while budget > 0 && self.has_running_slot() {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let bs = self.pool.block_size();
            // The last token is always recomputed: its logits are needed.
            let full = (s.tokens.len() - 1) / bs;
            let hashes = self.prefix_key.block_hashes(&s.tokens[..full * bs], bs);
            let hits = self.pool.acquire_prefix(&hashes);
            let computed = hits.len() * bs;
            let len = (s.tokens.len() - computed).min(budget);
            let upto = computed + len;
            let need = upto.div_ceil(bs).saturating_sub(hits.len());
            let Some(fresh) = self.pool.allocate(need) else {
                // Give the hits back (they stay cached) so running sequences can use
                // every free block; retry next step.
                self.pool.release(&hits);
                self.waiting.push_front(s);
                break;
            };
            self.prefix_queries += s.tokens.len() as u64;
            self.prefix_hits += computed as u64;
            if s.preemptions == 0 {
                s.cached_tokens = computed;
            }
            s.computed = computed;
            s.hashes = hashes[..hits.len()].to_vec();
            s.blocks = hits;
            s.blocks.extend(fresh);
            work.push(Work {
                seq: s.id,
                start: s.computed,
                len,
                sample: upto == s.tokens.len(),
            });
            budget -= len;
            self.running.push(s);
        }
        work
    }

    /// Records that `w` ran: its K/V are cached; newly full blocks join the prefix cache.
    pub fn complete(&mut self, w: &Work) {
        let bs = self.pool.block_size();
        let Some(s) = self.running.iter_mut().find(|s| s.id == w.seq) else {
            return;
        };
        s.computed = w.start + w.len;
        while s.hashes.len() < s.computed / bs {
            let i = s.hashes.len();
            let h = self
                .prefix_key
                .chain(s.hashes.last().copied(), &s.tokens[i * bs..(i + 1) * bs]);
            self.pool.register(s.blocks[i], h);
            s.hashes.push(h);
        }
    }

    /// Prompt tokens not yet prefilled, over running and waiting sequences.
    #[must_use]
    pub fn queued_prompt_tokens(&self) -> usize {
        self.running
            .iter()
            .chain(&self.waiting)
            .map(|s| s.prompt_len.saturating_sub(s.computed))
            .sum()
    }

    /// Sequences currently running, in admission order.
    pub fn running(&self) -> impl Iterator<Item = &SeqState> {
        self.running.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(blocks: usize, budget: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_batched_tokens: budget,
                max_running: 8,
                max_waiting: 8,
            },
            BlockPool::new(blocks, 4),
        )
    }

    fn run_step(s: &mut Scheduler, next_token: u32) -> Vec<Work> {
        let work = s.schedule();
        for w in &work {
            s.complete(w);
            if w.sample {
                s.get_mut(w.seq).unwrap().tokens.push(next_token);
            }
        }
        work
    }

    /// Sequences whose K/V is on its way hold running slots: waiting ones are not
    /// admitted into them, so the arrivals are never refused after their prefill.
    #[test]
    fn reserved_sequences_hold_running_slots() {
        let mut s = sched(64, 64);
        s.reserved_seqs = 7;
        for id in 0..3 {
            s.add(SeqState::new(id, vec![1, 2, 3]));
        }
        s.schedule();
        assert_eq!(s.num_running(), 1, "one slot of eight was free");
        assert_eq!(s.num_waiting(), 2);
        assert!(!s.has_running_slot());
        s.reserved_seqs = 5;
        s.schedule();
        assert_eq!(s.num_running(), 3);
    }

    #[test]
    fn decodes_first_then_chunked_prefill() {
        let mut s = sched(32, 6);
        s.add(SeqState::new(1, vec![1, 2, 3]));
        let w = run_step(&mut s, 9);
        assert_eq!(
            w,
            vec![Work {
                seq: 1,
                start: 0,
                len: 3,
                sample: true
            }]
        );
        s.add(SeqState::new(2, (0..10).collect()));
        let w = run_step(&mut s, 9);
        // Seq 1 decodes one token; seq 2 gets the remaining budget of 5.
        assert_eq!(
            w[0],
            Work {
                seq: 1,
                start: 3,
                len: 1,
                sample: true
            }
        );
        assert_eq!(
            w[1],
            Work {
                seq: 2,
                start: 0,
                len: 5,
                sample: false
            }
        );
        let w = run_step(&mut s, 9);
        assert_eq!(
            w[1],
            Work {
                seq: 2,
                start: 5,
                len: 5,
                sample: true
            }
        );
    }

    #[test]
    fn prefix_hits_skip_cached_blocks() {
        let mut s = sched(32, 64);
        let prompt: Vec<u32> = (0..13).collect();
        s.add(SeqState::new(1, prompt.clone()));
        run_step(&mut s, 99);
        s.remove(1);
        let mut p2 = prompt.clone();
        p2.push(50);
        s.add(SeqState::new(2, p2));
        let w = run_step(&mut s, 99);
        // 13 tokens = 3 full blocks of 4 cached; only the rest is computed.
        assert_eq!(
            w,
            vec![Work {
                seq: 2,
                start: 12,
                len: 2,
                sample: true
            }]
        );
        assert_eq!(s.get(2).unwrap().cached_tokens, 12);
    }

    #[test]
    fn preemption_frees_blocks_and_requeues_the_newest() {
        // 4 blocks of 4 tokens: two sequences of 6 tokens fit (2 blocks each) until
        // both grow past 8 tokens.
        let mut s = sched(4, 64);
        s.add(SeqState::new(1, (0..6).collect()));
        s.add(SeqState::new(2, (10..16).collect()));
        run_step(&mut s, 7);
        assert_eq!(s.num_running(), 2);
        for _ in 0..3 {
            run_step(&mut s, 7);
        }
        // Seq 1 needed a third block at position 8: seq 2 was preempted.
        assert_eq!(s.preemptions, 1);
        assert_eq!(s.num_running(), 1);
        assert_eq!(s.num_waiting(), 1);
        let waiting = s.get(2).unwrap();
        assert_eq!((waiting.computed, waiting.blocks.len()), (0, 0));
        // Freeing seq 1 lets seq 2 recompute everything it had.
        s.remove(1);
        let len = s.get(2).unwrap().tokens.len();
        let w = run_step(&mut s, 7);
        assert_eq!(w[0].seq, 2);
        // Its first block was still in the prefix cache; the rest is recomputed.
        assert_eq!(w[0].start, 4);
        assert_eq!(w[0].start + w[0].len, len);
        s.remove(2);
        assert_eq!(s.pool.used(), 0, "no block leaked");
    }

    #[test]
    fn remove_frees_every_block() {
        let mut s = sched(8, 64);
        s.add(SeqState::new(1, (0..10).collect()));
        run_step(&mut s, 1);
        assert!(s.pool.used() > 0);
        s.remove(1);
        assert_eq!(s.pool.used(), 0);
    }
}
