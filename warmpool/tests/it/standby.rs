//! Standby processes through [`StandbyPool`] with a stand-in replica (a small Python
//! HTTP server speaking the worker's `/internal/state` and `/internal/promote`, and
//! draining on SIGTERM like a worker): promoted standbys drain on shutdown, parked ones
//! are killed, and standbys that die at start are replaced with growing pauses.

use std::path::Path;
use std::time::{Duration, Instant};

use preheat_testkit::{Wait, wait_for_async};
use preheat_warmpool::config::StandbySpec;
use preheat_warmpool::standby::StandbyPool;

/// Answers `standby` until promoted, then `serving`; on SIGTERM it "finishes its
/// requests" (a pause) and writes `drained` to its marker file.
const REPLICA: &str = r#"
import http.server, json, os, signal, sys, time
port, marker = int(sys.argv[1]), sys.argv[2]
state = {"s": "standby"}
class H(http.server.BaseHTTPRequestHandler):
    def reply(self, body):
        b = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        self.reply({"state": state["s"]})
    def do_POST(self):
        state["s"] = "serving"
        self.reply({"ok": True})
    def log_message(self, *a):
        pass
def term(*_):
    time.sleep(0.5)  # deliberate: the drain's length
    with open(marker, "w") as f:
        f.write("drained")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever(poll_interval=0.05)
"#;

fn spec(dir: &Path, count: u32, command: Vec<String>) -> StandbySpec {
    std::fs::write(dir.join("replica.py"), REPLICA).unwrap();
    StandbySpec {
        pool: "decode".into(),
        model: "m".into(),
        count,
        base_port: preheat_testkit::free_port(),
        command,
        drain_grace: Duration::from_secs(10),
        unlist_delay: Duration::from_millis(300),
    }
}

/// The stand-in replica's command: it writes `drained` to `dir/marker` (placeholders
/// substituted) when it has drained.
fn replica(dir: &Path, marker: &str) -> Vec<String> {
    let d = dir.display();
    vec![
        "python3".to_owned(),
        format!("{d}/replica.py"),
        "{port}".to_owned(),
        format!("{d}/{marker}"),
    ]
}

/// Reconciles `pool` until `n` standbys are parked.
async fn until_ready(pool: &mut StandbyPool, n: usize) {
    wait_for_async(
        format!("{n} standbys parked"),
        Duration::from_secs(20),
        async || {
            if pool.ready() >= n {
                return true;
            }
            pool.reconcile().await.unwrap();
            false
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_agent_shutdown_killed_serving_promoted_standbys() {
    // The bug: stopping the agent SIGKILLed standbys that had been promoted and were
    // serving, losing their in-flight requests.
    let dir = tempfile::tempdir().unwrap();
    let command = replica(dir.path(), "drained-{port}");
    let mut pool = StandbyPool::new(spec(dir.path(), 2, command), Path::new("/unused"));
    until_ready(&mut pool, 2).await;
    let promoted = pool.promote().await.unwrap().expect("a ready standby");
    let port = promoted.url.rsplit(':').next().unwrap().to_owned();
    let t0 = Instant::now();
    pool.shutdown().await;
    let marker = dir.path().join(format!("drained-{port}"));
    assert_eq!(
        std::fs::read_to_string(&marker).ok().as_deref(),
        Some("drained"),
        "the promoted standby was not allowed to drain"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(500),
        "shutdown did not wait for the drain"
    );
    let others = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("drained-"))
        .count();
    assert_eq!(
        others, 1,
        "the parked standby serves nobody: killed, not drained"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standbys_that_die_at_start_are_replaced_with_growing_pauses_then_reported() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("logs");
    std::fs::create_dir_all(&log).unwrap();
    let starts = dir.path().join("starts");
    let command = vec![
        "sh".to_owned(),
        "-c".to_owned(),
        format!(
            "echo start >> {}; echo 'Error: worker refused: KV compatibility hash differs' >&2; exit 2",
            starts.display()
        ),
    ];
    let mut pool =
        StandbyPool::new(spec(dir.path(), 1, command), Path::new("/unused")).with_log_dir(&log);
    let t0 = Instant::now();
    Wait::new("the failing standby reported", Duration::from_secs(20))
        .every(Duration::from_millis(20))
        .until_async(async || {
            if pool.failing().is_some() {
                return true;
            }
            pool.reconcile().await.unwrap();
            false
        })
        .await;
    let spawned = std::fs::read_to_string(&starts).unwrap().lines().count();
    // 4 deaths with pauses of 0.5, 1 and 2 s between them: not one start per turn.
    assert_eq!(spawned, 4, "one start per death, none while backing off");
    assert!(
        t0.elapsed() >= Duration::from_millis(3500),
        "{:?}",
        t0.elapsed()
    );
    let why = pool.failing().unwrap();
    assert!(why.contains("KV compatibility hash differs"), "{why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_standby_leaves_the_serving_list_before_it_drains() {
    let dir = tempfile::tempdir().unwrap();
    let command = replica(dir.path(), "drained-{port}-{host}");
    let mut pool =
        StandbyPool::new(spec(dir.path(), 1, command), Path::new("/unused")).with_host("10.9.8.7");
    until_ready(&mut pool, 1).await;
    assert!(pool.serving_ports().is_empty(), "parked is not serving");
    let p = pool.promote().await.unwrap().expect("a ready standby");
    assert_eq!(pool.serving_ports(), [p.port]);
    assert_eq!(pool.retire(), Some(p.port));
    let t0 = Instant::now();
    assert!(pool.serving_ports().is_empty(), "unlisted at once");
    assert_eq!(pool.retire(), None, "nothing else serves");
    let marker = dir.path().join(format!("drained-{}-10.9.8.7", p.port));
    assert!(!marker.exists(), "drained before gateways could unlist it");
    wait_for_async(
        "the retired standby drained",
        Duration::from_secs(10),
        async || marker.exists(),
    )
    .await;
    // The unlist delay (300 ms) then the replica's own half-second drain.
    assert!(
        t0.elapsed() >= Duration::from_millis(750),
        "{:?}",
        t0.elapsed()
    );
    // The pool parks a replacement meanwhile; shutdown kills it and returns.
    until_ready(&mut pool, 1).await;
    pool.shutdown().await;
}
