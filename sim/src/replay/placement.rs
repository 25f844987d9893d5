//! Where a fleet simulation places a model's replicas: each start gets a node and a
//! start-up time from the fleet's state (which tier the model finds there), and the
//! GPUs of each replica that leaves go back to its node.

/// A start the fleet granted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Start {
    pub(crate) node: u16,
    /// Seconds from the decision to serving.
    pub(crate) ready_in: f64,
}

pub(crate) trait Placement {
    /// A replica is wanted at `t`: where and how fast it starts, or `None` when the
    /// fleet has no GPU for it (the decision is retried at the next one).
    fn start(&mut self, t: f64) -> Option<Start>;
    /// A replica serving when the run begins: the node it is on, or `None` when the
    /// fleet has no GPU for it (the pool opens without it).
    fn initial(&mut self) -> Option<u16>;
    /// A replica on `node` left (drained, or removed while starting).
    fn stop(&mut self, node: u16);
}
