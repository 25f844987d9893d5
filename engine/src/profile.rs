//! Forward rates measured on a loaded backend: what `engine profile` writes into the
//! scaler's capacity profile and `bench engine` compares with physical limits. Block
//! tables assume the backend's KV blocks hold [`BLOCK`] tokens.

use std::time::{Duration, Instant};

use crate::Result;
use crate::backend::{Backend, ForwardBatch, SeqSlice};

/// Tokens per KV block the measurements lay out their block tables for.
pub const BLOCK: usize = 16;

/// Runs `steps` decode steps for `batch` sequences after an 8-token prefill each.
pub fn decode_rate<B: Backend + ?Sized>(
    be: &mut B,
    batch: usize,
    steps: usize,
) -> Result<(f64, Duration)> {
    let per_seq_blocks = 2;
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| ((s * per_seq_blocks) as u32..((s + 1) * per_seq_blocks) as u32).collect())
        .collect();
    let seqs: Vec<SeqSlice<'_>> = tables.iter().map(|t| SeqSlice { block_table: t }).collect();
    let prompt = 8usize;
    let tokens: Vec<u32> = (0..batch * prompt).map(|i| (i % 200) as u32 + 1).collect();
    let positions: Vec<u32> = (0..batch * prompt).map(|i| (i % prompt) as u32).collect();
    let seq_of: Vec<u32> = (0..batch * prompt).map(|i| (i / prompt) as u32).collect();
    let rows: Vec<u32> = (0..batch)
        .map(|s| (s * prompt + prompt - 1) as u32)
        .collect();
    be.forward(&ForwardBatch {
        tokens: &tokens,
        positions: &positions,
        seq_of: &seq_of,
        seqs: &seqs,
        logits_rows: &rows,
    })?;
    let seq_of: Vec<u32> = (0..batch as u32).collect();
    let rows: Vec<u32> = (0..batch as u32).collect();
    let t0 = Instant::now();
    for s in 0..steps {
        let tokens = vec![7u32; batch];
        let positions = vec![(prompt + s) as u32; batch];
        be.forward(&ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            seq_of: &seq_of,
            seqs: &seqs,
            logits_rows: &rows,
        })?;
    }
    let d = t0.elapsed();
    Ok(((batch * steps) as f64 / d.as_secs_f64(), d / steps as u32))
}

/// Prompt tokens per second of one `len`-token prefill.
pub fn prefill_rate<B: Backend + ?Sized>(be: &mut B, len: usize) -> Result<f64> {
    let table: Vec<u32> = (0..len.div_ceil(BLOCK) as u32).collect();
    let seqs = [SeqSlice {
        block_table: &table,
    }];
    let tokens: Vec<u32> = (0..len).map(|i| (i % 200) as u32 + 1).collect();
    let positions: Vec<u32> = (0..len as u32).collect();
    let seq_of = vec![0u32; len];
    let t0 = Instant::now();
    be.forward(&ForwardBatch {
        tokens: &tokens,
        positions: &positions,
        seq_of: &seq_of,
        seqs: &seqs,
        logits_rows: &[len as u32 - 1],
    })?;
    Ok(len as f64 / t0.elapsed().as_secs_f64())
}
