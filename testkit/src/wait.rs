//! Waiting for a condition: the one way every test of the workspace polls.
//!
//! [`wait_for`] (or [`wait_for_async`] inside a runtime) looks at `probe` until it says
//! done, pausing [`PAUSE`] between looks, and fails the test once `timeout` has passed,
//! naming what it waited for, where, and what it saw last. A probe says done with
//! `true`, `Some(value)` or `Ok(value)`; `false`, `None` or `Err(observation)` mean
//! "not yet" (an `Err` carries what was seen, for the failure message). A probe may
//! assert too: a process that died while it was awaited fails the test at once.
//!
//! [`Wait`] is the same with a pause of its own ([`Wait::every`]: a probe that costs
//! much, such as a batch of Prometheus queries) or without failing the test
//! ([`Wait::poll`]: a caller that gathers evidence first, or that gives up quietly).

use std::fmt;
use std::panic::Location;
use std::time::{Duration, Instant};

/// The pause between two looks.
pub const PAUSE: Duration = Duration::from_millis(50);

/// What a probe says: done (with a value) or not yet (with what it saw).
pub trait Outcome {
    /// What the wait returns once done.
    type Output;
    /// `Ok` when done; `Err(what was seen)` when not yet.
    fn outcome(self) -> Result<Self::Output, String>;
}

impl Outcome for bool {
    type Output = ();
    fn outcome(self) -> Result<(), String> {
        if self { Ok(()) } else { Err("false".into()) }
    }
}

impl<T> Outcome for Option<T> {
    type Output = T;
    fn outcome(self) -> Result<T, String> {
        self.ok_or_else(|| "None".into())
    }
}

impl<T, E: fmt::Display> Outcome for Result<T, E> {
    type Output = T;
    fn outcome(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// A wait that ran out: what it waited for, for how long, and the last observation.
#[derive(Debug, Clone)]
pub struct TimedOut {
    pub what: String,
    pub waited: Duration,
    /// What the last look saw (`false`, `None`, or the probe's `Err`).
    pub last: String,
}

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "timed out after {:.1} s waiting for {}; last seen: {}",
            self.waited.as_secs_f64(),
            self.what,
            self.last
        )
    }
}

impl std::error::Error for TimedOut {}

/// A wait for `what`, up to `timeout`, looking every [`PAUSE`] unless told otherwise.
#[derive(Debug, Clone)]
#[must_use = "a Wait does nothing until polled"]
pub struct Wait {
    what: String,
    timeout: Duration,
    pause: Duration,
}

impl Wait {
    pub fn new(what: impl Into<String>, timeout: Duration) -> Self {
        Wait {
            what: what.into(),
            timeout,
            pause: PAUSE,
        }
    }

    /// Looks every `pause` instead of every [`PAUSE`].
    pub fn every(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// Looks at `probe` until done (its value) or `timeout` (a [`TimedOut`]). The
    /// probe is always looked at once, however short the timeout.
    pub fn poll<O: Outcome>(&self, mut probe: impl FnMut() -> O) -> Result<O::Output, TimedOut> {
        let t0 = Instant::now();
        loop {
            match probe().outcome() {
                Ok(v) => return Ok(v),
                Err(last) => {
                    if t0.elapsed() >= self.timeout {
                        return Err(self.timed_out(t0, last));
                    }
                }
            }
            std::thread::sleep(self.pause);
        }
    }

    /// [`Wait::poll`] inside a runtime: the pauses are the runtime's.
    pub async fn poll_async<O: Outcome>(
        &self,
        mut probe: impl AsyncFnMut() -> O,
    ) -> Result<O::Output, TimedOut> {
        let t0 = Instant::now();
        loop {
            match probe().await.outcome() {
                Ok(v) => return Ok(v),
                Err(last) => {
                    if t0.elapsed() >= self.timeout {
                        return Err(self.timed_out(t0, last));
                    }
                }
            }
            tokio::time::sleep(self.pause).await;
        }
    }

    /// [`Wait::poll`], failing the test (naming the caller's line) when it times out.
    #[track_caller]
    pub fn until<O: Outcome>(&self, probe: impl FnMut() -> O) -> O::Output {
        let at = Location::caller();
        self.poll(probe).unwrap_or_else(|t| panic!("{at}: {t}"))
    }

    /// [`Wait::poll_async`], failing the test (naming the caller's line) when it times out.
    #[track_caller]
    pub fn until_async<O: Outcome>(
        &self,
        probe: impl AsyncFnMut() -> O,
    ) -> impl Future<Output = O::Output> {
        let at = Location::caller();
        async move {
            self.poll_async(probe)
                .await
                .unwrap_or_else(|t| panic!("{at}: {t}"))
        }
    }

    fn timed_out(&self, t0: Instant, last: String) -> TimedOut {
        TimedOut {
            what: self.what.clone(),
            waited: t0.elapsed(),
            last,
        }
    }
}

/// Waits up to `timeout` for `probe` to say done (`true`, `Some`, `Ok`), looking every
/// [`PAUSE`]; returns its value, or fails the test naming `what`, the caller's line and
/// the last observation.
#[track_caller]
pub fn wait_for<O: Outcome>(
    what: impl Into<String>,
    timeout: Duration,
    probe: impl FnMut() -> O,
) -> O::Output {
    let at = Location::caller();
    Wait::new(what, timeout)
        .poll(probe)
        .unwrap_or_else(|t| panic!("{at}: {t}"))
}

/// [`wait_for`] inside a runtime (an async probe, the runtime's pauses).
#[track_caller]
pub fn wait_for_async<O: Outcome>(
    what: impl Into<String>,
    timeout: Duration,
    probe: impl AsyncFnMut() -> O,
) -> impl Future<Output = O::Output> {
    let at = Location::caller();
    let wait = Wait::new(what, timeout);
    async move {
        wait.poll_async(probe)
            .await
            .unwrap_or_else(|t| panic!("{at}: {t}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_returns_the_probes_value_once_it_is_done() {
        let mut n = 0;
        let got = wait_for("the third look", Duration::from_secs(5), || {
            n += 1;
            (n == 3).then_some(n * 10)
        });
        assert_eq!((got, n), (30, 3));
        let mut left = 2;
        let ok: &str = wait_for("Ok", Duration::from_secs(5), || {
            left -= 1;
            if left == 0 {
                Ok("done")
            } else {
                Err("not yet")
            }
        });
        assert_eq!(ok, "done");
        wait_for("true at once", Duration::ZERO, || true);
    }

    #[test]
    fn a_timed_out_wait_names_what_it_waited_for_where_and_what_it_saw_last() {
        let mut n = 0;
        let e = Wait::new("a thing that never happens", Duration::from_millis(120))
            .every(Duration::from_millis(10))
            .poll(|| {
                n += 1;
                Err::<(), _>(format!("look {n}"))
            })
            .unwrap_err();
        assert!(n >= 2, "looked {n} times");
        assert!(e.waited >= Duration::from_millis(120), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("a thing that never happens") && msg.contains(&format!("look {n}")),
            "{msg}"
        );
        let panicked = std::panic::catch_unwind(|| {
            wait_for("nothing", Duration::from_millis(10), || false);
        })
        .unwrap_err();
        let why = panicked
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(
            why.contains("nothing") && why.contains("last seen: false") && why.contains("wait.rs"),
            "the failure names neither what, where nor the last look: {why}"
        );
    }

    #[test]
    fn an_async_wait_pauses_on_the_runtime_and_fails_where_it_was_called() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut n = 0;
            let got = wait_for_async("the second look", Duration::from_secs(5), async || {
                n += 1;
                (n == 2).then_some(n)
            })
            .await;
            assert_eq!(got, 2);
            let t = tokio::spawn(wait_for_async(
                "never",
                Duration::from_millis(30),
                async || None::<()>,
            ));
            let why = t.await.unwrap_err().into_panic();
            let why = why.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(why.contains("never") && why.contains("wait.rs"), "{why}");
        });
    }
}
