//! The gRPC endpoint over TLS with client certificates, as KEDA connects when its
//! trigger sets `caCert`/`tlsClientCert` (certificates made with the `openssl` CLI), and
//! the limits it holds peers to.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use preheat_scaler::config::Config;
use preheat_scaler::profile::Profile;
use preheat_scaler::proto::ScaledObjectRef;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_testkit::wait_for_async;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

fn sref() -> ScaledObjectRef {
    ScaledObjectRef {
        name: "llama-decode".into(),
        namespace: "serving".into(),
        scaler_metadata: HashMap::from([
            ("pool".to_owned(), "decode".to_owned()),
            ("model".to_owned(), "llama".to_owned()),
        ]),
    }
}

async fn call(endpoint: &str, tls: Option<ClientTlsConfig>) -> Result<bool, String> {
    let mut ep = Channel::from_shared(endpoint.to_owned())
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2));
    if let Some(t) = tls {
        ep = ep.tls_config(t).map_err(|e| e.to_string())?;
    }
    let ch = ep.connect().await.map_err(|e| format!("{e:?}"))?;
    let mut c = ExternalScalerClient::new(ch);
    c.is_active(sref())
        .await
        .map(|r| r.into_inner().result)
        .map_err(|e| e.to_string())
}

/// A scaler whose gRPC endpoint asks for mutual TLS, with its certificates in `dir`.
struct Scaler {
    dir: tempfile::TempDir,
    port: u16,
    stop_tx: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<preheat_scaler::Result<()>>,
}

impl Scaler {
    /// With mutual TLS; `tls: false` for plain gRPC.
    fn start(tls: bool) -> Scaler {
        let dir = tempfile::tempdir().unwrap();
        preheat_testkit::make_certs(dir.path());
        let port = preheat_testkit::free_port();
        let d = dir.path().display();
        let cfg = Config::load(
            None,
            &[
                format!("grpc_listen=127.0.0.1:{port}"),
                "http_listen=127.0.0.1:0".into(),
                if tls {
                    format!("tls={{cert: {d}/srv.pem, key: {d}/srv.key, client_ca: {d}/ca.pem}}")
                } else {
                    "interval_s=5".into()
                },
                "models=[{name: llama, prefill: {}, decode: {}}]".into(),
            ],
        )
        .unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(preheat_scaler::server::run(
            cfg,
            Profile::default(),
            async {
                let _ = stop_rx.await;
            },
        ));
        Scaler {
            dir,
            port,
            stop_tx,
            server,
        }
    }

    /// What a client trusts (the CA), with KEDA's client certificate or without one.
    fn client_tls(&self, with_cert: bool) -> ClientTlsConfig {
        let read = |f: &str| std::fs::read(self.dir.path().join(f)).unwrap();
        let base = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("ca.pem")))
            .domain_name("localhost");
        if with_cert {
            base.identity(Identity::from_pem(read("cli.pem"), read("cli.key")))
        } else {
            base
        }
    }
}

/// Waits up to 10 s for the scaler at `url` to answer a call with `tls`.
async fn wait_served(what: &str, url: &str, tls: Option<&ClientTlsConfig>) {
    wait_for_async(what, Duration::from_secs(10), async || {
        call(url, tls.cloned()).await
    })
    .await;
}

#[tokio::test]
async fn mutual_tls_admits_only_clients_with_a_certificate_from_the_ca() {
    let scaler = Scaler::start(true);
    let (base, with_cert) = (scaler.client_tls(false), scaler.client_tls(true));
    let Scaler {
        port,
        stop_tx,
        server,
        ..
    } = scaler;
    let url = format!("https://127.0.0.1:{port}");
    wait_served("the TLS client to get in", &url, Some(&with_cert)).await;
    assert!(
        call(&url, Some(base)).await.is_err(),
        "a client without a certificate is refused"
    );
    assert!(
        call(&format!("http://127.0.0.1:{port}"), None)
            .await
            .is_err(),
        "plaintext is refused"
    );
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
}

/// The two silent-peer regressions below, run at once: each waits out a 10 s deadline
/// of the server's, and one after the other they held one of the binary's two test
/// threads 20 s (the binary's longest path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_peers_are_closed_at_the_deadlines_with_tls_and_without() {
    tokio::join!(
        regression_silent_tls_peers_held_unbounded_connections_on_the_grpc_port(),
        regression_a_silent_plaintext_peer_held_a_grpc_slot_for_ever(),
    );
}

/// A peer that opens connections and never finishes a TLS handshake held them (and a
/// task each) for ever, without limit. Now one past the cap is closed at accept, each
/// silent one is closed at the handshake deadline, and KEDA gets in again.
async fn regression_silent_tls_peers_held_unbounded_connections_on_the_grpc_port() {
    use preheat_scaler::grpc_incoming::MAX_CONNECTIONS;
    use preheat_scaler::server::TLS_HANDSHAKE_TIMEOUT;
    use tokio::io::AsyncReadExt;
    let scaler = Scaler::start(true);
    let keda = scaler.client_tls(true);
    let Scaler {
        port,
        stop_tx,
        server,
        ..
    } = scaler;
    let url = format!("https://127.0.0.1:{port}");
    wait_served("the scaler to serve", &url, Some(&keda)).await;
    // Fill every slot with a connection that says nothing.
    let opened = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        silent.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    // Give the server time to accept them all, then one more is closed at once.
    // (Deliberate: how many it has accepted is not observable from here.)
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut extra = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(2), extra.read(&mut b)).await;
    assert!(
        matches!(r, Ok(Ok(0) | Err(_))),
        "a connection past the cap was kept: {r:?}"
    );
    // The silent ones are closed at the handshake deadline, not held.
    let mut first = silent.swap_remove(0);
    let r = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT * 2, first.read(&mut b)).await;
    let held = opened.elapsed();
    assert!(
        matches!(r, Ok(Ok(0) | Err(_))),
        "a silent peer was kept: {r:?}"
    );
    assert!(
        held >= TLS_HANDSHAKE_TIMEOUT - Duration::from_secs(1),
        "closed before the deadline: {held:?}"
    );
    // Their slots are free again: KEDA gets in while the rest are still open on our side.
    wait_served("KEDA to get back in", &url, Some(&keda)).await;
    drop(silent);
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
}

/// Without TLS nothing but the connection cap bounded a silent peer: 256 connections
/// that never send the HTTP/2 preface held every slot for good. Now a connection that
/// sends nothing is closed at the first-byte deadline.
async fn regression_a_silent_plaintext_peer_held_a_grpc_slot_for_ever() {
    use preheat_scaler::grpc_incoming::FIRST_BYTE_TIMEOUT;
    use tokio::io::AsyncReadExt;
    let scaler = Scaler::start(false);
    let url = format!("http://127.0.0.1:{}", scaler.port);
    wait_served("the scaler to serve", &url, None).await;
    let opened = Instant::now();
    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", scaler.port))
        .await
        .unwrap();
    // Meanwhile KEDA is served.
    assert!(call(&url, None).await.is_ok());
    // (The server's own HTTP/2 settings arrive first; then the connection must end.)
    let mut got = Vec::new();
    let r = tokio::time::timeout(FIRST_BYTE_TIMEOUT * 2, silent.read_to_end(&mut got)).await;
    let held = opened.elapsed();
    assert!(r.is_ok(), "a silent peer was kept past twice the deadline");
    assert!(
        held >= FIRST_BYTE_TIMEOUT - Duration::from_secs(1),
        "closed before the deadline: {held:?}"
    );
    let _ = scaler.stop_tx.send(());
    scaler.server.await.unwrap().unwrap();
}

#[test]
fn missing_pem_files_are_config_errors() {
    let e = Config::load(
        None,
        &[
            "tls={cert: /nonexistent/srv.pem, key: /nonexistent/srv.key}".into(),
            "models=[{name: llama, prefill: {}, decode: {}}]".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("tls.cert: /nonexistent/srv.pem") && e.contains("tls.key"),
        "{e}"
    );
    // The simulator reads a deployed config's policies where its PEMs are not.
    Config::load_policies(
        None,
        &[
            "tls={cert: /nonexistent/srv.pem, key: /nonexistent/srv.key}".into(),
            "models=[{name: llama, prefill: {}, decode: {}}]".into(),
        ],
    )
    .expect("policies load without the host's TLS files");
}
