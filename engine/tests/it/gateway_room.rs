//! Requests waiting for room in a decode worker: how often they ask, and how soon the
//! next in line asks.

use std::time::{Duration, Instant};

use super::gateway_routing::{DONE, GOOD, Stack};
use super::server::listen;

/// A request refused for want of room asked again at once, in a loop without a
/// pause: the refused ask's own end counted as a sign that room had freed; and, with
/// two decode workers, once it held a place in the queue it asked the first again at
/// once after each refusal, never the second, and never timed out. Held 2 s against
/// workers that always answer 429, it must ask each about once a second (the
/// queue's recheck), not thousands of times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_a_request_refused_for_room_asked_again_in_a_loop() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let s = Stack::start_with(&[], |o| o.worker_timeout = Duration::from_secs(600)).await;
    for workers in [1, 2] {
        let asks = Arc::new(AtomicUsize::new(0));
        for i in 0..workers {
            let (l, url) = listen().await;
            let counted = Arc::clone(&asks);
            let full = axum::Router::new().route(
                "/internal/generate",
                axum::routing::post(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async {
                        (
                            axum::http::StatusCode::TOO_MANY_REQUESTS,
                            axum::Json(
                                serde_json::json!({"class": "overloaded", "message": "full"}),
                            ),
                        )
                    }
                }),
            );
            tokio::spawn(async move { axum::serve(l, full).await });
            s.register_decode(&format!("full-{workers}-{i}"), &url)
                .await;
        }
        // As many requests as workers: with two, one waits in the queue behind the
        // other (the loop needed a queue).
        let held: Vec<_> = (0..workers)
            .map(|_| {
                let client = s.client.clone();
                let target = format!("{}/v1/completions", s.url);
                tokio::spawn(async move {
                    client
                        .post(target)
                        .json(&serde_json::json!({"model": "tiny", "prompt": "hello", "max_tokens": 4}))
                        .send()
                        .await
                })
            })
            .collect();
        // Deliberate: the asks made while held are what is counted, over a set time.
        tokio::time::sleep(Duration::from_secs(2)).await;
        for h in held {
            h.abort();
            let _ = h.await;
        }
        let n = asks.load(Ordering::SeqCst);
        assert!(
            (1..=5 * workers * workers).contains(&n),
            "{n} asks of {workers} worker(s) by {workers} request(s) in 2 s"
        );
        // The next round's workers join these (full too): drop these first.
        for i in 0..workers {
            let _ = s
                .client
                .post(format!("{}/internal/deregister", s.internal))
                .json(&serde_json::json!({"id": format!("full-{workers}-{i}")}))
                .send()
                .await;
        }
    }
    s.stop().await;
}

/// Requests queued for room were let in one at a time, each after the one before had
/// its first token: a disaggregated request's answer waits for its K/V, so admissions
/// crawled at one per prefill while the decode worker had room for all. Here a worker
/// refuses the first ask (the others queue behind it), then takes every ask but
/// answers each after a second (its K/V pull): the three must be served together, not
/// one second after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_queued_requests_were_admitted_one_prefill_at_a_time() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let s = Stack::start_with(&[], |o| o.worker_timeout = Duration::from_secs(600)).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (l, url) = listen().await;
    let counted = Arc::clone(&calls);
    let slow = axum::Router::new().route(
        "/internal/generate",
        axum::routing::post(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                use axum::response::IntoResponse;
                if n == 0 {
                    return (
                        axum::http::StatusCode::TOO_MANY_REQUESTS,
                        axum::Json(serde_json::json!({"class": "overloaded", "message": "full"})),
                    )
                        .into_response();
                }
                // Deliberate: the K/V pull a taken request waits on.
                tokio::time::sleep(Duration::from_secs(1)).await;
                format!("{GOOD}\n{DONE}\n").into_response()
            }
        }),
    );
    tokio::spawn(async move { axum::serve(l, slow).await });
    s.register_decode("slow", &url).await;
    let t0 = Instant::now();
    let send = |delay_ms: u64| {
        let c = s.client.clone();
        let target = format!("{}/v1/completions", s.url);
        async move {
            // Deliberate: the later two arrive while the first waits in the queue.
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            c.post(target)
                .json(&serde_json::json!({"model": "tiny", "prompt": "hi", "max_tokens": 1}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let sends = [send(0), send(200), send(200)];
    for status in futures_util::future::join_all(sends).await {
        assert_eq!(status, 200);
    }
    // The queue's recheck (1 s), then a second of K/V for all of them, 200 ms apart
    // (about 2.4 s); one at a time took four.
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(3200), "served in {took:?}");
    s.stop().await;
}
