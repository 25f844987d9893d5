//! Progress reporting for long operations. The library only calls this trait; the
//! binary draws bars, tests use [`NoProgress`].

/// Receives progress of a long operation, in bytes.
pub trait Progress: Send + Sync {
    /// A new phase called `what` with `total` units of work begins.
    fn start(&self, what: &str, total: u64);
    /// `n` more units are done.
    fn advance(&self, n: u64);
    /// The phase is over.
    fn finish(&self) {}
}

/// Ignores all progress.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _: &str, _: u64) {}
    fn advance(&self, _: u64) {}
}
