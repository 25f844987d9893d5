//! The state file: a restarted scaler resumes its season from it; a corrupt one is
//! replaced; saves are published for the alert.

use super::*;

/// A scaler of one model whose prefill pool is at zero and whose decode pool has one
/// idle replica, reading no Prometheus, keeping its state in `state`.
async fn at_zero_with_state(state: &std::path::Path) -> Running {
    at_zero_with_state_and(state, "", "").await
}

/// [`at_zero_with_state`], with `extra` (`, key: value`) in both pools' configs and
/// `model_extra` in the model's.
async fn at_zero_with_state_and(
    state: &std::path::Path,
    model_extra: &str,
    extra: &str,
) -> Running {
    let d0 = Arc::new(Mutex::new(Some(engine_text(0))));
    let gw = Arc::new(Mutex::new(Some(
        "# TYPE preheat:gateway_pending_requests gauge\npreheat:gateway_pending_requests 0\n"
            .to_owned(),
    )));
    let (u0, ug) = (fake(d0).await, fake(gw).await);
    Running::start(&[
        "interval_s=0.2".into(),
        "window_s=2".into(),
        format!("state_file={}", state.display()),
        format!(
            "models=[{{name: llama{model_extra}, gateway: [{ug}], prefill: {{default_lead_s: 300{extra}}}, decode: {{endpoints: [{u0}]{extra}}}}}]"
        ),
    ])
    .await
}

/// The pool's desired replicas once the scaler has decided.
async fn first_decision(scaler: &mut Running, pool: &str) -> i64 {
    wait_for_async("a decision", Duration::from_secs(10), async || {
        Some(desired(&mut scaler.client, pool).await).filter(|d| *d >= 0)
    })
    .await
}

/// Waits for the state file at `path` to hold a save made after `after` (Unix s).
async fn saved_after(path: &std::path::Path, after: f64) -> preheat_scaler::state::SavedState {
    wait_for_async(
        format!("a state saved in {}", path.display()),
        Duration::from_secs(10),
        async || {
            preheat_scaler::state::load(path)
                .ok()
                .flatten()
                .filter(|s| s.saved_unix > after)
        },
    )
    .await
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The season's five-minute bucket of `unix`.
fn ramp_slot(unix: f64) -> usize {
    ((unix / 300.0).floor() as i64).rem_euclid(288) as usize
}

/// What a run learnt yesterday: quiet at this time of day, 1M prompt tokens/s from the
/// next five-minute bucket on.
fn ramp_yesterday(now: f64) -> preheat_scaler::policy::season::SeasonState {
    let mut learnt = vec![None; 288];
    learnt[ramp_slot(now)] = Some(0.0);
    for k in 1..=3 {
        learnt[ramp_slot(now + 300.0 * f64::from(k))] = Some(1e6);
    }
    preheat_scaler::policy::season::SeasonState {
        period_s: 86_400.0,
        bucket_s: 300.0,
        learnt,
        filling: None,
        last_unix: Some(now - 60.0),
    }
}

/// A season saved for another model under the same name is not resumed: `up --model`
/// once served SmolLM2 as `default` and its scaler resumed what the embedded model had
/// learnt. With `identity` (what `up` gives each model: its name and manifest digest),
/// only the same model resumes it; the other's stays in the file for a rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_season_saved_for_another_model_under_the_same_name_is_not_resumed() {
    use preheat_scaler::state::{SavedPool, SavedState, save};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scaler-state.json");
    let now = unix_now();
    let saved = SavedPool {
        model: "llama".into(),
        pool: "prefill".into(),
        saved_unix: now - 60.0,
        season: ramp_yesterday(now),
        identity: Some("llama-aaaa".into()),
    };
    save(&path, &SavedState::new(now - 60.0, vec![saved])).unwrap();
    let mut other = at_zero_with_state_and(&path, ", identity: llama-bbbb", "").await;
    assert_eq!(
        first_decision(&mut other, "prefill").await,
        0,
        "another model's season resumed"
    );
    other.stop().await;
    let mut same = at_zero_with_state_and(&path, ", identity: llama-aaaa", "").await;
    assert_eq!(
        first_decision(&mut same, "prefill").await,
        64,
        "its own season, carried across the other's run"
    );
    same.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_scaler_without_prometheus_resumes_its_season_from_its_state_file() {
    use preheat_scaler::state::{SavedPool, SavedState, save};
    // Yesterday, what the earlier run learnt: quiet at this time of day, 1M prompt
    // tokens/s from the next five-minute bucket on. Resumed, the season wakes the
    // prefill pool at zero one 5-minute lead ahead of the ramp, sized for it (past the
    // 64-replica limit); a fresh scaler leaves it at zero.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scaler-state.json");
    let now = unix_now();
    let slot = ramp_slot;
    let season = ramp_yesterday(now);
    let pool = |pool: &str| SavedPool {
        model: "llama".into(),
        pool: pool.into(),
        saved_unix: now - 60.0,
        season: season.clone(),
        identity: None,
    };
    // Saved a minute ago by the run before, with a pool that is no longer configured.
    let mut gone = pool("prefill");
    gone.model = "retired".into();
    save(
        &path,
        &SavedState::new(now - 60.0, vec![pool("prefill"), gone]),
    )
    .unwrap();

    let mut scaler = at_zero_with_state(&path).await;
    assert_eq!(
        first_decision(&mut scaler, "prefill").await,
        64,
        "the ramp yesterday"
    );
    // It goes on keeping its state: the next save holds the resumed season (and this
    // run's readings) for both pools, and carries the retired model's for a rollback.
    let st = saved_after(&path, now).await;
    scaler.stop().await;
    let pools: Vec<(&str, &str)> = st
        .pools
        .iter()
        .map(|p| (p.model.as_str(), p.pool.as_str()))
        .collect();
    assert_eq!(
        pools,
        [
            ("llama", "prefill"),
            ("llama", "decode"),
            ("retired", "prefill")
        ]
    );
    // (JSON reads a float back to within a unit in the last place.)
    assert!(
        (st.pools[2].saved_unix - (now - 60.0)).abs() < 1e-3,
        "carried as it was: {}",
        st.pools[2].saved_unix
    );
    for k in 1..=3 {
        let s = slot(now + 300.0 * f64::from(k));
        assert_eq!(st.pools[0].season.learnt[s], Some(1e6), "bucket {s}");
    }
    assert!(
        st.pools[0].season.last_unix.is_some_and(|t| t > now),
        "{:?}",
        st.pools[0].season.last_unix
    );

    // Without the state (a first start), the pool stays at zero.
    let fresh_dir = tempfile::tempdir().unwrap();
    let mut fresh = at_zero_with_state(&fresh_dir.path().join("scaler-state.json")).await;
    assert_eq!(
        first_decision(&mut fresh, "prefill").await,
        0,
        "nothing learnt"
    );
    fresh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_state_file_is_reported_and_replaced_and_never_stops_the_scaler() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scaler-state.json");
    // Half a file (written by something that is not the scaler: its own saves are whole).
    std::fs::write(
        &path,
        br#"{"format": "preheat-scaler-state/1", "saved_unix": 17"#,
    )
    .unwrap();
    let before = unix_now();
    let mut scaler = at_zero_with_state(&path).await;
    assert_eq!(first_decision(&mut scaler, "prefill").await, 0);
    let st = saved_after(&path, before - 1.0).await;
    assert_eq!(st.pools.len(), 2, "{st:?}");
    // The save is on the scaler's /metrics (from the tick after it), for an alert on
    // saves that stopped.
    state_saved(&scaler, |t| t >= before - 1.0).await;
    // The half file was set aside, not overwritten.
    let aside = std::fs::read_to_string(dir.path().join("scaler-state.json.rejected")).unwrap();
    assert!(aside.ends_with("\"saved_unix\": 17"), "{aside}");
    // A graceful stop saves once more: what was learnt since the last save is kept.
    let stopping = unix_now();
    scaler.stop().await;
    let last = preheat_scaler::state::load(&path).unwrap().unwrap();
    assert!(
        last.saved_unix >= stopping,
        "{} < {stopping}",
        last.saved_unix
    );
}

#[tokio::test]
async fn a_scaler_that_has_not_saved_its_state_publishes_zero_for_the_alert() {
    // Another scaler holds the state file's lock: this one waits for it (up to 90 s)
    // and saves nothing meanwhile. Its last save reads 0 ("never"), so the chart's
    // alert on the save's age fires for a scaler that cannot save, not only for one
    // that stopped.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scaler-state.json");
    let _held = preheat_scaler::state::lock(&path).unwrap();
    let scaler = at_zero_with_state(&path).await;
    assert_eq!(
        state_saved(&scaler, |_| true).await,
        0.0,
        "nothing was saved"
    );
    assert!(!path.exists(), "saved under another scaler's lock");
}

#[tokio::test]
async fn a_scaler_with_no_season_to_keep_is_never_reported_as_not_saving() {
    // Seasons off: nothing to save, so no file, but the alert on the last save's age
    // must not fire for ever: the time of each save that had nothing to write.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scaler-state.json");
    let before = unix_now();
    let scaler = at_zero_with_state_and(&path, "", ", season_period_s: 0").await;
    let t = state_saved(&scaler, |v| v > 0.0).await;
    assert!(t >= before - 1.0, "{t} < {before}");
    assert!(!path.exists(), "no season, no file");
}

/// The scaler's last save on its /metrics once `ok` accepts it (10 s at most).
async fn state_saved(scaler: &Running, ok: impl Fn(f64) -> bool) -> f64 {
    let what = format!(
        "{} as wanted on /metrics",
        preheat_scaler::signals::names::own::STATE_SAVED
    );
    wait_for_async(what, Duration::from_secs(10), async || {
        let m = scaler.metrics().await;
        let saved = preheat_scaler::signals::text_format::samples(&m)
            .filter_map(Result::ok)
            .find(|s| s.name == preheat_scaler::signals::names::own::STATE_SAVED)
            .map(|s| s.value);
        saved.filter(|v| ok(*v)).ok_or(m)
    })
    .await
}
