//! `preheat bench grammar`: what structured outputs cost per token. The baseline is a
//! decode step of the same model in the same run (one stream through the engine,
//! unconstrained). Each grammar is then run the same way (engine time per token, as a
//! ratio to the baseline), and its mask is timed alone: the tokens it generated are
//! replayed through a fresh matcher, timing mask + apply to the logits + advance, and
//! apart from them the `max_tokens` closer's check the engine makes for each of a
//! budget's last tokens.

use std::time::{Duration, Instant};

use preheat_engine::engine::{Engine, Event, GenerateRequest};
use preheat_engine::model::open_model;
use preheat_engine::profile::BLOCK;
use preheat_engine::sampling::SamplingParams;
use preheat_engine::sampling::grammar::Grammar;
use preheat_engine::tokenizer::Tokenizer;
use preheat_output::{outln, print_json};
use serde_json::{Value, json};

use crate::args::BenchGrammarArgs;

/// Generates from `prompt` under `grammar`; returns the tokens and the decode time per
/// token (first token to last: the prompt's prefill is not counted).
fn generate(
    engine: &Engine,
    prompt: &[u32],
    grammar: Option<Grammar>,
    tokens: usize,
) -> anyhow::Result<(Vec<u32>, Duration)> {
    let params = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        max_tokens: tokens,
        ignore_eos: true,
        grammar,
        ..SamplingParams::default()
    };
    let mut h = engine.submit(GenerateRequest {
        prompt: prompt.to_vec(),
        params,
    })?;
    let mut out = Vec::new();
    let (mut first, mut last) = (None, Instant::now());
    while let Some(ev) = h.events.blocking_recv() {
        match ev {
            Event::Delta { tokens, .. } => {
                last = Instant::now();
                first.get_or_insert(last);
                out.extend(tokens.iter().map(|t| t.id));
            }
            Event::Finished { .. } => break,
            // A replay (only a gateway sends one) would void the measurement.
            Event::Error(e) | Event::Replayed(e) => return Err(e.into()),
            Event::KvReady(_) => {}
        }
    }
    let first = first.ok_or_else(|| anyhow::anyhow!("nothing was generated"))?;
    let per = (last - first) / (out.len().max(2) - 1) as u32;
    Ok((out, per))
}

/// The budget left at which the closer's check is timed: within the last tokens of
/// `max_tokens`, where the engine runs it for every token.
const CLOSER_BUDGET: usize = 32;

fn mean_p99(times: &mut [Duration]) -> (Duration, Duration) {
    times.sort_unstable();
    let mean = times.iter().sum::<Duration>() / times.len().max(1) as u32;
    let p99 = times
        .get((times.len() * 99 / 100).min(times.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default();
    (mean, p99)
}

pub(crate) fn run(args: &BenchGrammarArgs) -> anyhow::Result<std::process::ExitCode> {
    tracing::info!(model = %args.model.display(), "opening the model");
    let (snap, _) = open_model(&args.model)?;
    snap.advise(preheat_snapshot::AccessHint::WillNeed)?;
    let tok = Tokenizer::from_snapshot(&snap)?;
    let t0 = Instant::now();
    let compiler = tok.grammar()?;
    let trie = t0.elapsed();
    let num_blocks = (args.tokens + 64).div_ceil(BLOCK) * 2;
    let engine = super::engine::start_engine(&snap, num_blocks, 4)?;
    let prompt = tok.encode("Write a short story about a robot who learns to paint.")?;
    let vocab = engine.vocab_size();
    tracing::info!(tokens = args.tokens, "decode, unconstrained");
    // A warm-up run (caches, the allocator), then the best of two: this machine is
    // shared, and one slow run would make every grammar look cheap.
    generate(&engine, &prompt, None, args.tokens)?;
    let best_of_two = |g: Option<Grammar>| -> anyhow::Result<(Vec<u32>, Duration)> {
        let a = generate(&engine, &prompt, g.clone(), args.tokens)?;
        let b = generate(&engine, &prompt, g, args.tokens)?;
        Ok(if b.1 < a.1 { b } else { a })
    };
    let (_, step) = best_of_two(None)?;
    // Grammars that run to max_tokens (a string with a floor on its length, a regex
    // with no end), so the engine's time per token is over many tokens; and a choice,
    // which ends after a few (its engine figure is not reported).
    let cases = [
        (
            "json_schema, string minLength 2000",
            Grammar::JsonSchema(
                json!({"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
                                       "required": ["story"], "additionalProperties": false}),
            ),
        ),
        ("regex [a-z ,.]+", Grammar::Regex("[a-z ,.]+".into())),
        (
            "choice of 3",
            Grammar::Choice(vec!["yes".into(), "no".into(), "it depends".into()]),
        ),
    ];
    let mut rows: Vec<Value> = Vec::new();
    for (name, g) in cases {
        tracing::info!(
            grammar = name,
            "decode under the grammar, then its mask alone"
        );
        let (ids, per) = best_of_two(Some(g.clone()))?;
        let mut c = compiler.compile(&g, "grammar")?;
        let mut logits = vec![0.0f32; vocab];
        let mut times: Vec<Duration> = Vec::with_capacity(ids.len());
        let mut checks: Vec<Duration> = Vec::with_capacity(ids.len());
        for &t in &ids {
            let t0 = Instant::now();
            c.allowed()?.apply(&mut logits);
            let t1 = Instant::now();
            // The max_tokens closer's check, as within the budget's last tokens (its
            // answer is not used: the replay follows the generated tokens).
            let _ = c.budget_check(t, CLOSER_BUDGET);
            let t2 = Instant::now();
            c.accept(t)?;
            times.push((t1 - t0) + t2.elapsed());
            checks.push(t2 - t1);
            if c.is_done() {
                break;
            }
        }
        let (mean, p99) = mean_p99(&mut times);
        let (check_mean, check_p99) = mean_p99(&mut checks);
        // A few tokens say nothing about time per token.
        let engine_ms = (ids.len() >= 16).then_some(per.as_secs_f64() * 1e3);
        rows.push(json!({
            "grammar": name, "tokens": ids.len(),
            "engine_ms_per_token": engine_ms,
            "engine_vs_unconstrained": engine_ms.map(|ms| ms / 1e3 / step.as_secs_f64()),
            "mask_us_mean": mean.as_secs_f64() * 1e6, "mask_us_p99": p99.as_secs_f64() * 1e6,
            "mask_vs_decode_step": mean.as_secs_f64() / step.as_secs_f64(),
            "closer_check_us_mean": check_mean.as_secs_f64() * 1e6,
            "closer_check_us_p99": check_p99.as_secs_f64() * 1e6,
        }));
    }
    let report = json!({
        "model": args.model.display().to_string(), "vocab": vocab,
        "trie_build_ms": trie.as_secs_f64() * 1e3,
        "decode_step_ms": step.as_secs_f64() * 1e3, "grammars": rows,
    });
    if args.out.json {
        print_json(&report)?;
        return Ok(std::process::ExitCode::SUCCESS);
    }
    outln!(
        "structured outputs: {} ({vocab} tokens); the vocabulary's trie built once in {:.0} ms",
        args.model.display(),
        trie.as_secs_f64() * 1e3
    );
    outln!(
        "  {:<34} {:>8.2} ms/token (the baseline)",
        "decode step, unconstrained",
        step.as_secs_f64() * 1e3
    );
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let engine = match r["engine_ms_per_token"].as_f64() {
            Some(ms) => format!("{ms:>8.2} ms/token = {:.2}×", f("engine_vs_unconstrained")),
            None => format!("{:>8} (too few tokens)", "-"),
        };
        outln!(
            "  {:<34} {engine} (mask alone {:.0} µs mean, {:.0} µs p99 = {:.3} of a step; {} tokens; max_tokens closer's check {:.0} µs mean, {:.0} µs p99)",
            r["grammar"].as_str().unwrap_or(""),
            f("mask_us_mean"),
            f("mask_us_p99"),
            f("mask_vs_decode_step"),
            r["tokens"],
            f("closer_check_us_mean"),
            f("closer_check_us_p99"),
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
