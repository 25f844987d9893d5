//! `--save-run`'s file: a measured run and everything its prediction needs, so that a
//! change to the simulator is judged on the same measurement (`--from-run`).

use std::path::Path;

use anyhow::{Context, bail};
use preheat_scaler::policy::PoolPolicy;
use preheat_scaler::profile::Profile;
use serde::{Deserialize, Serialize};

use super::measure::Measured;
use crate::serve::Planned;

/// `--save-run`'s file: bumped when a field changes meaning.
pub(super) const SAVED_RUN_FORMAT: u32 = 2;

/// A measured run and everything its prediction needs, as `--save-run` writes it.
#[derive(Serialize, Deserialize)]
pub(super) struct SavedRun {
    pub(super) format: u32,
    pub(super) planned: Vec<Planned>,
    pub(super) measured: Measured,
    pub(super) profile: Profile,
    pub(super) prefill: PoolPolicy,
    pub(super) decode: PoolPolicy,
    pub(super) standbys: u32,
    /// The stack's settings the run was measured under (`up`'s scaler tick and
    /// window, the engine's prefill token budget, the gateway's short-prompt rule), so
    /// a later build predicts it under them rather than its own.
    pub(super) interval_s: f64,
    pub(super) window_s: f64,
    pub(super) prefill_batch_tokens: f64,
    pub(super) disagg_min_tokens: u32,
}

impl SavedRun {
    pub(super) fn read(path: &Path) -> anyhow::Result<Self> {
        let bytes =
            std::fs::read(path).with_context(|| format!("reading the run {}", path.display()))?;
        let run: SavedRun = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a run `--save-run` wrote", path.display()))?;
        if run.format != SAVED_RUN_FORMAT {
            bail!(
                "{} is a format-{} run; this build reads format {SAVED_RUN_FORMAT}",
                path.display(),
                run.format
            );
        }
        if run.planned.len() != run.measured.outcomes.len() {
            bail!(
                "{}: {} requests planned but {} outcomes",
                path.display(),
                run.planned.len(),
                run.measured.outcomes.len()
            );
        }
        run.profile
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: its profile: {}", path.display(), e.join("; ")))?;
        Ok(run)
    }

    /// Written whole or not at all, as every file of the project's that a reader may
    /// find half-done ([`preheat_snapshot::publish`]).
    pub(super) fn write(&self, path: &Path) -> anyhow::Result<()> {
        use preheat_snapshot::publish::{publish_temp, temp_beside};
        let bytes = serde_json::to_vec(self)?;
        let (mut tmp, _) = temp_beside(path)?;
        std::io::Write::write_all(&mut tmp, &bytes)
            .with_context(|| format!("writing the run to {}", tmp.path().display()))?;
        publish_temp(tmp, path)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::Outcome;
    use crate::simreal::predict::predict;

    fn small_run() -> SavedRun {
        let planned: Vec<Planned> = (0..6)
            .map(|i| Planned {
                at: f64::from(i) * 0.5,
                input_tokens: 200,
                output_tokens: 20,
            })
            .collect();
        let outcomes = planned
            .iter()
            .map(|p| Outcome {
                sent_at: p.at,
                ok: true,
                ttft: Some(0.3),
                itl: Some(0.02),
                e2e: 0.7,
                output_chunks: 20,
                prompt_tokens: Some(200),
                completion_tokens: Some(20),
                ..Outcome::default()
            })
            .collect();
        SavedRun {
            format: SAVED_RUN_FORMAT,
            planned,
            measured: Measured {
                outcomes,
                replicas: vec![(0.0, 0, 0), (1.0, 1, 1)],
                starts: Vec::new(),
                window_s: 4.0,
                stack_cpu_s: Some(0.4),
                host_cores: 4,
                worker_threads: 1,
                up_exited: None,
                host_slowdown: vec![(2, 1.1), (4, 1.2)],
            },
            profile: Profile::default(),
            prefill: PoolPolicy::default(),
            decode: PoolPolicy::default(),
            standbys: 1,
            interval_s: 0.5,
            window_s: 60.0,
            prefill_batch_tokens: 256.0,
            disagg_min_tokens: 32,
        }
    }

    #[test]
    fn a_saved_run_predicts_as_the_measured_one_did() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        small_run().write(&path).unwrap();
        let direct = predict(small_run()).unwrap();
        let read = predict(SavedRun::read(&path).unwrap()).unwrap();
        assert_eq!(direct.predicted, read.predicted);
        assert_eq!(direct.predicted_attainment, read.predicted_attainment);
        assert_eq!(read.requests, 6);
        // The machine it was measured on, not this one: 4 cores less 0.1 used.
        assert!((read.host_slots - 3.9).abs() < 1e-9, "{}", read.host_slots);
        assert_eq!(read.host_slowdown, vec![(2, 1.1), (4, 1.2)]);
        // Nothing beside it: the temporary file became the run.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_run_file_that_is_cut_short_or_from_another_format_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        small_run().write(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let e = format!("{:#}", SavedRun::read(&path).err().unwrap());
        assert!(e.contains("not a run `--save-run` wrote"), "{e}");
        let mut old = small_run();
        old.format = 0;
        old.write(&path).unwrap();
        let e = format!("{:#}", SavedRun::read(&path).err().unwrap());
        assert!(e.contains("format-0 run"), "{e}");
        let mut torn = small_run();
        torn.planned.pop();
        torn.write(&path).unwrap();
        let e = format!("{:#}", SavedRun::read(&path).err().unwrap());
        assert!(e.contains("5 requests planned but 6 outcomes"), "{e}");
    }
}
