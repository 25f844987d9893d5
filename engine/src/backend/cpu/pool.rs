//! The rayon pool a replica's CPU kernels run in, with their caller inside it.
//!
//! Each kernel (a matrix product, attention) is a rayon parallel loop. Called from a
//! thread outside any pool, a loop is handed to the global pool and the caller sleeps
//! until it is done: a wake-up per kernel, eight per layer (seven matrix products and
//! attention), so 241 a decode step on SmolLM2's 30 layers. Alone on a core that costs
//! little. On a host whose cores are busy each wake-up waits for a CPU: a decode worker
//! beside two busy processes on two cores got 0.41 of a core where its fair share was
//! 0.67, and its ITL was 2.2× its ITL alone.
//! Run inside the pool, a loop starts on the thread that called it and the other
//! threads steal from it; with one thread nothing is handed off at all.

use rayon::{ThreadPool, ThreadPoolBuildError, ThreadPoolBuilder};

/// A pool of `threads` compute threads (`None` or 0: rayon's default,
/// `RAYON_NUM_THREADS` or one per core). Run the caller of the kernels in it with
/// [`ThreadPool::install`].
pub fn compute_pool(threads: Option<usize>) -> Result<ThreadPool, ThreadPoolBuildError> {
    ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .thread_name(|i| format!("preheat-engine-{i}"))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_called_in_the_pool_run_on_the_calling_thread() {
        let pool = compute_pool(Some(1)).unwrap();
        let (outer, inner) = pool.install(|| {
            let outer = std::thread::current().id();
            let inner = rayon::join(|| std::thread::current().id(), || ()).0;
            (outer, inner)
        });
        assert_eq!(outer, inner);
        assert_eq!(pool.current_num_threads(), 1);
    }
}
