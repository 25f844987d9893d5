//! The GPU backend computes what the CPU backend computes, on the reference fixtures:
//! prefill (direct launches), decode steps one sequence at a time and several at once
//! (replayed from captured graphs, with padding rows), and K/V moved between the two
//! backends. Needs a GPU, so those tests are ignored in the ordinary run (a GPU machine
//! runs them with `-- --ignored`), and fail naming what is missing where a driver or a
//! device is not there; the last checks the fallback where no driver is.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use preheat_engine::backend::cpu::CpuBackend;
use preheat_engine::backend::cuda::{CudaBackend, CudaOptions, Probe};
use preheat_engine::backend::{Backend, ForwardBatch, SeqSlice};
use preheat_engine::model::open_model;

/// Panics, naming what is missing, where no GPU can be used.
fn require_gpu() {
    match CudaBackend::probe() {
        Probe::Ready { .. } => {}
        other => panic!("these tests need an NVIDIA GPU and its driver: {other:?}"),
    }
}

use preheat_testkit::model_fixture as fixture;

/// Logits of `rows` after feeding `tokens` of sequences `seq_of` at `positions`.
fn forward(
    b: &mut dyn Backend,
    tables: &[Vec<u32>],
    tokens: &[u32],
    positions: &[u32],
    seq_of: &[u32],
    rows: &[u32],
) -> Vec<f32> {
    let seqs: Vec<SeqSlice<'_>> = tables.iter().map(|t| SeqSlice { block_table: t }).collect();
    b.forward(&ForwardBatch {
        tokens,
        positions,
        seq_of,
        seqs: &seqs,
        logits_rows: rows,
    })
    .unwrap()
}

/// Largest |a − b| over the largest |a|: bf16 keeps 8 bits of mantissa (≈ 0.4%), and
/// the fixtures' f32 weights run through tensor-core-free SGEMM, so 2% is generous
/// for accumulated rounding yet catches any wrong index or layout.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

fn check(name: &str) {
    let (snap, _) = open_model(&fixture(name)).unwrap();
    let mut cpu = CpuBackend::new(Arc::clone(&snap), 64, 16).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = CudaOptions {
        device: 0,
        kernel_cache: Some(dir.path().to_owned()),
        kernel_cache_key: None,
        graphs: true,
        max_batch_tokens: 64,
    };
    let mut gpu = CudaBackend::new(Arc::clone(&snap), 64, 16, &opts).unwrap();
    assert!(gpu.startup().graphs > 0, "decode graphs captured");
    let vocab = cpu.config().vocab_size as usize;
    // Three sequences, 12-token prompts, in disjoint blocks.
    let tables: Vec<Vec<u32>> = (0..3).map(|s| (s * 4..s * 4 + 4).collect()).collect();
    let prompt: Vec<u32> = (0..36).map(|i| (i * 7 + 3) % vocab as u32).collect();
    let positions: Vec<u32> = (0..36).map(|i| i % 12).collect();
    let seq_of: Vec<u32> = (0..36).map(|i| i / 12).collect();
    let last = [11u32, 23, 35];
    let c = forward(&mut cpu, &tables, &prompt, &positions, &seq_of, &last);
    let g = forward(&mut gpu, &tables, &prompt, &positions, &seq_of, &last);
    assert!(
        rel_err(&c, &g) < 0.02,
        "{name} prefill: {}",
        rel_err(&c, &g)
    );
    // Eight decode steps of all three (graph bucket 4: one padding row), then of one
    // alone (bucket 1), each fed the CPU's greedy token.
    let mut next: Vec<u32> = c.chunks(vocab).map(|r| argmax(r) as u32).collect();
    for step in 0..8u32 {
        let pos = [12 + step; 3];
        let c = forward(&mut cpu, &tables, &next, &pos, &[0, 1, 2], &[0, 1, 2]);
        let g = forward(&mut gpu, &tables, &next, &pos, &[0, 1, 2], &[0, 1, 2]);
        assert!(
            rel_err(&c, &g) < 0.02,
            "{name} decode {step}: {}",
            rel_err(&c, &g)
        );
        for (r, (cr, gr)) in c.chunks(vocab).zip(g.chunks(vocab)).enumerate() {
            assert_eq!(argmax(cr), argmax(gr), "{name} decode {step} row {r}");
        }
        next = c.chunks(vocab).map(|r| argmax(r) as u32).collect();
    }
    let one = &tables[..1];
    let c = forward(&mut cpu, one, &next[..1], &[20], &[0], &[0]);
    let g = forward(&mut gpu, one, &next[..1], &[20], &[0], &[0]);
    assert!(rel_err(&c, &g) < 0.02, "{name} single decode");
    // A prompt fed in two chunks, the first wanting no logits, ends where the whole
    // prompt does (the first chunk's K/V must still be written).
    let t3 = vec![(12..16).collect::<Vec<u32>>()];
    let p3: Vec<u32> = prompt[..12].to_vec();
    let pos: Vec<u32> = (0..12).collect();
    let _ = forward(&mut gpu, &t3, &p3[..6], &pos[..6], &[0; 6], &[]);
    let g = forward(&mut gpu, &t3, &p3[6..], &pos[6..], &[0; 6], &[5]);
    let c = forward(&mut cpu, &t3, &p3, &pos, &[0; 12], &[11]);
    assert!(rel_err(&c, &g) < 0.02, "{name} chunked prefill");
    // K/V written by the GPU, read back, is what the CPU computed.
    let (mut kc, mut kg) = (Vec::new(), Vec::new());
    cpu.export_kv(&tables[1], &mut kc).unwrap();
    gpu.export_kv(&tables[1], &mut kg).unwrap();
    assert_eq!(kc.len(), kg.len());
    let (fc, fg): (&[f32], &[f32]) = (bytemuck::cast_slice(&kc), bytemuck::cast_slice(&kg));
    assert!(rel_err(fc, fg) < 0.02, "{name} KV export");
    // And K/V imported into the GPU continues the sequence as the CPU would.
    gpu.import_kv(&tables[1], &kc).unwrap();
    let c = forward(&mut cpu, &tables[1..2], &[5], &[20], &[0], &[0]);
    let g = forward(&mut gpu, &tables[1..2], &[5], &[20], &[0], &[0]);
    assert!(rel_err(&c, &g) < 0.02, "{name} after KV import");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with -- --ignored on one"]
fn gpu_logits_match_the_cpu_backend_on_the_reference_fixtures() {
    require_gpu();
    for name in ["llama-tiny", "qwen2-tiny"] {
        check(name);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with -- --ignored on one"]
fn a_restart_restores_kernels_from_the_cache() {
    require_gpu();
    let (snap, _) = open_model(&fixture("llama-tiny")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = CudaOptions {
        device: 0,
        kernel_cache: Some(dir.path().to_owned()),
        // Signed, as in a deployment: the restart loads only what was signed.
        kernel_cache_key: Some([7; 32]),
        graphs: false,
        max_batch_tokens: 16,
    };
    let first = CudaBackend::new(Arc::clone(&snap), 8, 16, &opts).unwrap();
    assert!(!first.startup().kernels_from_cache);
    let second = CudaBackend::new(snap, 8, 16, &opts).unwrap();
    assert!(second.startup().kernels_from_cache);
    assert!(second.startup().kernels_s < first.startup().kernels_s);
}

#[test]
fn without_a_gpu_auto_serves_on_the_cpu_and_cuda_says_why() {
    if !preheat_testkit::present_or_skip(
        CudaBackend::probe() == Probe::NoDriver,
        "a machine without a CUDA driver",
        "any machine without one (CI's)",
    ) {
        return;
    }
    use preheat_engine::colocated::{Device, ServeOptions, load_engine};
    let mut o = ServeOptions::new(fixture("llama-tiny"), "127.0.0.1:0".parse().unwrap());
    o.kv_cache_bytes = 4 << 20;
    o.device = Device::Cuda;
    let err = load_engine(&o).unwrap_err().to_string();
    assert!(err.contains("no CUDA driver"), "{err}");
    o.device = Device::Auto;
    assert!(load_engine(&o).is_ok(), "auto falls back to the CPU");
}
