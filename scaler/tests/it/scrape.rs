//! Scraping real HTTP endpoints that misbehave: every one is reported as failed with a
//! reason an operator can act on, and none is read as idle or held in memory whole.

use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::get;
use preheat_scaler::scrape::{MAX_BODY_BYTES, scrape_all};

const GOOD: &str =
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 4\n";

async fn serve(app: Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

#[tokio::test]
async fn misbehaving_endpoints_fail_with_their_reason() {
    let app = Router::new()
        .route("/good", get(|| async { GOOD }))
        .route(
            "/declared-huge",
            get(|| async { vec![b'#'; MAX_BODY_BYTES + 1] }),
        )
        .route(
            "/streamed-huge",
            get(|| async {
                // Chunked, no length declared: the limit has to be counted.
                let chunk = Bytes::from(vec![b'#'; 1 << 20]);
                let n = MAX_BODY_BYTES / (1 << 20) + 2;
                Body::from_stream(futures_util::stream::iter(
                    (0..n).map(move |_| Ok::<_, std::io::Error>(chunk.clone())),
                ))
            }),
        )
        .route("/latin1", get(|| async { vec![b'a', b' ', 0xE9, b'\n'] }))
        .route(
            "/malformed",
            get(|| async {
                "vllm:num_requests_waiting 1\nvllm:num_requests_running{model_name=\"m\" 2\n"
            }),
        )
        .route(
            "/slow",
            get(|| async {
                // Deliberate: an endpoint slower than the scrape's deadline.
                tokio::time::sleep(Duration::from_secs(30)).await;
                GOOD
            }),
        );
    let base = serve(app).await;
    let urls: Vec<String> = [
        "good",
        "declared-huge",
        "streamed-huge",
        "latin1",
        "malformed",
        "slow",
        "missing",
    ]
    .iter()
    .map(|p| format!("{base}/{p}"))
    .collect();
    let client = reqwest::Client::new();
    let (ok, failed) = scrape_all(&client, &urls, Some("m"), Duration::from_secs(2)).await;
    assert_eq!(ok.len(), 1);
    assert_eq!(ok[0].1.waiting, Some(4.0));
    let reason = |p: &str| {
        failed
            .iter()
            .find(|f| f.url.ends_with(&format!("/{p}")))
            .map(|f| f.reason.clone())
            .unwrap_or_else(|| panic!("{p} should have failed"))
    };
    for p in ["declared-huge", "streamed-huge"] {
        assert!(reason(p).contains("larger than"), "{p}: {}", reason(p));
    }
    assert!(
        reason("latin1").contains("not UTF-8"),
        "{}",
        reason("latin1")
    );
    assert!(
        reason("malformed").contains("line 2"),
        "{}",
        reason("malformed")
    );
    assert!(reason("missing").contains("404"), "{}", reason("missing"));
    assert!(!reason("slow").is_empty());
    assert_eq!(failed.len(), 6);
}
