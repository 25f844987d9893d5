//! The model `up` serves: staged once into the cache directory (verified, atomically)
//! and measured for the scaler's profile.

use super::*;
use crate::profile::PROFILE_BATCHES;

/// The snapshot workers start from: the given one, a conversion of the given HF
/// directory or GGUF staged once in the cache, or the embedded default (a synthetic
/// tiny Llama with a byte tokenizer, made offline).
pub(super) fn stage(o: &Options, model: &ModelArg) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(&o.cache).with_context(|| format!("creating {}", o.cache.display()))?;
    let bar = preheat_output::progress_bar::Bar::new();
    match &model.path {
        Some(m) if m.extension().is_some_and(|e| e == "preheat") => Ok(m.clone()),
        Some(m) => {
            let stem = m
                .file_stem()
                .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
            // Named by the source's identity: another file of the same name (or this
            // one changed) is converted anew, never served from a stale conversion.
            let dest = o
                .cache
                .join(format!("{stem}-{:016x}.preheat", source_identity(m)?));
            if !dest.exists() {
                // Earlier conversions of this source (it changed since) are stale.
                for old in std::fs::read_dir(&o.cache)?.flatten() {
                    let n = old.file_name().to_string_lossy().into_owned();
                    if n.starts_with(&format!("{stem}-")) && n.ends_with(".preheat") {
                        let _ = std::fs::remove_file(old.path());
                    }
                }
                tracing::info!(source = %m.display(), dest = %dest.display(), "staging the model as a snapshot");
                preheat_snapshot::source::convert(
                    m,
                    &dest,
                    preheat_snapshot::source::TargetDtype::Keep,
                    &bar,
                )?;
            }
            Ok(dest)
        }
        None => {
            let dest = o.cache.join("default-tiny.preheat");
            if !dest.exists() {
                tracing::info!(dest = %dest.display(), "writing the embedded default model (synthetic tiny Llama)");
                preheat_snapshot::synth::synthesize("tiny", &dest, Default::default(), &bar)?;
            }
            Ok(dest)
        }
    }
}

/// A digest of what a source is: its canonical path and, for each file in it, the
/// name, size and modification time (a directory's files one level deep).
pub(super) fn source_identity(path: &Path) -> anyhow::Result<u64> {
    let path = path
        .canonicalize()
        .with_context(|| format!("reading {}", path.display()))?;
    let mut ident = path.to_string_lossy().into_owned();
    let mut files = vec![path.clone()];
    if path.is_dir() {
        files = std::fs::read_dir(&path)?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        files.sort();
    }
    for f in files {
        let meta = std::fs::metadata(&f)?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        ident.push_str(&format!("|{}:{}:{mtime}", f.display(), meta.len()));
    }
    Ok(preheat_snapshot::Checksum::of(ident.as_bytes()).0)
}

/// The name the warm pool stages a snapshot under: the served name and the digest of
/// its manifest (which holds every tensor's digest), so a run with another model can
/// never pick up this one's staged file.
pub(super) fn staged_name(name: &str, snap: &Path) -> anyhow::Result<String> {
    let digest = preheat_snapshot::Snapshot::open(snap)
        .with_context(|| format!("opening {}", snap.display()))?
        .header()
        .manifest_checksum
        .0;
    Ok(format!("{name}-{digest:016x}"))
}

/// Where a measured CPU profile of this model with the workers' KV budget and compute
/// threads (workers inherit this process's `RAYON_NUM_THREADS`) lies, cached beside
/// the snapshot (measured first when it is not there). Both are in the name: the scaler sizes decode by KV tokens and every pool
/// by speed, and a profile measured otherwise would tell it the wrong capacity.
pub(super) fn measured_profile(snap: &Path, kv_mib: usize) -> anyhow::Result<(PathBuf, Profile)> {
    let threads = rayon::current_num_threads();
    // `b10`: decode timed at ten batch sizes up to the engine's 64 (a cached profile
    // from before, timed at 1, 4 and 16, is measured again rather than reused).
    let path = snap.with_extension(format!("kv{kv_mib}.t{threads}.b10.profile.json"));
    if !path.exists() {
        tracing::info!("measuring one replica's capacity (once per model and KV budget)");
        crate::profile::measure(snap, &path, &[16, 64, 256], &PROFILE_BATCHES, 4, kv_mib)?;
    }
    // Read here, so a damaged cached profile fails before anything starts; the path
    // is what the scaler's config names.
    let profile = Profile::from_file(&path)?;
    Ok((path, profile))
}
