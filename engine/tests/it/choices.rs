//! Several choices per request (`n`, `best_of`): what each choice holds, that the
//! prompt is prefilled once, and how they stream.

use std::collections::{BTreeMap, HashSet};

use preheat_testkit::wait_for_async;
use serde_json::{Value, json};

use preheat_testkit::model_fixture as fixture;

use super::server::{Server, token_ids_of};

/// A prompt of more than four full blocks (block size 16).
fn long_prompt() -> Vec<u32> {
    (10..90).collect()
}

fn sampled(prompt: &[u32], extra: Value) -> Value {
    let mut body = json!({"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 1.0,
        "seed": 1234, "ignore_eos": true, "logprobs": 0, "return_tokens_as_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Token ids of choice `i` (completions with logprobs and token ids).
fn choice_ids(resp: &Value, i: usize) -> Vec<u32> {
    let one = json!({"choices": [resp["choices"][i].clone()]});
    token_ids_of(&one)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_one_prefill_and_each_is_its_own_seed() {
    let s = Server::start(fixture("llama-tiny"), |_| {}).await;
    let prompt = long_prompt();
    let hits0 = s.metric("vllm:prefix_cache_hits_total").await;
    let (st, r) = s
        .post("/v1/completions", sampled(&prompt, json!({"n": 4})))
        .await;
    assert_eq!(st, 200, "{r}");
    let hits = s.metric("vllm:prefix_cache_hits_total").await - hits0;
    // The three followers found every full block of the prompt (all but its last
    // token's block) cached: the prompt was prefilled once, not four times.
    let full = (prompt.len() - 1) / 16 * 16;
    assert!(
        hits >= (3 * full) as f64,
        "{hits} cached tokens, want 3 × {full}"
    );
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{r}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{r}");
        assert_eq!(c["finish_reason"], "length");
    }
    assert_eq!(
        r["usage"]["prompt_tokens"],
        prompt.len(),
        "the prompt counts once"
    );
    assert_eq!(r["usage"]["completion_tokens"], 4 * 8);
    // Choice i is exactly what a request of its own with seed 1234 + i gives.
    let mut distinct = HashSet::new();
    for i in 0..4 {
        let (_, alone) = s
            .post(
                "/v1/completions",
                sampled(&prompt, json!({"seed": 1234 + i})),
            )
            .await;
        assert_eq!(choice_ids(&r, i), token_ids_of(&alone), "choice {i}");
        distinct.insert(choice_ids(&r, i));
    }
    assert!(distinct.len() > 1, "four seeds at temperature 1 all agreed");
    // Greedy: every choice is the one greedy answer.
    let (_, g) = s
        .post(
            "/v1/completions",
            sampled(&prompt, json!({"n": 3, "temperature": 0})),
        )
        .await;
    let (_, g1) = s
        .post(
            "/v1/completions",
            sampled(&prompt, json!({"temperature": 0})),
        )
        .await;
    for i in 0..3 {
        assert_eq!(choice_ids(&g, i), token_ids_of(&g1));
    }
    // Nothing leaked: every block is free again once the requests are done.
    wait_for_async(
        "every block free again",
        std::time::Duration::from_secs(2),
        async || {
            let usage = s.metric("vllm:kv_cache_usage_perc").await;
            if usage == 0.0 {
                Ok(())
            } else {
                Err(format!("blocks still held: {usage}"))
            }
        },
    )
    .await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn best_of_returns_the_choices_with_the_highest_cumulative_logprob() {
    let s = Server::start(fixture("llama-tiny"), |_| {}).await;
    let prompt = long_prompt();
    // Without logprobs asked for: they rank the sequences but are not shown.
    let mut body = sampled(&prompt, json!({"n": 2, "best_of": 5}));
    body.as_object_mut().unwrap().remove("logprobs");
    body["return_tokens_as_token_ids"] = json!(false);
    let (st, r) = s.post("/v1/completions", body).await;
    assert_eq!(st, 200, "{r}");
    let got: Vec<&str> = r["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert!(c["logprobs"].is_null(), "{c}");
            c["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        r["usage"]["completion_tokens"],
        5 * 8,
        "all five were generated"
    );
    // The five sequences one by one (seed 1234 + i), scored independently.
    let mut scored: Vec<(f64, String)> = Vec::new();
    for i in 0..5 {
        let (_, alone) = s
            .post(
                "/v1/completions",
                sampled(
                    &prompt,
                    json!({"seed": 1234 + i, "return_tokens_as_token_ids": false}),
                ),
            )
            .await;
        let c = &alone["choices"][0];
        let sum: f64 = c["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .sum();
        scored.push((sum, c["text"].as_str().unwrap().to_owned()));
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    assert_eq!(
        got,
        vec![scored[0].1.as_str(), scored[1].1.as_str()],
        "{scored:?}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_streams_every_choice_then_one_usage_chunk() {
    let s = Server::start(fixture("llama-tiny"), |_| {}).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 6, "temperature": 1.0, "seed": 99, "ignore_eos": true, "n": 3});
    let (_, whole) = s.post("/v1/chat/completions", body.clone()).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (chunks, done) = s.stream("/v1/chat/completions", streamed).await;
    assert!(done, "[DONE] last");
    let (usage, rest) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]), "{usage}");
    // (Only cached_tokens differs: the second request finds the first's prompt.)
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        whole["usage"]["prompt_tokens"]
    );
    assert_eq!(usage["usage"]["completion_tokens"], 18);
    let mut text: BTreeMap<u64, String> = BTreeMap::new();
    let mut finished: BTreeMap<u64, usize> = BTreeMap::new();
    let mut seen_role = HashSet::new();
    for c in rest {
        assert!(c["usage"].is_null(), "usage comes once, last: {c}");
        let ch = &c["choices"][0];
        let i = ch["index"].as_u64().unwrap();
        if seen_role.insert(i) {
            assert_eq!(ch["delta"]["role"], "assistant", "first chunk of {i}: {c}");
        }
        if let Some(t) = ch["delta"]["content"].as_str() {
            text.entry(i).or_default().push_str(t);
        }
        if !ch["finish_reason"].is_null() {
            *finished.entry(i).or_default() += 1;
        }
    }
    assert_eq!(finished, BTreeMap::from([(0, 1), (1, 1), (2, 1)]));
    for (i, t) in &text {
        assert_eq!(
            t,
            whole["choices"][*i as usize]["message"]["content"]
                .as_str()
                .unwrap(),
            "choice {i}"
        );
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn choice_counts_out_of_bounds_are_refused_by_name() {
    let s = Server::start(fixture("llama-tiny"), |_| {}).await;
    let p = json!({"prompt": "x", "max_tokens": 2});
    let with = |extra: Value| {
        let mut b = p.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (path, body, param) in [
        ("/v1/completions", with(json!({"n": 0})), "n"),
        ("/v1/completions", with(json!({"n": 17})), "n"),
        ("/v1/completions", with(json!({"n": -1})), "n"),
        (
            "/v1/completions",
            with(json!({"n": 3, "best_of": 2})),
            "best_of",
        ),
        ("/v1/completions", with(json!({"best_of": 17})), "best_of"),
        (
            "/v1/completions",
            with(json!({"best_of": 2, "stream": true})),
            "best_of",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "best_of": 2}),
            "best_of",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": 200}),
            "n",
        ),
    ] {
        let (st, r) = s.post(path, body.clone()).await;
        assert_eq!(st, 400, "{body} → {r}");
        assert_eq!(r["error"]["param"], param, "{body} → {r}");
    }
    // More than the engine runs at once: refused up front, not half-started.
    let small = Server::start(fixture("llama-tiny"), |o| {
        o.scheduler = preheat_engine::scheduler::SchedulerConfig {
            max_running: 4,
            ..o.scheduler
        };
    })
    .await;
    let (st, r) = small.post("/v1/completions", with(json!({"n": 5}))).await;
    assert_eq!((st, r["error"]["param"].as_str()), (400, Some("n")), "{r}");
    let (st, r) = small
        .post("/v1/completions", with(json!({"n": 2, "best_of": 5})))
        .await;
    assert_eq!(
        (st, r["error"]["param"].as_str()),
        (400, Some("best_of")),
        "{r}"
    );
    let (st, r) = small.post("/v1/completions", with(json!({"n": 4}))).await;
    assert_eq!(st, 200, "{r}");
    small.stop().await;
    // best_of equal to n streams: nothing to rank.
    let (chunks, done) = s
        .stream(
            "/v1/completions",
            with(json!({"n": 2, "best_of": 2, "stream": true})),
        )
        .await;
    assert!(done && !chunks.is_empty());
    s.stop().await;
}
