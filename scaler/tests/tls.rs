//! The gRPC endpoint over TLS with client certificates, as KEDA connects when its
//! trigger sets `caCert`/`tlsClientCert`: certificates made with the `openssl` CLI.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use preheat_scaler::config::Config;
use preheat_scaler::profile::Profile;
use preheat_scaler::proto::ScaledObjectRef;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
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

#[tokio::test]
async fn mutual_tls_admits_only_clients_with_a_certificate_from_the_ca() {
    let dir = tempfile::tempdir().unwrap();
    preheat_testkit::make_certs(dir.path());
    let port = preheat_testkit::free_port();
    let d = dir.path().display();
    let cfg = Config::load(
        None,
        &[
            format!("grpc_listen=127.0.0.1:{port}"),
            "http_listen=127.0.0.1:0".into(),
            format!("tls={{cert: {d}/srv.pem, key: {d}/srv.key, client_ca: {d}/ca.pem}}"),
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
    let read = |f: &str| std::fs::read(dir.path().join(f)).unwrap();
    let base = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")))
        .domain_name("localhost");
    let with_cert = base
        .clone()
        .identity(Identity::from_pem(read("cli.pem"), read("cli.key")));
    let url = format!("https://127.0.0.1:{port}");
    let t0 = Instant::now();
    loop {
        match call(&url, Some(with_cert.clone())).await {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "TLS client never got in: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
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
}
