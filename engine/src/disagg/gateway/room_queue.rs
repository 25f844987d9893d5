//! Requests waiting for room in a decode worker, served first come, first served.
//!
//! When every decode worker has answered "no room now" (its cache, batch or queue is
//! full), a request waits at the gateway. Each waiter used to ask again on its own timer,
//! with a pause growing to 1 s, and whichever timer fired just after room freed took it:
//! a newcomer (20 ms pause) beat a request that had waited a minute (1 s pause). Under
//! sustained overload some requests then waited past their client's timeout while later
//! ones were served. Here waiters queue: only the head asks, it asks again each time room
//! may have freed (a request of this gateway's ended at a decode worker, a decode worker
//! reported its load or joined) or after [`RECHECK`] (room freed where this gateway does
//! not see it), and a request that arrives while others wait joins the tail.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Longest the head waits before asking again without a sign that room freed.
const RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
pub(super) struct RoomQueue {
    state: Mutex<State>,
    /// Woken on every change: the head left, room may have freed.
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    waiting: VecDeque<u64>,
    next_ticket: u64,
    /// Counts the signs that room may have freed.
    freed: u64,
}

/// A place in the queue, given up when dropped (admitted, failed, or the client went).
#[derive(Debug)]
pub(super) struct Ticket {
    queue: Arc<RoomQueue>,
    id: u64,
}

impl Ticket {
    /// Where it stands among all tickets ever given: a request that leaves the queue to
    /// ask a worker, and is refused, takes the same place back ([`RoomQueue::rejoin`]).
    pub(super) fn place(&self) -> u64 {
        self.id
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = self.queue.lock();
        if let Some(i) = s.waiting.iter().position(|&t| t == self.id) {
            s.waiting.remove(i);
        }
        drop(s);
        self.queue.changed.notify_waiters();
    }
}

/// Signals that room may have freed when dropped: held with a request at a decode
/// worker.
#[derive(Debug)]
pub(super) struct FreesRoom(pub(super) Arc<RoomQueue>);

impl Drop for FreesRoom {
    fn drop(&mut self) {
        self.0.room_may_have_freed();
    }
}

impl RoomQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether no request is waiting.
    pub(super) fn is_empty(&self) -> bool {
        self.lock().waiting.is_empty()
    }

    /// Requests waiting now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().waiting.len()
    }

    /// A place at the tail.
    pub(super) fn join(self: &Arc<Self>) -> Ticket {
        let mut s = self.lock();
        let id = s.next_ticket;
        s.next_ticket += 1;
        s.waiting.push_back(id);
        Ticket {
            queue: Arc::clone(self),
            id,
        }
    }

    /// Back at `place` (a [`Ticket::place`] given up to ask a worker): ahead of every
    /// request that joined after it, so asking costs no request its turn.
    pub(super) fn rejoin(self: &Arc<Self>, place: u64) -> Ticket {
        let mut s = self.lock();
        // The queue is in place order: joins take increasing places, rejoins are put
        // back where they belong.
        let at = s.waiting.partition_point(|&t| t < place);
        if s.waiting.get(at) != Some(&place) {
            s.waiting.insert(at, place);
        }
        Ticket {
            queue: Arc::clone(self),
            id: place,
        }
    }

    /// Where the signs of freed room stand now: read before asking a worker, so room
    /// that frees while the answer is on its way is not missed.
    pub(super) fn mark(&self) -> u64 {
        self.lock().freed
    }

    pub(super) fn room_may_have_freed(&self) {
        self.lock().freed += 1;
        self.changed.notify_waiters();
    }

    /// Waits until `ticket` heads the queue and, with `after`, until room may have
    /// freed since that [`RoomQueue::mark`] (or [`RECHECK`] passed). False at
    /// `deadline`.
    pub(super) async fn wait_turn(
        &self,
        ticket: &Ticket,
        after: Option<u64>,
        deadline: Instant,
    ) -> bool {
        let mut head_since: Option<Instant> = None;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let head = {
                let s = self.lock();
                let head = s.waiting.front() == Some(&ticket.id);
                if head && after.is_none_or(|m| s.freed != m) {
                    return true;
                }
                head
            };
            let wake = if head {
                let since = *head_since.get_or_insert(now);
                if now >= since + RECHECK {
                    return true;
                }
                deadline.min(since + RECHECK)
            } else {
                head_since = None;
                deadline
            };
            if now >= deadline {
                return false;
            }
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    #[tokio::test]
    async fn only_the_head_goes_and_the_next_follows_when_it_leaves() {
        let q = Arc::new(RoomQueue::default());
        let a = q.join();
        let b = q.join();
        assert!(q.wait_turn(&a, None, soon()).await);
        let waiting_b = {
            let q = Arc::clone(&q);
            tokio::spawn(async move { q.wait_turn(&b, None, soon()).await })
        };
        // Deliberate: b must still be waiting after a while.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting_b.is_finished(), "b went ahead of a");
        let left = Instant::now();
        drop(a);
        assert!(waiting_b.await.unwrap());
        assert!(
            left.elapsed() < Duration::from_millis(500),
            "b went as soon as a left"
        );
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn a_refused_head_asks_again_when_room_may_have_freed_or_after_the_recheck() {
        let q = Arc::new(RoomQueue::default());
        let a = q.join();
        let mark = q.mark();
        // Room freed while the refusal was on its way: asks again at once.
        q.room_may_have_freed();
        let t0 = Instant::now();
        assert!(q.wait_turn(&a, Some(mark), soon()).await);
        assert!(t0.elapsed() < Duration::from_millis(200));
        // No sign: asks after the recheck period.
        let t1 = Instant::now();
        assert!(q.wait_turn(&a, Some(q.mark()), soon()).await);
        assert!(t1.elapsed() >= RECHECK);
        // A request at a decode worker ends: asks again then.
        let q2 = Arc::clone(&q);
        let frees = FreesRoom(q2);
        let signal = tokio::spawn(async move {
            // Deliberate: the sign comes a while after the wait starts.
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(frees);
        });
        let t2 = Instant::now();
        assert!(q.wait_turn(&a, Some(q.mark()), soon()).await);
        let took = t2.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < RECHECK,
            "{took:?}"
        );
        signal.await.unwrap();
    }

    #[tokio::test]
    async fn a_request_back_from_asking_takes_its_place_ahead_of_later_ones() {
        let q = Arc::new(RoomQueue::default());
        let a = q.join();
        let b = q.join();
        // `a` leaves to ask a worker; `b` heads the queue meanwhile, `c` joins.
        let place = a.place();
        drop(a);
        assert!(q.wait_turn(&b, None, soon()).await);
        let c = q.join();
        // Refused, `a` comes back ahead of both.
        let a = q.rejoin(place);
        assert!(q.wait_turn(&a, None, soon()).await);
        let t0 = Instant::now();
        assert!(!q.wait_turn(&b, None, t0 + Duration::from_millis(100)).await);
        drop(a);
        assert!(q.wait_turn(&b, None, soon()).await);
        drop(b);
        assert!(q.wait_turn(&c, None, soon()).await);
    }

    #[tokio::test]
    async fn a_waiter_behind_the_head_gives_up_at_its_deadline_and_leaves_the_queue() {
        let q = Arc::new(RoomQueue::default());
        let _a = q.join();
        let b = q.join();
        let t0 = Instant::now();
        assert!(!q.wait_turn(&b, None, t0 + Duration::from_millis(300)).await);
        assert!(t0.elapsed() >= Duration::from_millis(300));
        drop(b);
        assert_eq!(q.len(), 1);
    }
}
