//! One value per pool, indexed by the scaler's [`Pool`] rather than by position.

use std::ops::{Index, IndexMut};

use preheat_scaler::policy::Pool;

/// Both pools, in the order the simulator visits them.
pub(crate) const POOLS: [Pool; 2] = [Pool::Prefill, Pool::Decode];

/// A value for each pool.
#[derive(Clone, Debug, Default)]
pub(crate) struct PerPool<T> {
    pub(crate) prefill: T,
    pub(crate) decode: T,
}

impl<T> PerPool<T> {
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        [&mut self.prefill, &mut self.decode].into_iter()
    }
}

impl<T> Index<Pool> for PerPool<T> {
    type Output = T;

    fn index(&self, pool: Pool) -> &T {
        match pool {
            Pool::Prefill => &self.prefill,
            Pool::Decode => &self.decode,
        }
    }
}

impl<T> IndexMut<Pool> for PerPool<T> {
    fn index_mut(&mut self, pool: Pool) -> &mut T {
        match pool {
            Pool::Prefill => &mut self.prefill,
            Pool::Decode => &mut self.decode,
        }
    }
}
