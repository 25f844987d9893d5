//! Every RPC of the KEDA external-scaler service over a real socket, with a gRPC
//! client, as KEDA calls them.

use std::collections::HashMap;
use std::time::Duration;

use preheat_scaler::grpc::ScalerService;
use preheat_scaler::policy::Pool;
use preheat_scaler::proto::external_scaler_client::ExternalScalerClient;
use preheat_scaler::proto::{GetMetricsRequest, ScaledObjectRef};
use preheat_scaler::{DecisionStore, PoolDecision};
use tokio_stream::StreamExt;
use tonic::Code;

fn sref(meta: &[(&str, &str)]) -> ScaledObjectRef {
    ScaledObjectRef {
        name: "llama-decode".into(),
        namespace: "serving".into(),
        scaler_metadata: meta
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<HashMap<_, _>>(),
    }
}

async fn start(
    models: &[&str],
) -> (
    std::sync::Arc<DecisionStore>,
    ExternalScalerClient<tonic::transport::Channel>,
) {
    let store = DecisionStore::new(models.iter().map(|m| (*m).to_owned()).collect());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = ScalerService::new(store.clone()).into_server();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    let client = ExternalScalerClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    (store, client)
}

#[tokio::test]
async fn metric_spec_and_metrics_land_hpa_on_the_desired_count() {
    let (store, mut c) = start(&["llama"]).await;
    let meta = [("pool", "decode"), ("model", "llama")];
    let spec = c.get_metric_spec(sref(&meta)).await.unwrap().into_inner();
    assert_eq!(spec.metric_specs.len(), 1);
    let ms = &spec.metric_specs[0];
    assert_eq!(ms.metric_name, "preheat-llama-decode");
    assert_eq!((ms.target_size, ms.target_size_float), (1, 1.0));
    store.set(
        "llama",
        Pool::Decode,
        PoolDecision {
            desired: 7,
            active: true,
        },
    );
    store.set(
        "llama",
        Pool::Prefill,
        PoolDecision {
            desired: 2,
            active: true,
        },
    );
    let m = c
        .get_metrics(GetMetricsRequest {
            scaled_object_ref: Some(sref(&meta)),
            metric_name: ms.metric_name.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, 7);
    assert_eq!(m.metric_values[0].metric_value_float, 7.0);
    // The pools are independent; `model` may be left out with a single model.
    let p = c
        .get_metrics(GetMetricsRequest {
            scaled_object_ref: Some(sref(&[("pool", "prefill")])),
            metric_name: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.metric_values[0].metric_value, 2);
    assert!(c.is_active(sref(&meta)).await.unwrap().into_inner().result);
}

#[tokio::test]
async fn stream_is_active_answers_at_once_then_on_every_change() {
    let (store, mut c) = start(&["llama"]).await;
    let meta = [("pool", "prefill"), ("model", "llama")];
    let mut s = c.stream_is_active(sref(&meta)).await.unwrap().into_inner();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), s.next())
            .await
            .is_err(),
        "a pool with no decision yet gets no answer (not a made-up \"inactive\")"
    );
    let e = c.is_active(sref(&meta)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    store.set(
        "llama",
        Pool::Prefill,
        PoolDecision {
            desired: 0,
            active: false,
        },
    );
    let first = tokio::time::timeout(Duration::from_secs(1), s.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(!first.result, "the first decision is sent at once");
    // Another pool changing does not wake this stream with a duplicate.
    store.set(
        "llama",
        Pool::Decode,
        PoolDecision {
            desired: 1,
            active: true,
        },
    );
    let t0 = std::time::Instant::now();
    store.set(
        "llama",
        Pool::Prefill,
        PoolDecision {
            desired: 1,
            active: true,
        },
    );
    let next = tokio::time::timeout(Duration::from_secs(1), s.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(next.result);
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "push took {:?}",
        t0.elapsed()
    );
    // Desired changing while active is not an activity change: no message.
    store.set(
        "llama",
        Pool::Prefill,
        PoolDecision {
            desired: 5,
            active: true,
        },
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(200), s.next())
            .await
            .is_err()
    );
    store.set(
        "llama",
        Pool::Prefill,
        PoolDecision {
            desired: 0,
            active: false,
        },
    );
    let off = tokio::time::timeout(Duration::from_secs(1), s.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(!off.result);
}

#[tokio::test]
async fn bad_metadata_gets_errors_that_say_why() {
    let (_store, mut c) = start(&["a", "b"]).await;
    let e = c
        .is_active(sref(&[("pool", "gpu"), ("model", "a")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("prefill") && e.message().contains("gpu"),
        "{}",
        e.message()
    );
    let e = c
        .get_metric_spec(sref(&[("pool", "decode")]))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::InvalidArgument,
        "model required with two models"
    );
    let e = c
        .get_metric_spec(sref(&[("pool", "decode"), ("model", "zzz")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .get_metrics(GetMetricsRequest {
            scaled_object_ref: None,
            metric_name: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .stream_metric_spec(sref(&[("pool", "decode"), ("model", "a")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
}
