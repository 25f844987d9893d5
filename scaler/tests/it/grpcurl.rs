//! Wire compatibility with an independent client: grpcurl (Go, using the `.proto`
//! only) calls every RPC as KEDA would.

use std::path::{Path, PathBuf};
use std::process::Command;

use preheat_scaler::grpc::ScalerService;
use preheat_scaler::policy::Pool;
use preheat_scaler::{DecisionStore, PoolDecision};
use serde_json::Value;

fn grpcurl() -> Option<PathBuf> {
    preheat_testkit::fetched(
        preheat_testkit::workspace_root().join(".cache/tools/grpcurl"),
        ".ci/fetch-tools",
    )
}

fn call(bin: &Path, addr: &str, method: &str, data: &str, extra: &[&str]) -> (bool, String) {
    let out = Command::new(bin)
        .args(["-plaintext", "-import-path"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("proto"))
        .args(["-proto", "externalscaler.proto", "-d", data])
        .args(extra)
        .arg(addr)
        .arg(format!("externalscaler.ExternalScaler/{method}"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_answers_grpcurl() {
    let Some(bin) = grpcurl() else { return };
    let store = DecisionStore::new(vec!["llama".into()]);
    store.set(
        "llama",
        Pool::Decode,
        PoolDecision {
            desired: 3,
            active: true,
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let svc = ScalerService::new(store.clone()).into_server();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let sref = r#"{"name":"llama-decode","namespace":"serving","scalerMetadata":{"pool":"decode","model":"llama"}}"#;
    let results = tokio::task::spawn_blocking(move || {
        let is_active = call(&bin, &addr, "IsActive", sref, &[]);
        let spec = call(&bin, &addr, "GetMetricSpec", sref, &[]);
        let metrics = call(
            &bin,
            &addr,
            "GetMetrics",
            &format!(r#"{{"scaledObjectRef":{sref},"metricName":"preheat-llama-decode"}}"#),
            &[],
        );
        // The stream stays open (KEDA holds it); grpcurl gives up after a second
        // having printed the immediate first answer.
        let stream = call(&bin, &addr, "StreamIsActive", sref, &["-max-time", "1"]);
        let unimpl = call(&bin, &addr, "StreamMetricSpec", sref, &[]);
        let bad = call(
            &bin,
            &addr,
            "IsActive",
            r#"{"scalerMetadata":{"pool":"gpu"}}"#,
            &[],
        );
        (is_active, spec, metrics, stream, unimpl, bad)
    })
    .await
    .unwrap();
    let (is_active, spec, metrics, stream, unimpl, bad) = results;
    let json = |t: &str| -> Value {
        serde_json::from_str(t.trim()).unwrap_or_else(|e| panic!("{e}: {t}"))
    };
    assert!(is_active.0, "{}", is_active.1);
    assert_eq!(json(&is_active.1)["result"], true);
    let s = json(&spec.1);
    assert_eq!(s["metricSpecs"][0]["metricName"], "preheat-llama-decode");
    assert_eq!(s["metricSpecs"][0]["targetSizeFloat"], 1.0);
    let m = json(&metrics.1);
    assert_eq!(
        m["metricValues"][0]["metricValue"], "3",
        "int64 is a JSON string in proto3 JSON"
    );
    assert_eq!(m["metricValues"][0]["metricValueFloat"], 3.0);
    assert!(stream.1.contains("\"result\": true"), "{}", stream.1);
    assert!(
        !unimpl.0 && unimpl.1.contains("Unimplemented"),
        "{}",
        unimpl.1
    );
    assert!(!bad.0 && bad.1.contains("InvalidArgument"), "{}", bad.1);
}
