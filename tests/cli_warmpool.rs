//! `preheat warmpool stage` through the binary: killed midway, it resumes.

mod harness;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use preheat_snapshot::synth::preset_config;
use preheat_snapshot::{DType, NoProgress, SnapshotBuilder, TensorSpec};
use preheat_testkit::wait_for;

/// A 16 MiB snapshot: the tiny model's config with one large tensor of noise.
fn big_snapshot(path: &Path) {
    let mut b = SnapshotBuilder::new(preset_config("tiny").unwrap(), Default::default());
    b.tensors.push(TensorSpec {
        name: "noise".into(),
        dtype: DType::F32,
        shape: vec![4 << 20],
    });
    b.write(
        path,
        |_, spec, buf| {
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            for _ in 0..spec.nbytes()? / 8 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                buf.extend_from_slice(&x.to_le_bytes());
            }
            Ok(())
        },
        &NoProgress,
    )
    .unwrap();
}

struct Slow {
    dir: PathBuf,
    delay_ms: AtomicU64,
    served: AtomicU64,
}

async fn serve(
    State(s): State<Arc<Slow>>,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    // Deliberate: a slow source (its pace is the scenario), not a wait for anything.
    tokio::time::sleep(Duration::from_millis(s.delay_ms.load(Ordering::SeqCst))).await;
    let Ok(bytes) = std::fs::read(s.dir.join(name)) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let len = bytes.len() as u64;
    let Some((a, b)) = headers
        .get("range")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| preheat_warmpool::files::parse_range(v, len))
    else {
        return StatusCode::RANGE_NOT_SATISFIABLE.into_response();
    };
    s.served.fetch_add(b - a + 1, Ordering::SeqCst);
    (
        StatusCode::PARTIAL_CONTENT,
        [("content-range", format!("bytes {a}-{b}/{len}"))],
        bytes[a as usize..=b as usize].to_vec(),
    )
        .into_response()
}

fn start_server(state: Arc<Slow>) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let app = axum::Router::new()
                .route("/m/{name}", axum::routing::get(serve))
                .with_state(state);
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    format!("http://{}", rx.recv().unwrap())
}

fn journal_entries(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join(".big.stage.journal"))
        .map(|s| s.lines().filter(|l| l.starts_with("done ")).count())
        .unwrap_or(0)
}

#[test]
fn staging_killed_midway_resumes_where_it_stopped() {
    let src = tempfile::tempdir().unwrap();
    let snap = src.path().join("big.preheat");
    big_snapshot(&snap);
    let total = std::fs::metadata(&snap).unwrap().len();
    let state = Arc::new(Slow {
        dir: src.path().to_path_buf(),
        delay_ms: AtomicU64::new(250),
        served: AtomicU64::new(0),
    });
    let url = format!("{}/m/big.preheat", start_server(Arc::clone(&state)));
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().display().to_string();
    let args = [
        "warmpool",
        "stage",
        "--source",
        &url,
        "--dir",
        &dir,
        "--piece-mib",
        "1",
        "--concurrency",
        "1",
        "--json",
    ];
    let mut child = harness::spawn(&args, Stdio::null());
    // Kill it once some pieces are durably journaled, well before the end.
    wait_for("two pieces journaled", Duration::from_secs(60), || {
        assert!(child.0.try_wait().unwrap().is_none(), "staging ended early");
        journal_entries(out.path()) >= 2
    });
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    assert!(
        !out.path().join("big.preheat").exists(),
        "a half-staged snapshot is never visible under its name"
    );
    let first = state.served.load(Ordering::SeqCst);
    assert!(first < total, "killed midway: {first} of {total}");
    state.delay_ms.store(0, Ordering::SeqCst);
    let o = harness::ok_json(args);
    let resumed = o["resumed_bytes"].as_u64().unwrap();
    let fetched = o["fetched_bytes"].as_u64().unwrap();
    assert!(resumed >= 2 << 20, "{o}");
    assert_eq!(resumed + fetched, total, "{o}");
    assert_eq!(
        std::fs::read(out.path().join("big.preheat")).unwrap(),
        std::fs::read(&snap).unwrap()
    );
    let leftovers: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial") || n.ends_with(".journal"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let again = harness::ok_json(args);
    assert_eq!(again["already_staged"], true, "{again}");
}

#[test]
fn stage_reports_every_bad_option_at_once() {
    let out = harness::preheat([
        "warmpool",
        "stage",
        "--source",
        "http://h/",
        "--dir",
        "/tmp/x",
        "--concurrency",
        "0",
        "--piece-mib",
        "0",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["--concurrency", "--piece-mib", "--name"] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

/// Terminates TLS with `cert`/`key` on a free loopback port and relays each connection
/// to `upstream` (`host:port`); prints the port.
const TLS_PROXY: &str = r#"
import socket, ssl, sys, threading
cert, key, upstream = sys.argv[1], sys.argv[2], sys.argv[3]
host, port = upstream.rsplit(":", 1)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
def pipe(a, b):
    try:
        while (d := a.recv(65536)):
            b.sendall(d)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
def serve(c):
    try:
        t = ctx.wrap_socket(c, server_side=True)
    except (ssl.SSLError, OSError):
        c.close(); return
    u = socket.create_connection((host, int(port)))
    threading.Thread(target=pipe, args=(t, u), daemon=True).start()
    pipe(u, t)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

#[test]
fn regression_https_sources_failed_for_lack_of_tls() {
    // The bug: reqwest was built without TLS, so every https:// source the README
    // shows failed. A snapshot served over TLS by a private CA: staged when that CA is
    // trusted (SSL_CERT_FILE, as operators add private CAs), refused by name when not.
    let tmp = tempfile::tempdir().unwrap();
    preheat_testkit::make_certs(tmp.path());
    let models = tmp.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    let snap = harness::synth_tiny(&models, "tiny", 3);
    let plain = preheat_testkit::serve_files(&models);
    std::fs::write(tmp.path().join("proxy.py"), TLS_PROXY).unwrap();
    let mut proxy = std::process::Command::new("python3")
        .arg(tmp.path().join("proxy.py"))
        .arg(tmp.path().join("srv.pem"))
        .arg(tmp.path().join("srv.key"))
        .arg(plain.trim_start_matches("http://"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let port = {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(proxy.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        line.trim().to_owned()
    };
    let _proxy = preheat_testkit::KillOnDrop(proxy);
    let url = format!("https://127.0.0.1:{port}/tiny.preheat");
    let stage = |dir: &str, ca: Option<&Path>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_preheat"));
        cmd.args([
            "warmpool", "stage", "--source", &url, "--dir", dir, "--json",
        ])
        .env("RUST_LOG", "warn")
        .env_remove("SSL_CERT_DIR");
        match ca {
            Some(ca) => cmd.env("SSL_CERT_FILE", ca),
            None => cmd.env_remove("SSL_CERT_FILE"),
        };
        cmd.output().unwrap()
    };
    let untrusted = stage(&tmp.path().join("a").display().to_string(), None);
    assert!(
        !untrusted.status.success(),
        "a certificate of an unknown CA was accepted"
    );
    let err = String::from_utf8_lossy(&untrusted.stderr).to_lowercase();
    assert!(
        err.contains("certificate"),
        "refused, but not for its certificate: {err}"
    );
    let dir = tmp.path().join("b");
    let out = stage(&dir.display().to_string(), Some(&tmp.path().join("ca.pem")));
    assert!(
        out.status.success(),
        "staging over https failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read(dir.join("tiny.preheat")).unwrap(),
        std::fs::read(&snap).unwrap()
    );
}

#[test]
fn regression_credentials_in_a_source_url_reached_errors_and_logs() {
    // A source with user info and a signed query (its credentials), unreachable: the
    // error names the source, redacted.
    let tmp = tempfile::tempdir().unwrap();
    let port = preheat_testkit::free_port();
    let out = harness::preheat([
        "warmpool",
        "stage",
        "--source",
        &format!("http://user:hunter2@127.0.0.1:{port}/m.phpack?X-Amz-Signature=topsecret"),
        "--dir",
        tmp.path().to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("http://***@127.0.0.1:{port}/m.phpack?***")),
        "{err}"
    );
    for secret in ["hunter2", "topsecret", "user:"] {
        assert!(!err.contains(secret), "{secret} shown: {err}");
    }
}
