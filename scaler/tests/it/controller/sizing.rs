//! What the scaler sizes with: measured prompt and sequence lengths, a steady load.

use super::*;

/// `model`'s `pool` as KEDA reads it; -1 before the first decision.
async fn desired_of(
    c: &mut ExternalScalerClient<tonic::transport::Channel>,
    model: &str,
    pool: &str,
) -> i64 {
    let r = ScaledObjectRef {
        name: format!("{model}-{pool}"),
        namespace: "default".into(),
        scaler_metadata: [("model", model), ("pool", pool)]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    };
    desired_for(c, r).await
}

/// A prefill endpoint whose counters grow in real time: `rate` prompt tokens/s in
/// prompts of `len` tokens (smooth, as a busy replica's look a scrape apart), read at
/// the moment each scrape is served so a rate between scrapes is exact. The handle
/// stops it.
async fn prefill_taking(rate: f64, len: f64) -> (String, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let t0 = Instant::now();
    let text = move || {
        let tokens = t0.elapsed().as_secs_f64() * rate;
        let prompts = tokens / len;
        format!(
            "# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total {tokens}\n\
             # TYPE vllm:time_to_first_token_seconds histogram\n\
             vllm:time_to_first_token_seconds_bucket{{le=\"1\"}} {prompts}\n\
             vllm:time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {prompts}\n\
             vllm:time_to_first_token_seconds_count {prompts}\n\
             vllm:time_to_first_token_seconds_sum {}\n",
            prompts * 0.5
        )
    };
    let app = Router::new().route("/metrics", get(move || async move { text() }));
    let server = tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (format!("http://{addr}/metrics"), server)
}

/// Two models' prefill pools take the same 40,000 prompt tokens/s, one in 32k-token
/// prompts and one in 2k-token prompts, and a decode replica holds 200 sequences of 225
/// tokens (10% of the default profile's 450k-token KV cache). The controller never told
/// the policy the lengths it measured, so every pool was sized at the configured
/// default of 2,048 tokens: long prompts got the replicas of short ones (at the 2k rate
/// of 16k tokens/s a replica, where 32k prompts get 7k and a 4.7 s prefill leaves room
/// for little queueing in their 8 s TTFT target), and every decode sequence counted as
/// 2,048 tokens of KV (2 replicas for 10% of one cache).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_the_scaler_sized_every_prompt_and_sequence_at_2048_tokens() {
    let decode = Arc::new(Mutex::new(Some(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 200\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.1\n"
            .to_owned(),
    )));
    let ud = fake(decode.clone()).await;
    let (long, feed_long) = prefill_taking(40_000.0, 32_768.0).await;
    let (short, feed_short) = prefill_taking(40_000.0, 2_048.0).await;
    let mut scaler = Running::start(&[
        "interval_s=0.25".into(),
        "window_s=3".into(),
        format!(
            "models=[{{name: long, prefill: {{endpoints: [{long}]}}, decode: {{endpoints: [{ud}]}}}}, \
             {{name: short, prefill: {{endpoints: [{short}]}}, decode: {{endpoints: [{ud}]}}}}]"
        ),
    ])
    .await;
    // Let the window fill (whole prompts of both lengths), then read the pools.
    // Deliberate: the window (3 s) is time passing, not a state to look for.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let c = &mut scaler.client;
    let (pl, ps, d) = (
        desired_of(c, "long", "prefill").await,
        desired_of(c, "short", "prefill").await,
        desired_of(c, "long", "decode").await,
    );
    feed_long.abort();
    feed_short.abort();
    scaler.stop().await;
    assert_eq!(
        d, 1,
        "200 sequences holding 10% of one replica's KV cache need one replica"
    );
    // The same forecast either way. A replica prefills 16k tokens/s of 2k prompts,
    // planned at 85%, and 7k tokens/s of 32k prompts, planned at the 41% that keeps a
    // 4.7 s prefill's queueing within an 8 s target (2 s per 8,192 tokens): about 4.7
    // times the replicas (4.3 seen), where one length for both gave the same number.
    // Rounding up and the early ticks' noisy rates keep the bound loose.
    let ratio = pl as f64 / ps as f64;
    assert!(
        ps > 0 && (2.0..=8.0).contains(&ratio),
        "32k-token prompts got {pl} prefill replicas and 2k-token prompts {ps} for the same tokens/s"
    );
}

/// A scaler started beside a pool already serving a steady 40k prompt tokens/s (every
/// restart, every upgrade): its first scrape has one reading per endpoint and so no
/// rates, and the policy took those zeros for a load that had just ramped up from
/// nothing. The forecast it published and sized for then climbed from a fraction of
/// the load to a multiple of it, one lead (the default minute) ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_a_scaler_started_at_a_steady_load_forecast_a_ramp() {
    let (prefill, feed) = prefill_taking(40_000.0, 4_096.0).await;
    let decode = fake(Arc::new(Mutex::new(Some(engine_text(10))))).await;
    let scaler = Running::start(&[
        "interval_s=0.25".into(),
        "window_s=3".into(),
        format!(
            "models=[{{name: llama, prefill: {{endpoints: [{prefill}]}}, decode: {{endpoints: [{decode}]}}}}]"
        ),
    ])
    .await;
    let load = |m: &str, kind: &str| {
        preheat_scaler::signals::text_format::samples(m)
            .filter_map(Result::ok)
            .find(|s| {
                s.name == preheat_scaler::signals::names::own::LOAD
                    && s.label("pool") == Some("prefill")
                    && s.label("kind") == Some(kind)
            })
            .map(|s| s.value)
    };
    // Read twice a second for 4 s: a false ramp's trend leaves the forecast under the
    // load while the level climbs, then over it.
    let mut seen = Vec::new();
    for _ in 0..8 {
        // Deliberate: the readings' pace.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let m = scaler.metrics().await;
        if let (Some(o), Some(f)) = (load(&m, "observed"), load(&m, "forecast")) {
            seen.push((o, f));
        }
    }
    feed.abort();
    scaler.stop().await;
    assert!(
        seen.len() >= 6,
        "prefill's load was not published: {seen:?}"
    );
    for &(observed, forecast) in &seen {
        assert!(
            (30_000.0..=50_000.0).contains(&observed) && (forecast / observed - 1.0).abs() <= 0.2,
            "a steady 40k tokens/s: (observed, forecast) {seen:?}"
        );
    }
}
