//! `preheat bench gpu`: a GPU replica's start, phase by phase, against the machine's
//! own limits measured in the same run: weights upload (pinned, two streams) against a
//! plain pinned host-to-device copy, kernels compiled by NVRTC against the same kernels
//! restored from the kernel cache, and decode-graph capture.

#[cfg(not(feature = "cuda"))]
pub(crate) fn run(_: &crate::args::BenchGpuArgs) -> anyhow::Result<std::process::ExitCode> {
    anyhow::bail!("this build has no GPU backend: build with --features cuda")
}

#[cfg(feature = "cuda")]
pub(crate) use self::on_gpu::run;

#[cfg(feature = "cuda")]
mod on_gpu {
    use std::process::ExitCode;
    use std::time::Instant;

    use serde::Serialize;

    use crate::args::BenchGpuArgs;
    use preheat_output::{outln, print_json};

    #[derive(Debug, Serialize)]
    struct Start {
        /// `compiled` (empty kernel cache) or `restored`.
        kernels: &'static str,
        kernels_s: f64,
        upload_gb_s: f64,
        upload_s: f64,
        upload_read_s: f64,
        graphs: usize,
        graph_capture_s: f64,
        /// Load call to logits of a one-token decode.
        total_s: f64,
    }

    #[derive(Debug, Serialize)]
    struct Report {
        model: String,
        weights_bytes: u64,
        arch: String,
        driver: String,
        h2d_gb_s: f64,
        upload_vs_h2d: f64,
        starts: Vec<Start>,
    }

    pub(crate) fn run(a: &BenchGpuArgs) -> anyhow::Result<ExitCode> {
        use std::sync::Arc;

        use preheat_engine::backend::cuda::{CudaBackend, CudaOptions, Probe, upload};
        use preheat_engine::backend::{Backend, ForwardBatch, SeqSlice};

        if !matches!(CudaBackend::probe(), Probe::Ready { .. }) {
            anyhow::bail!("no GPU here ({:?})", CudaBackend::probe());
        }
        let (name, path, _) = crate::coldstart::prepare::snapshot_for(&a.model, &a.work_dir)?;
        let snap = Arc::new(preheat_snapshot::Snapshot::open(&path)?);
        // Upload from a hot page cache: the start this measures is the warm pool's.
        snap.populate()?;
        let weights_bytes: u64 = snap.manifest().tensors.iter().map(|t| t.nbytes).sum();
        let h2d = upload::h2d_bandwidth(0, 256 << 20)?;
        // An empty kernel cache for the first start, kept for the second.
        let cache = a.work_dir.join("bench-gpu-kernels");
        let _ = std::fs::remove_dir_all(&cache);
        let mut starts = Vec::new();
        let (mut arch, mut driver) = (String::new(), String::new());
        for kernels in ["compiled", "restored"] {
            let t = Instant::now();
            let mut be = CudaBackend::new(
                Arc::clone(&snap),
                64,
                16,
                &CudaOptions {
                    device: 0,
                    kernel_cache: Some(cache.clone()),
                    kernel_cache_key: None,
                    graphs: true,
                    max_batch_tokens: 256,
                },
            )?;
            let seqs = [SeqSlice { block_table: &[0] }];
            be.forward(&ForwardBatch {
                tokens: &[1],
                positions: &[0],
                seq_of: &[0],
                seqs: &seqs,
                logits_rows: &[0],
            })?;
            let total_s = t.elapsed().as_secs_f64();
            let g = be.startup().clone();
            (arch, driver) = (g.arch.clone(), g.driver.clone());
            starts.push(Start {
                kernels,
                kernels_s: g.kernels_s,
                upload_gb_s: g.upload_bytes_per_s() / 1e9,
                upload_s: g.upload_s,
                upload_read_s: g.upload_read_s,
                graphs: g.graphs,
                graph_capture_s: g.graph_capture_s,
                total_s,
            });
        }
        let best_upload = starts.iter().map(|s| s.upload_gb_s).fold(0.0, f64::max);
        let report = Report {
            model: name,
            weights_bytes,
            arch,
            driver,
            h2d_gb_s: h2d / 1e9,
            upload_vs_h2d: best_upload * 1e9 / h2d,
            starts,
        };
        if a.out.json {
            print_json(&serde_json::to_value(&report)?)?;
        } else {
            outln!(
                "{}: {:.2} GiB of weights on {} (driver {})",
                report.model,
                report.weights_bytes as f64 / (1u64 << 30) as f64,
                report.arch,
                report.driver
            );
            outln!(
                "host-to-device copy {:.1} GB/s; weights upload {:.1} GB/s = {:.2}x of it",
                report.h2d_gb_s,
                best_upload,
                report.upload_vs_h2d
            );
            for s in &report.starts {
                outln!(
                    "kernels {:9} {:7.3} s | upload {:6.3} s ({:5.1} GB/s, reading {:.3} s) | {} graphs {:6.3} s | to first logits {:6.3} s",
                    s.kernels,
                    s.kernels_s,
                    s.upload_s,
                    s.upload_gb_s,
                    s.upload_read_s,
                    s.graphs,
                    s.graph_capture_s,
                    s.total_s
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    }
}
