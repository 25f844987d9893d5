//! A replica's capacity profile measured on this machine: what `up` gives its scaler
//! and simulator, and what `engine profile` writes for a deployment's.

use anyhow::Context;
use preheat_scaler::profile::Profile;

/// Decode batch sizes `up`'s profile times: up to the engine's most running sequences,
/// since the simulator runs no batch larger than the profile's largest, and densely,
/// since it interpolates between sizes and the cost bends (SmolLM2 on 2 cores: 50 ms
/// at 4, 129 at 12, 153 at 16, 243 at 32 with 256-token contexts; from 1, 4 and 16
/// alone, 12 read 8–12% fast and anything above 16 as 16). `engine profile` times the
/// same by default.
pub const PROFILE_BATCHES: [usize; 10] = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64];

/// Measures a replica of `model` on the CPU backend (prefill at `lengths`, decode at
/// `batches`, `steps` each, with `kv_mib` of KV cache) and writes its [`Profile`] to
/// `output`.
pub fn measure(
    model: &std::path::Path,
    output: &std::path::Path,
    lengths: &[usize],
    batches: &[usize],
    steps: usize,
    kv_mib: usize,
) -> anyhow::Result<()> {
    use preheat_engine::backend::cpu::CpuBackend;
    use preheat_engine::model::{ModelSource, open_model};
    let mut errs = Vec::new();
    if lengths.is_empty() || lengths.contains(&0) {
        errs.push("--lengths must be positive".to_owned());
    }
    if batches.is_empty() || batches.contains(&0) {
        errs.push("--batches must be positive".to_owned());
    }
    let max_steps = preheat_engine::profile::MAX_DECODE_STEPS;
    if steps == 0 || steps > max_steps {
        errs.push(format!("--steps {steps} must be in 1..={max_steps}"));
    }
    if !errs.is_empty() {
        anyhow::bail!("invalid options:\n  {}", errs.join("\n  "));
    }
    let t0 = std::time::Instant::now();
    let (snap, source) = open_model(model)?;
    let c = snap.manifest().model.clone();
    let block_bytes = CpuBackend::kv_block_bytes(&c, 16);
    let max_len = *lengths.iter().max().unwrap_or(&16);
    let max_batch = *batches.iter().max().unwrap_or(&1);
    // Decode is timed again with contexts as long as the longest prompt profiled (a
    // step's attention reads the whole context), where the model allows it.
    let short = preheat_engine::profile::DECODE_PROMPT;
    let long = max_len.min((c.max_position_embeddings as usize).saturating_sub(steps + 1));
    let long = (long > short).then_some(long);
    // The workers' KV budget, which the profile reports; the measurements below may
    // need more blocks than it (a batch of 64 long contexts), which they get.
    let budget_blocks = (kv_mib << 20) / block_bytes.max(1);
    let num_blocks = budget_blocks
        .max(max_len.div_ceil(16))
        .max(max_batch * preheat_engine::profile::decode_blocks_per_seq(steps))
        .max(long.map_or(0, |l| {
            preheat_engine::profile::decode_blocks_at(max_batch, steps, l)
        }));
    let mut be = CpuBackend::new(std::sync::Arc::clone(&snap), num_blocks, 16)?;
    let load = t0.elapsed().as_secs_f64();
    // Measured where an engine runs its kernels: inside their pool.
    let pool = preheat_engine::backend::cpu::compute_pool(None)?;
    let (mut prefill, mut itl, mut itl_long) = pool.install(|| -> anyhow::Result<_> {
        let mut prefill = Vec::new();
        for &len in lengths {
            let len = len.min(c.max_position_embeddings as usize);
            let tps = preheat_engine::profile::prefill_rate(&mut be, len)?;
            tracing::info!(len, tokens_per_s = tps, "prefill");
            prefill.push((len as f64, tps));
        }
        let timed = |be: &mut CpuBackend, context| -> anyhow::Result<Vec<(f64, f64)>> {
            let steps_s = preheat_engine::profile::decode_steps_at(be, batches, steps, context)?;
            Ok(batches
                .iter()
                .zip(steps_s)
                .map(|(&b, step)| {
                    tracing::info!(batch = b, context, itl_s = step.as_secs_f64(), "decode");
                    (b as f64, step.as_secs_f64())
                })
                .collect())
        };
        let itl = timed(&mut be, short)?;
        let itl_long = match long {
            Some(context) => timed(&mut be, context)?,
            None => Vec::new(),
        };
        Ok((prefill, itl, itl_long))
    })?;
    prefill.sort_by(|a, b| a.0.total_cmp(&b.0));
    prefill.dedup_by(|a, b| a.0 == b.0);
    itl.sort_by(|a, b| a.0.total_cmp(&b.0));
    itl.dedup_by(|a, b| a.0 == b.0);
    itl_long.sort_by(|a, b| a.0.total_cmp(&b.0));
    itl_long.dedup_by(|a, b| a.0 == b.0);
    let defaults = Profile::default();
    let mut startup = defaults.startup_s.clone();
    let which = match source {
        ModelSource::Converted => {
            startup.cold = load;
            "cold"
        }
        ModelSource::Snapshot => {
            startup.staged = load;
            startup.hot = load;
            "staged/hot"
        }
    };
    let p = Profile {
        source: format!(
            "measured by `preheat engine profile` on {} ({} backend, {} threads); startup {which} measured ({load:.2} s), other startup values are defaults",
            model.display(),
            preheat_engine::backend::Backend::name(&be),
            rayon::current_num_threads()
        ),
        prefill_tokens_per_s: prefill,
        decode_itl_s: itl,
        decode_itl_long: long.map(|context| preheat_scaler::profile::ContextItl {
            short_context: short as f64,
            context: context as f64,
            itl_s: itl_long,
        }),
        kv_tokens: (budget_blocks.max(1) * 16) as f64,
        startup_s: startup,
    };
    p.validate()
        .map_err(|e| anyhow::anyhow!("measured profile is invalid: {}", e.join("; ")))?;
    std::fs::write(output, serde_json::to_vec_pretty(&p)?)
        .with_context(|| format!("writing {}", output.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regression_the_profile_timed_decode_at_three_batch_sizes_up_to_16() {
        let most = preheat_engine::scheduler::SchedulerConfig::default().max_running;
        assert_eq!(PROFILE_BATCHES.iter().max(), Some(&most));
        // No gap wider than half the size at its end: 12 between 8 and 16, not 4 to 16.
        for w in PROFILE_BATCHES.windows(2) {
            assert!(w[1] > w[0] && 2 * (w[1] - w[0]) <= w[1], "{w:?}");
        }
    }
}
