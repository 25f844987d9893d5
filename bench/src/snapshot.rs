//! `preheat bench snapshot`: snapshot reads vs `cat`, vs the safetensors crate, verify
//! throughput, and the packed encoding vs plain zstd and the zstd CLI.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use preheat_output::progress_bar::Bar;
use preheat_output::{outln, print_json};
use preheat_snapshot::packed::{self, PackOptions};
use preheat_snapshot::synth::{self, SynthOptions};
use preheat_snapshot::{AccessHint, DType, NoProgress, Snapshot};
use serde_json::json;

use super::{best_of, gbps};
use crate::args::BenchSnapshotArgs;

/// Reads every byte of every tensor through the snapshot's mapping (a fresh open, so
/// page faults are paid as a loading replica would pay them).
fn read_all(path: &Path) -> anyhow::Result<u64> {
    let snap = Snapshot::open(path)?;
    snap.advise(AccessHint::Sequential)?;
    let mut acc = 0u64;
    for t in snap.tensors() {
        // Word-wise sum: cheap enough that the read, not the arithmetic, is measured.
        let (pre, words, post) = bytemuck_u64(t.bytes);
        acc = acc.wrapping_add(pre.iter().map(|&b| u64::from(b)).sum::<u64>());
        acc = words.iter().fold(acc, |a, &w| a.wrapping_add(w));
        acc = acc.wrapping_add(post.iter().map(|&b| u64::from(b)).sum::<u64>());
    }
    Ok(acc)
}

fn bytemuck_u64(b: &[u8]) -> (&[u8], &[u64], &[u8]) {
    let split = b.len() / 8 * 8;
    match bytemuck::try_cast_slice::<u8, u64>(&b[..split]) {
        Ok(w) => (&[], w, &b[split..]),
        Err(_) => (b, &[], &[]),
    }
}

fn cat(path: &Path) -> anyhow::Result<()> {
    let st = Command::new("cat")
        .arg(path)
        .stdout(Stdio::null())
        .status()
        .context("running cat")?;
    if !st.success() {
        bail!("cat {} failed", path.display());
    }
    Ok(())
}

/// The same tensors as a safetensors file, for the owned-buffer loader baseline.
fn write_safetensors(snap: &Snapshot, dest: &Path) -> anyhow::Result<()> {
    let mut views = Vec::new();
    for t in snap.tensors() {
        let dtype = match t.dtype() {
            DType::F32 => safetensors::Dtype::F32,
            DType::F16 => safetensors::Dtype::F16,
            DType::BF16 => safetensors::Dtype::BF16,
        };
        let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
        views.push((
            t.name().to_owned(),
            safetensors::tensor::TensorView::new(dtype, shape, t.bytes)?,
        ));
    }
    safetensors::serialize_to_file(views, None, dest)?;
    Ok(())
}

/// What a typical loader does: read the file, parse, copy each tensor into its own buffer.
fn load_safetensors_owned(path: &Path) -> anyhow::Result<u64> {
    let bytes = std::fs::read(path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let owned: HashMap<String, Vec<u8>> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect();
    Ok(owned.values().map(|v| v.len() as u64).sum())
}

fn zstd_cli(args: &[&str], input: &Path, output: &Path) -> anyhow::Result<()> {
    let st = Command::new("zstd")
        .args(args)
        .arg(input)
        .arg("-o")
        .arg(output)
        .stderr(Stdio::null())
        .status()
        .context("running the zstd CLI (apt-get install zstd)")?;
    if !st.success() {
        bail!("zstd {args:?} failed");
    }
    Ok(())
}

/// `zstd -d -c FILE > /dev/null`: the CLI's decompression speed without a disk write.
fn zstd_decompress_to_null(input: &Path) -> anyhow::Result<()> {
    let st = Command::new("zstd")
        .args(["-q", "-d", "-c"])
        .arg(input)
        .stdout(Stdio::null())
        .status()
        .context("running the zstd CLI (apt-get install zstd)")?;
    if !st.success() {
        bail!("zstd -d failed");
    }
    Ok(())
}

pub(crate) fn run(args: &BenchSnapshotArgs) -> anyhow::Result<std::process::ExitCode> {
    std::fs::create_dir_all(&args.dir)?;
    let snap_path = args.dir.join(format!("{}.preheat", args.preset));
    if Snapshot::open(&snap_path).is_err() {
        tracing::info!(preset = %args.preset, path = %snap_path.display(), "generating synthetic snapshot");
        synth::synthesize(
            &args.preset,
            &snap_path,
            SynthOptions::default(),
            &Bar::new(),
        )?;
    }
    let snap = Snapshot::open(&snap_path)?;
    let file_len = snap.file_len();
    let tensor_bytes = snap.tensor_bytes();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let scratch = |name: &str| -> PathBuf { args.dir.join(name) };
    let reps = args.reps;

    // Bring the file into page cache, then time the physical limit of reading it.
    cat(&snap_path)?;
    tracing::info!("timing cat");
    let (t_cat, ()) = best_of(reps, || cat(&snap_path))?;
    tracing::info!("timing snapshot reads");
    let (t_read, _) = best_of(reps, || read_all(&snap_path))?;
    let (t_open, _) = best_of(reps, || Ok(Snapshot::open(&snap_path)?))?;

    tracing::info!("writing and timing the safetensors baseline");
    let st_path = scratch("baseline.safetensors");
    write_safetensors(&snap, &st_path)?;
    cat(&st_path)?;
    let (t_st, _) = best_of(reps, || load_safetensors_owned(&st_path))?;
    std::fs::remove_file(&st_path)?;

    tracing::info!("timing verify");
    let (t_verify1, r1) = best_of(reps, || Ok(snap.verify(1)?))?;
    let (t_verify_n, rn) = best_of(reps, || Ok(snap.verify(threads)?))?;
    if !r1.mismatches.is_empty() || !rn.mismatches.is_empty() {
        bail!("benchmark snapshot failed verification");
    }

    tracing::info!("packing");
    let packed_path = scratch("packed.phpack");
    let plain_path = scratch("plain.phpack");
    let opts = PackOptions {
        threads,
        ..PackOptions::default()
    };
    let s_planes = packed::pack(&snap_path, &packed_path, opts, &Bar::new())?;
    let s_plain = packed::pack(
        &snap_path,
        &plain_path,
        PackOptions {
            byte_planes: false,
            ..opts
        },
        &Bar::new(),
    )?;
    std::fs::remove_file(&plain_path)?;
    cat(&packed_path)?;
    tracing::info!("timing decompression on one thread and on all");
    let (t_unpack1, _) = best_of(reps, || Ok(packed::check(&packed_path, 1)?))?;
    let (t_unpack_n, _) = best_of(reps, || Ok(packed::check(&packed_path, threads)?))?;
    tracing::info!("timing a full unpack (decompress, write, fsync, open)");
    let out_path = scratch("unpacked.preheat");
    let (t_unpack_full, _) = best_of(1, || {
        Ok(packed::unpack(
            &packed_path,
            &out_path,
            threads,
            &NoProgress,
        )?)
    })?;
    std::fs::remove_file(&out_path)?;
    std::fs::remove_file(&packed_path)?;

    tracing::info!("timing the zstd CLI on the same bytes");
    let zst = scratch("plain.zst");
    zstd_cli(&["-q", "-f", "-3", "-T1"], &snap_path, &zst)?;
    let zst_len = std::fs::metadata(&zst)?.len();
    cat(&zst)?;
    let (t_zstd_d, ()) = best_of(reps, || zstd_decompress_to_null(&zst))?;
    std::fs::remove_file(&zst)?;

    let secs = |d: Duration| d.as_secs_f64();
    let cat_gbps = gbps(file_len, t_cat);
    let report = json!({
        "preset": args.preset,
        "file_bytes": file_len,
        "tensor_bytes": tensor_bytes,
        "threads": threads,
        "cat_seconds": secs(t_cat), "cat_gbps": cat_gbps,
        "open_seconds": secs(t_open),
        "snapshot_read_seconds": secs(t_read),
        "snapshot_read_gbps": gbps(tensor_bytes, t_read),
        "snapshot_read_vs_cat": gbps(tensor_bytes, t_read) / cat_gbps,
        "safetensors_owned_seconds": secs(t_st),
        "safetensors_owned_gbps": gbps(tensor_bytes, t_st),
        "snapshot_read_speedup_vs_safetensors": secs(t_st) / secs(t_read),
        "verify_1t_gbps": gbps(r1.bytes, t_verify1),
        "verify_1t_vs_cat": gbps(r1.bytes, t_verify1) / cat_gbps,
        "verify_nt_gbps": gbps(rn.bytes, t_verify_n),
        "verify_nt_vs_cat": gbps(rn.bytes, t_verify_n) / cat_gbps,
        "packed_ratio_byte_planes": s_planes.ratio(),
        "packed_ratio_plain_zstd": s_plain.ratio(),
        "zstd_cli_ratio": file_len as f64 / zst_len as f64,
        "unpack_1t_gbps": gbps(file_len, t_unpack1),
        "unpack_nt_gbps": gbps(file_len, t_unpack_n),
        "unpack_full_to_disk_gbps": gbps(file_len, t_unpack_full),
        "zstd_cli_decompress_gbps": gbps(file_len, t_zstd_d),
        "unpack_1t_vs_zstd_cli": secs(t_zstd_d) / secs(t_unpack1),
    });
    if args.out.json {
        print_json(&report)?;
    } else {
        let f = |k: &str| report[k].as_f64().unwrap_or(f64::NAN);
        outln!(
            "snapshot benchmark: {} ({:.2} GB, {threads} threads)",
            args.preset,
            file_len as f64 / 1e9
        );
        outln!(
            "  open                          {:>8.2} ms",
            f("open_seconds") * 1e3
        );
        outln!(
            "  cat FILE > /dev/null          {:>8.2} GB/s (baseline)",
            f("cat_gbps")
        );
        outln!(
            "  read all tensors via Snapshot {:>8.2} GB/s = {:.2}× cat",
            f("snapshot_read_gbps"),
            f("snapshot_read_vs_cat")
        );
        outln!(
            "  safetensors, owned buffers    {:>8.2} GB/s; Snapshot is {:.2}× faster",
            f("safetensors_owned_gbps"),
            f("snapshot_read_speedup_vs_safetensors")
        );
        outln!(
            "  verify, 1 thread              {:>8.2} GB/s = {:.2}× cat",
            f("verify_1t_gbps"),
            f("verify_1t_vs_cat")
        );
        outln!(
            "  verify, {threads} threads             {:>8.2} GB/s = {:.2}× cat",
            f("verify_nt_gbps"),
            f("verify_nt_vs_cat")
        );
        outln!(
            "  packed ratio, byte planes     {:>8.3}×",
            f("packed_ratio_byte_planes")
        );
        outln!(
            "  packed ratio, plain zstd      {:>8.3}×  (zstd CLI -3: {:.3}×)",
            f("packed_ratio_plain_zstd"),
            f("zstd_cli_ratio")
        );
        outln!(
            "  decompress, 1 thread          {:>8.2} GB/s = {:.2}× zstd CLI ({:.2} GB/s)",
            f("unpack_1t_gbps"),
            f("unpack_1t_vs_zstd_cli"),
            f("zstd_cli_decompress_gbps")
        );
        outln!(
            "  decompress, {threads} threads         {:>8.2} GB/s",
            f("unpack_nt_gbps")
        );
        outln!(
            "  unpack to disk incl. fsync    {:>8.2} GB/s",
            f("unpack_full_to_disk_gbps")
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
