//! The engine computes the same function as Hugging Face transformers: last-position
//! logits within 1e-4, argmax at every position, and the greedy continuation, for every
//! reference fixture, however the tokens arrive.

use std::sync::Arc;

use preheat_engine::backend::cpu::CpuBackend;
use preheat_engine::backend::{Backend, ForwardBatch, SeqSlice};
use preheat_engine::model::open_model;
use serde_json::Value;

use preheat_testkit::model_fixture as fixture;

fn reference(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(fixture(name).join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Feeds `tokens[from..to]` of a single sequence at their positions and returns the
/// logits of every fed position.
fn run(b: &mut CpuBackend, table: &[u32], tokens: &[u32], from: usize, to: usize) -> Vec<Vec<f32>> {
    let positions: Vec<u32> = (from as u32..to as u32).collect();
    let seq_of = vec![0u32; to - from];
    let rows: Vec<u32> = (0..(to - from) as u32).collect();
    let seqs = [SeqSlice { block_table: table }];
    let logits = b
        .forward(&ForwardBatch {
            tokens: &tokens[from..to],
            positions: &positions,
            seq_of: &seq_of,
            seqs: &seqs,
            logits_rows: &rows,
        })
        .unwrap();
    let v = b.config().vocab_size as usize;
    logits.chunks_exact(v).map(<[f32]>::to_vec).collect()
}

fn check_model(name: &str) {
    let (snap, _) = open_model(&fixture(name)).unwrap();
    let refj = reference(name);
    let mut backend = CpuBackend::new(Arc::clone(&snap), 64, 16).unwrap();
    let table: Vec<u32> = (0..16).collect();
    for case in refj["cases"].as_array().unwrap() {
        let prompt = ids(&case["input_ids"]);
        let n = prompt.len();
        let want_last: Vec<f32> = case["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let want_argmax = ids(&case["logits_checksum"]["argmax_per_position"]);
        let greedy = ids(&case["greedy_24"]);
        // Whole prompt at once.
        let whole = run(&mut backend, &table, &prompt, 0, n);
        let max_err = whole[n - 1]
            .iter()
            .zip(&want_last)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max_err < 1e-4, "{name}: last logits differ by {max_err}");
        let got_argmax: Vec<u32> = whole.iter().map(|l| argmax(l)).collect();
        assert_eq!(got_argmax, want_argmax, "{name}: argmax per position");
        // Token by token, and in uneven chunks: same logits.
        for chunk in [1usize, 5] {
            let mut last = Vec::new();
            let mut i = 0;
            while i < n {
                let j = (i + chunk).min(n);
                last = run(&mut backend, &table, &prompt, i, j).pop().unwrap();
                i = j;
            }
            let err = last
                .iter()
                .zip(&want_last)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-4, "{name}: chunk {chunk} differs by {err}");
        }
        // Greedy continuation, decoding one token at a time.
        let mut toks = prompt.clone();
        let mut next = argmax(&whole[n - 1]);
        let mut out = Vec::new();
        for _ in 0..greedy.len() {
            out.push(next);
            toks.push(next);
            let l = run(&mut backend, &table, &toks, toks.len() - 1, toks.len())
                .pop()
                .unwrap();
            next = argmax(&l);
        }
        assert_eq!(out, greedy, "{name}: greedy continuation");
    }
}

#[test]
fn llama_tiny_matches_transformers() {
    check_model("llama-tiny");
}

#[test]
fn qwen2_tiny_matches_transformers() {
    check_model("qwen2-tiny");
}
