//! A map from prefix block id to a small value, for the prefix caches and their index.
//! Ids below [`DENSE_IDS`] live in a vector indexed by id (no hashing: these maps are
//! the simulator's innermost loops), the rest in a hash map. [`crate::trace::intern_blocks`]
//! numbers a trace's blocks from 0, so a trace of up to 262,144 distinct blocks takes
//! the vector path throughout; any id still works.

use std::collections::HashMap;

use crate::block_id_hash::BlockIdHasher;

/// Ids kept in the vector: at most 1 MiB per prefix cache (`u32` nodes) and 4 MiB for
/// the index (`u128` owner masks).
pub(crate) const DENSE_IDS: u64 = 1 << 18;

#[derive(Clone, Debug)]
pub(crate) struct BlockMap<V: Copy + PartialEq> {
    /// The value that means "absent" (never stored).
    empty: V,
    dense: Vec<V>,
    sparse: HashMap<u64, V, BlockIdHasher>,
    len: usize,
}

impl<V: Copy + PartialEq> BlockMap<V> {
    pub(crate) fn new(empty: V) -> Self {
        BlockMap {
            empty,
            dense: Vec::new(),
            sparse: HashMap::default(),
            len: 0,
        }
    }

    #[inline]
    pub(crate) fn get(&self, id: u64) -> Option<V> {
        let v = if id < DENSE_IDS {
            self.dense.get(id as usize).copied()
        } else {
            self.sparse.get(&id).copied()
        };
        v.filter(|v| *v != self.empty)
    }

    /// Sets `id` to `v`; the empty value removes it.
    #[inline]
    pub(crate) fn set(&mut self, id: u64, v: V) {
        let was = if id < DENSE_IDS {
            let i = id as usize;
            if i >= self.dense.len() {
                if v == self.empty {
                    return;
                }
                let want = (i + 1).next_power_of_two().min(DENSE_IDS as usize);
                self.dense.resize(want, self.empty);
            }
            std::mem::replace(&mut self.dense[i], v)
        } else if v == self.empty {
            self.sparse.remove(&id).unwrap_or(self.empty)
        } else {
            self.sparse.insert(id, v).unwrap_or(self.empty)
        };
        match (was == self.empty, v == self.empty) {
            (true, false) => self.len += 1,
            (false, true) => self.len -= 1,
            _ => {}
        }
    }

    /// Ids held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_sparse_ids_behave_alike() {
        let mut m = BlockMap::new(u32::MAX);
        let ids = [0, 5, DENSE_IDS - 1, DENSE_IDS, u64::MAX, 5];
        for (k, &id) in ids.iter().enumerate() {
            m.set(id, k as u32);
        }
        assert_eq!(m.len(), 5, "5 set twice");
        assert_eq!(m.get(5), Some(5));
        assert_eq!(m.get(u64::MAX), Some(4));
        assert_eq!(m.get(DENSE_IDS), Some(3));
        assert_eq!(m.get(7), None);
        assert_eq!(m.get(DENSE_IDS + 1), None);
        for id in [5, DENSE_IDS, 123_456, DENSE_IDS + 9] {
            m.set(id, u32::MAX);
        }
        assert_eq!(m.len(), 3, "removing absent ids changes nothing");
        assert_eq!((m.get(5), m.get(DENSE_IDS)), (None, None));
    }
}
