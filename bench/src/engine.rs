//! `preheat bench engine`: decode against the memory-bandwidth roofline, prefill
//! against the matmul library's own throughput on the model's shapes, and continuous
//! batching (32 streams vs 1), on a synthetic model.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use preheat_engine::backend::cpu::CpuBackend;
use preheat_engine::backend::cpu::matmul::linear;
use preheat_engine::backend::weights::Weight;
use preheat_engine::engine::{Engine, EngineConfig, Event, GenerateRequest};
use preheat_engine::metrics::{EngineMetrics, Role};
use preheat_engine::profile::{BLOCK, decode_rate, prefill_rate};
use preheat_engine::sampling::SamplingParams;
use preheat_engine::scheduler::SchedulerConfig;
use preheat_engine::tokenizer::Tokenizer;
use preheat_output::progress_bar::Bar;
use preheat_output::{outln, print_json};
use preheat_snapshot::Snapshot;
use preheat_snapshot::synth::{self, SynthOptions};
use preheat_snapshot::tensors::{self, LayerTensors};
use rayon::prelude::*;
use serde_json::json;

use super::best_of;
use crate::args::BenchEngineArgs;

/// Bytes per second of a large multi-threaded memcpy (bytes copied / time).
fn memcpy_bandwidth(bytes: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes / rayon::current_num_threads().max(1) / 8;
    let (d, _) = best_of(reps, || {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        Ok(())
    })
    .expect("infallible");
    std::hint::black_box(&dst);
    bytes as f64 / d.as_secs_f64()
}

/// Tokens/s if a prefill of `len` tokens did nothing but the model's matmuls, through
/// the same `linear` (gemm) the backend uses.
fn matmul_only_rate(snap: &Arc<Snapshot>, len: usize) -> anyhow::Result<f64> {
    let c = &snap.manifest().model;
    let h = c.hidden_size as usize;
    let l = LayerTensors::of(c, 0);
    let mut per_layer = Duration::ZERO;
    for t in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
        let w = Weight::load_named(snap, t)?;
        let (n, k) = (w.rows, w.cols);
        let x = vec![0.01f32; len * k];
        let mut y = vec![0f32; len * n];
        let t0 = Instant::now();
        linear(&x, len, &w, &mut y);
        per_layer += t0.elapsed();
    }
    let head = Weight::load_named(snap, &tensors::embed(c))?;
    let x = vec![0.01f32; h];
    let mut y = vec![0f32; c.vocab_size as usize];
    let t0 = Instant::now();
    linear(&x, 1, &head, &mut y);
    let total = per_layer * c.num_hidden_layers as u32 + t0.elapsed();
    Ok(len as f64 / total.as_secs_f64())
}

/// A CPU engine over `snap` with `num_blocks` KV blocks, running up to `max_running`
/// sequences (and queueing as many).
pub(super) fn start_engine(
    snap: &Arc<Snapshot>,
    num_blocks: usize,
    max_running: usize,
) -> anyhow::Result<Engine> {
    Ok(Engine::start(
        Box::new(CpuBackend::new(Arc::clone(snap), num_blocks, BLOCK)?),
        Tokenizer::from_snapshot(snap)?,
        EngineConfig {
            model_name: "bench".into(),
            block_size: BLOCK,
            num_blocks,
            scheduler: SchedulerConfig {
                max_batched_tokens: 512,
                max_running,
                max_waiting: max_running,
            },
            threads: None,
            prefix_key: preheat_engine::kv::PrefixKey::UNKEYED,
        },
        Arc::new(EngineMetrics::new("bench", Role::Colocated)),
    )?)
}

/// Aggregate generated tokens/s with `streams` concurrent requests through the engine.
fn engine_throughput(
    snap: &Arc<Snapshot>,
    streams: usize,
    tokens: usize,
    num_blocks: usize,
) -> anyhow::Result<f64> {
    let engine = start_engine(snap, num_blocks, 64)?;
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let t0 = Instant::now();
    let mut handles: Vec<_> = (0..streams)
        .map(|i| {
            engine.submit(GenerateRequest {
                prompt: vec![1 + i as u32; 8],
                params: params.clone(),
            })
        })
        .collect::<Result<_, _>>()?;
    let mut generated = 0;
    for h in &mut handles {
        while let Some(ev) = h.events.blocking_recv() {
            match ev {
                Event::Delta { tokens, .. } => generated += tokens.len(),
                Event::Finished { .. } => break,
                // A replay (only a gateway sends one) would void the measurement.
                Event::Error(e) | Event::Replayed(e) => return Err(e.into()),
                Event::KvReady(_) => {}
            }
        }
    }
    Ok(generated as f64 / t0.elapsed().as_secs_f64())
}

pub(crate) fn run(args: &BenchEngineArgs) -> anyhow::Result<std::process::ExitCode> {
    let mut errs = Vec::new();
    for (flag, v, max) in [
        (
            "--steps",
            args.steps,
            preheat_engine::profile::MAX_DECODE_STEPS,
        ),
        ("--prefill-len", args.prefill_len, 8192),
        ("--gen-tokens", args.gen_tokens, 1024),
    ] {
        if v == 0 || v > max {
            errs.push(format!("{flag} {v} must be in 1..={max}"));
        }
    }
    if !errs.is_empty() {
        anyhow::bail!("invalid options:\n  {}", errs.join("\n  "));
    }
    std::fs::create_dir_all(&args.dir)?;
    let path = args.dir.join(format!("{}.preheat", args.preset));
    if Snapshot::open(&path).is_err() {
        synth::synthesize(&args.preset, &path, SynthOptions::default(), &Bar::new())?;
    }
    let snap =
        Arc::new(Snapshot::open(Path::new(&path)).context("opening the benchmark snapshot")?);
    // Resident before timing: this measures compute, not disk.
    snap.advise(preheat_snapshot::AccessHint::WillNeed)?;
    let _ = snap.verify(2)?;
    // Measured where an engine runs its kernels: inside their pool.
    preheat_engine::backend::cpu::compute_pool(None)?.install(|| measure(args, &snap))
}

fn measure(args: &BenchEngineArgs, snap: &Arc<Snapshot>) -> anyhow::Result<std::process::ExitCode> {
    let threads = rayon::current_num_threads();
    tracing::info!("measuring memcpy bandwidth");
    let bw = memcpy_bandwidth(1 << 30, 5);
    let num_blocks = (64 * 2 + 64)
        .max(32 * preheat_engine::profile::decode_blocks_per_seq(args.steps.div_ceil(2)))
        .max(preheat_engine::profile::decode_blocks_per_seq(args.steps))
        .max(args.prefill_len.div_ceil(BLOCK));
    let mut be = CpuBackend::new(Arc::clone(snap), num_blocks, BLOCK)?;
    let bytes_per_step = be.weight_bytes_per_step() as f64;
    tracing::info!("decode, batch 1");
    let (d1, step1) = decode_rate(&mut be, 1, args.steps)?;
    tracing::info!("decode, batch 32");
    let (d32, step32) = decode_rate(&mut be, 32, args.steps.div_ceil(2))?;
    let roof1 = bw / bytes_per_step;
    tracing::info!(tokens = args.prefill_len, "prefill");
    let pf = prefill_rate(&mut be, args.prefill_len)?;
    let mm = matmul_only_rate(snap, args.prefill_len)?;
    drop(be);
    tracing::info!("continuous batching: 1 stream, then 32");
    let one = engine_throughput(snap, 1, args.gen_tokens, num_blocks)?;
    let many = engine_throughput(snap, 32, args.gen_tokens, num_blocks)?;
    let report = json!({
        "preset": args.preset, "threads": threads,
        "weight_bytes_per_step": bytes_per_step, "memcpy_gbps": bw / 1e9,
        "decode_b1_tok_s": d1, "decode_b1_step_ms": step1.as_secs_f64() * 1e3,
        "roofline_b1_tok_s": roof1, "decode_b1_vs_roofline": d1 / roof1,
        "decode_b32_tok_s": d32, "decode_b32_step_ms": step32.as_secs_f64() * 1e3,
        "decode_b32_vs_b1": d32 / d1,
        "prefill_len": args.prefill_len, "prefill_tok_s": pf, "matmul_only_tok_s": mm,
        "prefill_vs_matmul": pf / mm,
        "engine_1_stream_tok_s": one, "engine_32_streams_tok_s": many, "batching_gain": many / one,
    });
    if args.out.json {
        print_json(&report)?;
    } else {
        let f = |k: &str| report[k].as_f64().unwrap_or(f64::NAN);
        outln!(
            "engine benchmark: {} on {threads} threads, {:.2} GB of weights read per decode step",
            args.preset,
            bytes_per_step / 1e9
        );
        outln!(
            "  memcpy bandwidth             {:>9.2} GB/s",
            f("memcpy_gbps")
        );
        outln!(
            "  decode, batch 1              {:>9.2} tok/s = {:.2}× the roofline ({:.2} tok/s)",
            d1,
            f("decode_b1_vs_roofline"),
            roof1
        );
        outln!(
            "  decode, batch 32             {:>9.2} tok/s = {:.2}× batch 1",
            d32,
            f("decode_b32_vs_b1")
        );
        outln!(
            "  prefill {:>4} tokens          {:>9.2} tok/s = {:.2}× matmuls alone ({:.2} tok/s)",
            args.prefill_len,
            pf,
            f("prefill_vs_matmul"),
            mm
        );
        outln!("  engine, 1 stream             {:>9.2} tok/s", one);
        outln!(
            "  engine, 32 streams           {:>9.2} tok/s = {:.2}× one stream",
            many,
            f("batching_gain")
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
