//! Forward rates measured on a loaded backend: what `engine profile` writes into the
//! scaler's capacity profile and `bench engine` compares with physical limits. Block
//! tables assume the backend's KV blocks hold [`BLOCK`] tokens.

use std::time::{Duration, Instant};

use crate::Result;
use crate::backend::{Backend, ForwardBatch, SeqSlice};

/// Tokens per KV block the measurements lay out their block tables for.
pub const BLOCK: usize = 16;

/// Tokens each sequence of [`decode_rate`] is prefilled with before its timed steps:
/// its ITL is that of short contexts ([`decode_rate_at`] times longer ones).
pub const DECODE_PROMPT: usize = 8;

/// Most steps [`decode_rate`] runs: each grows every sequence's KV by a token (and
/// its block table with it), and a measurement needs far fewer.
pub const MAX_DECODE_STEPS: usize = 1024;

/// KV blocks each sequence of [`decode_rate`] holds for `steps` steps: the backend
/// needs `batch ×` this many.
#[must_use]
pub fn decode_blocks_per_seq(steps: usize) -> usize {
    decode_blocks_at(1, steps, DECODE_PROMPT)
}

/// KV blocks [`decode_rate_at`] uses for `batch` sequences of a `context`-token prompt.
#[must_use]
pub fn decode_blocks_at(batch: usize, steps: usize, context: usize) -> usize {
    batch * (context + steps).div_ceil(BLOCK)
}

/// Runs `steps` decode steps for `batch` sequences after an 8-token prefill each, on
/// blocks `0..batch × decode_blocks_per_seq(steps)`.
pub fn decode_rate<B: Backend + ?Sized>(
    be: &mut B,
    batch: usize,
    steps: usize,
) -> Result<(f64, Duration)> {
    decode_rate_at(be, batch, steps, DECODE_PROMPT)
}

/// As [`decode_rate`], each sequence's prompt `context` tokens long: a step's attention
/// reads every token of it, so the ITL grows with it. One sequence's prompt is
/// prefilled and its K/V copied to the others' own blocks, so the set-up costs one
/// prompt whatever the batch while every sequence still reads K/V of its own, as
/// unrelated requests do. On blocks `0..decode_blocks_at(batch, steps, context)`.
pub fn decode_rate_at<B: Backend + ?Sized>(
    be: &mut B,
    batch: usize,
    steps: usize,
    context: usize,
) -> Result<(f64, Duration)> {
    let step = decode_steps_at(be, &[batch], steps, context)?[0];
    Ok((
        (batch * steps) as f64 / (step * steps as u32).as_secs_f64(),
        step,
    ))
}

/// [`decode_rate_at`]'s step time at each of `batches`, with one prompt prefilled and
/// copied for them all: each batch's steps write the same positions of the same
/// sequences, past the prompt. On blocks `0..decode_blocks_at(max batch, steps,
/// context)`.
pub fn decode_steps_at<B: Backend + ?Sized>(
    be: &mut B,
    batches: &[usize],
    steps: usize,
    context: usize,
) -> Result<Vec<Duration>> {
    let max_batch = batches.iter().copied().max().unwrap_or(0);
    if context == 0 || batches.contains(&0) || max_batch == 0 {
        return Err(crate::EngineError::InvalidRequest {
            message: format!("decode batches {batches:?} and context {context} must be positive"),
            param: Some("batch".into()),
        });
    }
    if steps == 0 || steps > MAX_DECODE_STEPS {
        return Err(crate::EngineError::InvalidRequest {
            message: format!("decode steps {steps} must be in 1..={MAX_DECODE_STEPS}"),
            param: Some("steps".into()),
        });
    }
    let per_seq = decode_blocks_at(1, steps, context);
    let tables: Vec<Vec<u32>> = (0..max_batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let seqs: Vec<SeqSlice<'_>> = tables.iter().map(|t| SeqSlice { block_table: t }).collect();
    let tokens: Vec<u32> = (0..context).map(|i| (i % 200) as u32 + 1).collect();
    let positions: Vec<u32> = (0..context as u32).collect();
    be.forward(&ForwardBatch {
        tokens: &tokens,
        positions: &positions,
        seq_of: &vec![0; context],
        seqs: &seqs[..1],
        logits_rows: &[context as u32 - 1],
    })?;
    let context_blocks = context.div_ceil(BLOCK);
    let mut kv = Vec::new();
    be.export_kv(&tables[0][..context_blocks], &mut kv)?;
    for table in &tables[1..] {
        be.import_kv(&table[..context_blocks], &kv)?;
    }
    let mut out = Vec::with_capacity(batches.len());
    for &batch in batches {
        let seq_of: Vec<u32> = (0..batch as u32).collect();
        let t0 = Instant::now();
        for s in 0..steps {
            let tokens = vec![7u32; batch];
            let positions = vec![(context + s) as u32; batch];
            be.forward(&ForwardBatch {
                tokens: &tokens,
                positions: &positions,
                seq_of: &seq_of,
                seqs: &seqs[..batch],
                logits_rows: &seq_of,
            })?;
        }
        out.push(t0.elapsed() / steps as u32);
    }
    Ok(out)
}

/// Timed passes per prefill length, after one untimed warm-up pass; the fastest counts.
const PREFILL_PASSES: usize = 3;

/// Prompt tokens per second of one `len`-token prefill on a warm backend: the first
/// pass pays for faulting weights in and sizing buffers, which a serving replica pays
/// once, not per prompt.
pub fn prefill_rate<B: Backend + ?Sized>(be: &mut B, len: usize) -> Result<f64> {
    let passes = prefill_passes(be, len, 1 + PREFILL_PASSES)?;
    let best = passes[1..].iter().min().copied().unwrap_or(Duration::MAX);
    Ok(len as f64 / best.as_secs_f64())
}

/// The time of each of `passes` prefills of one `len`-token prompt, on blocks
/// `0..len.div_ceil(BLOCK)` (the first one cold where the backend is).
pub fn prefill_passes<B: Backend + ?Sized>(
    be: &mut B,
    len: usize,
    passes: usize,
) -> Result<Vec<Duration>> {
    if len == 0 {
        return Err(crate::EngineError::InvalidRequest {
            message: "a prefill of 0 tokens".into(),
            param: Some("len".into()),
        });
    }
    let table: Vec<u32> = (0..len.div_ceil(BLOCK) as u32).collect();
    let seqs = [SeqSlice {
        block_table: &table,
    }];
    let tokens: Vec<u32> = (0..len).map(|i| (i % 200) as u32 + 1).collect();
    let positions: Vec<u32> = (0..len as u32).collect();
    let seq_of = vec![0u32; len];
    let batch = ForwardBatch {
        tokens: &tokens,
        positions: &positions,
        seq_of: &seq_of,
        seqs: &seqs,
        logits_rows: &[len as u32 - 1],
    };
    (0..passes)
        .map(|_| {
            let t0 = Instant::now();
            be.forward(&batch)?;
            Ok(t0.elapsed())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::KvLayout;
    use crate::kv::BlockId;
    use preheat_snapshot::ModelConfig;

    /// A backend whose first forward pass is slow, as a real one is while it faults
    /// its weights in and sizes its buffers; later passes take `warm`. It checks
    /// block tables as a real one does.
    struct ColdFirst {
        calls: usize,
        cold: Duration,
        warm: Duration,
    }

    impl Backend for ColdFirst {
        fn name(&self) -> &'static str {
            "cold-first"
        }
        fn config(&self) -> &ModelConfig {
            unreachable!("the measurement only runs forward passes")
        }
        fn kv_layout(&self) -> KvLayout {
            unreachable!("the measurement only runs forward passes")
        }
        fn forward(&mut self, b: &ForwardBatch<'_>) -> Result<Vec<f32>> {
            // Refuses a position its sequence's block table does not cover, as every
            // real backend does (`check_batch`).
            for (p, s) in b.positions.iter().zip(b.seq_of) {
                if b.seqs[*s as usize].block_table.len() < *p as usize / BLOCK + 1 {
                    return Err(crate::EngineError::Internal(format!(
                        "block table too short for position {p}"
                    )));
                }
            }
            self.calls += 1;
            std::thread::sleep(if self.calls == 1 {
                self.cold
            } else {
                self.warm
            });
            Ok(Vec::new())
        }
        fn weights_fingerprint(&self) -> u64 {
            0
        }
        fn export_kv(&self, _: &[BlockId], _: &mut Vec<u8>) -> Result<()> {
            Ok(())
        }
        fn import_kv(&mut self, _: &[BlockId], _: &[u8]) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn regression_engine_profile_failed_past_24_decode_steps() {
        // Each sequence had two blocks (32 positions) whatever `--steps` asked:
        // `engine profile --steps 32` stopped with "internal error: block table too
        // short for position 32".
        for steps in [1, 24, 25, 32, 100, MAX_DECODE_STEPS] {
            let mut be = ColdFirst {
                calls: 0,
                cold: Duration::ZERO,
                warm: Duration::ZERO,
            };
            decode_rate(&mut be, 3, steps).unwrap_or_else(|e| panic!("{steps} steps: {e}"));
            assert_eq!(be.calls, steps + 1, "the prefill, then every step");
        }
        let mut be = ColdFirst {
            calls: 0,
            cold: Duration::ZERO,
            warm: Duration::ZERO,
        };
        assert!(decode_rate(&mut be, 1, MAX_DECODE_STEPS + 1).is_err());
        assert_eq!(be.calls, 0, "refused before any pass");
        assert_eq!(decode_blocks_per_seq(24), 2);
        assert_eq!(decode_blocks_per_seq(25), 3);
    }

    #[test]
    fn a_long_context_costs_one_prompt_and_fits_its_blocks() {
        for (batch, context, steps) in [(1, 8, 4), (3, 40, 4), (16, 256, 4), (2, 32, 17)] {
            let mut be = ColdFirst {
                calls: 0,
                cold: Duration::ZERO,
                warm: Duration::ZERO,
            };
            decode_rate_at(&mut be, batch, steps, context)
                .unwrap_or_else(|e| panic!("{batch}/{context}/{steps}: {e}"));
            // One prefill pass (the others' prompts are copied), then every step.
            assert_eq!(be.calls, steps + 1);
            assert_eq!(
                decode_blocks_at(batch, steps, context),
                batch * (context + steps).div_ceil(BLOCK)
            );
        }
        let mut be = ColdFirst {
            calls: 0,
            cold: Duration::ZERO,
            warm: Duration::ZERO,
        };
        assert!(decode_rate_at(&mut be, 0, 4, 64).is_err());
        assert!(decode_rate_at(&mut be, 2, 4, 0).is_err());
    }

    #[test]
    fn every_batch_size_is_timed_on_one_prefilled_prompt() {
        let mut be = ColdFirst {
            calls: 0,
            cold: Duration::ZERO,
            warm: Duration::from_millis(1),
        };
        let batches = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64];
        let steps = decode_steps_at(&mut be, &batches, 3, 256).unwrap();
        assert_eq!(steps.len(), batches.len());
        assert!(
            steps.iter().all(|s| *s >= Duration::from_millis(1)),
            "{steps:?}"
        );
        // One prefill for them all, then each batch's steps.
        assert_eq!(be.calls, 1 + 3 * batches.len());
        assert!(decode_steps_at(&mut be, &[4, 0], 3, 256).is_err());
        assert!(decode_steps_at(&mut be, &[], 3, 256).is_err());
    }

    #[test]
    fn regression_prefill_rate_was_one_cold_pass() {
        // `engine profile` timed a single pass per prompt length, the first of which
        // paid the backend's warm-up: `preheat up`'s profile said 114 prompt tokens/s
        // at 16 tokens where the serving engine did 16 in 94 ms (170/s), and the
        // simulator built on it over-predicted TTFT. The rate is of warm passes.
        let mut be = ColdFirst {
            calls: 0,
            cold: Duration::from_millis(200),
            warm: Duration::from_millis(10),
        };
        let rate = prefill_rate(&mut be, 16).unwrap();
        // Warm: 16 tokens / 10 ms = 1,600/s; cold: 80/s. Sleeps overshoot, so the
        // bound is loose, but far above any rate the cold pass can give.
        assert!(
            rate > 16.0 / 0.05,
            "{rate} tokens/s: the cold pass was timed"
        );
        assert!(be.calls >= 2);
    }
}
