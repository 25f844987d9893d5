//! Allocation of KV blocks with reference counts and a prefix cache.
//!
//! A block is in exactly one state: *used* (ref count > 0), *free and cached* (ref 0,
//! holds the KV of a known prefix, evictable in LRU order), or *free* (ref 0, no known
//! content). Allocation prefers free blocks and evicts the least recently released
//! cached block only when none is left, so popular prefixes survive.

use std::collections::{BTreeMap, HashMap};

use super::BlockHash;

pub type BlockId = u32;

#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    hash_of: Vec<Option<BlockHash>>,
    /// Prefix cache: content hash → block holding it.
    cached: HashMap<BlockHash, BlockId>,
    free: Vec<BlockId>,
    /// Free cached blocks by release time (oldest first), and each one's time.
    evictable: BTreeMap<u64, BlockId>,
    released_at: Vec<u64>,
    clock: u64,
    used: usize,
}

impl BlockPool {
    #[must_use]
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        BlockPool {
            block_size,
            refs: vec![0; num_blocks],
            hash_of: vec![None; num_blocks],
            cached: HashMap::new(),
            // Pop from the end: hand out low ids first (easier to read in logs).
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            clock: 0,
            used: 0,
        }
    }

    /// Content hashes of every block in the prefix cache (in use or free).
    pub fn cached_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.cached.keys().copied()
    }

    #[must_use]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    #[must_use]
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks an allocation could get right now (free plus evictable).
    #[must_use]
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one sequence.
    #[must_use]
    pub fn used(&self) -> usize {
        self.used
    }

    /// Fraction of blocks in use, as `vllm:kv_cache_usage_perc` reports it.
    #[must_use]
    pub fn usage(&self) -> f64 {
        if self.refs.is_empty() {
            0.0
        } else {
            self.used as f64 / self.refs.len() as f64
        }
    }

    /// Allocates `n` blocks with ref count 1, or none at all if fewer are available.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.available() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let (_, b) = self.evictable.pop_first().expect("available() counted it");
                    if let Some(h) = self.hash_of[b as usize].take() {
                        self.cached.remove(&h);
                    }
                    b
                }
            };
            self.refs[b as usize] = 1;
            self.used += 1;
            out.push(b);
        }
        Some(out)
    }

    /// Takes a reference on the cached blocks of the longest cached prefix of `hashes`
    /// and returns them (possibly none).
    pub fn acquire_prefix(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let mut out = Vec::new();
        for h in hashes {
            let Some(&b) = self.cached.get(h) else { break };
            self.acquire(b);
            out.push(b);
        }
        out
    }

    /// How many leading blocks of `hashes` are cached, without taking them.
    #[must_use]
    pub fn cached_prefix_len(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    fn acquire(&mut self, b: BlockId) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.evictable.remove(&self.released_at[i]);
            self.used += 1;
        }
        self.refs[i] += 1;
    }

    /// Records that used block `b` now holds the full block whose chained hash is `h`,
    /// so later requests with the same prefix can share it. If another block already
    /// holds that content, `b` simply stays uncached.
    pub fn register(&mut self, b: BlockId, h: BlockHash) {
        let i = b as usize;
        if self.hash_of[i].is_some() || self.cached.contains_key(&h) {
            return;
        }
        self.hash_of[i] = Some(h);
        self.cached.insert(h, b);
    }

    /// Drops one reference on each of `blocks` (a finished, aborted or preempted
    /// sequence). Blocks released together become evictable together, the last block
    /// of a sequence first, since it is the least likely to be shared.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let i = b as usize;
            debug_assert!(self.refs[i] > 0, "double release of block {b}");
            if self.refs[i] == 0 {
                tracing::error!(block = b, "released a block that was not in use");
                continue;
            }
            self.refs[i] -= 1;
            if self.refs[i] == 0 {
                self.used -= 1;
                if self.hash_of[i].is_some() {
                    self.clock += 1;
                    self.released_at[i] = self.clock;
                    self.evictable.insert(self.clock, b);
                } else {
                    self.free.push(b);
                }
            }
        }
    }

    /// Forgets all cached content (e.g. after weights change); used blocks keep theirs.
    pub fn clear_cache(&mut self) {
        for (_, b) in std::mem::take(&mut self.evictable) {
            self.hash_of[b as usize] = None;
            self.free.push(b);
        }
        self.cached.retain(|_, b| self.refs[*b as usize] > 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_all_or_nothing_and_usage_tracks_refs() {
        let mut p = BlockPool::new(4, 16);
        let a = p.allocate(3).unwrap();
        assert_eq!(p.usage(), 0.75);
        assert!(
            p.allocate(2).is_none(),
            "must not hand out a partial allocation"
        );
        assert_eq!(p.available(), 1);
        p.release(&a);
        assert_eq!((p.usage(), p.available()), (0.0, 4));
    }

    #[test]
    fn cached_prefixes_are_shared_and_survive_release() {
        let mut p = BlockPool::new(4, 16);
        let a = p.allocate(2).unwrap();
        p.register(a[0], 100);
        p.register(a[1], 200);
        let hits = p.acquire_prefix(&[100, 200, 300]);
        assert_eq!(hits, a, "a second sequence shares both blocks");
        assert_eq!(p.used(), 2);
        p.release(&a);
        p.release(&hits);
        assert_eq!(p.used(), 0);
        assert_eq!(
            p.cached_prefix_len(&[100, 200]),
            2,
            "content kept while free"
        );
        // Fresh blocks come from the free list before any cached block is evicted.
        let b = p.allocate(2).unwrap();
        assert!(!b.contains(&a[0]) && !b.contains(&a[1]));
        assert_eq!(p.cached_prefix_len(&[100, 200]), 2);
        // Now evictions are needed: the block released first is evicted first.
        // `release` frees a sequence's last block first, so block a[1] (hash 200) goes.
        let c = p.allocate(1).unwrap();
        assert_eq!(c, vec![a[1]]);
        assert_eq!(p.cached_prefix_len(&[100, 200]), 1);
        assert_eq!(p.cached_prefix_len(&[200]), 0);
    }

    #[test]
    fn reacquiring_an_evictable_block_protects_it() {
        let mut p = BlockPool::new(2, 16);
        let a = p.allocate(1).unwrap();
        p.register(a[0], 7);
        p.release(&a);
        let hit = p.acquire_prefix(&[7]);
        assert_eq!(hit, a);
        // Only one block may be handed out: the other is in use by the hit.
        assert_eq!(p.allocate(2), None);
        assert!(p.allocate(1).is_some());
    }

    #[test]
    fn duplicate_content_is_not_registered_twice() {
        let mut p = BlockPool::new(2, 16);
        let a = p.allocate(2).unwrap();
        p.register(a[0], 9);
        p.register(a[1], 9);
        p.release(&a);
        assert_eq!(p.acquire_prefix(&[9]), vec![a[0]]);
    }

    #[test]
    fn clear_cache_frees_cached_blocks() {
        let mut p = BlockPool::new(2, 16);
        let a = p.allocate(2).unwrap();
        p.register(a[0], 1);
        p.release(&a);
        p.clear_cache();
        assert_eq!(p.cached_prefix_len(&[1]), 0);
        assert_eq!(p.available(), 2);
    }
}
