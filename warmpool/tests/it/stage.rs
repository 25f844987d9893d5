//! Staging against real files and a real HTTP server that can fail, corrupt and count.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use preheat_snapshot::packed::{PackOptions, pack};
use preheat_snapshot::synth::{SynthOptions, synthesize};
use preheat_snapshot::{NoProgress, Snapshot};
use preheat_warmpool::stage::{self, StageOptions};
use preheat_warmpool::{Error, Fetcher, Source, Store};

/// Faults the test server injects.
#[derive(Default)]
struct Faults {
    /// Bytes served so far (all requests).
    served: AtomicU64,
    /// Refuse (500) every range once this many bytes were served.
    fail_after: AtomicU64,
    /// Flip a bit of the byte at this offset in every response that covers it.
    corrupt_at: AtomicU64,
    corrupt: AtomicBool,
}

struct Server {
    url: String,
    faults: Arc<Faults>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve_range(
    State((dir, f)): State<(PathBuf, Arc<Faults>)>,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    if f.served.load(Ordering::SeqCst) >= f.fail_after.load(Ordering::SeqCst) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "injected failure").into_response();
    }
    let Ok(bytes) = std::fs::read(dir.join(&name)) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let len = bytes.len() as u64;
    let Some((s, e)) = headers
        .get("range")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| preheat_warmpool::files::parse_range(v, len))
    else {
        return StatusCode::RANGE_NOT_SATISFIABLE.into_response();
    };
    let mut body = bytes[s as usize..=e as usize].to_vec();
    let c = f.corrupt_at.load(Ordering::SeqCst);
    if f.corrupt.load(Ordering::SeqCst) && (s..=e).contains(&c) {
        body[(c - s) as usize] ^= 0x10;
    }
    f.served.fetch_add(body.len() as u64, Ordering::SeqCst);
    (
        StatusCode::PARTIAL_CONTENT,
        [("content-range", format!("bytes {s}-{e}/{len}"))],
        body,
    )
        .into_response()
}

async fn server(dir: &Path) -> Server {
    let faults = Arc::new(Faults {
        fail_after: AtomicU64::new(u64::MAX),
        ..Faults::default()
    });
    let app = axum::Router::new()
        .route("/f/{name}", axum::routing::get(serve_range))
        .with_state((dir.to_path_buf(), Arc::clone(&faults)));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        axum::serve(l, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await
            .unwrap();
    });
    Server {
        url,
        faults,
        _stop: tx,
    }
}

/// A tiny synthetic snapshot and its packed encoding in `dir`.
fn model(dir: &Path) -> (PathBuf, PathBuf) {
    let snap = dir.join("tiny.preheat");
    synthesize("tiny", &snap, SynthOptions::default(), &NoProgress).unwrap();
    let packed = dir.join("tiny.phpack");
    pack(
        &snap,
        &packed,
        PackOptions {
            chunk_size: 64 << 10,
            ..PackOptions::default()
        },
        &NoProgress,
    )
    .unwrap();
    (snap, packed)
}

fn small_pieces() -> StageOptions {
    StageOptions {
        piece_bytes: 64 << 10,
        concurrency: 3,
        ..StageOptions::default()
    }
}

fn fetcher(s: &str) -> Fetcher {
    Fetcher::new(Source::parse(s), std::time::Duration::from_secs(10)).unwrap()
}

/// Stages `source` as model `tiny` in `dir`.
async fn stage_tiny(
    source: &str,
    dir: &Path,
    opts: &StageOptions,
) -> preheat_warmpool::Result<stage::StageOutcome> {
    stage::stage(&fetcher(source), dir, "tiny", opts, Arc::new(NoProgress)).await
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".stage.") && !n.ends_with(".lock"))
        .collect()
}

#[tokio::test]
async fn stages_plain_and_packed_from_a_path_and_over_http() {
    let src = tempfile::tempdir().unwrap();
    let (snap, packed) = model(src.path());
    let srv = server(src.path()).await;
    for source in [
        snap.display().to_string(),
        packed.display().to_string(),
        format!("{}/f/tiny.preheat", srv.url),
        format!("{}/f/tiny.phpack", srv.url),
    ] {
        let out = tempfile::tempdir().unwrap();
        let o = stage_tiny(&source, out.path(), &small_pieces())
            .await
            .unwrap();
        assert!(!o.already_staged);
        assert_eq!(o.resumed_bytes, 0);
        assert_eq!(o.bytes, std::fs::metadata(&snap).unwrap().len());
        assert!(same_bytes(&o.path, &snap), "{source}");
        assert!(
            leftovers(out.path()).is_empty(),
            "{:?}",
            leftovers(out.path())
        );
        // Staging again finds it in place and verified.
        let again = stage_tiny(&source, out.path(), &small_pieces())
            .await
            .unwrap();
        assert!(again.already_staged);
        assert_eq!(again.fetched_bytes, 0);
    }
}

#[tokio::test]
async fn an_interrupted_staging_resumes_where_it_stopped() {
    let src = tempfile::tempdir().unwrap();
    let (snap, packed) = model(src.path());
    for (file, total) in [
        ("tiny.preheat", std::fs::metadata(&snap).unwrap().len()),
        ("tiny.phpack", std::fs::metadata(&packed).unwrap().len()),
    ] {
        let srv = server(src.path()).await;
        srv.faults.fail_after.store(total / 2, Ordering::SeqCst);
        let out = tempfile::tempdir().unwrap();
        let url = format!("{}/f/{file}", srv.url);
        let opts = StageOptions {
            concurrency: 1,
            ..small_pieces()
        };
        let err = stage_tiny(&url, out.path(), &opts).await.unwrap_err();
        assert!(matches!(err, Error::Fetch { .. }), "{err}");
        assert!(
            !stage::snapshot_path(out.path(), "tiny").exists(),
            "nothing is published by a failed staging"
        );
        let first = srv.faults.served.load(Ordering::SeqCst);
        srv.faults.fail_after.store(u64::MAX, Ordering::SeqCst);
        let o = stage_tiny(&url, out.path(), &opts).await.unwrap();
        assert!(o.resumed_bytes > 0, "{file}: {o:?}");
        let second = srv.faults.served.load(Ordering::SeqCst) - first;
        assert!(
            second < total * 3 / 4,
            "{file}: the second run fetched {second} of {total} bytes"
        );
        assert!(same_bytes(&o.path, &snap));
        assert!(leftovers(out.path()).is_empty());
    }
}

#[tokio::test]
async fn a_corrupt_source_is_never_published() {
    let src = tempfile::tempdir().unwrap();
    let (snap, _) = model(src.path());
    let s = Snapshot::open(&snap).unwrap();
    let t = s.manifest().tensors.last().unwrap();
    let at = t.offset + t.nbytes / 2;
    drop(s);
    let srv = server(src.path()).await;
    srv.faults.corrupt_at.store(at, Ordering::SeqCst);
    srv.faults.corrupt.store(true, Ordering::SeqCst);
    let out = tempfile::tempdir().unwrap();
    let url = format!("{}/f/tiny.preheat", srv.url);
    let err = stage_tiny(&url, out.path(), &small_pieces())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt(..)), "{err}");
    assert!(!stage::snapshot_path(out.path(), "tiny").exists());
    // The source is fixed: the next attempt succeeds.
    srv.faults.corrupt.store(false, Ordering::SeqCst);
    let o = stage_tiny(&url, out.path(), &small_pieces()).await.unwrap();
    assert!(same_bytes(&o.path, &snap));
}

#[tokio::test]
async fn corruption_of_the_partial_file_is_caught_and_refetched() {
    let src = tempfile::tempdir().unwrap();
    let (snap, _) = model(src.path());
    let total = std::fs::metadata(&snap).unwrap().len();
    let srv = server(src.path()).await;
    srv.faults.fail_after.store(total * 3 / 4, Ordering::SeqCst);
    let out = tempfile::tempdir().unwrap();
    let url = format!("{}/f/tiny.preheat", srv.url);
    let opts = StageOptions {
        concurrency: 1,
        ..small_pieces()
    };
    stage_tiny(&url, out.path(), &opts).await.unwrap_err();
    // Flip bytes in what the journal says is done (a bad disk, a torn write).
    let partial = out.path().join(".tiny.stage.partial");
    let mut b = std::fs::read(&partial).unwrap();
    let s = Snapshot::open(&snap).unwrap();
    let t0 = s.manifest().tensors[0].clone();
    b[(t0.offset + 1) as usize] ^= 0xff;
    std::fs::write(&partial, b).unwrap();
    srv.faults.fail_after.store(u64::MAX, Ordering::SeqCst);
    let o = stage_tiny(&url, out.path(), &opts).await.unwrap();
    assert!(same_bytes(&o.path, &snap));
}

#[tokio::test]
async fn a_corrupt_published_snapshot_is_staged_again() {
    let src = tempfile::tempdir().unwrap();
    let (snap, _) = model(src.path());
    let out = tempfile::tempdir().unwrap();
    let f = fetcher(&snap.display().to_string());
    let o = stage::stage(
        &f,
        out.path(),
        "tiny",
        &small_pieces(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    let mut b = std::fs::read(&o.path).unwrap();
    let n = b.len();
    b[n - 10] ^= 1;
    std::fs::write(&o.path, b).unwrap();
    let again = stage::stage(
        &f,
        out.path(),
        "tiny",
        &small_pieces(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap();
    assert!(!again.already_staged);
    assert!(same_bytes(&again.path, &snap));
}

#[tokio::test]
async fn concurrent_requests_for_one_model_stage_it_once() {
    let src = tempfile::tempdir().unwrap();
    let (snap, _) = model(src.path());
    let total = std::fs::metadata(&snap).unwrap().len();
    let srv = server(src.path()).await;
    let out = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(out.path(), 1 << 30).unwrap());
    let url = format!("{}/f/tiny.preheat", srv.url);
    let runs = (0..4).map(|_| {
        let store = Arc::clone(&store);
        let f = fetcher(&url);
        tokio::spawn(async move {
            store
                .ensure(
                    "tiny",
                    &f,
                    &small_pieces(),
                    &HashSet::new(),
                    Arc::new(NoProgress),
                )
                .await
        })
    });
    let outs: Vec<_> = futures_util::future::join_all(runs).await;
    let fetched: u64 = outs
        .into_iter()
        .map(|r| r.unwrap().unwrap().fetched_bytes)
        .sum();
    assert_eq!(
        fetched, total,
        "one staging fetched it all, the others none"
    );
    // Header probes aside, the server sent the file once.
    assert!(srv.faults.served.load(Ordering::SeqCst) < total + 64 * 1024);
}

/// A store with room for two and a half snapshots of the tiny model, and that
/// model as the source of every name.
struct Room {
    _src: tempfile::TempDir,
    out: tempfile::TempDir,
    size: u64,
    store: Store,
    f: Fetcher,
}

impl Room {
    fn for_two() -> Room {
        let src = tempfile::tempdir().unwrap();
        let (snap, _) = model(src.path());
        let size = std::fs::metadata(&snap).unwrap().len();
        let out = tempfile::tempdir().unwrap();
        // No grace: these wants are milliseconds apart.
        let store = Store::open(out.path(), size * 2 + size / 2)
            .unwrap()
            .with_want_grace(std::time::Duration::ZERO);
        let f = fetcher(&snap.display().to_string());
        Room {
            _src: src,
            out,
            size,
            store,
            f,
        }
    }

    /// Demand for `name` (stages it, making room; records the want).
    async fn want(&self, name: &str) -> preheat_warmpool::Result<()> {
        self.want_keeping(name, &[]).await
    }

    async fn want_keeping(&self, name: &str, keep: &[&str]) -> preheat_warmpool::Result<()> {
        let keep: HashSet<String> = keep.iter().map(|k| (*k).to_owned()).collect();
        self.store
            .ensure(name, &self.f, &small_pieces(), &keep, Arc::new(NoProgress))
            .await
            .map(|_| ())
    }

    async fn prefetch(&self, name: &str) -> preheat_warmpool::Result<()> {
        self.store
            .prefetch(name, &self.f, &small_pieces(), Arc::new(NoProgress))
            .await
            .map(|_| ())
    }

    /// Wants each of `names` in turn, at distinct times (what eviction orders by).
    async fn want_in_turn(&self, names: &[&str]) {
        for name in names {
            self.want(name).await.unwrap();
            // Deliberate: the wants must be at distinct times.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Staged names, least recently wanted first.
    fn names(&self) -> Vec<String> {
        self.store
            .list()
            .unwrap()
            .into_iter()
            .map(|m| m.name)
            .collect()
    }

    fn lease(&self, name: &str) -> preheat_warmpool::lease::Lease {
        preheat_warmpool::lease::Lease::take(&self.store.path_of(name).unwrap()).unwrap()
    }
}

#[tokio::test]
async fn least_recently_used_snapshots_are_evicted_past_the_budget() {
    let r = Room::for_two();
    r.want_in_turn(&["a", "b"]).await;
    r.store.touch("a");
    r.want("c").await.unwrap();
    assert_eq!(r.names(), vec!["a", "c"], "b was least recently used");
    assert_eq!(r.store.evictions(), 1);
    // Everything else must stay: no room for d.
    let err = r.want_keeping("d", &["a", "c"]).await.unwrap_err();
    assert!(matches!(err, Error::OverBudget(_)), "{err}");
    let tiny = Store::open(tempfile::tempdir().unwrap().path(), r.size / 2).unwrap();
    assert!(matches!(
        tiny.ensure(
            "a",
            &r.f,
            &small_pieces(),
            &HashSet::new(),
            Arc::new(NoProgress)
        )
        .await,
        Err(Error::OverBudget(_))
    ));
}

#[tokio::test]
async fn a_model_just_wanted_is_not_evicted_before_its_replica_can_lease_it() {
    let r = Room::for_two();
    r.want_in_turn(&["a", "b"]).await;
    // The default grace: a and b were both wanted a moment ago (their pods may be
    // starting, their files not leased yet): c cannot make room.
    let store = Store::open(r.out.path(), r.size * 2 + r.size / 2).unwrap();
    store.touch("a");
    let err = store
        .ensure(
            "c",
            &r.f,
            &small_pieces(),
            &HashSet::new(),
            Arc::new(NoProgress),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::OverBudget(ref m) if m.contains("wanted in the last")),
        "{err}"
    );
    assert_eq!(r.names(), vec!["b", "a"], "nothing evicted");
}

#[tokio::test]
async fn a_snapshot_a_replica_maps_is_never_evicted_however_long_ago_it_was_wanted() {
    let r = Room::for_two();
    r.want_in_turn(&["a", "b"]).await;
    // A replica maps a, the least recently wanted: b goes instead.
    let lease = r.lease("a");
    r.want("c").await.unwrap();
    assert_eq!(r.names(), vec!["a", "c"]);
    // With a and c both mapped, nothing can make room for d.
    let _c = r.lease("c");
    let err = r.want("d").await.unwrap_err();
    assert!(
        matches!(err, Error::OverBudget(ref m) if m.contains("mapped")),
        "{err}"
    );
    // Unmapped, a (wanted before c) makes room.
    drop(lease);
    r.want("d").await.unwrap();
    assert_eq!(r.names(), vec!["c", "d"]);
}

#[tokio::test]
async fn prefetching_fills_spare_room_only_and_goes_first_when_a_wanted_model_needs_it() {
    let r = Room::for_two();
    // b is staged after a was wanted (its file is the newer one).
    r.want_in_turn(&["a"]).await;
    r.prefetch("b").await.unwrap();
    // No room left beside a and b: a prefetch evicts nothing.
    let err = r.prefetch("c").await.unwrap_err();
    assert!(matches!(err, Error::OverBudget(_)), "{err}");
    assert_eq!(r.store.evictions(), 0);
    // Asked for, c makes room: b, prefetched and never wanted, goes before a.
    r.want("c").await.unwrap();
    assert_eq!(r.names(), vec!["a", "c"]);
    // Prefetching a staged model records no want: a stays the least recently wanted.
    r.prefetch("c").await.unwrap();
    r.prefetch("a").await.unwrap();
    assert_eq!(r.names()[0], "a");
}

#[tokio::test]
async fn the_agent_and_a_pods_staging_step_share_one_record_of_wants() {
    // The agent's store, open for its life.
    let r = Room::for_two();
    r.want_in_turn(&["a", "b"]).await;
    // A pod's staging step (another process, its own store) wants a again...
    Store::open(r.out.path(), r.size * 2 + r.size / 2)
        .unwrap()
        .ensure(
            "a",
            &r.f,
            &small_pieces(),
            &HashSet::new(),
            Arc::new(NoProgress),
        )
        .await
        .unwrap();
    // ...which the agent sees when it next makes room: b goes.
    r.want("c").await.unwrap();
    assert_eq!(r.names(), vec!["a", "c"]);
}

#[tokio::test]
async fn bad_sources_get_clear_errors() {
    let src = tempfile::tempdir().unwrap();
    std::fs::write(src.path().join("junk.preheat"), vec![b'x'; 4096]).unwrap();
    let out = tempfile::tempdir().unwrap();
    let srv = server(src.path()).await;
    for s in [
        src.path().join("junk.preheat").display().to_string(),
        src.path().join("missing.preheat").display().to_string(),
        format!("{}/f/missing.preheat", srv.url),
        "http://127.0.0.1:1/x.preheat".to_owned(),
    ] {
        let e = stage::stage(
            &fetcher(&s),
            out.path(),
            "m",
            &small_pieces(),
            Arc::new(NoProgress),
        )
        .await
        .unwrap_err();
        assert!(!e.to_string().is_empty());
    }
    let e = stage::stage(
        &fetcher("/x"),
        out.path(),
        "../m",
        &small_pieces(),
        Arc::new(NoProgress),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("model name"), "{e}");
}
