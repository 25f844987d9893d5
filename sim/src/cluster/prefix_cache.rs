//! The LRU set of prefix blocks one prefill replica holds, which KV-aware routing asks
//! about for every request.

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
}
