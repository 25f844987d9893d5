//! Regressions, each named after the bug it pins.

use std::sync::Arc;

use preheat_engine::backend::cpu::CpuBackend;
use preheat_engine::engine::{Engine, EngineConfig, Event, GenerateRequest};
use preheat_engine::metrics::{EngineMetrics, Role};
use preheat_engine::model::open_model;
use preheat_engine::sampling::SamplingParams;
use preheat_engine::scheduler::SchedulerConfig;
use preheat_engine::tokenizer::Tokenizer;
use preheat_testkit::wait_for_async;
use serde_json::Value;

/// A prompt longer than the step's token budget is prefilled in chunks; a step whose
/// chunks sample nothing asked the LM head for zero rows, and the matvec kernel
/// panicked on a zero chunk size, killing the engine thread (found by `bench serve`
/// replaying the Azure trace through `preheat up`).
#[tokio::test]
async fn regression_prompt_longer_than_the_token_budget_killed_the_engine() {
    let dir = preheat_testkit::model_fixture("llama-tiny");
    let refj: Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let (snap, _) = open_model(&dir).unwrap();
    let e = Engine::start(
        Box::new(CpuBackend::new(Arc::clone(&snap), 64, 16).unwrap()),
        Tokenizer::from_snapshot(&snap).unwrap(),
        EngineConfig {
            model_name: "t".into(),
            block_size: 16,
            num_blocks: 64,
            scheduler: SchedulerConfig {
                max_batched_tokens: 32,
                ..SchedulerConfig::default()
            },
            threads: None,
            prefix_key: preheat_engine::kv::PrefixKey::UNKEYED,
        },
        Arc::new(EngineMetrics::new("t", Role::Colocated)),
    )
    .unwrap();
    for case in refj["cases"].as_array().unwrap() {
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let (prompt, want) = (ids(&case["input_ids"]), ids(&case["greedy_24"]));
        let mut h = e
            .submit(GenerateRequest {
                prompt,
                params: SamplingParams {
                    temperature: 0.0,
                    max_tokens: want.len(),
                    ignore_eos: true,
                    ..SamplingParams::default()
                },
            })
            .unwrap();
        let mut got = Vec::new();
        loop {
            match h.events.recv().await {
                Some(Event::Delta { tokens, .. }) => got.extend(tokens.iter().map(|t| t.id)),
                Some(Event::Finished { .. }) => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            got, want,
            "chunked prefill (32-token steps) changes nothing"
        );
    }
}

/// `vllm:prompt_tokens_total` counted only the prompt tokens computed, leaving out
/// prefix-cache hits: the scaler, which takes the hit share out of the prompt rate as it
/// must for vLLM (whose counter holds whole prompts), discounted the hits twice and
/// under-sized prefill by the hit rate on preheat engines, and the mean prompt length it
/// derives (prompt tokens per first token) came out short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_prompt_tokens_left_out_prefix_cache_hits() {
    let s =
        super::server::Server::start(preheat_testkit::model_fixture("llama-tiny"), |_| {}).await;
    let prompt: Vec<u32> = (1..=48).collect();
    for _ in 0..2 {
        let (st, r) = s
            .post(
                "/v1/completions",
                serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}),
            )
            .await;
        assert_eq!(st, 200, "{r}");
    }
    let hits = s.metric("vllm:prefix_cache_hits_total").await;
    assert!(
        hits >= 32.0,
        "the second prompt came from the cache: {hits}"
    );
    assert_eq!(
        s.metric("vllm:prompt_tokens_total").await,
        96.0,
        "two whole prompts of 48 tokens"
    );
}

/// The prefix-cache key was a process-wide global, set once by whichever command
/// started first: two engines in one process could not belong to two deployments. Each
/// engine now takes its key from its own deployment's token: the same token gives the
/// same block hashes, another token other ones, and none the unkeyed ones.
#[tokio::test]
async fn the_prefix_key_follows_each_engines_deployment_not_the_process() {
    use preheat_engine::colocated::{ServeOptions, load_engine};
    let dir = tempfile::tempdir().unwrap();
    let token = |name: &str| {
        Some(Arc::new(
            preheat_edge::ClusterToken::generate_to(&dir.path().join(name)).unwrap(),
        ))
    };
    let (a, b) = (token("a"), token("b"));
    let prompt: Vec<u32> = (1..40).collect();
    let mut hashes = Vec::new();
    for t in [a.clone(), a, b, None] {
        let mut o = ServeOptions::new(
            preheat_testkit::model_fixture("llama-tiny"),
            "127.0.0.1:0".parse().unwrap(),
        );
        o.kv_cache_bytes = 4 << 20;
        o.cluster_token = t;
        let e = load_engine(&o).unwrap();
        let params = SamplingParams {
            max_tokens: 1,
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let mut h = e
            .submit(GenerateRequest {
                prompt: prompt.clone(),
                params,
            })
            .unwrap();
        while let Some(ev) = h.events.recv().await {
            if matches!(ev, Event::Finished { .. } | Event::Error(_)) {
                break;
            }
        }
        // The engine reports its cached blocks when it goes idle.
        let mut cached = wait_for_async(
            "the cached blocks reported",
            std::time::Duration::from_secs(5),
            async || Some(e.cached_blocks()).filter(|c| !c.is_empty()),
        )
        .await;
        cached.sort_unstable();
        assert_eq!(cached.len(), 2, "two full blocks of 16 cached");
        hashes.push(cached);
    }
    assert_eq!(hashes[0], hashes[1], "one deployment, one key");
    assert_ne!(
        hashes[0], hashes[2],
        "another deployment's token, the same hashes"
    );
    assert_ne!(
        hashes[0], hashes[3],
        "a keyed deployment hashes as an unkeyed one"
    );
    assert_eq!(hashes[3], {
        let mut h = preheat_engine::kv::PrefixKey::UNKEYED.block_hashes(&prompt[..32], 16);
        h.sort_unstable();
        h
    });
}
