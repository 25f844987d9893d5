//! The scaler's state file as the control loop keeps it: resumed at start, saved off
//! the loop, published on `/metrics`. The file itself is `crate::state`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{ModelLoop, unix_now};
use crate::decisions::DecisionStore;
use crate::policy::Pool;

/// Runs file work for `path` off the async threads; a task that panicked is an I/O
/// error on `path`.
async fn blocking<T: Send + 'static>(
    path: &std::path::Path,
    f: impl FnOnce() -> Result<T, crate::state::StateError> + Send + 'static,
) -> Result<T, crate::state::StateError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(join_error(path, &e)))
}

fn join_error(path: &std::path::Path, e: &tokio::task::JoinError) -> crate::state::StateError {
    crate::state::StateError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    }
}

/// Keeps the state file: resumes it at start, saves every [`SAVE_EVERY_S`] off the
/// control loop (at most one save in flight: a hung disk delays saves, never
/// decisions), and once more at a graceful stop. Pools it cannot resume now (their
/// model gone from the config, their season configured differently) are carried in
/// every save until [`max_age_s`] has passed, so a rollback finds them.
///
/// [`SAVE_EVERY_S`]: crate::state::SAVE_EVERY_S
/// [`max_age_s`]: crate::state::max_age_s
pub(super) struct StateKeeper {
    /// Where the last successful save is published (`/metrics`).
    store: Arc<DecisionStore>,
    path: std::path::PathBuf,
    carried: Vec<crate::state::SavedPool>,
    saved_at: Option<Instant>,
    in_flight: Option<tokio::task::JoinHandle<Result<f64, crate::state::StateError>>>,
    /// Whether the last save failed (a failure is logged when it starts and ends).
    failing: bool,
    /// Whether a save still running when the next was due was logged.
    slow_logged: bool,
    /// The path is not a file this scaler can replace (a directory, a FIFO), or
    /// another scaler holds it: no saves.
    disabled: bool,
    /// The lock on the state file, held for the keeper's life (`None`: the
    /// filesystem cannot lock).
    _lock: Option<std::fs::File>,
}

/// Seasons carried for a rollback, newest first, at most: the file stays far below
/// the size a scaler reads back.
const MAX_CARRIED: usize = 64;

impl StateKeeper {
    /// Takes back what an earlier run saved: each pool's season whose model, pool,
    /// period and bucket still match and that is not too old. A file that cannot be
    /// read is set aside (`.rejected`) and each season learnt afresh; nothing here
    /// stops the scaler.
    pub(super) async fn resume(
        path: &std::path::Path,
        models: &mut [ModelLoop],
        store: Arc<DecisionStore>,
    ) -> Self {
        let mut keeper = StateKeeper {
            store,
            path: path.to_path_buf(),
            carried: Vec::new(),
            saved_at: None,
            in_flight: None,
            failing: false,
            slow_logged: false,
            disabled: false,
            _lock: None,
        };
        // Published as 0 ("never") until the first save lands, so an alert on its age
        // also fires for a scaler that could never save (a read-only volume, a lock
        // another scaler kept), not only for one that stopped.
        keeper.store.set_state_saved(0.0);
        // One scaler per state file: two would overwrite each other's seasons (two
        // `preheat up` on one cache dir, a shared claim). A pod replaced outside a
        // rollout starts while the old one drains: wait for it (the listeners are up,
        // KEDA is told "no decision yet" and keeps the pools), then go without the file
        // rather than not at all.
        let p = path.to_path_buf();
        let wait = Duration::from_secs_f64(crate::state::LOCK_WAIT_S);
        match blocking(path, move || crate::state::lock_waiting(&p, wait)).await {
            Ok(f) => keeper._lock = Some(f),
            Err(e @ crate::state::StateError::InUse { .. }) => {
                tracing::error!(error = %e, "running without the state file: this scaler's seasons are neither resumed nor kept");
                keeper.disabled = true;
                return keeper;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot lock the state file: not checking for another scaler using it");
            }
        }
        let p = path.to_path_buf();
        let state = match blocking(path, move || crate::state::load(&p)).await {
            Ok(Some(s)) => s,
            Ok(None) => {
                tracing::info!(path = %path.display(), "no state file yet: learning each pool's season from now on");
                return keeper;
            }
            // Contents that cannot be used: kept aside for whoever wants them.
            Err(
                e @ (crate::state::StateError::Parse { .. }
                | crate::state::StateError::Format { .. }
                | crate::state::StateError::TooLarge { .. }),
            ) => {
                match crate::state::set_aside(path) {
                    Ok(aside) => {
                        tracing::warn!(error = %e, aside = %aside.display(), "not resuming the state file: set aside; learning each pool's season afresh")
                    }
                    Err(e2) => {
                        tracing::error!(error = %e, aside_error = %e2, "not resuming the state file, and it could not be set aside: not saving over it");
                        keeper.disabled = true;
                    }
                }
                return keeper;
            }
            // Not a file it can read (a directory, a FIFO, no permission): left alone.
            Err(e) => {
                tracing::error!(error = %e, "cannot use the state file: seasons are neither resumed nor kept");
                keeper.disabled = true;
                return keeper;
            }
        };
        let Some(now) = unix_now() else {
            tracing::warn!("no wall clock: not resuming the state file");
            keeper.carried = state.pools;
            return keeper;
        };
        let mut resumed: Vec<(String, Pool)> = Vec::new();
        for mut saved in state.pools {
            // Saved by a clock ahead of this one: aged from now, not from the future.
            saved.saved_unix = saved.saved_unix.min(now);
            let age = now - saved.saved_unix;
            if !(age.is_finite() && age <= crate::state::max_age_s(saved.season.period_s)) {
                tracing::info!(model = %saved.model, pool = %saved.pool, age_s = age, "state file: the season is too old to resume; dropping it");
                continue;
            }
            // Another model under the same name (a name reused for other weights) does
            // not resume this one's season.
            if let Some(m) = models.iter().find(|m| m.cfg.name == saved.model)
                && m.cfg.identity.is_some()
                && m.cfg.identity != saved.identity
            {
                tracing::info!(model = %saved.model, pool = %saved.pool, saved = ?saved.identity, now = ?m.cfg.identity, "state file: saved for another model under the same name; keeping it in the file for a rollback");
                keeper.carried.push(saved);
                continue;
            }
            let found = models
                .iter_mut()
                .filter(|m| m.cfg.name == saved.model)
                .flat_map(|m| m.pools.iter_mut())
                .find(|p| p.pool.as_str() == saved.pool);
            let Some(p) = found else {
                tracing::info!(model = %saved.model, pool = %saved.pool, "state file: no such pool configured now; keeping its season in the file for a rollback");
                keeper.carried.push(saved);
                continue;
            };
            let key = (saved.model.clone(), p.pool);
            if resumed.contains(&key) {
                // A second entry: one carried for another season configuration.
                if p.policy.season_buckets() != Some((saved.season.bucket_s, saved.season.period_s))
                {
                    keeper.carried.push(saved);
                }
                continue;
            }
            match p.policy.restore_season(&saved.season, now) {
                Ok(r) => {
                    tracing::info!(model = %saved.model, pool = %saved.pool, buckets = r.buckets, filling_s = r.filling_s, age_s = age, "season resumed from the state file");
                    resumed.push(key);
                }
                Err(reason) => {
                    tracing::warn!(model = %saved.model, pool = %saved.pool, %reason, "state file: not resuming the pool's season; keeping it in the file for a rollback");
                    keeper.carried.push(saved);
                }
            }
        }
        keeper
            .carried
            .sort_by(|a, b| b.saved_unix.total_cmp(&a.saved_unix));
        keeper.carried.truncate(MAX_CARRIED);
        keeper
    }

    /// What each pool learnt, and what is carried.
    fn state(&self, models: &[ModelLoop]) -> Option<crate::state::SavedState> {
        let now = unix_now()?;
        let live = models.iter().flat_map(|m| {
            m.pools.iter().filter_map(|p| {
                Some(crate::state::SavedPool {
                    model: m.cfg.name.clone(),
                    pool: p.pool.as_str().to_owned(),
                    saved_unix: now,
                    season: p.policy.season_state()?,
                    identity: m.cfg.identity.clone(),
                })
            })
        });
        let pools: Vec<crate::state::SavedPool> = live
            .chain(
                self.carried
                    .iter()
                    .filter(|c| now - c.saved_unix <= crate::state::max_age_s(c.season.period_s))
                    .cloned(),
            )
            .collect();
        (!pools.is_empty()).then(|| crate::state::SavedState::new(now, pools))
    }

    /// Starts a save when one is due and none is in flight.
    pub(super) fn save_if_due(&mut self, models: &[ModelLoop]) {
        if self.disabled {
            return;
        }
        // A save that finished is heard at the next tick (its time goes to /metrics),
        // unless the task budget defers its result: then at a later one.
        if let Some(mut h) = self.in_flight.take() {
            match h
                .is_finished()
                .then(|| futures_util::FutureExt::now_or_never(&mut h))
                .flatten()
            {
                Some(r) => {
                    self.slow_logged = false;
                    self.heard(Some(r));
                }
                None => self.in_flight = Some(h),
            }
        }
        if self
            .saved_at
            .is_some_and(|s| s.elapsed().as_secs_f64() < crate::state::SAVE_EVERY_S)
        {
            return;
        }
        if let Some(h) = &self.in_flight {
            if !self.slow_logged && !h.is_finished() {
                self.slow_logged = true;
                tracing::warn!(path = %self.path.display(), "the last state file save has not finished (a slow disk?): skipping saves until it does");
            }
            return;
        }
        self.saved_at = Some(Instant::now());
        let Some(state) = self.state(models) else {
            // Nothing to keep (no pool learns a season): the file is as current as it
            // can be, and the alert on the save's age must not fire for ever.
            if let Some(now) = unix_now() {
                self.store.set_state_saved(now);
            }
            return;
        };
        let p = self.path.clone();
        self.in_flight = Some(tokio::task::spawn_blocking(move || {
            crate::state::save(&p, &state).map(|()| state.saved_unix)
        }));
    }

    /// Waits (a few seconds at most) for the save in flight, then saves once more.
    pub(super) async fn last_save(mut self, models: &[ModelLoop]) {
        const WAIT: Duration = Duration::from_secs(5);
        if self.disabled {
            return;
        }
        if let Some(h) = self.in_flight.take() {
            match tokio::time::timeout(WAIT, h).await {
                Ok(r) => self.heard(Some(r)),
                Err(_) => {
                    tracing::warn!(path = %self.path.display(), "a state file save is stuck: not saving at stop");
                    return;
                }
            }
        }
        let Some(state) = self.state(models) else {
            return;
        };
        let p = self.path.clone();
        let h = tokio::task::spawn_blocking(move || {
            crate::state::save(&p, &state).map(|()| state.saved_unix)
        });
        match tokio::time::timeout(WAIT, h).await {
            Ok(r) => self.heard(Some(r)),
            Err(_) => {
                tracing::warn!(path = %self.path.display(), "the state file save at stop is stuck: what was learnt since the last save is lost")
            }
        }
    }

    fn heard(
        &mut self,
        r: Option<Result<Result<f64, crate::state::StateError>, tokio::task::JoinError>>,
    ) {
        let r = match r {
            Some(Ok(r)) => r,
            Some(Err(e)) => Err(join_error(&self.path, &e)),
            None => return,
        };
        if let Ok(unix) = r {
            self.store.set_state_saved(unix);
        }
        match r {
            Ok(_) if self.failing => {
                self.failing = false;
                tracing::info!(path = %self.path.display(), "state file saved again");
            }
            Ok(_) => {}
            Err(e) if !self.failing => {
                self.failing = true;
                tracing::warn!(error = %e, "saving the state file failed: a restart now would lose what was learnt since the last save; retrying every 30 s");
            }
            Err(_) => {}
        }
    }
}
