//! Which prefill replicas hold each prefix block. KV-aware routing asks, for every
//! request, how many of its leading blocks each ready replica holds; asking each
//! replica's cache costs replicas × blocks lookups (the simulator's hottest loop at
//! fleet scale), while walking the request's blocks once against this index answers
//! for every replica together. A replica gets one of [`SLOTS`] slots when it first
//! caches something; any beyond that many are asked the slow way.

use crate::block_map::BlockMap;

/// Replicas the index tracks at once (a bit each).
pub(crate) const SLOTS: usize = 128;

#[derive(Clone, Debug)]
pub(crate) struct PrefixIndex {
    /// Each block's holders, a bit per slot (0: none).
    owners: BlockMap<u128>,
    used: u128,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex {
            owners: BlockMap::new(0),
            used: 0,
        }
    }
}

impl PrefixIndex {
    /// A free slot, if any.
    pub(crate) fn take_slot(&mut self) -> Option<u8> {
        let free = !self.used;
        if free == 0 {
            return None;
        }
        let slot = free.trailing_zeros() as u8;
        self.used |= 1u128 << slot;
        Some(slot)
    }

    /// Frees `slot`, forgetting the blocks its replica held.
    pub(crate) fn release(&mut self, slot: u8, blocks: impl Iterator<Item = u64>) {
        for b in blocks {
            self.remove(slot, b);
        }
        self.used &= !(1u128 << slot);
    }

    pub(crate) fn add(&mut self, slot: u8, block: u64) {
        let m = self.owners.get(block).unwrap_or(0);
        self.owners.set(block, m | 1u128 << slot);
    }

    pub(crate) fn remove(&mut self, slot: u8, block: u64) {
        if let Some(m) = self.owners.get(block) {
            self.owners.set(block, m & !(1u128 << slot));
        }
    }

    /// For each slot in `asked`, the number of leading `blocks` it holds, written to
    /// `out[slot]`.
    pub(crate) fn overlaps(&self, blocks: &[u64], asked: u128, out: &mut [u32; SLOTS]) {
        let mut alive = asked;
        for (i, b) in blocks.iter().enumerate() {
            if alive == 0 {
                return;
            }
            let still = alive & self.owners.get(*b).unwrap_or(0);
            let mut stopped = alive & !still;
            while stopped != 0 {
                let s = stopped.trailing_zeros() as usize;
                out[s] = i as u32;
                stopped &= stopped - 1;
            }
            alive = still;
        }
        while alive != 0 {
            let s = alive.trailing_zeros() as usize;
            out[s] = blocks.len() as u32;
            alive &= alive - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::PrefixCache;

    #[test]
    fn the_index_agrees_with_each_replicas_cache() {
        // Three replicas with different, partly shared, evicting caches.
        let mut index = PrefixIndex::default();
        let mut caches: Vec<(PrefixCache, u8)> = (0..3)
            .map(|_| (PrefixCache::new(6), index.take_slot().unwrap()))
            .collect();
        let prompts: [&[u64]; 5] = [&[1, 2, 3, 4], &[1, 2, 9], &[7, 8], &[1, 2, 3, 5, 6], &[7]];
        for (k, p) in prompts.iter().enumerate() {
            let (cache, slot) = &mut caches[k % 3];
            cache.touch(p, |b, added| {
                if added {
                    index.add(*slot, b);
                } else {
                    index.remove(*slot, b);
                }
            });
        }
        let asked = caches.iter().fold(0u128, |m, c| m | 1u128 << c.1);
        for q in [&[1u64, 2, 3, 4, 5][..], &[7, 8, 9], &[1, 2, 9], &[42], &[]] {
            let mut out = [u32::MAX; SLOTS];
            index.overlaps(q, asked, &mut out);
            for (cache, slot) in &caches {
                assert_eq!(out[*slot as usize] as usize, cache.overlap(q), "{q:?}");
            }
        }
        // A released slot holds nothing and can be taken again.
        let (cache, slot) = caches.pop().unwrap();
        index.release(slot, cache.blocks());
        assert_eq!(index.take_slot(), Some(slot));
        let mut out = [0; SLOTS];
        index.overlaps(&[7, 8], 1u128 << slot, &mut out);
        assert_eq!(out[slot as usize], 0);
    }
}
