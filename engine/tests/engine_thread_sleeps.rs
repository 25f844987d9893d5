//! A regression measured on the whole process's threads, so it has a process (a test
//! binary) of its own: in the shared `it` binary other tests' engines would add their
//! threads' sleeps to the count. It reads `/proc`, so Linux only.
#![cfg(target_os = "linux")]

use std::sync::Arc;

use preheat_engine::backend::cpu::CpuBackend;
use preheat_engine::engine::{Engine, EngineConfig, Event, GenerateRequest};
use preheat_engine::metrics::{EngineMetrics, Role};
use preheat_engine::model::open_model;
use preheat_engine::sampling::SamplingParams;
use preheat_engine::scheduler::SchedulerConfig;
use preheat_engine::tokenizer::Tokenizer;

/// The engine thread was outside the rayon pool its kernels run in, so every kernel
/// (a few per layer) was handed to the pool while the engine thread slept until it
/// was done. On a host whose cores are busy each wake-up waits for a CPU: a decode
/// worker beside two busy processes on two cores got 0.41 of a core, not its 0.67, and
/// its ITL was 2.2× its time alone (one cause of `bench simreal`'s miss at 2 req/s).
/// With one compute thread a decode step now runs where it is called: the engine's
/// threads should not sleep once per kernel.
#[tokio::test]
async fn regression_the_engine_thread_slept_through_every_kernel() {
    let dir = preheat_testkit::model_fixture("llama-tiny");
    let (snap, _) = open_model(&dir).unwrap();
    let e = Engine::start(
        Box::new(CpuBackend::new(Arc::clone(&snap), 64, 16).unwrap()),
        Tokenizer::from_snapshot(&snap).unwrap(),
        EngineConfig {
            model_name: "t".into(),
            block_size: 16,
            num_blocks: 64,
            scheduler: SchedulerConfig::default(),
            threads: Some(1),
            prefix_key: preheat_engine::kv::PrefixKey::UNKEYED,
        },
        Arc::new(EngineMetrics::new("t", Role::Colocated)),
    )
    .unwrap();
    let generate = async |n: usize| {
        let mut h = e
            .submit(GenerateRequest {
                prompt: (1..=8).collect(),
                params: SamplingParams {
                    temperature: 0.0,
                    max_tokens: n,
                    ignore_eos: true,
                    ..SamplingParams::default()
                },
            })
            .unwrap();
        let mut got = 0;
        loop {
            match h.events.recv().await {
                Some(Event::Delta { tokens, .. }) => got += tokens.len(),
                Some(Event::Finished { .. }) => break got,
                other => panic!("{other:?}"),
            }
        }
    };
    // Warm up (the pool's threads start, buffers are sized), then count.
    generate(4).await;
    let (threads, before) = engine_thread_sleeps();
    assert!(
        threads > 0,
        "the engine's threads are named preheat-engine…"
    );
    let tokens = generate(200).await;
    let sleeps = engine_thread_sleeps().1 - before;
    assert_eq!(tokens, 200);
    assert!(
        sleeps < tokens as u64 / 4,
        "{sleeps} sleeps of the engine's threads for {tokens} tokens: kernels are handed off"
    );
}

/// This process's engine threads (named `preheat-engine…`) and their voluntary context
/// switches so far.
fn engine_thread_sleeps() -> (usize, u64) {
    let (mut threads, mut n) = (0, 0);
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("preheat-engine") {
            continue;
        }
        threads += 1;
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        n += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    (threads, n)
}
