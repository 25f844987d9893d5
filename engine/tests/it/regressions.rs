//! Regressions, each named after the bug it pins.

use std::sync::Arc;

use preheat_engine::backend::cpu::CpuBackend;
use preheat_engine::engine::{Engine, EngineConfig, Event, GenerateRequest};
use preheat_engine::metrics::{EngineMetrics, Role};
use preheat_engine::model::open_model;
use preheat_engine::sampling::SamplingParams;
use preheat_engine::scheduler::SchedulerConfig;
use preheat_engine::tokenizer::Tokenizer;
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
