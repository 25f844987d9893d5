//! What a gateway counts for operators and the scaler: its rotation
//! (`preheat:gateway_workers`) and the requests it holds, by the pool they wait for
//! (`preheat:gateway_pending_requests`).

use std::time::Duration;

use preheat_testkit::Wait;

use super::gateway_routing::{DONE, SEEN, Stack, fake_decode_workers};
use super::server::{listen, scrape};

/// `preheat:gateway_workers` was set only by a 250 ms housekeeping loop, so a scrape
/// right after a worker joined or left read the rotation as it had been: `bench serve`'s
/// last look, taken as a short run ended, saw no decode worker although one had served
/// every request ("decode came up" failed in `up`'s scale-from-zero test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_the_workers_gauge_lagged_a_worker_joining_or_leaving() {
    let s = Stack::start_with(&[], |o| o.worker_timeout = Duration::from_secs(600)).await;
    let decode_workers = async || {
        let page = scrape(&s.client, &s.url).await;
        page.lines()
            .find(|l| l.starts_with("preheat:gateway_workers") && l.contains("role=\"decode\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let (_l, url) = listen().await;
    for round in 0..3 {
        s.register_decode("joined", &url).await;
        assert_eq!(
            decode_workers().await,
            1.0,
            "round {round}: right after joining"
        );
        let r = s
            .client
            .post(format!("{}/internal/deregister", s.internal))
            .json(&serde_json::json!({"id": "joined"}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        assert_eq!(
            decode_workers().await,
            0.0,
            "round {round}: right after leaving"
        );
    }
    s.stop().await;
}

/// A held request counts for the pool it waits for: every one for decode, and one
/// whose prompt is long enough to be prefilled apart, with no prefill worker there,
/// for prefill too, held or running on a decode worker that prefills it. The count had
/// no pool before, and the scaler woke both pools for every held request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_request_counts_for_the_pools_it_waits_for() {
    let s = Stack::start_with(&[], |o| {
        o.disagg_min_tokens = 32;
        // The fake decode worker below sends no heartbeats.
        o.worker_timeout = Duration::from_secs(600);
    })
    .await;
    let pending = async |pool: &str| {
        let page = scrape(&s.client, &s.url).await;
        let label = format!("pool=\"{pool}\"");
        page.lines()
            .find(|l| {
                l.starts_with("preheat:gateway_pending_requests")
                    && l.contains(&label)
                    && l.contains("model_name=\"tiny\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    // Both pools read 0 before anything is held.
    assert_eq!(pending("decode").await, Some(0.0));
    assert_eq!(pending("prefill").await, Some(0.0));
    let send = |prompt: Vec<u32>| {
        let (c, url) = (s.client.clone(), format!("{}/v1/completions", s.url));
        tokio::spawn(async move {
            c.post(url)
                .json(&serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 4}))
                .send()
                .await
        })
    };
    let short = send(vec![1, 2, 3]);
    Wait::new("the short prompt held for decode", Duration::from_secs(10))
        .until_async(async || pending("decode").await == Some(1.0))
        .await;
    assert_eq!(
        pending("prefill").await,
        Some(0.0),
        "a short prompt woke prefill"
    );
    let long = send((1..=40).collect());
    Wait::new(
        "the long prompt held for both pools",
        Duration::from_secs(10),
    )
    .until_async(async || {
        pending("decode").await == Some(2.0) && pending("prefill").await == Some(1.0)
    })
    .await;
    for h in [short, long] {
        h.abort();
        let _ = h.await;
    }
    let nothing_held = async || {
        Wait::new("nothing held", Duration::from_secs(10))
            .until_async(async || {
                pending("decode").await == Some(0.0) && pending("prefill").await == Some(0.0)
            })
            .await;
    };
    nothing_held().await;
    // A decode worker and no prefill worker: a long prompt runs there at once, and
    // counts for prefill while it runs; a short one counts for neither.
    fake_decode_workers(&s, 1, |_| {
        let mut lines = vec![Some(SEEN); 20];
        lines.push(Some(DONE));
        lines
    })
    .await;
    let long = send((1..=40).collect());
    Wait::new(
        "the long prompt counted for prefill",
        Duration::from_secs(10),
    )
    .until_async(async || pending("prefill").await == Some(1.0))
    .await;
    assert_eq!(pending("decode").await, Some(0.0), "it is not held");
    assert_eq!(long.await.unwrap().unwrap().status(), 200);
    nothing_held().await;
    let short = send(vec![1, 2, 3]);
    for _ in 0..5 {
        // Deliberate: the short prompt must stay uncounted, which only time shows.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            pending("prefill").await,
            Some(0.0),
            "a short prompt counted"
        );
    }
    assert_eq!(short.await.unwrap().unwrap().status(), 200);
    s.stop().await;
}
