//! Which workers serve a request. Pure functions over the registry's view, so the
//! rules are testable without processes.
//!
//! - Decode: the least loaded (KV usage, then running + waiting sequences).
//! - Prefill: KV-aware: cost = prompt blocks not in the worker's prefix cache + load
//!   (waiting and running prompts, each weighted as `load_weight` blocks); ties go to
//!   the least loaded. What each prefill worker caches is tracked here from the
//!   prompts the router sent it (bounded per worker, oldest forgotten first).

use std::collections::{HashMap, HashSet, VecDeque};

use super::wire::messages::Load;
use crate::kv::BlockHash;

/// Blocks remembered per prefill worker.
const PREFIX_MEMORY: usize = 65_536;

/// What the router remembers of one prefill worker's prefix cache.
#[derive(Debug, Default)]
pub struct PrefixMemory {
    set: HashSet<BlockHash>,
    order: VecDeque<BlockHash>,
}

impl PrefixMemory {
    /// Leading blocks of `hashes` this worker holds.
    #[must_use]
    pub fn overlap(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.set.contains(h)).count()
    }

    /// What the worker reports it holds replaces what the router guessed.
    pub fn replace(&mut self, hashes: &[BlockHash]) {
        self.set.clear();
        self.order.clear();
        self.remember(hashes);
    }

    pub fn remember(&mut self, hashes: &[BlockHash]) {
        for &h in hashes {
            if self.set.insert(h) {
                self.order.push_back(h);
            }
        }
        while self.order.len() > PREFIX_MEMORY {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }
}

fn load_of(l: &Load) -> f64 {
    l.running + l.waiting
}

/// Index of the decode worker to use, if any.
#[must_use]
pub fn pick_decode(loads: &[&Load]) -> Option<usize> {
    loads
        .iter()
        .enumerate()
        .min_by(|a, b| {
            a.1.kv_usage
                .total_cmp(&b.1.kv_usage)
                .then(load_of(a.1).total_cmp(&load_of(b.1)))
        })
        .map(|(i, _)| i)
}

/// Index of the prefill worker with the lowest cost for `hashes`.
#[must_use]
pub fn pick_prefill(
    cands: &[(&Load, &PrefixMemory)],
    hashes: &[BlockHash],
    load_weight: f64,
) -> Option<usize> {
    cands
        .iter()
        .enumerate()
        .map(|(i, (load, mem))| {
            let uncached = (hashes.len() - mem.overlap(hashes)) as f64;
            (i, uncached + load_weight * load_of(load), load_of(load))
        })
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.total_cmp(&b.2)))
        .map(|(i, _, _)| i)
}

/// Router-side bookkeeping per prefill worker id.
#[derive(Debug, Default)]
pub struct PrefixIndex(pub HashMap<String, PrefixMemory>);

#[cfg(test)]
mod tests {
    use super::*;

    fn load(running: f64, kv: f64) -> Load {
        Load {
            running,
            waiting: 0.0,
            kv_usage: kv,
            kv_blocks: 0,
        }
    }

    #[test]
    fn decode_goes_to_the_emptiest_cache() {
        let (a, b, c) = (load(1.0, 0.5), load(9.0, 0.1), load(0.0, 0.1));
        assert_eq!(pick_decode(&[&a, &b, &c]), Some(2));
        assert_eq!(pick_decode(&[]), None);
    }

    #[test]
    fn prefill_prefers_the_cached_prefix_unless_it_is_swamped() {
        let hashes: Vec<u64> = (0..8).collect();
        let mut warm = PrefixMemory::default();
        warm.remember(&hashes[..6]);
        let cold = PrefixMemory::default();
        let (idle, busy) = (load(0.0, 0.0), load(2.0, 0.0));
        // Warm but slightly busy beats cold and idle: 2 uncached + 2 vs 8.
        assert_eq!(
            pick_prefill(&[(&idle, &cold), (&busy, &warm)], &hashes, 1.0),
            Some(1)
        );
        // Swamped: 2 + 20 vs 8.
        let swamped = load(20.0, 0.0);
        assert_eq!(
            pick_prefill(&[(&idle, &cold), (&swamped, &warm)], &hashes, 1.0),
            Some(0)
        );
        // Equal cost: least loaded.
        assert_eq!(
            pick_prefill(&[(&busy, &cold), (&idle, &cold)], &hashes, 0.0),
            Some(1)
        );
    }

    #[test]
    fn a_report_replaces_the_guess() {
        let mut m = PrefixMemory::default();
        m.remember(&[1, 2, 3]);
        m.replace(&[7, 8]);
        assert_eq!(m.overlap(&[1, 2]), 0);
        assert_eq!(m.overlap(&[7, 8, 9]), 2);
    }

    #[test]
    fn memory_is_bounded_and_forgets_the_oldest() {
        let mut m = PrefixMemory::default();
        let all: Vec<u64> = (0..(PREFIX_MEMORY as u64 + 10)).collect();
        m.remember(&all);
        assert_eq!(m.overlap(&all), 0, "the first blocks were forgotten");
        assert_eq!(m.overlap(&all[10..]), PREFIX_MEMORY);
    }
}
