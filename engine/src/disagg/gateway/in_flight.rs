//! This gateway's requests in flight at each worker, and the load a router reads: the
//! worker's last report corrected by what this gateway sent and got back since.
//!
//! Reports come about once a second (heartbeats, or discovery's polls). Routing on the
//! report alone sent every request of that second to the worker that looked emptiest
//! at its start. A decode worker's report also leaves out requests still pulling their
//! K/V, which can take the whole prefill. So the gateway counts its own requests
//! exactly and takes only the rest, other gateways' requests, from the report.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use crate::disagg::wire::messages::Load;

#[derive(Debug, Default)]
struct Counts {
    /// This gateway's requests at the worker now.
    requests: AtomicI64,
    /// KV blocks those requests reserved (decode workers).
    blocks: AtomicI64,
    /// The same two when the worker's last report arrived.
    requests_at_report: AtomicI64,
    blocks_at_report: AtomicI64,
}

/// One worker's counts; cloned into each [`InFlight`] so a request ends where it
/// started even if the worker left the rotation meanwhile.
#[derive(Clone, Debug, Default)]
pub(super) struct InFlightCounts(Arc<Counts>);

/// This gateway's requests and blocks at one worker at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Snapshot {
    requests: i64,
    blocks: i64,
}

impl InFlightCounts {
    /// What is in flight now, to pair with a report asked for now.
    pub(super) fn snapshot(&self) -> Snapshot {
        Snapshot {
            requests: self.0.requests.load(Ordering::Relaxed),
            blocks: self.0.blocks.load(Ordering::Relaxed),
        }
    }

    /// A report arrived, taken when this gateway had `then` in flight there (a
    /// heartbeat: now; a polled load: when the poll was sent, since one slow peer holds
    /// up every poll's answer).
    pub(super) fn reported(&self, then: Snapshot) {
        let c = &self.0;
        c.requests_at_report.store(then.requests, Ordering::Relaxed);
        c.blocks_at_report.store(then.blocks, Ordering::Relaxed);
    }

    /// A request sent to the worker, reserving `blocks` there, until the guard drops.
    pub(super) fn start(&self, blocks: usize) -> InFlight {
        let blocks = i64::try_from(blocks).unwrap_or(i64::MAX / 2);
        self.0.requests.fetch_add(1, Ordering::Relaxed);
        self.0.blocks.fetch_add(blocks, Ordering::Relaxed);
        InFlight {
            counts: self.clone(),
            blocks,
        }
    }

    /// This gateway's requests at the worker now.
    pub(super) fn requests(&self) -> i64 {
        self.0.requests.load(Ordering::Relaxed)
    }

    /// `report` with this gateway's share as of the report replaced by its share now.
    /// Everything is folded into `running` (the router reads running + waiting).
    pub(super) fn load(&self, report: &Load) -> Load {
        let c = &self.0;
        let mine = c.requests.load(Ordering::Relaxed) as f64;
        let mine_then = c.requests_at_report.load(Ordering::Relaxed) as f64;
        let others = (report.running + report.waiting - mine_then).max(0.0);
        let mut kv_usage = report.kv_usage;
        if report.kv_blocks > 0 {
            let total = report.kv_blocks as f64;
            let blocks = c.blocks.load(Ordering::Relaxed) as f64;
            let blocks_then = c.blocks_at_report.load(Ordering::Relaxed) as f64;
            kv_usage = (report.kv_usage - blocks_then / total).max(0.0) + blocks / total;
        }
        Load {
            running: others + mine,
            waiting: 0.0,
            kv_usage,
            kv_blocks: report.kv_blocks,
        }
    }
}

/// One request at a worker; counted until dropped.
#[derive(Debug)]
pub(super) struct InFlight {
    counts: InFlightCounts,
    blocks: i64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.counts.0.requests.fetch_sub(1, Ordering::Relaxed);
        self.counts
            .0
            .blocks
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(running: f64, waiting: f64, kv_usage: f64) -> Load {
        Load {
            running,
            waiting,
            kv_usage,
            kv_blocks: 100,
        }
    }

    #[test]
    fn requests_sent_since_the_report_count_before_the_next_one() {
        let c = InFlightCounts::default();
        let idle = report(0.0, 0.0, 0.0);
        let a = c.start(10);
        let b = c.start(10);
        let l = c.load(&idle);
        assert_eq!(l.running, 2.0);
        assert!((l.kv_usage - 0.2).abs() < 1e-9);
        drop(a);
        assert_eq!(c.load(&idle).running, 1.0);
        drop(b);
        assert_eq!(
            c.load(&idle),
            Load {
                kv_blocks: 100,
                ..Load::default()
            }
        );
    }

    #[test]
    fn other_gateways_requests_come_from_the_report() {
        let c = InFlightCounts::default();
        let _mine = c.start(5);
        // The worker saw this gateway's one request and three of others'.
        c.reported(c.snapshot());
        let l = c.load(&report(3.0, 1.0, 0.25));
        assert_eq!(l.running, 4.0);
        assert!((l.kv_usage - 0.25).abs() < 1e-9);
        let _more = c.start(5);
        let l = c.load(&report(3.0, 1.0, 0.25));
        assert_eq!(l.running, 5.0);
        assert!((l.kv_usage - 0.30).abs() < 1e-9);
    }

    #[test]
    fn a_report_that_missed_this_gateways_requests_does_not_hide_them() {
        // A decode worker's report leaves out requests still pulling their K/V.
        let c = InFlightCounts::default();
        let _a = c.start(4);
        let _b = c.start(4);
        c.reported(c.snapshot());
        let l = c.load(&report(0.0, 0.0, 0.0));
        assert_eq!(l.running, 2.0, "never below this gateway's own requests");
        assert!((l.kv_usage - 0.08).abs() < 1e-9);
    }

    #[test]
    fn a_report_counts_what_was_in_flight_when_it_was_asked_for() {
        let c = InFlightCounts::default();
        let a = c.start(1);
        let asked = c.snapshot();
        // While the poll was out, `a` ended and `b` started; the worker saw only `a`.
        drop(a);
        let _b = c.start(1);
        c.reported(asked);
        assert_eq!(
            c.load(&report(1.0, 0.0, 0.0)).running,
            1.0,
            "b, and no one else's"
        );
    }

    #[test]
    fn without_a_kv_size_the_reported_usage_stands() {
        let c = InFlightCounts::default();
        let _a = c.start(50);
        let l = c.load(&Load {
            kv_usage: 0.5,
            ..Load::default()
        });
        assert_eq!(l.kv_usage, 0.5);
        assert_eq!(l.running, 1.0);
    }
}
